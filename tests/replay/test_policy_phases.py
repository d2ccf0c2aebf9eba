"""Phase priority and Sarathi-Serve's stall-free chunks, on timelines worked out by hand."""

from __future__ import annotations

from replay.config import EngineConfig, instance_config
from replay.costmodel import ConstantCostConfig, CostModelBase, CostModelInfo, StepShape
from replay.policies import DecodeFirstConfig, SarathiConfig
from replay.policies.tenancy import ClassConfig, Tenancy
from tests.replay.conftest import make_workload

MS = 1_000_000
CONSTANT = {"cost_model": "constant", "cost_model_config": ConstantCostConfig(step_time_ns=10 * MS)}


class LinearCost(CostModelBase):
    """A step takes 5 ms plus 50 us per token through the model (prefill tokens + decode sequences)."""

    name = "linear-test"

    def step_time_ns(self, shape: StepShape) -> int:
        return 5 * MS + 50_000 * shape.num_tokens

    def info(self) -> CostModelInfo:
        return CostModelInfo(self.name, "5 ms + 50 us per token", ())


def steps(out) -> list[tuple[int, int]]:
    """(prefill tokens, decode sequences) of each step, in time order."""
    return [(s["num_prefill_tokens"], s["num_decode_seqs"])
            for s in sorted(out.of_type("step_executed"), key=lambda s: s["start_ns"]) for _ in range(s["num_steps"])]


def test_prefill_first_plans_the_new_prompt_before_the_running_decode(run):
    # r0 decodes from 10 ms on; r1 (4,000-token prompt) arrives at 25 ms: the step at 30 ms
    # FCFS: r0's decode first (1 token), r1 gets the other 2,047; prefill-first: r1 takes the whole
    # 2,048-token budget and r0's decode waits a step
    w = make_workload([0, 25 * MS], [10, 4000], [50, 2])
    fcfs, pf = run(w, **CONSTANT), run(w, policy_name="prefill-first", **CONSTANT)
    assert steps(fcfs)[3] == (2047, 1)
    assert steps(pf)[3] == (2048, 0)
    assert steps(pf)[4] == (1952, 1)  # the rest of the prompt beside r0's decode
    # and r0's token gap over that step doubles: 20 ms instead of 10 ms
    assert fcfs.row("r0")["itl_max_s"] == 0.01 and pf.row("r0")["itl_max_s"] == 0.02


def test_decode_first_admits_one_prefill_at_a_time(run):
    # two 3,000-token prompts at 0, 2 output tokens each, budget 2,048. decode-first (max_prefilling 1):
    # r0 2,048; r0's last 952 (r1 not admitted while r0 prefills); r0's decode + r1 2,047; r1 953; r1's decode
    w = make_workload([0, 0], [3000, 3000], [2, 2])
    df = run(w, policy_name="decode-first", policy_config=DecodeFirstConfig(max_prefilling=1), **CONSTANT)
    assert steps(df) == [(2048, 0), (952, 0), (2047, 1), (953, 0), (0, 1)]
    # FCFS fills the budget with r1 at once: r0 952 + r1 1,096
    assert steps(run(w, **CONSTANT))[1] == (2048, 0)


def test_sarathi_sizes_chunks_to_the_itl_objective(run):
    # ITL objective 100 ms x 0.9 = a 90 ms step target: 5 ms + 50 us x (c + 1 decode) <= 90 ms gives
    # c = 1,699. r1's 5,000-token prompt goes in as 1,699 + 1,699 + 1,602 beside r0's decode, and r0's
    # gaps stay at 90 ms; FCFS puts 2,047 tokens beside it: 5 + 0.05 x 2,048 = 107.4 ms
    tenancy = Tenancy(classes=(ClassConfig(name="chat", itl_objective_s=0.1),), default_class="chat")
    w = make_workload([0, 20 * MS], [10, 5000], [200, 2])
    sarathi = run(w, policy_name="sarathi", policy_config=SarathiConfig(tenancy=tenancy), cost_model=LinearCost())
    chunks = [p for p, _ in steps(sarathi) if p > 10]  # r0's own 10-token prompt aside
    assert chunks[:3] == [1699, 1699, 1602]
    assert abs(sarathi.row("r0")["itl_max_s"] - 0.090) < 1e-6
    fcfs = run(w, cost_model=LinearCost())
    assert abs(fcfs.row("r0")["itl_max_s"] - 0.1074) < 1e-6


def test_sarathi_prices_every_chunk_at_the_longest_prefill_context(run):
    # a long prompt deep into its prefill and a fresh one in the same step: the second chunk must not be
    # sized as if it were alone (its attention would be priced at context 0); with the roofline model,
    # every step that carries prefill stays within the 135 ms target
    tenancy = Tenancy(classes=(ClassConfig(name="chat", itl_objective_s=0.15),), default_class="chat")
    w = make_workload([0, 0, 1 * MS, 2 * MS, 400 * MS], [10, 8000, 400, 60, 300], [300, 2, 2, 2, 2])
    out = run(w, policy_name="sarathi", policy_config=SarathiConfig(tenancy=tenancy),
              instance=instance_config("llama-2-7b", "a100-80g", engine=EngineConfig()))
    for s in out.of_type("step_executed"):
        if s["num_prefill_tokens"] > 0:
            assert (s["end_ns"] - s["start_ns"]) / s["num_steps"] <= 135 * MS
