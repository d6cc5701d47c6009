"""Running code where a crash or a hang cannot take the test run down with it: a fresh
Python process (a segfault is a return code) or a forked child (a hang is a kill)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(
    code: str, *, env: dict[str, str] | None = None, timeout: float = 100
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) in a new interpreter that imports this checkout."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    """How a subprocess ended, for assertion messages."""
    how = f"exit status {proc.returncode}"
    if proc.returncode < 0:
        how = f"killed by {signal.Signals(-proc.returncode).name}"
    return f"{how}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


HUNG = "hung"


def run_in_fork(fn: Callable[[], str], timeout: float = 30) -> str:
    """Call ``fn`` in a forked child and return what it returned, or ``"raised
    <Type>: <message>"``, or :data:`HUNG` if the child did not answer within ``timeout``
    seconds (it is killed then). The child leaves with ``os._exit``: nothing of the
    parent's (atexit hooks, buffered output) runs twice."""
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():  # 3.12+: fork of a process with threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child
        os.close(read_fd)
        try:
            out = fn()
        except BaseException as exc:
            out = f"raised {type(exc).__name__}: {exc}"
        os.write(write_fd, out.encode()[:60000])
        os._exit(0)
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            return HUNG
        data = b""
        while chunk := os.read(read_fd, 65536):
            data += chunk
        return data.decode()
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
