"""A fresh instance in a second process is served what an earlier one stored after it
closed: through disk (files mode), a real Valkey server on 127.0.0.1, and Mooncake Store
(a real ``mooncake_master`` and storage node, in a private network namespace)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import Server, make_valkey, valkey_server  # noqa: F401  (fixtures)
from tests.sglang.harness import disk, remote
from tests.sglang.scenarios import LAYOUTS, ROOT, Job, run, store


def test_a_second_process_is_served_through_disk_and_valkey(
    tmp_path: Path,
    valkey_server: Server,  # noqa: F811
) -> None:
    jobs: list[Job] = [
        ([disk(tmp_path / "kv")], "page_first", 3, 5),
        ([disk(tmp_path / "kv")], "layer_first", 4, 5),
        ([remote(valkey_server)], "page_first", 5, 5),
    ]
    first = [store(*job) for job in jobs]  # here; each backend closes
    second = run("load", json.dumps(jobs))  # a fresh process
    for before, after in zip(first, second):
        assert before["stored"] == [True] * 5
        assert after["found"] == 5 and after["loaded"] == [True] * 5
        assert after["got"] == before["want"]
        assert after["other"] == 0


def _why_no_mooncake() -> str | None:
    try:
        from tests.test_mooncake_store import WHY_NOT
    except BaseException as exc:  # its module skips itself where Mooncake is missing
        return str(exc) or type(exc).__name__
    if WHY_NOT is not None:
        return WHY_NOT
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return "runs inside `unshare --net`, as root"
    return None


def test_a_second_process_is_served_through_mooncake() -> None:
    why = _why_no_mooncake()
    if why is not None:
        pytest.skip(f"Mooncake Store: {why}")
    cmd = ["unshare", "--net", sys.executable, "-m", "tests.sglang.scenarios", "mooncake", "50171"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    seen = json.loads(lines[-1])
    for layout, before, after in zip(LAYOUTS, seen["first"], seen["second"]):
        assert before["stored"] == [True] * 6
        assert before["staged"] == (layout == "layer_first")  # the shm pool: in place
        assert after["found"] == 6 and after["loaded"] == [True] * 6
        assert after["got"] == before["want"]
        assert after["other"] == 0
