"""The command line's own surface: help for every subcommand."""

from __future__ import annotations

import functools
import itertools
import re
import subprocess
import sys
import textwrap
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
        # Writable by permissions (for root), yet nothing can be created there.
        ("--json", "/proc/x.json", "cannot be written|is not writable"),
        ("--plot", "/proc/x.png", "cannot be written|is not writable"),
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
    import asyncoffload.replay.command as command

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the trace was loaded before the output path was checked")

    monkeypatch.setattr(command, "_load_workload", no_work)
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
        # ZeroMQ took 99999 as port 34463 (modulo 2**16) and the demo published there.
        (
            ["--publish", "tcp://127.0.0.1:99999", "--requests", "5", "--time-scale", "0"],
            "--publish tcp://127.0.0.1:99999: endpoint 'tcp://127.0.0.1:99999': port 99999 is",
        ),
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
    from asyncoffload.demo.progress import _Progress, _render

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


# --- the command line as a process: exit statuses and stderr, never a traceback ----------

#: Bounds of a CLI process in these tests: seconds, and address space (so that a
#: regression that allocates without bound fails with MemoryError, not the machine).
CLI_TIMEOUT_S = 90
CLI_MEMORY_BYTES = 4 << 30


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (CLI_MEMORY_BYTES, CLI_MEMORY_BYTES))


def cli_env() -> dict[str, str]:
    import os

    from tests.processes import REPO

    return {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}


def run_cli(*argv: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``python -m asyncoffload ARGV`` in a fresh process, bounded in time and memory."""
    from tests.processes import REPO

    try:
        return subprocess.run(
            [sys.executable, "-m", "asyncoffload", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env=cli_env(),
            preexec_fn=_limit_memory,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"asyncoffload {' '.join(argv)} did not end within {timeout} s"
        ) from None


def one_line_error(proc: subprocess.CompletedProcess[str], status: int, *parts: str) -> str:
    """The process ended with ``status`` and no traceback; its last stderr line (the
    error) names every one of ``parts``."""
    from tests.processes import describe

    assert proc.returncode == status, describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    last = proc.stderr.strip().splitlines()[-1]
    for part in parts:
        assert part in last, describe(proc)
    return last


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_replay_json_that_fails_at_write_time_is_one_line_and_exit_1() -> None:
    """/dev/full opens, and every write fails (ENOSPC) after the whole replay ran."""
    proc = run_cli(
        "replay", "synthetic:60", "--policy", "lru", "--no-progress", "--json", "/dev/full"
    )
    one_line_error(proc, 1, "--json /dev/full", "No space left on device")
    assert "prefix hit rate" in proc.stdout  # the results were shown before


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--seed", str(10**30)],
        ["demo", "--seed", str(-(10**30))],
    ],
)
def test_the_demo_takes_any_integer_seed(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The seed seeds Python's random (any int) and the block contents (modulo 2**64)."""
    tiny = ["--requests", "12", "--cpu-blocks", "64", "--layers", "1", "--time-scale", "0"]
    assert main([*argv, *tiny, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"seed {argv[-1]}" in out.replace("\n  ", " ")
    assert "OK: verified" in out


def test_the_demo_refuses_a_workload_too_large_for_memory_before_making_it() -> None:
    """--blocks-per-turn 1e9 used to allocate until MemoryError (minutes, all the memory)."""
    proc = run_cli("demo", "--blocks-per-turn", "1e9", "--requests", "5")
    last = one_line_error(proc, 2, "--blocks-per-turn 1e+09", "needs at least", "available")
    assert "asyncoffload demo: error:" in last


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--blocks-per-turn", "1e9"], "--blocks-per-turn 1e+09"),
        (["--blocks-per-turn", "1e300"], "--blocks-per-turn 1e+300"),
        (["--turns", str(10**30)], f"--turns {10**30}"),
        (["--turns", "100000", "--requests", "1000"], "--turns 100000"),
        (["--requests", str(10**30)], f"--requests {10**30}"),
        (["--system-prompts", str(10**30)], f"--system-prompts {10**30}"),
        (["--system-prompt-blocks", str(10**30)], f"--system-prompt-blocks {10**30}"),
    ],
)
def test_demo_sizes_too_large_for_memory_are_refused_naming_the_option(
    argv: list[str],
    option: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncoffload.demo import DemoConfig

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the workload was generated before its size was checked")

    monkeypatch.setattr(DemoConfig, "workload", never)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv, "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert option in err and "needs at least" in err and "available" in err, err


def test_demo_size_check_lets_real_workloads_through() -> None:
    from asyncoffload.demo import DemoConfig
    from asyncoffload.demo.settings import _check_workload_size

    for cfg in (
        DemoConfig(),
        DemoConfig(requests=20_000),
        DemoConfig(requests=200, blocks_per_turn=2000.0),
        DemoConfig(system_prompts=20_000, system_prompt_blocks=4),
        DemoConfig(requests=10, system_prompt_blocks=20_000),
    ):
        _check_workload_size(cfg)  # raises DemoConfigError when too large


def test_demo_disk_tier_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A capacity no file can have (the tier's own check) is an option error, exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--disk", str(tmp_path), "--disk-bytes", "1000000PB", "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--disk-bytes" in err and "larger than any file" in err, err


@pytest.mark.parametrize("source", [f"synthetic:{10**30}", f"family:chat:{10**30}"])
def test_replay_refuses_more_generated_requests_than_memory_holds(
    source: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncoffload.workloads as workloads

    def never(*args: object, **kwargs: object) -> list[object]:
        if any(args[-1:]):  # the source's parameters are checked with 0 requests
            raise AssertionError("the requests were generated before their number was checked")
        return []

    monkeypatch.setattr(workloads, "synthetic_sessions", never)
    monkeypatch.setattr(workloads.TraceFamily, "generate", never)
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", source, "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "requests need at least" in err and "--limit" in err, err


def test_the_output_check_truncates_nothing_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checking --json / --plot by opening them keeps an existing file's bytes and
    removes a file it had to create (the run may still fail before writing it)."""
    import asyncoffload.replay.command as command

    def stop(*args: object, **kwargs: object) -> None:
        raise SystemExit(3)

    monkeypatch.setattr(command, "_load_workload", stop)
    old, new = tmp_path / "old.json", tmp_path / "new.png"
    old.write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "synthetic", "--json", str(old), "--plot", str(new)])
    assert exit_info.value.code == 3
    assert old.read_text() == "keep me"
    assert not new.exists()


# --- Ctrl-C: "interrupted" and status 130 wherever it lands --------------------------------

#: Seconds a process has to end after a SIGINT.
SIGINT_EXIT_S = 30.0


def _spawn(argv: list[str]) -> subprocess.Popen[str]:
    from tests.processes import REPO

    return subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=cli_env(),
        preexec_fn=_limit_memory,
    )


def _interrupt(proc: subprocess.Popen[str], when: str) -> None:
    """SIGINT ``proc`` (``when`` says where it is); it must print ``interrupted`` as
    the last line of stderr, no traceback, and exit with status 130."""
    import signal

    assert proc.poll() is None, f"the command ended before the SIGINT {when}"
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=SIGINT_EXIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"no exit within {SIGINT_EXIT_S} s of a SIGINT {when}") from None
    got = f"SIGINT {when}: exit status {proc.returncode}, stderr:\n{err[-3000:]}"
    assert proc.returncode == 130, got
    assert "Traceback" not in err, got
    assert err.strip().splitlines()[-1] == "interrupted", got


def _ended(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def test_ctrl_c_while_replay_reads_its_trace(tmp_path: Path) -> None:
    """The trace is a FIFO: once the replay has opened it (our write end opens), it is
    reading; one line in, it waits for the next when the SIGINT comes."""
    import errno
    import os
    import time

    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    proc = _spawn(["-m", "asyncoffload", "replay", str(fifo), "--no-progress"])
    fd = -1
    try:
        deadline = time.monotonic() + CLI_TIMEOUT_S
        while fd < 0:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:  # ENXIO: no reader yet
                if exc.errno != errno.ENXIO:
                    raise
                assert proc.poll() is None, f"the replay ended without opening {fifo}"
                assert time.monotonic() < deadline, (
                    f"the replay did not open its trace {fifo} within {CLI_TIMEOUT_S} s"
                )
                time.sleep(0.02)
        line = b'{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
        os.write(fd, line)
        _interrupt(proc, "while the replay reads its trace")
    finally:
        if fd >= 0:
            os.close(fd)
        _ended(proc)


def test_ctrl_c_while_replay_generates_its_trace() -> None:
    """A generator that says when it starts (on stdout), then takes seconds."""
    code = textwrap.dedent(
        """
        import sys
        import asyncoffload.workloads as workloads
        from asyncoffload.cli import main

        real = workloads.synthetic_sessions

        def generating(*args, **kwargs):
            print("generating", flush=True)
            return real(*args, **kwargs)

        workloads.synthetic_sessions = generating
        sys.exit(main(["replay", "synthetic:300000", "--no-progress", "--policy", "lru"]))
        """
    )
    import selectors

    proc = _spawn(["-c", code])
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(CLI_TIMEOUT_S)
        assert ready, f"the replay did not start generating its trace within {CLI_TIMEOUT_S} s"
        assert proc.stdout.readline() == "generating\n", "the replay ended before generating"
        _interrupt(proc, "while the replay generates its trace")
    finally:
        _ended(proc)


@functools.cache
def _interpreter_start_s() -> float:
    """How long this machine's interpreter takes to start (``site`` included), the
    longest of three: the stretch before any code of ours can handle a SIGINT."""
    import time

    from tests.processes import REPO

    times = []
    for _ in range(3):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "pass"], check=True, cwd=REPO, timeout=60)
        times.append(time.monotonic() - t0)
    return max(times)


@pytest.mark.parametrize("after_s", [0.0, 0.05, 0.2, 0.5, 1.5])
def test_ctrl_c_during_start_up(after_s: float) -> None:
    """From the package's import (torch: a second or more) to main's start; SIGINT
    ``after_s`` past twice the interpreter's own start-up (before it, no code of ours
    runs yet: docs/reliability.md)."""
    import time

    delay = 2 * _interpreter_start_s() + after_s
    argv = ["-m", "asyncoffload", "replay", "synthetic:300000", "--no-progress"]
    proc = _spawn(argv)
    try:
        time.sleep(delay)
        _interrupt(proc, f"{delay:.2f} s after the start")
    finally:
        _ended(proc)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python", "-m", "asyncoffload", "demo"], True),
        (["python", "-masyncoffload"], True),
        (["python", "-X", "importtime", "-u", "-m", "asyncoffload"], True),
        (["/venv/bin/python", "/venv/bin/asyncoffload", "replay", "x"], True),
        (["python", "-m", "asyncoffload.cli"], False),
        (["python", "-m", "pytest", "-m", "asyncoffload"], False),
        (["python", "-c", "import asyncoffload"], False),
        (["python", "script.py", "-m", "asyncoffload"], False),
        (["python"], False),
    ],
)
def test_only_the_command_line_guards_sigint_at_start_up(argv: list[str], expected: bool) -> None:
    import signal

    from asyncoffload import _interrupt

    assert _interrupt.is_command_line(argv) is expected
    # This process (pytest) imported the package: its SIGINT handling is untouched.
    assert signal.getsignal(signal.SIGINT) is not _interrupt.exit_now
