"""`pdd fault`: what it refuses before touching a cluster (tests/integration/test_faults.py runs it on one)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from app.ops.cli import main
from app.ops.faults import Faults


def invoke(*args: str):
    return CliRunner().invoke(main, ["fault", *args], env={"COLUMNS": "200"})


def test_slow_needs_a_figure():
    result = invoke("slow", "dc-a->dc-b")
    assert result.exit_code == 2 and "slow needs --bandwidth-mbps and/or --rtt-ms" in result.output


@pytest.mark.parametrize(
    "args, named",
    [
        (["kill", "decoder"], "'decoder' is not one of 'prefill', 'relay_decode', 'main_decode', 'conductor'"),
        (["stall", "dc-a->dc-b", "-3"], "-3"),
        (["slow", "dc-a->dc-b", "--bandwidth-mbps", "0"], "--bandwidth-mbps"),
    ],
)
def test_bad_arguments_are_named(args, named):
    result = invoke(*args)
    assert result.exit_code == 2 and named in " ".join(result.output.split()), result.output


@pytest.mark.parametrize("direction", ["dc-b", "->dc-b", "dc-a->"])
def test_a_direction_must_name_both_ends(direction):
    with pytest.raises(ValueError, match="reads like dc-a->dc-b"):
        Faults("pdd").cut_link(direction)
