"""Reliability soak: events through the emitter, a broker and ingest processes killed at random.

A local broker (Tansu) takes synthetic lifecycle events (``benchmarks/synthetic.py``, 1% producer
retries included) from the emitter SDK, while a second producer injects faults: messages that are
not JSON, events with a field of the wrong type, oversized messages (over
``ingest.max_message_bytes``) and re-sent copies of events already sent. Meanwhile ``servelens
ingest`` runs as a child process that is killed with SIGKILL at random moments (every
``--kill-every-s`` seconds on average) and restarted; once the producers are done, a last ingest
process drains the topic and exits.

At the end the lake must hold every distinct valid event exactly once (checked id by id against
the keyed pseudonyms of what was sent) and the dead letters every injected invalid message once,
with its reason. The resident memory of the ingest processes is sampled every 0.25 s and plotted
(``soak.html``; ``soak.png`` through headless Chromium when Playwright is installed).

    python benchmarks/soak.py                # 5,000,000 events (the README figure)
    python benchmarks/soak.py --quick        # 50,000 events at 5,000/s, under a minute
    python benchmarks/soak.py --events 1000000 --kill-every-s 5 --out out/soak

The last line of output is one JSON object with the figures; the exit status is 1 when an event
was lost or duplicated or a fault was not dead-lettered as it should have been.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.synthetic import iter_chunks  # noqa: E402
from pipelines.broker import LocalBroker  # noqa: E402
from pipelines.emitter import Emitter  # noqa: E402
from pipelines.lake import DEAD_LETTERS, EVENTS, Lake  # noqa: E402
from privacy.keys import KeyRing  # noqa: E402
from schemas.wire import iter_table_json  # noqa: E402

TOPIC = "servelens.soak.v1"
PARTITIONS = 4
KEY = bytes(range(32))
KEYRING = KeyRing("soak", {"soak": KEY})
MAX_MESSAGE_BYTES = 16_384  # the ingest's limit in the soak: oversized faults stay cheap to send
FAULT_SHARE = 0.001  # of each kind, per valid event


@dataclass
class Faults:
    """What the fault injector sent, by kind, and the dead-letter reason each kind must get."""

    sent: Counter[str] = field(default_factory=Counter)
    REASONS = {"not_json": "invalid_json", "wrong_type": "wrong_type", "oversized": "oversized"}

    @property
    def expected_dead_letters(self) -> Counter[str]:
        return Counter({self.REASONS[k]: n for k, n in self.sent.items() if k in self.REASONS})


def inject(producer, rng: random.Random, valid: list[tuple[bytes, bytes]], faults: Faults, count: int) -> None:
    """Send ``count`` faults of each kind, built from the chunk's valid messages ``valid``."""
    for _ in range(count):
        key, value = valid[rng.randrange(len(valid))]
        record = json.loads(value)
        producer.send(TOPIC, key=key, value=b'{"event_type": "request_arrived", "ts_ns": ' + value[:20])
        faults.sent["not_json"] += 1
        record_wrong = dict(record, ts_ns="yesterday")
        producer.send(TOPIC, key=key, value=json.dumps(record_wrong).encode())
        faults.sent["wrong_type"] += 1
        producer.send(TOPIC, key=key, value=value[:-1] + b', "padding": "' + b"x" * MAX_MESSAGE_BYTES + b'"}')
        faults.sent["oversized"] += 1
        producer.send(TOPIC, key=key, value=value)  # a copy of an event already sent: stored once
        faults.sent["duplicate"] += 1


def produce(bootstrap: str, num_events: int, expected_path: Path, faults: Faults, seed: int, status: dict,
            events_per_s: float | None = None) -> None:
    """Emit the synthetic events through the SDK (at ``events_per_s`` at most, if given) and inject
    the faults; record the expected ids."""
    from kafka import KafkaProducer

    rng = random.Random(seed)
    emitter = Emitter(bootstrap, TOPIC, max_buffered_events=200_000).start()
    injector = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, compression_type="zstd",
                             max_in_flight_requests_per_connection=1, retries=10)
    started = time.monotonic()
    with pq.ParquetWriter(expected_path, pa.schema([("event_id", pa.string())])) as expected:
        for table in iter_chunks(num_events, seed=seed, requests_per_chunk=1_000):
            if events_per_s:  # an engine fleet's pace, not a backfill's
                time.sleep(max(0.0, started + status["emitted"] / events_per_s - time.monotonic()))
            ids = pc.unique(table["event_id"]).to_pylist()
            expected.write_table(pa.table({"event_id": KEYRING.pseudonyms("ev", ids, hex_chars=32)}))
            status["emitted"] += emitter.emit_table(table, timeout_s=600)
            sample = table.slice(0, 64)
            valid = list(zip([k.encode() for k in sample["request_id"].fill_null("x").to_pylist()],
                             iter_table_json(sample)))
            inject(injector, rng, valid, faults, max(1, round(table.num_rows * FAULT_SHARE)))
    injector.flush(120)
    injector.close()
    if not emitter.flush(300):
        raise RuntimeError("the emitter could not deliver every event within 300 s")
    stats = emitter.close()
    status["emitter"] = {"sent": stats.num_sent, "failed": stats.num_failed, "dropped": stats.num_dropped}


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def ingest_env(bootstrap: str, lake_root: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SERVELENS_PSEUDONYM_KEY": "soak:" + base64.b64encode(KEY).decode(),
        "SERVELENS_KAFKA__BOOTSTRAP_SERVERS": bootstrap, "SERVELENS_KAFKA__TOPIC": TOPIC,
        "SERVELENS_KAFKA__NUM_PARTITIONS": str(PARTITIONS), "SERVELENS_LAKE__ROOT": str(lake_root),
        "SERVELENS_INGEST__SESSION_TIMEOUT_MS": "2000", "SERVELENS_INGEST__HEARTBEAT_INTERVAL_MS": "500",
        "SERVELENS_INGEST__MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
        "SERVELENS_INGEST__FLUSH_INTERVAL_S": "1.0",
    }


def watch(proc: subprocess.Popen, until_s: float | None, samples: list[tuple[float, int, float]], t0: float,
          until=lambda: False) -> None:
    """Sample ``proc``'s memory every 0.25 s until it exits, ``until_s`` (monotonic) passes or ``until()``."""
    while proc.poll() is None and (until_s is None or time.monotonic() < until_s) and not until():
        rss = rss_mb(proc.pid)
        if rss is not None:
            samples.append((time.monotonic() - t0, proc.pid, rss))
        time.sleep(0.25)


def lake_version(lake_root: Path) -> int:
    """The events table's Delta version: it advances with every commit (-1 before the first)."""
    table = Lake(lake_root).table(EVENTS)
    return table.version() if table is not None else -1


def lake_figures(lake_root: Path, expected_path: Path) -> dict:
    lake = Lake(lake_root)
    con = lake.connect()
    con.execute(f"CREATE VIEW expected AS SELECT DISTINCT event_id FROM read_parquet('{expected_path}')")
    stored, distinct = con.execute("SELECT count(*), count(DISTINCT event_id) FROM events").fetchone()
    (lost,) = con.execute("SELECT count(*) FROM expected WHERE event_id NOT IN (SELECT event_id FROM events)").fetchone()
    (foreign,) = con.execute("SELECT count(*) FROM events WHERE event_id NOT IN (SELECT event_id FROM expected)").fetchone()
    (num_expected,) = con.execute("SELECT count(*) FROM expected").fetchone()
    dead: dict[str, int] = {}
    dead_distinct = 0
    if lake.table(DEAD_LETTERS) is not None:
        dead = dict(con.execute("SELECT reason, count(*) FROM dead_letters GROUP BY reason").fetchall())
        (dead_distinct,) = con.execute(
            "SELECT count(*) FROM (SELECT DISTINCT topic, partition, epoch, \"offset\" FROM dead_letters)").fetchone()
    return {"expected": num_expected, "stored": stored, "distinct": distinct, "lost": lost, "foreign": foreign,
            "duplicated": stored - distinct, "dead_letters": dead, "dead_letters_distinct": dead_distinct}


def plot(samples: list[tuple[float, int, float]], kills: list[float], out: Path) -> dict[str, str | None]:
    """The ingest processes' memory over time: ``soak.html``, and ``soak.png`` through Chromium."""
    import plotly.graph_objects as go

    fig = go.Figure()
    pids = list(dict.fromkeys(pid for _, pid, _ in samples))
    for n, pid in enumerate(pids):
        points = [(t, rss) for t, p, rss in samples if p == pid]
        fig.add_trace(go.Scatter(x=[t for t, _ in points], y=[r for _, r in points], mode="lines",
                                 name=f"ingest process {n + 1}", showlegend=n < 3 or n == len(pids) - 1))
    for t in kills:
        fig.add_vline(x=t, line_width=1, line_dash="dot", line_color="firebrick")
    fig.update_layout(title="Ingest resident memory during the soak (dotted: SIGKILL)", xaxis_title="time (s)",
                      yaxis_title="RSS (MB)", template="plotly_white", width=1000, height=500)
    html = out / "soak.html"
    fig.write_html(html, include_plotlyjs=True)
    png: str | None = None
    try:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            executable = "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
            browser = p.chromium.launch(executable_path=executable)
            page = browser.new_page(viewport={"width": 1020, "height": 520})
            page.goto(html.resolve().as_uri())
            page.wait_for_selector(".main-svg")
            page.screenshot(path=str(out / "soak.png"))
            browser.close()
        png = str(out / "soak.png")
    except Exception as exc:  # noqa: BLE001 - the PNG is a convenience; the HTML holds the same plot
        print(f"soak.png not written ({type(exc).__name__}: {exc}); open {html}", file=sys.stderr)
    return {"html": str(html), "png": png}


def run_soak(num_events: int, out: Path, *, kill_every_s: float = 3.0, events_per_s: float | None = None,
             seed: int = 7, quiet: bool = False) -> dict:
    """Run the soak; return its figures (``ok`` says whether every check held)."""
    out.mkdir(parents=True, exist_ok=True)
    lake_root, expected_path = out / "lake", out / "expected_ids.parquet"
    if lake_root.exists():
        raise SystemExit(f"{lake_root} exists: give a fresh --out folder (the soak checks an empty lake's contents)")
    faults, status = Faults(), {"emitted": 0}
    samples: list[tuple[float, int, float]] = []
    kills: list[float] = []
    kills_committing = 0  # kills of a process that had committed (not one still starting)
    rng = random.Random(seed)
    say = (lambda *_: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    started = time.monotonic()
    with LocalBroker(topics={TOPIC: PARTITIONS}) as broker:
        env = ingest_env(broker.bootstrap, lake_root)
        failure: list[BaseException] = []

        def producing() -> None:
            try:
                produce(broker.bootstrap, num_events, expected_path, faults, seed, status, events_per_s)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failure.append(exc)

        producer = threading.Thread(target=producing, name="soak-producer")
        producer.start()
        while producer.is_alive():
            proc = subprocess.Popen([sys.executable, "-m", "servelens", "ingest"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # let it start and commit (a kill during start-up tests little), then kill it at random
            version = lake_version(lake_root)
            watch(proc, time.monotonic() + 300, samples, started,
                  until=lambda version=version: not producer.is_alive() or lake_version(lake_root) > version)
            committed = lake_version(lake_root) > version
            watch(proc, time.monotonic() + rng.uniform(0.0, 2 * kill_every_s), samples, started)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills.append(time.monotonic() - started)
                kills_committing += committed
            say(f"{status['emitted']:,} events emitted, {len(kills)} ingest processes killed")
        producer.join()
        if failure:
            raise failure[0]
        say("producers done; a last ingest process drains the topic")
        final = subprocess.Popen([sys.executable, "-m", "servelens", "ingest", "--idle-exit-s", "5"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        sampler = threading.Thread(target=watch, args=(final, None, samples, started))
        sampler.start()
        _, stderr = final.communicate(timeout=3600)
        sampler.join()
        if final.returncode != 0:
            raise RuntimeError(f"the last ingest process failed ({final.returncode}): {stderr[-2000:]}")
    wall_s = time.monotonic() - started
    lake = lake_figures(lake_root, expected_path)
    expected_dead = faults.expected_dead_letters
    rss = [r for _, _, r in samples]
    # flat memory: the longest-lived process (the drain) holds no more at its end than after warm-up
    longest = [r for _, pid, r in samples if pid == max(Counter(p for _, p, _ in samples).items(),
                                                         key=lambda kv: kv[1], default=(None, 0))[0]]
    quarter = max(1, len(longest) // 4)
    second, last = max(longest[quarter:2 * quarter], default=0.0), max(longest[-quarter:], default=0.0)
    figures = {
        "events_emitted": status["emitted"],
        "emitter": status.get("emitter"),
        "distinct_valid_events": lake["expected"],
        "stored": lake["stored"],
        "lost": lake["lost"],
        "duplicated": lake["duplicated"],
        "unexpected_events": lake["foreign"],
        "restarts": len(kills),
        "restarts_after_commits": kills_committing,
        "injected": dict(faults.sent),
        "dead_letters_by_reason": lake["dead_letters"],
        "dead_letters_expected": dict(expected_dead),
        "peak_rss_mb": round(max(rss, default=0.0), 1),
        "longest_process_rss_last_vs_second_quarter": round(last / second, 2) if second else None,
        "events_per_s": events_per_s,
        "wall_s": round(wall_s, 1),
        "plot": plot(samples, kills, out),
    }
    figures["ok"] = (
        lake["lost"] == 0 and lake["duplicated"] == 0 and lake["foreign"] == 0
        and lake["dead_letters"] == dict(expected_dead) and lake["dead_letters_distinct"] == sum(expected_dead.values())
        and status.get("emitter", {}).get("failed") == 0 and status.get("emitter", {}).get("dropped") == 0
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="50,000 events at 5,000/s instead of 5,000,000")
    parser.add_argument("--events", type=int, default=None, help="how many valid events to emit (about)")
    parser.add_argument("--kill-every-s", type=float, default=3.0, help="mean seconds between SIGKILLs (default 3)")
    parser.add_argument("--events-per-s", type=float, default=None,
                        help="pace the emitter (default: as fast as it goes; --quick: 5,000/s)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None, help="where the lake and the plot go (default: a new temp folder)")
    args = parser.parse_args()
    num_events = args.events or (50_000 if args.quick else 5_000_000)
    if args.out is None:
        import tempfile

        args.out = Path(tempfile.mkdtemp(prefix="servelens-soak-"))
    rate = args.events_per_s or (5_000 if args.quick else None)
    figures = run_soak(num_events, args.out, kill_every_s=args.kill_every_s, events_per_s=rate, seed=args.seed)
    print(json.dumps(figures))
    sys.exit(0 if figures["ok"] else 1)


if __name__ == "__main__":
    main()
