"""The engine model: vLLM v1 scheduling, KV accounting, preemption, cancellation, branches, prefix cache.

Timelines use the constant cost model (every step 10 ms), so every timestamp below is worked out by
hand from the scheduling rules in ``replay/engine.py`` and written next to the assertion.
"""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.config import EngineConfig, instance_config
from replay.costmodel import ConstantCostConfig, RooflineCostModel, StepShape, prefill_time_ns
from replay.derive import derive_requests
from replay.errors import ReplayError
from replay.policies import FcfsPolicy, register
from replay.run import run_replay
from tests.replay.conftest import make_workload

MS = 1_000_000
CONSTANT = {"cost_model": "constant", "cost_model_config": ConstantCostConfig(step_time_ns=10 * MS)}


def engine(**kwargs) -> dict:
    return {"instance": instance_config(engine=EngineConfig(**kwargs))}


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_hand_computed_timeline(run, mode):
    # r0 at 0 ms (prompt 100, 3 tokens); r1 at 5 ms (prompt 100, 2 tokens); r2 at 25 ms (prompt 3000, 1 token)
    w = make_workload([0, 5 * MS, 25 * MS], [100, 100, 3000], [3, 2, 1])
    out = run(w, mode=mode, **CONSTANT)
    # step [0,10]: r0's prefill -> r0 first token at 10
    # step [10,20]: r0 decodes (token 2), r1 (arrived at 5) prefills -> r1 first token at 20
    # step [20,30]: r0 and r1 decode -> r0 token 3 and r1 token 2: both done at 30
    # step [30,40]: r2 (arrived at 25) prefills 2048 of 3000 tokens; step [40,50]: the other 952 -> token at 50
    expected = {
        "r0": (0, 0, 0, 10, 30, 30, 3),
        "r1": (5, 5, 10, 20, 30, 30, 2),
        "r2": (25, 25, 30, 50, 50, 50, 1),
    }
    for rid, (arrival, admission, scheduled, first, last, finish, tokens) in expected.items():
        row = out.row(rid)
        got = tuple(row[c] // MS for c in ("arrival_ns", "admission_ns", "scheduled_ns", "first_token_ns",
                                            "last_token_ns", "finish_ns")) + (row["num_output_tokens"],)
        assert got == (arrival, admission, scheduled, first, last, finish, tokens), rid
        assert row["outcome"] == "completed"
    steps = sorted(out.of_type("step_executed"), key=lambda e: e["start_ns"])
    assert [(s["start_ns"] // MS, s["end_ns"] // MS, s["num_prefill_tokens"], s["num_decode_seqs"]) for s in steps] == [
        (0, 10, 100, 0), (10, 20, 100, 1), (20, 30, 0, 2), (30, 40, 2048, 0), (40, 50, 952, 0)]
    assert all(s["num_steps"] == 1 for s in steps)  # nothing to coalesce: compositions all differ
    states = out.of_type("instance_state")
    assert [s["state"] for s in states] == ["ready", "stopped"]


def test_ttft_without_contention_is_the_prefill_time_exactly(run):
    inst = instance_config()
    model = RooflineCostModel(inst)
    w = make_workload([1_700_000_000_000_000_000, 1_700_000_100_000_000_000], [1500, 5000], [10, 1])
    out = run(w, instance=inst)
    assert out.row("r0")["first_token_ns"] - out.row("r0")["arrival_ns"] == model.step_time_ns(StepShape(((1500, 0),), 0, 0))
    # a prompt longer than the budget: chunks of 2048, 2048, 904, each extending the context
    assert out.row("r1")["first_token_ns"] - out.row("r1")["arrival_ns"] == prefill_time_ns(model, 5000, 2048)
    assert out.row("r1")["queue_s"] == 0.0


@register
class _WaitingRecorder(FcfsPolicy):
    """FCFS that records the waiting queue after every step (through the read-only view)."""

    name = "test-waiting-recorder"
    seen: list[tuple[int, list[str]]] = []

    def observe_step(self, view, requests, num_tokens, num_steps) -> None:
        type(self).seen.append((view.now_ns, [r.request_id for r in view.waiting]))


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_recompute_preemption_takes_the_newest_and_sends_it_to_the_front(run, mode):
    # 12 blocks of 16 tokens; r0 and r1 (60 + 100 tokens each) cannot both keep decoding, r2 waits
    _WaitingRecorder.seen = []
    w = make_workload([0, 1 * MS, 2 * MS], [60, 60, 60], [100, 100, 5])
    out = run(w, mode=mode, policy_name="test-waiting-recorder", check_invariants=True, **CONSTANT,
              **engine(num_kv_blocks_override=12))
    r0, r1, r2 = out.row("r0"), out.row("r1"), out.row("r2")
    assert r0["num_preemptions"] == 0  # FCFS never preempts the oldest for a newer one
    assert r1["num_preemptions"] >= 1 and r1["num_lost_tokens"] > 0
    assert all(r["outcome"] == "completed" for r in (r0, r1, r2))
    assert (r0["num_output_tokens"], r1["num_output_tokens"], r2["num_output_tokens"]) == (100, 100, 5)
    pre = out.of_type("request_preempted")
    assert {p["mode"] for p in pre} == {"recompute"}
    assert [p["lease_generation"] for p in pre if p["request_id"] == "r1"] == list(range(1, r1["num_preemptions"] + 1))
    # a preempted request goes to the front of the waiting queue, ahead of r2 which waited longer
    step_ends = {s["start_ns"]: s["end_ns"] for s in out.of_type("step_executed")}
    waiting_at = dict(_WaitingRecorder.seen)
    for p in pre:
        assert waiting_at[step_ends[p["ts_ns"]]][0] == p["request_id"]
    assert any("r2" in waiting_at[step_ends[p["ts_ns"]]][1:] for p in pre)
    used = [s["num_kv_blocks_used"] for s in out.of_type("step_executed")]
    assert max(used) <= 12 and min(used) >= 0


def test_swap_preemption_keeps_progress_and_costs_bandwidth(run):
    inst = instance_config(engine=EngineConfig(num_kv_blocks_override=12, preemption_mode="swap",
                                               swap_bandwidth_bytes_per_s=1e9))
    w = make_workload([0, 1 * MS], [60, 60], [100, 100])
    out = run(w, instance=inst, check_invariants=True, **CONSTANT)
    pre = out.of_type("request_preempted")
    assert pre and {p["mode"] for p in pre} == {"swap"} and all(p["num_lost_tokens"] == 0 for p in pre)
    # a step that swaps blocks out or in lasts 10 ms plus blocks x 16 tokens x 128 KiB / 1 GB/s
    block_ns = 16 * 131_072  # ns per block at 1e9 bytes/s
    extra = {(s["end_ns"] - s["start_ns"]) - 10 * MS * s["num_steps"] for s in out.of_type("step_executed")}
    assert 0 in extra and any(e > 0 and e % block_ns == 0 for e in extra)
    assert out.row("r1")["num_output_tokens"] == 100 and out.row("r1")["num_lost_tokens"] == 0


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_cancellation_frees_everything_at_once(run, mode):
    # r0: prefill [0,10] (token 1), decodes end at 20, 30, 40, 50 (tokens 2..5); cancelled at 55,
    # inside the step [50,60]: its token from that step is never delivered
    w = make_workload([0, 0], [100, 100], [1000, 3], cancel_after_ns=[55 * MS, None])
    out = run(w, mode=mode, check_invariants=True, **CONSTANT)
    r0 = out.row("r0")
    assert (r0["outcome"], r0["cancel_ns"], r0["finish_ns"], r0["last_token_ns"]) == ("cancelled", 55 * MS, 55 * MS, 50 * MS)
    assert r0["num_output_tokens"] == 5
    # after 55 ms nothing is held: the step ending at 60 reports no used blocks
    last = max(out.of_type("step_executed"), key=lambda s: s["end_ns"])
    assert last["end_ns"] == 60 * MS and last["num_kv_blocks_used"] == 0


def test_a_waiting_request_cancelled_before_its_turn_is_never_scheduled(run):
    w = make_workload([0, 1 * MS], [100, 100], [50, 50], cancel_after_ns=[None, 30 * MS])
    out = run(w, **CONSTANT, **engine(max_num_seqs=1))
    r1 = out.row("r1")
    assert (r1["outcome"], r1["scheduled_ns"], r1["first_token_ns"], r1["finish_ns"]) == ("cancelled", None, None, 31 * MS)
    assert r1["num_output_tokens"] == 0


def test_parallel_sampling_widens_the_batch_and_shares_the_prompt(run):
    w = make_workload([0], [100], [5], num_branches=[3])
    out = run(w, check_invariants=True, mode="reference", **CONSTANT)
    steps = sorted(out.of_type("step_executed"), key=lambda s: s["start_ns"])
    assert steps[0]["num_prefill_tokens"] == 100 and steps[0]["request_num_tokens"] == [100]
    assert [s["num_decode_seqs"] for s in steps[1:]] == [3, 3, 3, 3] and steps[1]["request_num_tokens"] == [3]
    # 6 full prompt blocks shared + one block per branch (each branch copies the 4-token tail and
    # adds its tokens): 6 + 3 = 9 after the first decode, where one sequence would hold ceil(101/16) = 7
    assert steps[0]["num_kv_blocks_used"] == 7 and steps[1]["num_kv_blocks_used"] == 9
    assert out.row("r0")["num_output_tokens"] == 15 and out.row("r0")["num_branches"] == 3


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_reuses_a_shared_prefix(run, caching):
    # two requests share two 512-token trace blocks (64 engine blocks); the second arrives after the first ends
    w = make_workload([0, 100 * MS], [1100, 1100], [2, 2], prefix_block_ids=[[7, 8, 9], [7, 8, 10]],
                      prefix_block_size_tokens=[512, 512])
    out = run(w, check_invariants=True, **CONSTANT, **engine(enable_prefix_caching=caching))
    second = [s for s in out.of_type("step_executed") if s["request_ids"] == ["r1"] and s["num_prefill_tokens"]]
    arrived = {e["request_id"]: e for e in out.of_type("request_arrived")}
    if caching:
        assert arrived["r1"]["num_cached_prefix_tokens"] == 1024 and out.row("r1")["num_cached_prefix_tokens"] == 1024
        assert second[0]["num_prefill_tokens"] == 1100 - 1024
        assert out.summary.num_prefix_hit_tokens == 1024
    else:
        assert arrived["r1"]["num_cached_prefix_tokens"] is None
        assert second[0]["num_prefill_tokens"] == 1100


def test_a_request_that_can_never_fit_names_itself_and_the_capacity(run):
    w = make_workload([0, 1], [10, 1000], [5, 5])
    with pytest.raises(ReplayError, match=r"request r1 can never fit: it needs 63 KV blocks .* holds 5 blocks of 16 tokens"):
        run(w, **engine(num_kv_blocks_override=5))
    assert not [t for t in threading.enumerate() if t.name == "replay-parquet"]  # the writer thread stopped


def test_unsorted_workloads_are_refused():
    w = make_workload([5, 1], [10, 10], [1, 1])
    with pytest.raises(ReplayError, match="not in arrival order"):
        run_replay(w, sink=lambda t: None)


def test_failed_trace_rows_end_in_error_without_tokens(run):
    w = make_workload([0, 0], [50, 50], [0, 4], failed=[True, False])
    out = run(w, **CONSTANT)
    assert (out.row("r0")["outcome"], out.row("r0")["num_output_tokens"], out.row("r0")["first_token_ns"]) == ("error", 0, None)
    assert out.row("r1")["outcome"] == "completed"


# ---------------------------------------------------------------------------------------------- random workloads


@st.composite
def small_workloads(draw):
    n = draw(st.integers(1, 16))
    arrivals = sorted(draw(st.lists(st.integers(0, 80 * MS), min_size=n, max_size=n)))
    prompts = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    branches = draw(st.lists(st.sampled_from([1, 1, 1, 2, 3]), min_size=n, max_size=n))
    cancels = draw(st.lists(st.one_of(st.none(), st.integers(0, 200 * MS)), min_size=n, max_size=n))
    prefixes = draw(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=3), min_size=n, max_size=n))
    # a prefix id chain is shared only if equal at equal positions: make ids position-specific
    prefix_ids = [[10 * (i + 1) + x for i, x in enumerate(p)] for p in prefixes]
    w = make_workload(arrivals, prompts, outputs, num_branches=branches, cancel_after_ns=cancels,
                      prefix_block_ids=prefix_ids, prefix_block_size_tokens=[32] * n)
    need = max(-(-(p + max(o, 1)) // 16) * b for p, o, b in zip(prompts, outputs, branches)) + 2
    cfg = EngineConfig(
        num_kv_blocks_override=need + draw(st.integers(0, 12)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.sampled_from([64, 128, 512])),
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        enable_prefix_caching=draw(st.booleans()),
    )
    return w, cfg


def _replay_tables(w: pa.Table, cfg: EngineConfig, mode: str) -> tuple[pa.Table, pa.Table]:
    chunks: list[pa.Table] = []
    run_replay(w, instance=instance_config(engine=cfg), mode=mode, sink=chunks.append, check_invariants=True,
               chunk_rows=50)
    events = pa.concat_tables(chunks)
    return events, derive_requests(events)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(small_workloads())
def test_random_workloads_keep_kv_invariants_and_modes_agree(case):
    w, cfg = case
    tables = {mode: _replay_tables(w, cfg, mode) for mode in ("fast", "reference")}
    for events, requests in tables.values():
        finished = [e for e in events.to_pylist() if e["event_type"] == "request_finished"]
        assert sorted(e["request_id"] for e in finished) == sorted(w["request_id"].to_pylist())  # exactly one each
        steps = [e for e in events.to_pylist() if e["event_type"] == "step_executed"]
        assert all(0 <= s["num_kv_blocks_used"] <= cfg.num_kv_blocks_override for s in steps)
        assert all(s["num_kv_blocks_used"] + s["num_kv_blocks_free"] == cfg.num_kv_blocks_override for s in steps)
        # an empty output is served as one token (no engine serves max_tokens 0: replay.run)
        wanted = {r["request_id"]: max(1, r["num_output_tokens"]) * r["num_branches"] for r in w.to_pylist()}
        for row in requests.to_pylist():
            if row["outcome"] == "completed":
                assert row["num_output_tokens"] == wanted[row["request_id"]]
    cols = ["request_id", "arrival_ns", "admission_ns", "scheduled_ns", "first_token_ns", "last_token_ns",
            "cancel_ns", "finish_ns", "outcome", "num_output_tokens", "num_preemptions", "num_lost_tokens"]
    assert tables["fast"][1].select(cols).to_pylist() == tables["reference"][1].select(cols).to_pylist()


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_async_scheduling_puts_a_request_that_arrives_during_a_step_into_the_step_after_next(run, mode):
    # r0 decodes from 0 (10 ms steps); r1 arrives at 25 ms, during the step [20, 30]. Synchronous scheduling
    # plans the next step at 30 with r1 in it; async scheduling planned that step when [20, 30] began, so r1
    # joins the step [40, 50]: its first token at 50, not 40. An idle engine takes r0 at once either way.
    w = make_workload([0, 25 * MS], [16, 16], [20, 5])
    sync = run(w, mode=mode, **CONSTANT, **engine(async_scheduling=False))
    asyn = run(w, mode=mode, check_invariants=True, **CONSTANT, **engine(async_scheduling=True))
    assert (sync.row("r1")["scheduled_ns"], sync.row("r1")["first_token_ns"]) == (30 * MS, 40 * MS)
    assert (asyn.row("r1")["scheduled_ns"], asyn.row("r1")["first_token_ns"]) == (40 * MS, 50 * MS)
    assert asyn.row("r0")["first_token_ns"] == sync.row("r0")["first_token_ns"] == 10 * MS
    assert asyn.row("r0")["last_token_ns"] == sync.row("r0")["last_token_ns"] == 200 * MS


def test_a_frontend_stamps_client_sends_and_first_and_last_bytes(run):
    # the client sends r0 at 0 and r1 at 25 ms; the frontend takes 3 ms + 1 us per prompt token (16) to hand a
    # request to the engine and 1 ms to deliver a token. r0 reaches the engine at 3.016 ms (idle: scheduled
    # at once), first token at 13.016, last (20th) at 203.016; r1 reaches it at 28.016, during the step
    # [23.016, 33.016], and async scheduling puts it into [43.016, 53.016]; its 5th token at 93.016.
    from dataclasses import replace

    from replay.config import FrontendConfig

    frontend = FrontendConfig(request_overhead_s=0.003, tokenize_s_per_token=1e-6, stream_delivery_s=0.001)
    instance = replace(instance_config(engine=EngineConfig(async_scheduling=True)), frontend=frontend)
    out = run(make_workload([0, 25 * MS], [16, 16], [20, 5]), instance=instance, **CONSTANT)
    r0, r1 = out.row("r0"), out.row("r1")
    assert (r0["client_sent_ns"], r0["arrival_ns"], r0["scheduled_ns"]) == (0, 3 * MS, 3_016_000)
    assert (r0["first_token_ns"], r0["first_byte_ns"], r0["last_byte_ns"]) == (13_016_000, 14_016_000, 204_016_000)
    assert (r1["client_sent_ns"], r1["scheduled_ns"], r1["first_byte_ns"], r1["last_byte_ns"]) == (
        25 * MS, 43_016_000, 54_016_000, 94_016_000)
    assert r1["ttft_client_s"] == pytest.approx(0.029016) and r1["e2e_client_s"] == pytest.approx(0.069016)
    assert r1["ttft_s"] == pytest.approx(0.025016)  # engine side: from the frontend's receipt


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_a_cpu_tier_keeps_evicted_prefix_blocks_and_a_hit_copies_them_back(run, mode):
    # an 80-block pool (16-token blocks of llama-3-8b, 2 MiB each). r0 (1,100 tokens, trace blocks 7, 8, 9 of
    # 512 tokens) finishes at 20 ms; r1 (1,200 unrelated tokens) needs 75 blocks at 100 ms and evicts the
    # cached units 7 and 8 (64 blocks). r2 at 300 ms shares 7 and 8 with r0: without a CPU tier it prefills
    # all 1,100 tokens; with one it copies the 64 blocks back (134,217,728 bytes at 50 GB/s: 2,684,355 ns,
    # charged to its first step) and prefills 76.
    w = make_workload([0, 100 * MS, 300 * MS], [1100, 1200, 1100], [2, 2, 2],
                      prefix_block_ids=[[7, 8, 9], [1, 2, 3], [7, 8, 10]], prefix_block_size_tokens=[512] * 3)
    plain = run(w, mode=mode, **CONSTANT, **engine(num_kv_blocks_override=80))
    tier = run(w, mode=mode, check_invariants=True, **CONSTANT,
               **engine(num_kv_blocks_override=80, cpu_kv_offload_bytes=1 << 30))

    def first_step(out):
        return [s for s in out.of_type("step_executed") if s["request_ids"] == ["r2"]][0]

    assert first_step(plain)["num_prefill_tokens"] == 1100 and plain.row("r2")["num_cached_prefix_tokens"] == 0
    assert first_step(tier)["num_prefill_tokens"] == 76 and tier.row("r2")["num_cached_prefix_tokens"] == 1024
    assert first_step(tier)["end_ns"] - first_step(tier)["start_ns"] == 10 * MS + 2_684_355
    assert tier.summary.num_prefix_hit_tokens == plain.summary.num_prefix_hit_tokens + 1024
