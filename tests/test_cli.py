"""The command line's own surface: help for every subcommand."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

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


@pytest.mark.parametrize(
    ("option", "path", "message"),
    [
        ("--plot", "{tmp}/missing/x.png", "the folder .* does not exist"),
        ("--json", "{tmp}/missing/x.json", "the folder .* does not exist"),
        ("--plot", "{tmp}/out.txt", r"name a \.png"),
        ("--plot", "{tmp}", "is a directory"),
        ("--json", "{tmp}", "is a directory"),
    ],
)
def test_replay_refuses_an_output_path_before_any_work(
    option: str,
    path: str,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncoffload.cli as cli

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the trace was loaded before the output path was checked")

    monkeypatch.setattr(cli, "_load_workload", no_work)
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "synthetic", option, path.format(tmp=tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert option in err
    assert re.search(message, err), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--metrics-port", "70000"], "--metrics-port 70000: should be less than or equal"),
        (["--publish", "foo"], "--publish foo: endpoint 'foo' must be"),
    ],
)
def test_demo_option_errors_name_the_option_not_pydantic(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert expected in err
    assert "Value error" not in err and "Input should" not in err


@pytest.mark.parametrize("columns", [40, 60, 80, 100])
def test_the_demo_progress_line_is_shorter_than_the_terminal(columns: int) -> None:
    from asyncoffload.demo import _Progress, _render

    progress = _Progress()
    progress.done = 12345
    progress.bytes_moved = 123 * 10**9
    line = _render(progress, 99999, 1234.5, columns)
    assert line.startswith("\r")
    assert len(line) - 1 < columns
    assert "12345/99999 requests" in line


@pytest.mark.parametrize("columns", ["80", "100"])
def test_demo_output_fits_the_terminal(
    columns: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    assert main(["demo", "--requests", "40", "--progress"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines() + captured.err.replace("\r", "\n").splitlines()
    assert max(len(line) for line in lines) < int(columns)
    assert "verification" in captured.out


@pytest.mark.parametrize("columns", ["80", "120"])
def test_replay_of_every_policy_fits_the_terminal(
    columns: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    argv = ["replay", "synthetic", "--policy", "all", "--limit", "60", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) < int(columns)
    for policy in ("lru", "arc", "kv", "s3fifo", "sieve", "belady"):
        assert f"{policy} hit / written" in out
