"""The Mooncake Store calls the Mooncake tier (issue 26) is built on, against a real
``mooncake_master`` and client (``asyncoffload[mooncake]``), never mocked.

Both listen on every interface, so they run inside a private network namespace: the test
runs tests/mooncake_probe.py under ``unshare --net`` (root; CI runs as root) and asserts
what it saw. Without the package (or Debian's libibverbs1, libnl-3-200 and
libnl-route-3-200, which its binaries link even over TCP), or without ``unshare`` and
root, the module skips with one summary line.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def _why_not() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: a library it links is missing
        return f"needs asyncoffload[mooncake] and its Debian libraries ({exc})"
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return "needs unshare --net as root (its servers listen on every interface)"
    return None


WHY_NOT = _why_not()
if WHY_NOT is not None:
    pytest.skip(f"Mooncake Store: {WHY_NOT}", allow_module_level=True)

PROBE = Path(__file__).with_name("mooncake_probe.py")
TIMEOUT_S = 120


def _probe(port: int, mode: str) -> dict[str, Any]:
    """What tests/mooncake_probe.py in ``mode`` saw, run inside its own netns."""
    cmd = ["unshare", "--net", sys.executable, str(PROBE), str(port), mode]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tests/mooncake_probe.py {mode} did not finish within {TIMEOUT_S} s")
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    """The store's own client, driven by the probe."""
    return _probe(50261, "store")


def test_registered_memory_is_put_and_read_back_byte_exact(seen: dict[str, Any]) -> None:
    assert seen["setup"] == 0 and seen["register"] == [0, 0]
    assert seen["put"] == [0, 0]
    assert seen["exists"] == [1, 1, 0]
    assert seen["get"][:2] == [8192, 8192] and seen["get_equal"]


def test_a_missing_object_is_a_negative_code_not_an_exception(seen: dict[str, Any]) -> None:
    assert seen["get"][2] == -704  # OBJECT_NOT_FOUND: a miss
    assert seen["exists_after_remove"] == 0


def test_a_header_and_a_payload_from_two_places_make_one_object(seen: dict[str, Any]) -> None:
    """What lets the tier keep its checked block format without copying the payload:
    the header lives in its own buffer and goes out (and comes back) beside the slot."""
    assert seen["multi_put"] == [0]
    assert seen["multi_size"] == 64 + 8192
    assert seen["multi_get"] == [64 + 8192] and seen["multi_equal"]


def test_a_buffer_shorter_than_the_object_is_refused(seen: dict[str, Any]) -> None:
    assert seen["short_get"][0] < 0


def test_an_object_shorter_than_its_buffers_fails_as_transfer_fail(
    seen: dict[str, Any],
) -> None:
    """What the tier's helper relies on to read a cut-short value as a short block (and
    remove it) instead of a transfer that may still run: the code is TRANSFER_FAIL, and
    the object's size is not a block's."""
    assert seen["short_put"] == [0]
    assert seen["short_object_get"] == [-800]
    assert seen["short_object_size"] == 100


def test_a_second_put_of_a_key_is_not_an_error(seen: dict[str, Any]) -> None:
    assert seen["put_again"] == [0]
    # ... and writes nothing: the first value stays (a put is put-if-absent).
    assert seen["get_again"] == [8192] and seen["first_value_stays"]


def test_remove_waits_for_the_objects_lease(seen: dict[str, Any]) -> None:
    assert seen["remove_now"] == -706  # the master's lease still holds the object
    assert seen["remove_later"] == 0


@pytest.fixture(scope="module")
def lane() -> dict[str, Any]:
    """asyncoffload's helper-process lane, driven by the probe."""
    return _probe(50271, "lane")


def test_the_lane_puts_and_gets_blocks_byte_exact(lane: dict[str, Any]) -> None:
    """Requests woken through a completion bridge's eventfd (the helper writes it): the
    memfd mapped and registered by the helper, each block's payload back where the
    reader asked, checked against its header (a get's result is the payload's bytes)."""
    assert lane["map"] == [0]
    assert lane["put"] == [0, 0]
    assert lane["exists"] == [1, 1, 0]
    assert lane["get"][:2] == [8192, 8192]
    assert lane["payload_equal"]


def test_the_lane_reports_a_miss_as_an_errno(lane: dict[str, Any]) -> None:
    assert lane["get"][2] == -errno.ENOENT


def test_the_lane_refuses_pieces_outside_its_regions_or_not_making_a_block(
    lane: dict[str, Any],
) -> None:
    assert "outside the regions mapped" in lane["outside"]
    assert lane["not_a_block"] == [-errno.EINVAL]


def test_a_dead_helper_fails_the_batch_instead_of_hanging(lane: dict[str, Any]) -> None:
    assert lane["after_kill"] == [-errno.EHOSTDOWN]
    assert lane["pending_after_kill"] == 0


def test_a_master_down_fails_the_batch_at_once_and_a_restarted_one_is_used_again(
    lane: dict[str, Any],
) -> None:
    """Killed: the batch fails (EHOSTDOWN) without waiting. Restarted: once the client has
    reconnected it knows no object (a miss), and its puts succeed again once it has
    mounted its segment (each within the probe's 20 s)."""
    assert lane["master_down"] == [-errno.EHOSTDOWN]
    assert lane["master_down_s"] < 5.0
    gets = lane["restarted_gets"]
    assert gets[-1] == -errno.ENOENT, gets
    assert all(g == -errno.EHOSTDOWN for g in gets[:-1]), gets
    puts = lane["restarted_puts"]
    assert puts[-1] == 0, puts
    assert all(p == -errno.ENOSPC for p in puts[:-1]), puts
