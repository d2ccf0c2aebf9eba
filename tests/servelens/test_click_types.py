"""The CLI's shared parameter types."""

from __future__ import annotations

import click
from click.testing import CliRunner

from servelens.click_types import Finite


@click.command()
@click.option("--rate", type=Finite(min=0, min_open=True), required=True)
def _command(rate: float) -> None:
    click.echo(f"rate {rate}")


def test_finite_refuses_nan_and_inf_and_keeps_its_range():
    runner = CliRunner()
    assert runner.invoke(_command, ["--rate", "2.5"]).output == "rate 2.5\n"
    for value, message in (("nan", "'nan' is not a finite number"), ("inf", "'inf' is not a finite number"),
                           ("-inf", "-inf"), ("0", "not in the range x>0"), ("fast", "'fast' is not a valid")):
        result = runner.invoke(_command, ["--rate", value])
        assert result.exit_code == 2 and message in result.output, (value, result.output)


def test_an_output_that_is_an_input_is_refused_through_any_path(tmp_path):
    import pytest

    from servelens.click_types import refuse_overwriting
    from servelens.errors import ServelensError

    source = tmp_path / "events.parquet"
    source.write_bytes(b"PAR1")
    (tmp_path / "link.parquet").symlink_to(source)
    for out in (source, tmp_path / "." / "events.parquet", tmp_path / "link.parquet"):
        with pytest.raises(ServelensError, match="is also an input of this command"):
            refuse_overwriting(out, None, source)
    refuse_overwriting(tmp_path / "new.parquet", source)  # not there yet: a new file
    refuse_overwriting([tmp_path / "other.csv"], source, tmp_path / "missing.yaml")
    assert source.read_bytes() == b"PAR1"


def test_help_shows_a_range_only_where_there_is_one():
    """click's FloatRange printed ``[x<=None]`` after every unbounded number in --help."""
    from click.testing import CliRunner

    from servelens.cli import cli

    out = CliRunner().invoke(cli, ["replay", "--help"]).output
    assert "None]" not in out and "[x>=1]" in out


def test_a_duration_takes_units_and_keeps_its_range():
    from servelens.click_types import Duration

    @click.command()
    @click.option("--window", type=Duration(0, 1e9, min_open=True), required=True)
    def command(window: float) -> None:
        click.echo(f"window {window}")

    runner = CliRunner()
    assert runner.invoke(command, ["--window", "5m"]).output == "window 300.0\n"
    for value, message in (("0s", "0s is 0 s: 0.0 is not in the range 0<x<=1000000000.0"),
                           ("99999999999999h", "99999999999999h is 3.6e+17 s"),  # was an internal OverflowError
                           ("soon", "'soon' is not a duration (write it like 30s, 10m, 1h or 1d)")):
        result = runner.invoke(command, ["--window", value])
        assert result.exit_code == 2 and message in result.output and "'--window'" in result.output, (value, result.output)


def test_every_seed_option_refuses_a_negative_seed():
    """--seed -1 was an internal ValueError (numpy's generators refuse a negative seed) once the replay ran."""
    from servelens.cli import cli

    for command in (["replay"], ["fidelity"], ["profile"], ["compare-measured"]):
        result = CliRunner().invoke(cli, [*command, "--seed", "-1"])
        assert result.exit_code == 2, (command, result.output)
        assert "Invalid value for '--seed': -1 is not in the range 0<=x<=" in result.output, (command, result.output)


def test_an_output_path_is_refused_before_any_work_when_it_cannot_be_written_as_asked(tmp_path):
    """Before, replay --out /dev/null replayed first and then failed on 'File exists', trace to-blis --out /dev/null
    wrote its header to /dev/null.yaml, and --out dir/ wrote a file named like the folder."""
    import click
    import pytest

    from servelens.click_types import OUT_FILE, OUT_FOLDER

    (tmp_path / "f.csv").write_text("")
    assert OUT_FOLDER.convert(str(tmp_path / "new"), None, None) == tmp_path / "new"
    assert OUT_FILE.convert(str(tmp_path / "f.csv"), None, None) == tmp_path / "f.csv"  # overwritten, as before
    for convert, value, message in (
        (OUT_FOLDER, "/dev/null", "/dev/null exists and is not a folder"),
        (OUT_FOLDER, str(tmp_path / "f.csv"), "is a file"),
        (OUT_FILE, "/dev/null", "/dev/null exists and is not a regular file"),
        (OUT_FILE, f"{tmp_path}/", r"names a folder \(it ends in /\)"),
        (OUT_FILE, str(tmp_path), "is a directory"),
    ):
        with pytest.raises(click.BadParameter, match=message):
            convert.convert(value, None, None)
