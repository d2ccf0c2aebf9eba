"""Deadline admission caps speculative drafts: turned off where speculation does not pay and that makes the
horizon fit, kept where it pays; never more than the instance drafts; plain instances untouched."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from replay.config import ModelConfig, SpeculativeConfig, instance_config
from replay.costmodel import ConstantCostConfig, ConstantCostModel
from replay.policies import DeadlineConfig
from replay.policies.tenancy import ClassConfig, Tenancy
from replay.speculative import SpeculativeCostModel
from tests.replay.conftest import make_workload

MS = 1_000_000
DRAFT = ModelConfig(name="draft-1b", num_layers=16, hidden_size=2048, num_attention_heads=32, num_kv_heads=8, head_dim=64,
                    intermediate_size=8192, vocab_size=128256)
SPEC = SpeculativeConfig(draft=DRAFT, num_speculative_tokens=3, acceptance_rate=0.5)  # E = 1.875
INSTANCE = dataclasses.replace(instance_config(), speculative=SPEC)


def cost(draft_ms: int) -> SpeculativeCostModel:
    """Constant target passes of 10 ms and draft passes of ``draft_ms``: a speculative step of 3 drafts and
    one verification takes 3 x draft + 10 ms (no decodes: the target's 10 ms)."""
    return SpeculativeCostModel(ConstantCostModel(ConstantCostConfig(step_time_ns=10 * MS)),
                                ConstantCostModel(ConstantCostConfig(step_time_ns=draft_ms * MS)), SPEC)


def config(e2e_s: float, **kwargs) -> DeadlineConfig:
    tenancy = Tenancy(classes=(ClassConfig(name="chat", ttft_objective_s=1.0, e2e_objective_s=e2e_s),),
                      default_class="chat")
    return DeadlineConfig(tenancy=tenancy, prior_output_tokens_high=250, min_history=1000, **kwargs)


def decision(out) -> dict:
    (d,) = out.of_type("admission_decided")
    return d


# One request of 100 prompt and 100 output tokens, predicted up to 250 (the prior). Admitted alone, its
# first token is predicted after one 10 ms prefill step (TTFT 0.01 s); the E2E budget is the objective x
# (1 - overload margin 0.1). Its decode: one token per 10 ms step with drafts off, E = 1.875 tokens per
# speculative step with them on.
W = make_workload([0], [100], [100])


def test_drafts_off_when_speculation_does_not_pay_and_that_makes_the_horizon_fit(run):
    # drafts as slow as the target (10 ms): a speculative step is 3 x 10 + 10 = 40 ms for 1.875 tokens,
    # 21.3 ms a token. E2E objective 5 s: budget 4.5 s. With drafts on: 0.01 + 250 x 0.040 / 1.875 =
    # 5.343 s, late (its output would be capped at (4.5 - 0.01) x 1.875 / 0.040 = 210 tokens); off:
    # 0.01 + 250 x 0.010 = 2.51 s, in time: 'degrade' with speculation off and no output cap
    out = run(W, instance=INSTANCE, cost_model=cost(10), policy_name="deadline", policy_config=config(5.0),
              check_invariants=True)
    d = decision(out)
    assert d["decision"] == "degrade"
    assert d["reason"] == "speculative drafts off (k 3 to 0): speculation does not pay at its predicted batch"
    row = out.row("r0")
    # it decodes one token per plain 10 ms step: first token at 10 ms, the 99 others 990 ms later
    assert (row["outcome"], row["num_output_tokens"], row["last_token_ns"]) == ("completed", 100, 1000 * MS)
    # with the switch off the drafts stay on and the output is capped at 210 tokens (more than the 100 it
    # produces): after the first token, floor(n x 1.875) reaches 99 at n = 53 steps of 40 ms: 2,130 ms
    kept = run(W, instance=INSTANCE, cost_model=cost(10), policy_name="deadline",
               policy_config=config(5.0, cap_speculative_drafts=False))
    d = decision(kept)
    assert (d["decision"], d["reason"]) == ("degrade", "output capped at 210 tokens to meet its E2E objective")
    assert kept.row("r0")["last_token_ns"] == 2130 * MS


def test_drafts_kept_where_speculation_pays(run):
    # cheap drafts (1 ms): a speculative step is 3 + 10 = 13 ms for 1.875 tokens, 6.9 ms a token
    # - E2E objective 2 s (budget 1.8 s): on, 0.01 + 250 x 0.013 / 1.875 = 1.743 s: accepted as it came;
    # - 1.5 s (budget 1.35 s): on, late, capped at (1.35 - 0.01) x 1.875 / 0.013 = 193 tokens; off,
    #   0.01 + 2.5 = 2.51 s, capped at (1.35 - 0.01) / 0.010 = 134: off falls shorter, the drafts stay
    fits = run(W, instance=INSTANCE, cost_model=cost(1), policy_name="deadline", policy_config=config(2.0))
    assert decision(fits)["decision"] == "accept"
    # 53 speculative steps of 13 ms after the 10 ms prefill: 699 ms
    assert fits.row("r0")["last_token_ns"] == 699 * MS
    capped = run(W, instance=INSTANCE, cost_model=cost(1), policy_name="deadline", policy_config=config(1.5))
    d = decision(capped)
    assert (d["decision"], d["reason"]) == ("degrade", "output capped at 193 tokens to meet its E2E objective")
    assert capped.row("r0")["last_token_ns"] == 699 * MS  # still speculating (100 tokens, under the cap)


def test_requests_on_a_plain_instance_are_untouched_and_the_switch_leaves_run_ids(run, tmp_path):
    # the first case's workload and objective on an instance without speculation: 0.01 + 250 x 0.010 =
    # 2.51 s <= 4.5 s, accepted; the switch changes nothing there
    plain = dict(instance=instance_config(), cost_model="constant",
                 cost_model_config=ConstantCostConfig(step_time_ns=10 * MS), policy_name="deadline")
    on = run(W, policy_config=config(5.0), **plain)
    off = run(W, policy_config=config(5.0, cap_speculative_drafts=False), **plain)
    assert decision(on)["decision"] == decision(off)["decision"] == "accept"
    assert on.row("r0")["last_token_ns"] == off.row("r0")["last_token_ns"] == 1000 * MS  # 10 + 99 x 10 ms
    # the switch at its default is absent from the manifest (run ids of existing deadline runs stay)
    manifest = json.loads(Path(on.summary.manifest_path).read_text())
    assert "cap_speculative_drafts" not in json.dumps(manifest)
    assert "cap_speculative_drafts" in Path(off.summary.manifest_path).read_text()
    assert on.summary.run_id != off.summary.run_id


def test_the_cap_never_raises_the_drafts_and_fast_equals_reference(run):
    # a burst of 40 requests on the slow-draft instance: every degrade turns drafts off (k 3 to 0) or
    # leaves them, never raises them; the engine's fast mode is its reference there
    w = make_workload([i * 5 * MS for i in range(40)], [100 + 10 * i for i in range(40)], [60 + i for i in range(40)])
    fast = run(w, instance=INSTANCE, cost_model=cost(10), policy_name="deadline", policy_config=config(5.0),
               check_invariants=True)
    ref = run(w, instance=INSTANCE, cost_model=cost(10), policy_name="deadline", policy_config=config(5.0),
              mode="reference")
    reasons = [d["reason"] or "" for d in fast.of_type("admission_decided")]
    assert any("speculative drafts off (k 3 to 0)" in r for r in reasons)
    assert all("k 3 to 0" in r for r in reasons if "speculative" in r)
    for column in ("admission_decision", "first_token_ns", "last_token_ns", "num_output_tokens"):
        assert fast.requests[column].to_pylist() == ref.requests[column].to_pylist(), column


# ---------------------------------------------------------------------------------------------- the Azure trace


def test_the_draft_cap_on_the_azure_trace_at_twice_its_rate(run, shared):
    # 1,500 Azure conversation requests at 2x their recorded rate, the two-class tenancy with a 10 s E2E
    # objective for the interactive class, on llama-3-8b / A100 with a poorly matched 1B draft (k = 4,
    # alpha = 0.5: E = 1.94). The batch holds ~130 sequences: verifying 5 tokens each makes the step
    # compute-bound, so speculation costs more step time than the tokens it adds and requests whose
    # horizon does not fit have their drafts turned off. Measured (docs/policies.md): cap on 583 drafts
    # turned off, 236 rejected (15.7%), SLO goodput 4.14 req/s; cap off 372 rejected (24.8%), 3.88 req/s
    from replay.abuse import TWO_CLASS_TENANCY, metric_classes, scenario_for, time_scaled, two_class_workload
    from replay.config import parse_instance
    from replay.metrics import MetricsConfig, run_metrics
    from replay.traces import read_trace

    tenancy = dataclasses.replace(TWO_CLASS_TENANCY, classes=tuple(
        dataclasses.replace(c, e2e_objective_s=10.0) if c.name == "interactive" else c for c in TWO_CLASS_TENANCY.classes))
    w = time_scaled(two_class_workload(read_trace("azure-conv", shared), tenancy=tenancy).slice(0, 1500), 2.0)
    base = parse_instance("llama-3-8b@a100-80g")

    def replayed(alpha: float, cap: bool):
        inst = dataclasses.replace(base, speculative=SpeculativeConfig(draft=DRAFT, num_speculative_tokens=4,
                                                                       acceptance_rate=alpha))
        out = run(w, instance=inst, policy_name="deadline", scenario=scenario_for(tenancy),
                  policy_config=DeadlineConfig(tenancy=tenancy, cap_speculative_drafts=cap))
        figures = {v.name: v.value for v in run_metrics(out.requests, out.events, MetricsConfig(
            classes=metric_classes(tenancy))) if v.scope == "overall"}
        reasons = [d["reason"] or "" for d in out.of_type("admission_decided")]
        return figures, [r for r in reasons if "speculative drafts off" in r]

    on, off_decisions = replayed(0.5, True)
    off, none = replayed(0.5, False)
    assert len(off_decisions) > 300 and not none
    assert all("(k 4 to 0)" in r for r in off_decisions)  # never raised, only turned off
    assert on["rejected_share"] < off["rejected_share"] - 0.05
    assert on["goodput_rps"] > 1.03 * off["goodput_rps"]
    assert on["attainment_itl"] > off["attainment_itl"]
    # a well matched draft (alpha = 0.8, E = 3.36) pays at this batch: the cap keeps every draft
    _, kept = replayed(0.8, True)
    assert not kept
