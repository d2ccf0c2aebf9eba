"""The event kernel: integer clock, heap order with a pinned tie-break, running ahead safely."""

from __future__ import annotations

import pytest

from replay.kernel import ARRIVAL, CANCEL, SCHEDULE, STEP_END, Kernel


def test_order_is_time_then_priority_then_scheduling_order():
    k = Kernel()
    seen: list[str] = []
    # scheduled deliberately out of order; at t=10 all four kinds plus two arrivals tie
    k.schedule(10, SCHEDULE, lambda: seen.append("schedule@10"))
    k.schedule(10, ARRIVAL, lambda: seen.append("arrival-a@10"))
    k.schedule(5, ARRIVAL, lambda: seen.append("arrival@5"))
    k.schedule(10, CANCEL, lambda: seen.append("cancel@10"))
    k.schedule(10, ARRIVAL, lambda: seen.append("arrival-b@10"))
    k.schedule(10, STEP_END, lambda: seen.append("step_end@10"))
    k.run()
    assert seen == ["arrival@5", "step_end@10", "cancel@10", "arrival-a@10", "arrival-b@10", "schedule@10"]
    assert k.now_ns == 10 and k.num_actions == 6


def test_actions_scheduled_while_running_keep_the_order():
    k = Kernel()
    seen: list[tuple[int, str]] = []

    def step_end() -> None:
        seen.append((k.now_ns, "step_end"))
        k.schedule(k.now_ns, SCHEDULE, lambda: seen.append((k.now_ns, "schedule")))
        k.schedule(k.now_ns, ARRIVAL, lambda: seen.append((k.now_ns, "late arrival")))

    k.schedule(7, STEP_END, step_end)
    k.run()
    # an arrival scheduled at the same instant still precedes the scheduling pass
    assert seen == [(7, "step_end"), (7, "late arrival"), (7, "schedule")]


def test_the_clock_is_integer_and_never_goes_back():
    k = Kernel(start_ns=1_700_000_000_000_000_000)
    k.schedule(1_700_000_000_000_000_001, ARRIVAL, lambda: None)
    k.run()
    assert k.now_ns == 1_700_000_000_000_000_001 and isinstance(k.now_ns, int)
    with pytest.raises(ValueError, match="already at"):
        k.schedule(1_700_000_000_000_000_000, ARRIVAL, lambda: None)


def test_run_until_stops_before_later_actions():
    k = Kernel()
    seen: list[int] = []
    for t in (1, 2, 3):
        k.schedule(t, ARRIVAL, lambda t=t: seen.append(t))
    k.run(until_ns=2)
    assert seen == [1, 2] and len(k) == 1 and k.next_time_ns() == 3
    assert k.step() and seen == [1, 2, 3] and not k.step()


def test_advance_only_when_nothing_is_due_first():
    k = Kernel()
    k.schedule(100, ARRIVAL, lambda: None)
    k.advance(99)
    assert k.now_ns == 99
    with pytest.raises(ValueError, match="due first"):
        k.advance(100)
    with pytest.raises(ValueError, match="due first"):
        k.advance(50)  # backwards
