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
