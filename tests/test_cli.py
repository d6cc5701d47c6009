"""The command line's own surface: help for every subcommand."""

from __future__ import annotations

import itertools

import pytest

from asyncoffload import histogram
from asyncoffload.cli import COMMANDS, main


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("command", [cmd.name for cmd in COMMANDS])
def test_every_subcommand_prints_its_help(
    command: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, flag])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and command in out


def test_the_top_level_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(cmd.name in out for cmd in COMMANDS)


@pytest.mark.parametrize(
    "bounds",
    [histogram.LATENCY_BUCKETS_S, histogram.TRANSFER_BUCKETS_S, histogram.BYTES_PER_SECOND_BUCKETS],
)
def test_histogram_buckets_never_skip_a_step_of_the_1_2_5_series(
    bounds: tuple[float, ...],
) -> None:
    """1, 2.5, 5, 10: no step left out (the transfer buckets went from 2.5 s to 10 s)."""
    assert list(bounds) == sorted(bounds)
    assert all(b / a <= 2.5 + 1e-9 for a, b in itertools.pairwise(bounds))
