"""The reliability soak's short mode: a real broker, the emitter SDK, ingest processes killed with
SIGKILL while committing, and injected faults; the lake ends exact."""

from __future__ import annotations

from pathlib import Path

from benchmarks.soak import run_soak


def test_the_short_soak_loses_nothing_stores_nothing_twice_and_dead_letters_every_fault(tmp_path):
    figures = run_soak(20_000, tmp_path / "soak", kill_every_s=1.0, events_per_s=1_000, quiet=True)
    injected = figures["injected"]
    assert figures["restarts_after_commits"] >= 1, figures  # at least one process died mid-stream
    assert figures["emitter"] == {"sent": figures["events_emitted"], "failed": 0, "dropped": 0}
    assert figures["stored"] == figures["distinct_valid_events"] > 19_000
    assert figures["lost"] == figures["duplicated"] == figures["unexpected_events"] == 0
    assert injected["duplicate"] >= 1
    assert figures["dead_letters_by_reason"] == {
        "invalid_json": injected["not_json"], "wrong_type": injected["wrong_type"], "oversized": injected["oversized"]}
    assert figures["ok"]
    assert "Ingest resident memory" in Path(figures["plot"]["html"]).read_text()
