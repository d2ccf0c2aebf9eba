"""Hostile values of `servelens replay`'s cluster options, `dashboard --host` and `trace convert --out` (probe4
D4-D7, D9, D11, D12): refused at once, naming the flag, or warned about."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tests.servelens.test_cli import servelens

REPLAY = ("replay", "--workload", "azure-conv", "--requests", "50")


def test_instances_beyond_the_cluster_bound_are_refused_at_parse_time(tmp_path):
    proc = servelens(*REPLAY, "--instances", "100000000000", "--out", str(tmp_path / "o"))
    assert proc.returncode == 3
    assert "Invalid value for '--instances': 100000000000 is not in the range 1<=x<=10000." in proc.stderr
    assert "internal error" not in proc.stderr and not (tmp_path / "o").exists()


def test_requests_beyond_a_billion_are_refused(tmp_path):
    proc = servelens("replay", "--workload", "azure-conv", "--requests", "1000000000000", "--out", str(tmp_path / "o"))
    assert proc.returncode == 3
    assert "Invalid value for '--requests': 1000000000000 is not in the range 1<=x<=1000000000." in proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--instances", "1", "--decode-router", "nope"],
     "error: --decode-router: unknown router 'nope'\n"
     "  hint: valid names: gie, least-load, least-outstanding-tokens, round-robin\n"),
    (["--instances", "2", "--decode-router", "gie"],
     "error: --decode-router needs --decode-instances: it configures the decode pool of disaggregated serving\n"
     "  hint: add --decode-instances N, or drop --decode-router\n"),
    (["--instances", "2", "--kv-transfer-gbps", "5"],
     "error: --kv-transfer-gbps needs --decode-instances: it configures the decode pool of disaggregated serving\n"
     "  hint: add --decode-instances N, or drop --kv-transfer-gbps\n"),
    (["--instances", "2", "--kv-transfer-gbps", "5", "--kv-transfer-latency-s", "0.1"],
     "error: --kv-transfer-gbps, --kv-transfer-latency-s need --decode-instances: they configure the decode pool of "
     "disaggregated serving\n  hint: add --decode-instances N, or drop --kv-transfer-gbps and --kv-transfer-latency-s\n"),
    (["--instances", "2", "--fail", "5:0", "--fail", "5:0"],
     "error: --fail 5:0 is given twice (an instance fails once at a time)\n"),
])
def test_cluster_options_that_would_be_ignored_are_refused_naming_the_flag(tmp_path, args, message):
    proc = servelens(*REPLAY, *args, "--out", str(tmp_path / "o"))
    assert proc.returncode == 3 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


def test_no_decode_instances_is_refused(tmp_path):
    proc = servelens(*REPLAY, "--instances", "2", "--decode-instances", "0", "--out", str(tmp_path / "o"))
    assert proc.returncode == 3
    assert "Invalid value for '--decode-instances': 0 is not in the range 1<=x<=10000." in proc.stderr


def test_a_decode_pool_with_its_options_still_runs(tmp_path):
    proc = servelens(*REPLAY, "--instances", "1", "--decode-instances", "1", "--decode-router", "gie",
                     "--kv-transfer-gbps", "5", "--out", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    assert "on 2 instances" in proc.stdout and "50 KV transfers" in proc.stdout


def test_requests_lost_to_failed_instances_are_warned_about(tmp_path):
    proc = servelens(*REPLAY, "--instances", "2", "--fail", "1:0", "--fail", "1:1", "--out", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    errored = pq.read_table(tmp_path / "o" / "requests.parquet")["outcome"].to_pylist().count("error")
    assert errored == 49
    assert ("warning: 49 of 50 requests ended in error (failed in the recorded trace, its failed column, or their "
            "instance failed and no instance took them over); see the outcome column of requests.parquet\n") in proc.stderr


def test_a_run_without_failures_has_no_error_warning(tmp_path):
    proc = servelens(*REPLAY, "--instances", "2", "--out", str(tmp_path / "o"))
    assert proc.returncode == 0 and "ended in error" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(("host", "message"), [
    ("", "Invalid value for '--host': must not be empty (an empty host listens on every interface)"),
    ("  ", "Invalid value for '--host': must not be empty (an empty host listens on every interface)"),
    ("no such host!!", "Invalid value for '--host': 'no such host!!' does not resolve to an address ("),
])
def test_dashboard_host_that_is_empty_or_unresolvable_is_refused(host, message):
    proc = servelens("dashboard", "--host", host, "--port", "0")
    assert proc.returncode == 3 and message in proc.stderr, proc.stderr
    assert "listens on" not in proc.stderr.split("Error:")[0]  # no "beyond loopback" warning first
    assert "check the path" not in proc.stderr


@pytest.mark.parametrize(("to", "name", "message"), [
    ("events", "a.csv", "a.csv does not end in .jsonl or .parquet, the file --to events writes"),
    ("workload", "a.jsonl", "a.jsonl does not end in .parquet, the file --to workload writes"),
    ("workload", "a", "a does not end in .parquet, the file --to workload writes"),
])
def test_trace_convert_refuses_a_suffix_of_another_format(tmp_path, to, name, message):
    proc = servelens("trace", "convert", "burstgpt-1", "--to", to, "--out", str(tmp_path / name))
    assert proc.returncode == 3 and f"Invalid value for '--out': {tmp_path / message}" in proc.stderr, proc.stderr
    assert not (tmp_path / name).exists()


def test_trace_convert_follows_the_suffix_it_accepts(tmp_path):
    for to, name in (("workload", "w.parquet"), ("events", "e.parquet"), ("events", "e.jsonl")):
        proc = servelens("trace", "convert", "burstgpt-1", "--to", to, "--out", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr
    assert pq.read_table(tmp_path / "e.parquet").num_rows == len((tmp_path / "e.jsonl").read_text().splitlines())


def test_an_empty_out_is_refused_naming_it():
    proc = servelens("trace", "convert", "burstgpt-1", "--out", "")
    assert proc.returncode == 3 and "Invalid value for '--out': must not be empty; give the file's name" in proc.stderr
