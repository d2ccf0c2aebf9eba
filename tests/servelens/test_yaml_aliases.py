"""YAML and JSON documents: shared values read as before; a "billion laughs" or an alias inside its own anchor is refused
at once, naming the file, instead of hanging every reader of it (gate configs, workload specs, policies)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servelens.errors import ConfigError
from servelens.settings import MAX_EXPANDED_NODES, read_document

# nine levels of nine aliases: 324 bytes that expand to 9**9 values
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))


def test_shared_values_read_as_before(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &base {ttft_s: 1.0}\nclasses: [*base, *base]\n")
    assert read_document(path, "gate configuration") == {"base": {"ttft_s": 1.0},
                                                         "classes": [{"ttft_s": 1.0}, {"ttft_s": 1.0}]}


def test_aliases_expanding_past_the_bound_are_refused(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(LAUGHS)
    with pytest.raises(ConfigError) as caught:
        read_document(path, "gate configuration")
    assert caught.value.message == (f"gate configuration {path} expands its aliases to more than "
                                    f"{MAX_EXPANDED_NODES:,} values")


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    path = tmp_path / "cycle.yaml"
    path.write_text("a: &a [1, {b: *a}]\n")
    with pytest.raises(ConfigError, match=r"holds an alias inside the value it names"):
        read_document(path, "policy configuration")


def test_the_command_line_refuses_it_at_once(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(LAUGHS)
    done = subprocess.run([sys.executable, "-m", "servelens", "replay", "--workload", str(path), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and "expands its aliases to more than" in done.stderr, done.stderr


def test_a_number_too_long_to_read_and_a_pipe_are_refused(tmp_path):
    import os

    for name, text in (("long.yaml", "a: " + "9" * 5001 + "\n"), ("long.json", '{"a": ' + "9" * 5001 + "}")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=r"holds a number of more than 4,300 digits"):
            read_document(tmp_path / name, "gate configuration")
    os.mkfifo(tmp_path / "pipe.yaml")  # opening it would block until something writes to it
    with pytest.raises(ConfigError, match=r"is not a regular file \(a pipe, a device or a socket\)"):
        read_document(tmp_path / "pipe.yaml", "gate configuration")
