"""Bounded cardinality: fixed memory whatever the input, heavy hitters kept, no flapping."""

from __future__ import annotations

from privacy.sketch import OTHER, BoundedDimension, SpaceSaving


def test_space_saving_keeps_every_heavy_hitter_in_fixed_memory():
    sketch = SpaceSaving(capacity=50)
    for i in range(200_000):
        sketch.update(f"noise-{i}")  # an attacker's stream of unique ids
        if i % 10 == 0:
            sketch.update("heavy-a")
        if i % 25 == 0:
            sketch.update("heavy-b")
    assert len(sketch) == 50  # never more than its capacity
    assert sketch.heap_size <= 4 * 50 + 64 + 1
    assert {"heavy-a", "heavy-b"} <= set(sketch.counts)
    # Space-Saving's guarantee: count - error <= true count <= count
    assert sketch.counts["heavy-a"] - sketch.errors["heavy-a"] <= 20_000 <= sketch.counts["heavy-a"]


def test_budget_bounds_distinct_outputs_and_counts_folds():
    dim = BoundedDimension("tenant", budget=3)
    weights = {"a": 50, "b": 40, "c": 30, "d": 2, "e": 1}
    dim.observe(weights)
    mapping = dim.fold_all(weights, weights)
    assert {mapping[v] for v in "abc"} == {"a", "b", "c"}
    assert mapping["d"] == mapping["e"] == OTHER
    assert dim.num_folded == 3


def test_membership_does_not_flap_between_close_values():
    """Two challengers trading a small lead each batch: the kept set never changes."""
    dim = BoundedDimension("model", budget=1, margin=0.25)
    changes, previous = 0, None
    for batch in range(200):
        lead, trail = ("x", "y") if batch % 2 else ("y", "x")
        dim.observe({lead: 11, trail: 10})
        if dim.kept != previous:
            changes += 1
            previous = set(dim.kept)
    assert changes == 1  # the first admission only


def test_a_clearly_heavier_newcomer_takes_over():
    dim = BoundedDimension("model", budget=1, margin=0.25)
    dim.observe({"old": 100})
    assert dim.kept == {"old"}
    dim.observe({"new": 120})  # 120 <= 1.25 * 100: not yet
    assert dim.kept == {"old"}
    dim.observe({"new": 20})  # 140 > 125
    assert dim.kept == {"new"}
