"""The examples as the README runs them, in real processes."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.processes import REPO
from tests.servers import free_port


def test_the_index_started_before_the_demo_waits_for_it_and_follows() -> None:
    """README: the demo in the background, then the consumer at once. The consumer is
    up first (the demo still imports torch); it must wait, say so, and then follow."""
    port = free_port(pair=True)
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    index = subprocess.Popen(
        [
            sys.executable,
            "examples/kv_index.py",
            "--endpoint",
            endpoint,
            "--replay-endpoint",
            replay,
            "--seconds",
            "12",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncoffload",
            "demo",
            "--publish",
            endpoint,
            "--requests",
            "2000",
            "--time-scale",
            "5",
            "--no-progress",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = index.communicate(timeout=120)
    finally:
        demo.kill()
        demo.communicate()
    assert index.returncode == 0, err[-3000:]
    assert "waiting up to 60 s for the server's replay socket" in err
    final = out.strip().splitlines()[-1]
    assert final.startswith("final: seq ") and not final.startswith("final: seq -1"), out
    assert final.endswith(" 0 lost"), out
