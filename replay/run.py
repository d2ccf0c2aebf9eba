"""One replay run, end to end: workload in, events and a run manifest out (the library entry point).

``run_replay`` builds the kernel, the engine, the policy and the cost model, feeds the workload's
arrivals (streamed batch by batch, the scenario applied on the way), runs the kernel to the end and
writes:

- the lifecycle events, to ``<out_dir>/events.parquet`` or to any ``sink(table)`` callable;
- ``<out_dir>/manifest.json``: workload hash, scenario, policy and its config, instance and engine
  config, cost model, seed, mode, code version and the SHA-256 of the events. Nothing in it depends
  on the wall clock, so identical inputs give a byte-identical manifest and event file.

Progress (simulated time against wall time) goes to an optional callback; the CLI draws it.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from replay.calibration import Calibration, apply_calibration, calibration_record
from replay.config import InstanceConfig, instance_config
from replay.cost_models import make_cost_model
from replay.costmodel import StepCostModel
from replay.emit import EventWriter
from replay.engine import Engine, Mode, check_clock
from replay.errors import ReplayError
from replay.kernel import ARRIVAL, Kernel
from replay.load import StepLoadMeter, load_record
from replay.offload import Offloaded
from replay.outputs import ReplayOutputs, TableSink
from replay.policies import make_policy
from replay.request import Request
from replay.request_table import REQUESTS_FILE, DoneTracker
from replay.scenario import Scenario, apply_scenario, image_tokens
from replay.workload import Workload, as_workload
from schemas.events import SCHEMA_VERSION
from servelens.provenance import code_version

MANIFEST_VERSION = 1
#: Replays of at least this many requests build their outputs in a process of their own (``replay.outputs``).
OFFLOAD_MIN_REQUESTS = 5_000
PROGRESS_EVERY = 20_000  # arrivals between progress reports


@dataclass(frozen=True, slots=True)
class ReplayProgress:
    """Where a running replay is."""

    simulated_ns: int  # simulated time since the first arrival
    wall_s: float
    num_arrived: int
    num_finished: int
    num_requests: int | None  # in the workload, when known


@dataclass(frozen=True, slots=True)
class ReplaySummary:
    """What a finished replay did and where its outputs are."""

    run_id: str
    engine_id: str
    instance_id: str
    mode: str
    num_requests: int
    num_events: int
    num_steps: int  # engine iterations simulated
    num_step_events: int  # step_executed events (a fast run of k identical steps is one)
    num_preemptions: int
    num_prefix_hit_tokens: int
    num_kv_blocks: int
    simulated_s: float
    wall_s: float
    requests_per_wall_s: float
    output_sha256: str
    workload_sha256: str
    events_path: Path | None
    manifest_path: Path | None
    requests_path: Path | None = None  # the run's own request table (replay.request_table)
    busy_s: tuple[tuple[str, float], ...] = ()  # (instance, seconds its step events span in total)


def run_replay(
    workload: pa.Table | Workload,
    *,
    scenario: Scenario | None = None,
    policy_name: str = "fcfs",
    policy_config: object | None = None,
    instance: InstanceConfig | None = None,
    cost_model: str | StepCostModel = "roofline",
    cost_model_config: object | None = None,
    seed: int = 0,
    out_dir: str | Path | None = None,
    sink: TableSink | None = None,
    mode: Mode = "fast",
    progress: Callable[[ReplayProgress], None] | None = None,
    shared: Path | None = None,
    chunk_rows: int = 200_000,
    check_invariants: bool = False,
    progress_every: int = PROGRESS_EVERY,
    step_timer: Callable | None = None,
    calibration: Calibration | None = None,
    write_requests: bool = True,
    offload_outputs: bool | None = None,
) -> ReplaySummary:
    """Replay ``workload`` through one modelled instance; write events and a manifest.

    Outputs go to ``out_dir`` (``events.parquet`` + ``manifest.json``) and/or ``sink`` (called with
    each chunk of events as an ``EVENTS_SCHEMA`` table). ``cost_model`` is a name (``roofline``,
    ``profile``, ``constant``; the profile model reads its tables under ``shared``) or a model.
    ``step_timer`` (``replay.measured``) makes the run a measured replay: every step is executed and
    its measured time is the clock (reference mode; the manifest's ``clock`` says what measured it).
    ``calibration`` (``replay.calibration``) puts its frontend and engine defaults on the instance and its
    step cost terms on the roofline model (unless ``cost_model_config`` is given); the manifest names it.
    With ``out_dir``, the run also writes its own request table, ``requests.parquet``
    (``replay.request_table``; ``write_requests=False``: not). The outputs are built in a process of their own
    beside the replay with ``offload_outputs`` (None: for workloads of ``OFFLOAD_MIN_REQUESTS`` requests or more,
    without a ``sink``; the same files either way).
    """
    instance, cost_model_config = _calibrated(instance or instance_config(), calibration, cost_model, cost_model_config)
    check_clock(instance, mode, step_timer)  # before the outputs open
    source = as_workload(workload)
    scenario = scenario or Scenario()
    policy = make_policy(policy_name, policy_config)
    model = (make_cost_model(cost_model, instance, config=cost_model_config, shared=shared)
             if isinstance(cost_model, str) else cost_model)
    manifest = _manifest(source, scenario, policy_name, policy.config, instance, model, seed, mode)
    _record_calibration_and_clock(manifest, calibration, instance, step_timer)
    run_id = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:12]
    engine_id = f"replay-{run_id}"
    instance_id = f"{engine_id}-i0"
    outputs = _Outputs(out_dir, sink, write_requests=write_requests, offload=offload(source, offload_outputs))
    writer = outputs.writer(EventWriter, run_id=run_id, engine_id=engine_id, chunk_rows=chunk_rows)
    kernel = Kernel()
    engine = Engine(kernel, instance, model, policy, writer, instance_id=instance_id, mode=mode,
                    check_invariants=check_invariants, step_timer=step_timer)
    feeder = _Feeder(kernel, engine, source, scenario, seed, instance, progress, progress_every)
    output_sha256, wall_s, wall0 = outputs.drive(kernel, feeder, engine, writer)
    if progress is not None:
        progress(feeder.report(wall0))
    return _finish(outputs, manifest, (run_id, engine_id, instance_id), kernel, engine, feeder, mode=mode,
                   output_sha256=output_sha256, wall_s=wall_s, num_events=writer.num_events, calibration=calibration)


def _calibrated(instance: InstanceConfig, calibration: Calibration | None, cost_model: str | StepCostModel,
                cost_model_config: object | None) -> tuple[InstanceConfig, object | None]:
    """``instance`` with ``calibration``'s defaults, and the cost model's config (the calibration's roofline
    terms for the roofline model without a config of its own)."""
    if calibration is not None:
        instance, roofline = apply_calibration(instance, calibration)
        if cost_model == "roofline" and cost_model_config is None:
            cost_model_config = roofline
    return instance, cost_model_config


def _record_calibration_and_clock(manifest: dict, calibration: Calibration | None, instance: InstanceConfig,
                                  step_timer: Callable | None) -> None:
    """Name the calibration and the measured clock in ``manifest`` (when there are)."""
    if calibration is not None:
        manifest["calibration"] = calibration_record(calibration, instance)
    if step_timer is not None:
        manifest["clock"] = step_timer.info() if hasattr(step_timer, "info") else {"measured": True}


def _finish(outputs: _Outputs, manifest: dict, ids: tuple[str, str, str], kernel: Kernel, engine: Engine,
            feeder: _Feeder, *, mode: str, output_sha256: str, wall_s: float, num_events: int,
            calibration: Calibration | None) -> ReplaySummary:
    """Write the manifest of a finished replay (``ids``: its run, engine and instance ids) and summarize the run."""
    run_id, engine_id, instance_id = ids
    manifest["run_id"] = run_id
    manifest["engine_id"] = engine_id
    manifest["instance_id"] = instance_id
    manifest_path = outputs.write_manifest(manifest, output_sha256, num_events,
                                           busy_s={instance_id: engine.stats.busy_ns / 1e9},
                                           max_num_seqs=engine.instance.engine.max_num_seqs, calibration=calibration)
    simulated_s = (kernel.now_ns - feeder.first_arrival_ns) / 1e9 if feeder.first_arrival_ns is not None else 0.0
    stats = engine.stats
    return ReplaySummary(
        run_id=run_id,
        engine_id=engine_id,
        instance_id=instance_id,
        mode=mode,
        num_requests=feeder.num_arrived,
        num_events=num_events,
        num_steps=stats.num_steps,
        num_step_events=stats.num_step_events,
        num_preemptions=stats.num_preemptions,
        num_prefix_hit_tokens=stats.num_prefix_hit_tokens,
        num_kv_blocks=engine.pool.num_total,
        simulated_s=simulated_s,
        wall_s=wall_s,
        requests_per_wall_s=feeder.num_arrived / wall_s if wall_s > 0 else float("inf"),
        output_sha256=output_sha256,
        workload_sha256=manifest["workload"]["sha256"],
        events_path=outputs.events_path,
        manifest_path=manifest_path,
        requests_path=outputs.requests_path,
        busy_s=((instance_id, stats.busy_ns / 1e9),),
    )


def offload(source: Workload, offload_outputs: bool | None) -> bool:
    """Whether a replay of ``source`` builds its outputs in a process of its own (``run_replay``)."""
    if offload_outputs is not None:
        return offload_outputs
    return source.num_requests is not None and source.num_requests >= OFFLOAD_MIN_REQUESTS


class _Outputs:
    """Where a replay's events go: ``events.parquet`` (and the request table) under ``out_dir`` and/or ``sink``,
    built by ``replay.outputs.ReplayOutputs``, in a process of its own with ``offload`` (not for a sink: it is
    called here)."""

    def __init__(self, out_dir: str | Path | None, sink: TableSink | None, *, write_requests: bool = True,
                 offload: bool = False) -> None:
        self.out = Path(out_dir) if out_dir is not None else None
        self.sink = sink
        self.events_path = self.out / "events.parquet" if self.out is not None else None
        self.requests_path = self.out / REQUESTS_FILE if self.out is not None and write_requests else None
        # written under these names, renamed into place when the replay succeeds: a failed replay into the folder of
        # an earlier run leaves that run's files as they were (its events, table and manifest still agree)
        self._partial = {path: path.with_name(f".{path.name}.partial") for path in (self.events_path, self.requests_path)
                         if path is not None}
        self.offload = offload and sink is None and self.out is not None
        self.outputs: ReplayOutputs | Offloaded | None = None
        self.load: StepLoadMeter | None = None  # the run's load, for its manifest

    def writer(self, writer_class: type[EventWriter], *, run_id: str, engine_id: str, chunk_rows: int) -> EventWriter:
        """The run's event writer, feeding its outputs (their event ids are made of ``run_id`` and ``engine_id``)."""
        # a sink that only reads the events back (``digest = False``: a calibration's replays) skips the hash
        hash_tables = self.events_path is None and getattr(self.sink, "digest", True)
        ids = (run_id, engine_id)
        # the manifest records the run's load (with an output folder)
        where = {"events_path": self._partial.get(self.events_path), "requests_path": self._partial.get(self.requests_path),
                 "measure_load": self.out is not None}
        self.outputs = (Offloaded(ReplayOutputs, *ids, name="replay-outputs", **where) if self.offload
                        else ReplayOutputs(*ids, **where, sink=self.sink, hash_tables=hash_tables))
        writer = writer_class(self.outputs.feed, chunk_rows=chunk_rows)
        if self.requests_path is not None:
            writer.requests = DoneTracker()
        return writer

    def drive(self, kernel: Kernel, feeder: _Feeder, actor, writer: EventWriter) -> tuple[str, float, float]:
        """Run the replay: arrivals from ``feeder`` into ``actor`` (an engine or a cluster: ``start``,
        ``stop``, ``num_active``) until nothing is pending; returns (output sha256, wall s, wall start)."""
        wall0 = time.perf_counter()
        # The replay makes no reference cycles that outlive a request (finished requests drop their
        # view), so the cyclic collector would only rescan millions of live buffer tuples: pause it.
        collecting = gc.isenabled()
        gc.disable()
        try:
            feeder.start()
            first_ns = kernel.next_time_ns()
            if first_ns is not None:  # the instances come up when the trace begins, not at the epoch
                kernel.now_ns = first_ns  # (the earliest action: the order stays the heap's)
            actor.start()
            kernel.run()
            actor.stop()
            writer.flush()
            assert self.outputs is not None
            written = self.outputs.close()
            output_sha256, self.load = written.output_sha256, written.load
        except BaseException:
            if self.outputs is not None:
                self.outputs.abort()
            self._drop_partial()
            raise
        finally:
            if collecting:
                gc.enable()
        wall_s = time.perf_counter() - wall0
        if actor.num_active:
            self._drop_partial()
            raise ReplayError(f"{actor.num_active} requests did not finish (an engine bug)")
        return output_sha256, wall_s, wall0

    def _drop_partial(self) -> None:
        for partial in self._partial.values():
            partial.unlink(missing_ok=True)

    def write_manifest(self, manifest: dict, output_sha256: str, num_events: int, *, busy_s: dict[str, float],
                       max_num_seqs: int | dict[str, int], calibration: Calibration | None, **dumps) -> Path | None:
        """Record the output in ``manifest`` and write it next to the events (if written to a folder), with the
        run's load (``replay.load``; ``max_num_seqs``: by instance id where instances differ) against the load
        ``calibration`` was fitted on."""
        manifest["output"] = {
            "events_sha256": output_sha256,
            "hash_of": "the events Parquet file" if self.events_path is not None else "the Arrow IPC stream of the event chunks",
            "num_events": num_events,
            "events_file": "events.parquet" if self.events_path is not None else None,
        }
        if self.requests_path is not None:  # written by the replay itself (replay.request_table)
            manifest["output"]["requests_file"] = REQUESTS_FILE
        # the seconds each instance's step events span in total: what run metrics read of the steps (cost, idle)
        manifest["output"]["busy_s"] = busy_s
        if self.out is None:
            return None
        for final, partial in self._partial.items():
            partial.replace(final)
        if self.load is not None:
            manifest["load"] = load_record(self.load.windows(max_num_seqs),
                                           calibration.fitted_load if calibration is not None else None)
        path = self.out / "manifest.json"
        path.write_text(json.dumps(manifest, indent=2, sort_keys=True, **dumps) + "\n")
        return path


class _Feeder:
    """Streams the workload's arrivals into the kernel, one pending arrival at a time."""

    def __init__(self, kernel: Kernel, engine: Engine, source: Workload, scenario: Scenario, seed: int,
                 instance: InstanceConfig, progress: Callable[[ReplayProgress], None] | None,
                 progress_every: int) -> None:
        self.kernel = kernel
        self.engine = engine
        self.source = source
        self.scenario = scenario
        self.seed = seed
        self.progress = progress
        self.progress_every = max(1, progress_every)
        self.block_size = instance.engine.block_size_tokens
        self.prefix_caching = instance.engine.enable_prefix_caching
        # with a frontend model, workload arrivals are client sends: the engine sees each request later
        self.frontend = instance.frontend
        self._batches = source.batches()
        self._rows: list[tuple] = []
        self._pos = 0
        self._offset = 0
        self.num_arrived = 0
        self.first_arrival_ns: int | None = None
        self._last_arrival_ns = -(2**63)
        self._wall0 = time.perf_counter()
        self._objectives = {c.name: c for c in scenario.service_classes}
        self._origin_ns: int | None = None  # the first arrival (where a scenario's model phases start)
        self._images: list[int] | None = None  # encoder tokens of the loaded rows (multimodal scenarios)

    def start(self) -> None:
        self._wall0 = time.perf_counter()
        self._schedule_next()

    def report(self, wall0: float | None = None) -> ReplayProgress:
        start = self.first_arrival_ns or 0
        return ReplayProgress(
            simulated_ns=self.kernel.now_ns - start,
            wall_s=time.perf_counter() - (wall0 if wall0 is not None else self._wall0),
            num_arrived=self.num_arrived,
            num_finished=self.engine.stats.num_finished,
            num_requests=self.source.num_requests,
        )

    def _load(self) -> bool:
        for batch in self._batches:
            if batch.num_rows == 0:
                continue
            if self.scenario != Scenario():
                if self._origin_ns is None:
                    self._origin_ns = batch.column("arrival_ns")[0].as_py()
                batch = apply_scenario(batch, self.scenario, self.seed, self._offset, self._origin_ns)
                self._images = image_tokens(self.scenario, self.seed, self._offset, batch.num_rows)
            self._offset += batch.num_rows
            cols = [batch.column(name).to_pylist() for name in _FEED_COLUMNS]
            self._rows = list(zip(*cols))
            self._pos = 0
            return True
        return False

    def _schedule_next(self) -> None:
        if self._pos >= len(self._rows) and not self._load():
            return
        row = self._rows[self._pos]
        arrival = row[1]
        if arrival < self._last_arrival_ns:
            raise ReplayError(
                f"request {row[0]} arrives before the request ahead of it: the workload is not in arrival order",
                "sort the workload by arrival_ns once; the replay never reorders arrivals itself",
            )
        self._last_arrival_ns = arrival
        if self.frontend is not None:
            arrival += self.frontend.in_delay_ns(max(1, row[2]), row[0])
        self.kernel.schedule(max(arrival, self.kernel.now_ns), ARRIVAL, self._arrive)

    def _arrive(self) -> None:
        row = self._rows[self._pos]
        self._pos += 1
        (rid, arrival, prompt, output, block_ids, block_tokens, session, tenant, cls, model, adapter,
         branches, cancel_after, failed) = row
        if self.first_arrival_ns is None:
            self.first_arrival_ns = arrival
        spec = self._objectives.get(cls) if cls is not None else None
        prompt, output = max(1, prompt), max(1, output)  # an engine serves neither an empty prompt nor max_tokens 0
        sent = None
        if self.frontend is not None:  # stamped when the frontend received it; the client sent it earlier
            sent, arrival = arrival, arrival + round(self.frontend.request_overhead_s * 1e9)
        r = Request(
            self.num_arrived,
            rid,
            arrival,
            prompt,
            num_branches=max(1, branches),
            unit_keys=_unit_keys(block_ids, block_tokens, prompt, self.block_size) if (block_ids and self.prefix_caching) else (),
            tenant=tenant,
            service_class=cls,
            model=model,
            adapter=adapter,
            session_id=session,
            prefix_block_ids=block_ids,
            ttft_deadline_ns=arrival + round(spec.ttft_objective_s * 1e9) if spec and spec.ttft_objective_s is not None else None,
            e2e_deadline_ns=arrival + round(spec.e2e_objective_s * 1e9) if spec and spec.e2e_objective_s is not None else None,
            max_output_tokens=spec.max_output_tokens if spec else None,
            cancel_after_ns=cancel_after,
            failed=failed,
        )
        r.client_sent_ns = sent
        if self._images is not None:
            r.num_image_tokens = self._images[self._pos - 1]
        self.num_arrived += 1
        self.engine.writer.new_requests.append(r)  # its id and labels, for the events that name it
        self.engine.submit(r, output)
        if self.progress is not None and self.num_arrived % self.progress_every == 0:
            self.progress(self.report())
        self._schedule_next()


_FEED_COLUMNS = (
    "request_id", "arrival_ns", "num_prompt_tokens", "num_output_tokens", "prefix_block_ids",
    "prefix_block_size_tokens", "session_id", "tenant", "service_class", "model", "adapter",
    "num_branches", "cancel_after_ns", "failed",
)


def _unit_keys(block_ids: list[int], block_tokens: int | None, prompt: int, block_size: int) -> tuple:
    """Cache units of a prompt: one per trace block id, covering the engine blocks fully inside it.

    A trace block of ``block_tokens`` (Mooncake: 512) holds ``block_tokens / block_size`` engine
    blocks (32 of 16 tokens); the prompt's last trace block covers only the engine blocks its
    tokens fill. Without a trace block size, ids are taken to name engine blocks.
    """
    per = (block_tokens or block_size)
    full = prompt // block_size
    units = []
    for i, key in enumerate(block_ids):
        start = -(-i * per // block_size)
        end = min((i + 1) * per // block_size, full)
        if end <= start:
            break
        units.append((key, start, end - start))
    return tuple(units)


def _manifest(source: Workload, scenario: Scenario, policy_name: str, policy_config: Any,
              instance: InstanceConfig, model: StepCostModel, seed: int, mode: str) -> dict[str, Any]:
    info = model.info()
    return {
        "manifest_version": MANIFEST_VERSION,
        "event_schema_version": SCHEMA_VERSION,
        "workload": {"name": source.name, "sha256": source.fingerprint(), "num_requests": source.num_requests,
                     **source.meta},
        "scenario": _plain(scenario),
        "policy": {"name": policy_name, "config": _plain(policy_config)},
        "instance": _plain(instance),
        "num_kv_blocks": instance.num_kv_blocks,
        "cost_model": {"name": info.name, "description": info.description, "parameters": dict(info.parameters)},
        "seed": seed,
        "mode": mode,
        "code_version": code_version(),
    }


def _plain(obj: Any) -> Any:
    """A config dataclass as JSON-ready values (for the manifest only)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)  # (a new setting left unset:)
                if not (f.metadata.get("omit_empty") and getattr(obj, f.name) == ())
                and not (f.metadata.get("omit_default") and getattr(obj, f.name) == f.default)}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
