"""The measured side of the replay: real forward passes, their profiles, and a clock made of them.

- ``shapes``: Llama-architecture shape configs (tiny, 1B-, 8B- and 70B-class), scaled by layer count;
- ``executor``: a PyTorch Llama decoder with random weights and a paged KV cache that runs one engine
  step (prefill chunks and decode tokens over their contexts) exactly as the engine composed it;
- ``profiler``: sweeps step shapes, times each (CUDA events on a GPU, ``perf_counter`` on a CPU) and
  writes a Parquet profile with its metadata;
- ``fit``: the profile-table cost model fitted to a profile, with its held-out error and roofline share;
- ``measured``: the measured replay (every step executed; its measured time is the clock) and the
  comparison of modelled and measured replays of one workload and policy.

PyTorch is an optional extra (``pip install 'servelens[gpu]'``): ``shapes`` and ``fit`` (and every
other part of the package) import without it; ``executor`` and ``profiler`` need it, and say so
cleanly (``require_torch``) when it is missing. Documented in ``docs/calibration.md``.
"""
