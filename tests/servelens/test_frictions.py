"""The small frictions of issue #23, each with a known answer: what used to fail or mislead now works or says why."""

from __future__ import annotations

import base64
import dataclasses
import gzip
import shutil
from pathlib import Path

import pyarrow.parquet as pq
from click.testing import CliRunner

from servelens.cli import cli

KEY = "test-key:" + base64.b64encode(bytes(range(32))).decode()


def _run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), env=env or {}, catch_exceptions=False)


def test_privacy_lookup_prints_the_pseudonym_the_sanitizer_stores(tmp_path):
    from privacy.config import PrivacyConfig
    from privacy.keys import load_keyring
    from privacy.sanitize import Sanitizer
    from replay.workload import arrival_events
    from tests.replay.conftest import make_workload

    events = arrival_events(make_workload([0], [10], [2], request_id=["req-042"], tenant=["acme"]), engine_id="e")
    ring = load_keyring(None, {"SERVELENS_PSEUDONYM_KEY": KEY})
    stored = Sanitizer(ring, PrivacyConfig()).sanitize(events).to_pylist()[0]
    assert _run("privacy", "lookup", "req-042", env={"SERVELENS_PSEUDONYM_KEY": KEY}).output.split()[0] == stored["request_id"]
    tenant = _run("privacy", "lookup", "acme", "--field", "tenant", env={"SERVELENS_PSEUDONYM_KEY": KEY})
    assert tenant.output.split()[0] == stored["tenant"]


def test_azure_2024_timestamps_and_gzipped_traces_are_read(tmp_path):
    from replay.traces import read_trace

    csv = tmp_path / "azure2024.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2024-05-10 00:00:00.009930+00:00,100,20\n2024-05-10 00:00:01.5+00:00,200,30\n")
    with csv.open("rb") as raw, gzip.open(tmp_path / "azure2024.csv.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    for path in (csv, tmp_path / "azure2024.csv.gz"):
        table = read_trace(str(path))
        assert table["arrival_ns"].to_pylist() == [1_715_299_200_009_930_000, 1_715_299_201_500_000_000]
        assert table["request_id"][0].as_py() == "azure2024-000000"
    stats = _run("trace", "stats", str(tmp_path / "azure2024.csv.gz"))
    assert stats.exit_code == 0 and stats.output.startswith("2 requests")


def test_trace_stats_and_convert_refuse_an_unsorted_trace_as_replay_does(tmp_path):
    csv = tmp_path / "unsorted.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:05,100,20\n2023-11-16 18:00:01,200,30\n")
    for args in (["trace", "stats", str(csv)], ["replay", "--workload", str(csv), "--out", str(tmp_path / "r")],
                 ["trace", "convert", str(csv), "--out", str(tmp_path / "w.parquet")]):  # convert wrote it before
        done = CliRunner().invoke(cli, args)
        assert done.exit_code == 3 and "not in arrival order" in done.output, done.output


def test_trace_stats_of_a_single_instant_prints_no_rate_rather_than_nan(tmp_path):
    csv = tmp_path / "one.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:05,100,20\n")
    done = CliRunner().invoke(cli, ["trace", "stats", str(csv)])
    assert done.exit_code == 0 and "nan" not in done.output, done.output
    assert "over 0.0 s, no rate (every arrival at one instant)" in done.output
    assert "inter-arrival CV n/a (fewer than two gaps)" in done.output


def test_requests_derive_checks_sanitized_events_against_the_key_ring_and_copies_a_replays_own_table(tmp_path):
    from replay.run import run_replay
    from tests.replay.conftest import make_workload

    summary = run_replay(make_workload([0, 10**6], [100, 100], [3, 3]), out_dir=tmp_path / "run")
    done = _run("requests", "derive", str(summary.events_path), "--out", str(tmp_path / "copy.parquet"))
    assert done.exit_code == 0 and "the replay wrote it" in done.output
    assert pq.read_table(tmp_path / "copy.parquet").equals(pq.read_table(summary.requests_path))
    # sanitized events (every one carries a key id): validated and their key ids checked against the ring, not
    # sanitized again
    sanitized = tmp_path / "sanitized.parquet"
    _run("privacy", "sanitize", str(summary.events_path), "--out", str(sanitized), env={"SERVELENS_PSEUDONYM_KEY": KEY})
    done = _run("requests", "derive", str(sanitized), "--out", str(tmp_path / "derived.parquet"),
                env={"SERVELENS_PSEUDONYM_KEY": KEY})
    assert done.exit_code == 0 and pq.read_metadata(tmp_path / "derived.parquet").num_rows == 2
    derived = pq.read_table(tmp_path / "derived.parquet")["request_id"].to_pylist()
    assert sorted(derived) == sorted(set(pq.read_table(sanitized)["request_id"].drop_null().to_pylist()))


def test_requests_derive_warns_of_latencies_left_null_because_a_clock_ran_backwards(tmp_path):
    from schemas.arrow import events_to_table
    from tests.pipelines.test_tables import T0, completed_request

    events = completed_request()
    events[0] = dataclasses.replace(events[0], ts_ns=T0 + 4 * 10**9)  # arrives 4 s after its own first token
    path = tmp_path / "events.parquet"
    pq.write_table(events_to_table(events), path)
    done = _run("requests", "derive", str(path), "--out", str(tmp_path / "r.parquet"), env={"SERVELENS_PSEUDONYM_KEY": KEY})
    assert done.exit_code == 0, done.output
    assert "warning: 1 requests have a timestamp before the one their latency is measured from" in done.output
    assert pq.read_table(tmp_path / "r.parquet")["ttft_s"].to_pylist() == [None]


def test_durations_and_the_lake_option(tmp_path):
    from servelens.click_types import Duration

    since = Duration()  # gate --since's type
    assert [since.convert(v, None, None) for v in ("1h", "30m", "90s", "90", "1.5d")] == [3600.0, 1800.0, 90.0, 90.0, 129_600.0]
    done = _run("--lake", str(tmp_path / "nowhere"), "lake", "compact")
    assert done.exit_code == 3 and f"no lake at {tmp_path / 'nowhere'}: not there" in done.output


def test_metrics_export_labels_a_replay_with_its_models_name(tmp_path):
    from replay.config import parse_instance
    from replay.run import run_replay
    from tests.replay.conftest import make_workload

    n = 12  # a label value needs k = 5 requests, else it folds into 'other'
    summary = run_replay(make_workload([i * 10**6 for i in range(n)], [100] * n, [3] * n),
                         instance=parse_instance("llama-3-8b@h100-sxm"), out_dir=tmp_path)
    text = _run("metrics", "export", str(summary.events_path)).output
    assert 'model_name="llama-3-8b"' in text and 'model_name="unknown"' not in text


def test_metrics_export_refuses_latencies_that_are_not_durations(tmp_path):
    """Before, a negative or NaN ttft_s was exported (sums of +Inf, NaN rows dropped from the buckets unsaid)."""
    import pyarrow.compute as pc

    from replay.run import run_replay
    from tests.replay.conftest import make_workload

    n = 12
    summary = run_replay(make_workload([i * 10**6 for i in range(n)], [100] * n, [3] * n), out_dir=tmp_path)
    table = pq.read_table(summary.requests_path)
    column = table.schema.get_field_index("ttft_s")
    for name, values in (("neg", pc.multiply(table["ttft_s"], -1.0)), ("nan", pc.divide(table["ttft_s"], 0.0))):
        pq.write_table(table.set_column(column, "ttft_s", values), tmp_path / f"{name}.parquet")
        done = _run("metrics", "export", str(tmp_path / f"{name}.parquet"))
        assert done.exit_code == 3 and "durations must be seconds, finite and not negative" in done.output, done.output
        assert f"ttft_s is {'negative' if name == 'neg' else 'NaN or infinite'} in {n} rows" in done.output, done.output


def test_the_demo_does_not_print_dagsters_telemetry_banner():
    source = (Path(__file__).resolve().parents[2] / "servelens" / "demo.py").read_text()
    assert '"telemetry": {"enabled": False}' in source  # the instance's override (the banner comes with telemetry)
