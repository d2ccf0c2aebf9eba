"""`ingest --name` is a plain file name, checked before anything runs; `ingest status` names a corrupt
status file and shows the others; `--idle-exit-s` also ends a consumer that is never assigned a partition."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipelines.broker import ensure_topics
from pipelines.ingest import (
    IngestConsumer,
    IngestStats,
    check_consumer_name,
    read_status_files,
    read_statuses,
    write_status,
)
from servelens.cli import cli
from servelens.errors import ServelensError
from tests.pipelines.test_ingest import FAST, KEYRING, consumer

RULE = "use 1 to 100 letters, digits, '.', '_' or '-', not starting with '.'"
BAD_NAMES = ["/../../../../tmp/escaped", "a/b", "", ".hidden", "..", "n" * 101, "a b", "tab\tname", "a\\b"]


def status(name: str, **changes) -> IngestStats:
    stats = IngestStats(consumer=name, records_read=3, events_written=2, dead_letters=1, duplicates_dropped=0, commits=1,
                        commits_fenced=0, events_per_s=2.0, dead_letter_rate=1 / 3, last_commit_ns=None, lag=(),
                        broker_reachable=True)
    return dataclasses.replace(stats, **changes)


@pytest.mark.parametrize("name", ["c1", "ingest-0", "host.example.com-1234", "A_b.c-9", "n" * 100])
def test_plain_names_are_accepted(name: str) -> None:
    assert check_consumer_name(name) == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_names_that_are_not_plain_file_names_are_refused(name: str) -> None:
    with pytest.raises(ServelensError) as caught:
        check_consumer_name(name)
    shown = name if len(name) <= 40 else name[:40] + "..."
    assert caught.value.message == (f"consumer name {shown!r} is not a plain file name: it names the status file "
                                    "<lake>/_ingest/<name>.json")
    assert caught.value.hint == RULE


@pytest.mark.parametrize("name", BAD_NAMES)
def test_ingest_refuses_a_bad_name_when_it_parses_its_options(tmp_path: Path, name: str) -> None:
    """No broker is asked and nothing is written: the name is refused before the command runs."""
    lake = tmp_path / "lake"
    out = CliRunner().invoke(cli, ["--bootstrap-server", "127.0.0.1:1", "--lake", str(lake), "ingest", "--name", name])
    assert out.exit_code == 2
    assert "Invalid value for '--name': consumer name " in out.output and RULE in out.output
    assert not lake.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_console_script_exits_3_on_a_path_as_name(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "servelens", "--bootstrap-server", "127.0.0.1:1", "--lake",
                           str(tmp_path / "lake"), "ingest", "--idle-exit-s", "1", "--name", "a/b"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stderr.splitlines()[-1] == (
        "Error: Invalid value for '--name': consumer name 'a/b' is not a plain file name: it names the status file "
        f"<lake>/_ingest/<name>.json; {RULE}"
    )
    assert not (tmp_path / "lake").exists()


def test_a_bad_name_from_the_configuration_is_refused_too(tmp_path: Path) -> None:
    from pipelines.config import LakeConfig
    from pipelines.kafka_config import KafkaConfig
    from privacy.config import PrivacyConfig

    config = dataclasses.replace(FAST, consumer_name="../../escaped")
    with pytest.raises(ServelensError, match="consumer name '../../escaped' is not a plain file name"):
        IngestConsumer(KafkaConfig(bootstrap_servers="127.0.0.1:1"), config, LakeConfig(root=str(tmp_path / "lake")),
                       PrivacyConfig(), KEYRING, consumer_name=None)
    with pytest.raises(ServelensError, match="consumer name '' is not a plain file name"):
        IngestConsumer(KafkaConfig(bootstrap_servers="127.0.0.1:1"), FAST, LakeConfig(root=str(tmp_path / "lake")),
                       PrivacyConfig(), KEYRING, consumer_name="")


def test_write_status_never_writes_outside_the_status_folder(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    with pytest.raises(ServelensError, match="is not a plain file name"):
        write_status(str(root), status("../../escaped"))
    assert not (tmp_path / "escaped.json").exists() and not root.exists()
    write_status(str(root), status("c1"))
    assert [p.name for p in (root / "_ingest").iterdir()] == ["c1.json"]


def test_corrupt_status_files_are_named_and_the_others_shown(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    write_status(str(root), status("good"))
    folder = root / "_ingest"
    (folder / "a-notjson.json").write_text("{not json")
    (folder / "b-list.json").write_text("[1,2]")
    (folder / "c-bytes.json").write_bytes(b"\xff\xfe")
    (folder / "d-nofield.json").write_text('{"consumer": "d"}')
    (folder / "e-type.json").write_text('{"consumer": 5}')
    (folder / "f-folder.json").mkdir()
    statuses, unreadable = read_status_files(str(root))
    assert [s["consumer"] for s in statuses] == ["good"] == [s["consumer"] for s in read_statuses(str(root))]
    assert [(p.name, why) for p, why in unreadable] == [
        ("a-notjson.json", "not JSON: Expecting property name enclosed in double quotes at character 1"),
        ("b-list.json", "a JSON list, not an object of fields"),
        ("c-bytes.json", "not UTF-8 text"),
        ("d-nofield.json", "lacks the field 'written_ns'"),
        ("e-type.json", "field 'consumer' is an integer, not a string"),
        ("f-folder.json", "Is a directory"),
    ]
    out = CliRunner().invoke(cli, ["--lake", str(root), "ingest", "status"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    tail = "remove it (a running ingest rewrites its own every ingest.status_interval_s)"
    assert lines[0] == (f"{folder / 'a-notjson.json'}: unreadable status file (not JSON: Expecting property name "
                        f"enclosed in double quotes at character 1); {tail}")
    assert lines[5] == f"{folder / 'f-folder.json'}: unreadable status file (Is a directory); {tail}"
    assert lines[6].startswith("good: reported ") and "3 read, 2 written (2/s), 1 dead letters (33.33%), lag 0" in lines[6]


def test_idle_exit_ends_a_consumer_that_is_never_assigned_a_partition(broker, tmp_path: Path) -> None:
    """The topic's one partition is held by another member of the group, which keeps polling: the ingest
    consumer gets nothing assigned, and stops idle_exit_s + the session timeout after it started."""
    from kafka import KafkaConsumer

    topic = "test.unassigned." + uuid.uuid4().hex[:8]
    ensure_topics(broker.bootstrap, {topic: 1, f"{topic}.dead": 1})
    holder = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=f"ingest-{topic}", client_id="a-holder",
                           session_timeout_ms=FAST.session_timeout_ms, heartbeat_interval_ms=FAST.heartbeat_interval_ms)
    holder.subscribe([topic])
    deadline = time.monotonic() + 60
    while not holder.assignment() and time.monotonic() < deadline:
        holder.poll(timeout_ms=100)
    assert holder.assignment(), "the holder never joined the group"
    done = threading.Event()

    def keep_polling() -> None:
        while not done.is_set():
            holder.poll(timeout_ms=100)

    poller = threading.Thread(target=keep_polling, daemon=True)
    poller.start()
    ingest = consumer(broker.bootstrap, topic, tmp_path / "lake", name="z-waiting")
    result: list = []
    started = time.monotonic()
    loop = threading.Thread(target=lambda: result.append(ingest.run(idle_exit_s=1.0)))
    loop.start()
    loop.join(timeout=30)
    elapsed = time.monotonic() - started
    still_running = loop.is_alive()  # the old behaviour: never idle while unassigned
    if still_running:
        ingest.stop()
        loop.join(timeout=30)
    done.set()
    poller.join(timeout=10)
    holder.close()
    assert not still_running, f"still running after {elapsed:.0f} s with no partition assigned"
    assert result[0].records_read == 0 and not ingest.partitions
    assert 1.0 + FAST.session_timeout_ms / 1000 <= elapsed < 30
    assert json.loads((tmp_path / "lake" / "_ingest" / "z-waiting.json").read_text())["consumer"] == "z-waiting"
