"""The profile-table cost model reads the measured Vidur operator timings right and stays exact."""

from __future__ import annotations

import csv
import math

import pytest

from replay.config import instance_config
from replay.cost_models import make_cost_model
from replay.costmodel import TICKS_PER_NS, CostModelBase, StepShape
from replay.profiles import ProfileCostModel
from servelens.errors import DataNotFoundError


def test_profile_model_reads_the_measured_operators(shared):
    inst = instance_config("llama-3-8b", "a100-80g")
    model = make_cost_model("profile", inst, shared=shared)
    assert isinstance(model, ProfileCostModel) and model.tables.attention is None
    path = shared / "profiles/vidur/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv"
    with open(path) as fh:
        rows = [r for r in csv.DictReader(fh) if r["num_tokens"] == "512" and r["num_tensor_parallel_workers"] == "1"]
    ops = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
           "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
    per_layer_ms = sum(sum(float(r[f"time_stats.{op}.median"]) for op in ops) for r in rows) / len(rows)
    # at exactly a measured token count, the non-attention part is the measurement x 32 layers; the
    # attention of a 512-token prefill comes from the roofline (no attention profile for this model)
    shape = StepShape(((512, 0),), 0, 0)
    u = model.units
    attention_ns = math.ceil(max(512 * 513 // 2 * u.attention_pair, 512 * u.kv_token) / TICKS_PER_NS)
    assert model.step_time_ns(shape) == round(32 * per_layer_ms * 1e6) + attention_ns
    # decode runs: closed form == stepping
    for args in ((8, 8 * 900, 200, 150_000_000), (64, 64 * 3000, 50, None)):
        assert tuple(model.decode_run(*args)) == tuple(CostModelBase.decode_run(model, *args))


def test_profile_model_uses_measured_attention_where_profiled(shared):
    inst = instance_config("llama-2-70b", "a100-80g", tensor_parallel_size=2)
    model = make_cost_model("profile", inst, shared=shared)
    att = model.tables.attention
    assert att is not None and any("attention_tp2" in s for s in model.tables.sources)
    assert any("all_reduce" in s for s in model.tables.sources)
    # inside the measured grid the decode attention is the table's (bilinear between grid points)
    assert att.decode(16, 1024.0) is not None and att.decode(500, 1024.0) is None
    inside = model.decode_step_ns(16, 16 * 1024)
    outside = model.decode_step_ns(16, 16 * 6000)  # beyond the profiled 4k context: roofline fills in
    assert 0 < inside < outside
    assert tuple(model.decode_run(16, 16 * 1000, 40, 10**9)) == tuple(CostModelBase.decode_run(model, 16, 16 * 1000, 40, 10**9))


def test_profile_model_without_a_profile_says_so(shared):
    with pytest.raises(DataNotFoundError, match="no measured profile for llama-3-8b on h100-sxm") as err:
        make_cost_model("profile", instance_config("llama-3-8b", "h100-sxm"), shared=shared)
    assert "roofline" in err.value.hint
    with pytest.raises(DataNotFoundError, match="no measured profile"):
        make_cost_model("profile", instance_config("llama-3-8b", "h200"), shared=shared)
