"""Every example in every command's --help runs as written after `make demo` (in a folder where the demo ran).

Examples run in order (a few produce what later ones read: a profile, a key file, a BLIS trace), in process
for speed (click's runner, the same command objects), with the environment assignments they write. The
commands that serve until Ctrl-C (broker, dashboard) are started as processes, checked to be up and
stopped with SIGINT. What cannot run here is listed in ``NOT_HERE`` with the reason, and the test fails
when an entry there is no longer an example.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
from click.testing import CliRunner

from servelens.cli import cli
from tests.terminal import sigint_as_in_a_terminal

#: Examples that cannot run on this machine or in a test, and why.
NOT_HERE = {
    "servelens demo": "the whole demo with its dashboard until Ctrl-C: the demo_output fixture ran it (--no-serve), "
                      "and tests/servelens/test_cli.py serves and stops it",
    "servelens demo --requests 2000 --candidates sarathi,vtc --loads 1x --no-serve": "what the demo_output fixture runs",
    "servelens profile --model llama-8b --device cuda --out profiles/llama-8b-h200.parquet --max-seconds 240": "needs a CUDA GPU",
    "servelens profile --model llama-70b --layers 8 --device cuda --out profiles/llama-70b-8l-h200.parquet": "needs a CUDA GPU",
    "servelens fidelity --out out/fidelity": "every measured run at full length: 12 minutes (docs/calibration.md)",
    "servelens calibrate --out out/vllm-h100.json": "fits to every fidelity experiment by simulation: many minutes",
    "servelens gate --live --candidate-pool canary --since 1h --previous-config policy=fcfs@v12":
        "needs a live canary: a lake whose events carry the pool label (the demo's has none; refused with exit 3)",
    "servelens ingest status": "reads ingest's status files: the other tests of ingest cover it (the demo's consumer "
                               "ran in process and left none)",
    "promtool tsdb create-blocks-from openmetrics run.om /prometheus/data": "Prometheus's tool, not servelens",
    "servelens ingest": "consumes a Kafka topic until stopped: tests/pipelines/test_ingest.py runs it against a real broker",
    "servelens ingest --idle-exit-s 10": "needs a Kafka broker with the topic: tests/pipelines/test_ingest.py runs it",
    "blis replay --trace-header blis/trace.yaml --trace-data blis/trace.csv ...": "BLIS's own command (inference-sim), "
                                                                                  "not servelens",
}
#: Commands that serve until Ctrl-C: started, seen up, stopped.
SERVING = ("servelens broker", "servelens dashboard")
#: Verdict commands: exit 1 (fail) and 2 (inconclusive) are answers, not errors.
VERDICTS = ("servelens gate",)
#: Run first: what later examples read.
FIRST = ("servelens trace convert", "servelens profile --model tiny", "servelens trace to-blis", "servelens privacy keygen")


def _commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        yield (*path, name), command


def examples() -> list[str]:
    """Every example line of every help text (after its 'Example:' line), comments removed, in order."""
    found: list[str] = []
    for _, command in [((), cli), *_commands(cli)]:
        lines = (command.help or "").splitlines()
        starts = [i for i, line in enumerate(lines) if line.strip() == "Example:"]
        for line in lines[starts[0] + 1:] if starts else []:
            text = line.split("  #")[0].strip()
            if text and text not in found:
                found.append(text)
    return found


def _ordered(items: list[str]) -> list[str]:
    return sorted(items, key=lambda e: next((i for i, p in enumerate(FIRST) if e.startswith(p)), len(FIRST)))


def _split(example: str, env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(example)
    extra = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        extra[key] = value
    return {**env, **extra}, words


def _serve(words: list[str], env: dict[str, str], cwd) -> None:
    proc = subprocess.Popen([sys.executable, "-m", *words[:1], *words[1:]], cwd=cwd, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=sigint_as_in_a_terminal)
    try:
        deadline, seen = time.monotonic() + 90, ""
        while time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            seen += line
            if "serves at" in line or "broker (Tansu" in line or "dashboard at" in line:
                break
        assert proc.poll() is None, seen
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) in (0, 130, -signal.SIGINT), seen
    finally:
        if proc.poll() is None:
            proc.kill()


def test_every_help_example_runs_as_written_after_the_demo(demo_output, monkeypatch):
    found = examples()
    assert not set(NOT_HERE) - set(found), f"no longer examples: {sorted(set(NOT_HERE) - set(found))}"
    monkeypatch.chdir(demo_output)
    if not (demo_output / "profiles").exists():  # as in the checkout, where `make demo` runs: its measured profiles
        (demo_output / "profiles").symlink_to(Path(__file__).resolve().parents[2] / "profiles")
    env: dict[str, str] = {}
    failed = []
    for example in _ordered([e for e in found if e not in NOT_HERE]):
        if example.startswith("export "):
            key, _, value = example.removeprefix("export ").partition("=")
            env[key] = value
            continue
        run_env, words = _split(example, env)
        assert words[0] == "servelens", example
        if any(example.startswith(s) for s in SERVING):
            from pipelines.broker import free_port

            # the documented default ports may be taken on a shared machine: free ones, through the configuration
            ports = {"SERVELENS_DASHBOARD__PORT": str(free_port()),
                     "SERVELENS_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}"}
            _serve(words, {**ports, **run_env}, demo_output)
            continue
        done = CliRunner().invoke(cli, words[1:], env=run_env, catch_exceptions=True)
        allowed = (0, 1, 2) if any(example.startswith(v) for v in VERDICTS) else (0,)
        if done.exit_code not in allowed:
            failed.append(f"{example}\n  exit {done.exit_code}: {done.output[-600:]} {done.exception!r}")
    assert not failed, "\n".join(failed)
