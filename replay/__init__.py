"""Trace-driven replay: recorded workloads through candidate policies on a modelled engine.

``replay.traces`` reads public trace formats into one workload table; ``replay.workload`` and
``replay.scenario`` shape workloads (load transforms, explicit seeded assumptions); ``replay.engine``
models one serving instance (vLLM v1 scheduling, KV blocks, prefix cache, preemption) on the
``replay.kernel`` event loop, priced by a ``replay.costmodel`` and steered by a ``replay.policies``
policy; ``replay.run.run_replay`` runs it end to end (docs/replay.md). The replay emits the same
event schema as a real engine, so one metrics path serves real and replayed data: ``replay.metrics``,
``replay.compare``, ``replay.gate`` and ``replay.report`` compare and gate runs.
"""
