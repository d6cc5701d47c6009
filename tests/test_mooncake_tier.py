"""The Mooncake tier (issue 26) on a real ``mooncake_master`` and real clients, never
mocked: engines share blocks across processes, other identities find nothing, damaged or
evicted objects are misses that never reach the KV, and a master or helper that dies
mid-batch is survived and rejoined.

The master and Mooncake's clients listen on every interface, so each scenario runs
tests/mooncake_engines.py inside its own private network namespace (``unshare --net``,
as root: CI runs as root) and the test asserts what it printed. Without the package (or
its Debian libraries), or without ``unshare`` and root, the module skips with one line.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_mooncake_store import WHY_NOT

if WHY_NOT is not None:
    pytest.skip(f"Mooncake Store: {WHY_NOT}", allow_module_level=True)

SCRIPT = Path(__file__).with_name("mooncake_engines.py")
TIMEOUT_S = 240
PORT = 50161


def _scenario(name: str) -> dict[str, Any]:
    """What tests/mooncake_engines.py's ``name`` saw, run in a netns of its own."""
    cmd = ["unshare", "--net", sys.executable, str(SCRIPT), str(PORT), name]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tests/mooncake_engines.py {name} did not finish within {TIMEOUT_S} s")
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def test_quotas_hold_in_every_tier_mooncake_and_valkey_included() -> None:
    """Two tenants, one flooding and one steady, with CPU, disk, Valkey and Mooncake
    tiers (tests/quota_flood.py): tests/test_quota_tiers.py's checks, every tier."""
    from tests.servers import valkey_binary
    from tests.test_quota_tiers import check_flood_and_steady

    if not valkey_binary().exists():
        pytest.skip("valkey-server is not installed")
    seen = _scenario("quotas")
    names = list(seen["flood"]["tiers"])
    assert len(names) == 4 and names[0] == "CPU"
    check_flood_and_steady(seen["calm"], seen["flood"], names)


@pytest.fixture(scope="module")
def share() -> dict[str, Any]:
    return _scenario("share")


def test_two_engines_in_two_processes_share_blocks_byte_exact(share: dict[str, Any]) -> None:
    seen = share
    assert seen["written"] == 8
    reader = seen["reader"]
    assert reader["lookup_before"] == 0  # local knowledge only
    assert reader["alookup"] == 8 and reader["lookup_after"] == 8
    assert reader["load"] == "ok" and reader["blocks_read"] == 8
    assert reader["got"] == seen["want"]
    # alookup's finds are published: one stored event of the tier per block.
    assert len(reader["events"]["stored"]) == 8 and not reader["events"]["removed"]


def test_a_put_of_a_block_the_store_holds_is_present_not_written(share: dict[str, Any]) -> None:
    """Mooncake's put answers 0 for an object it holds already, as for one it wrote: that
    counted in ``blocks_written`` and ``blocks_present`` stayed 0 (issue 37, D7)."""
    again = share["again"]
    assert (again["written"], again["present"], again["failures"]) == (2, 6, 0)
    assert again["bytes_written"] == 2 * 8192
    assert again["ready"] == 8  # present blocks are in the index all the same


def test_host_slots_outside_shared_memory_are_refused_by_name(share: dict[str, Any]) -> None:
    assert "needs the host slots in shared memory" in share["reader"]["no_shared_host"]


def test_another_identity_tenant_or_mac_key_finds_nothing(share: dict[str, Any]) -> None:
    reader = share["reader"]
    assert reader["other_model"] == 0
    assert reader["other_tenant"] == 0
    assert reader["other_mac"] == 0


@pytest.fixture(scope="module")
def damaged() -> dict[str, Any]:
    return _scenario("damaged")


def test_damaged_objects_are_misses_that_never_reach_the_kv(damaged: dict[str, Any]) -> None:
    """A flipped payload byte, a flipped header byte, a cut-short value and another
    namespace's value, planted with Mooncake's own client: each load fails, the KV
    blocks stay as they were, and the failures are counted by cause."""
    assert damaged["raw_get"] == [4096 + 8192] * 5
    assert all(codes[-1] == 0 for codes in damaged["planted"])
    assert damaged["alookup"] == 6  # the store holds all six names
    assert all("could not be read" in r for r in damaged["loads"])
    assert damaged["kv_untouched"]
    assert damaged["failures"] == {"corrupt": 2, "short": 1, "stale": 1, "oversize": 1}
    assert damaged["dropped"] == 5
    assert damaged["lookup_after"] == [0, 0, 0, 0, 0, 1]
    assert damaged["good_load"] == "ok" and damaged["good_equal"]


def test_a_damaged_block_leaves_with_a_removed_event(damaged: dict[str, Any]) -> None:
    events = damaged["events"]
    assert len(events["stored"]) == 6
    assert sorted(events["removed"]) == sorted(events["stored"])[:5]


def test_damaged_objects_are_removed_so_a_new_store_replaces_them(
    damaged: dict[str, Any],
) -> None:
    """Blocks are put if absent: a damaged object left in the store would keep every
    later store of the block out. The helper removes it once the lease of the get that
    found it lets go: one longer than a block too, which Mooncake answers INVALID_PARAMS
    (-600) and which was never removed (issue 37, D5)."""
    assert damaged["left_in_store"] == [0] * 5
    assert damaged["restored_written"] == 5
    assert damaged["restored_in_store"] == [1] * 5
    assert damaged["again_alookup"] == 5 and damaged["again_load"] == "ok"
    assert damaged["again_equal"] == [True] * 5


def test_objects_the_store_evicts_are_misses_never_wrong_bytes() -> None:
    """160 blocks of 132 KiB into a 16 MiB segment: the store evicts some and refuses
    others (ENOSPC, counted); every read gives the block's bytes or a miss."""
    seen = _scenario("evicted")
    assert seen["wrong"] == 0
    assert seen["hits"] > 0 and seen["misses"] > 0
    assert seen["written"] + seen["write_failures"].get("ENOSPC", 0) == 160
    assert seen["hits"] + seen["misses"] == 160
    # Written, then found missing when read: evicted by the store, dropped from the index.
    assert seen["failures"].get("missing", 0) == seen["dropped"] > 0


@pytest.fixture(scope="module")
def restart() -> dict[str, Any]:
    return _scenario("restart")


def test_a_master_killed_mid_batch_leaves_no_hang_and_no_lost_state(
    restart: dict[str, Any],
) -> None:
    """Killed with 256 blocks of write-through in flight: every write ends (written or
    failed), nothing stays pinned, and the CPU tier keeps every block."""
    assert restart["written_plus_failed"] == 256
    assert restart["tier_pending"] == [0, 0]
    assert restart["cpu"] == [0, 256]
    # Failed at once while the store is down; those still waiting behind a write that
    # failed whole (the tier's writes lagged) are not tried: after_failure.
    assert set(restart["failures_down"]) <= {"unavailable", "after_failure"}
    assert restart["failures_down"].get("unavailable", 0) > 0


def test_while_the_store_is_down_the_tier_fails_at_once(restart: dict[str, Any]) -> None:
    assert restart["down_unavailable"]
    assert restart["alookup_down"] == 0
    assert restart["alookup_down_s"] < 1.0


def test_the_tier_rejoins_a_restarted_master_and_restarts_a_killed_helper(
    restart: dict[str, Any],
) -> None:
    assert restart["rejoined"], restart
    assert restart["starts_after_master"] == 1  # the same helper reconnected
    assert restart["rejoined_helper"], restart
    assert restart["starts"] >= 2


#: Far below the ~4.3 s each call blocked in Mooncake's client while it reconnected to a
#: dead master (benchmarks/mooncake_busy.py --dead-master measures the calls: ms).
CALL_BOUND_S = 1.0


@pytest.fixture(scope="module")
def dead() -> dict[str, Any]:
    return _scenario("dead")


def test_with_the_master_dead_every_call_fails_fast_not_only_the_first(
    dead: dict[str, Any],
) -> None:
    """SIGKILLed master, three streams of calls (stores, questions, loads of blocks on
    the tier) for 3.6 s: only the first call after the kill failed at once, the later
    ones that reached the helper blocked about 4.3 s each in Mooncake's client while it
    reconnected (issue 41). Now the helper fails them at once and a probe off the
    request path looks for the master."""
    for phase in ("down", "down_again"):
        for kind, seconds in dead[phase]["seconds"].items():
            assert len(seconds) == (24 if phase == "down" else 8)
            assert max(seconds) < CALL_BOUND_S, (phase, kind, [round(s, 3) for s in seconds])
        assert "ok" not in dead[phase]["load_results"]  # misses, failed fast
    assert dead["up"]["load_results"] == ["ok"]
    assert set(dead["down_failures"]) <= {"unavailable", "lookup_failed", "after_failure"}


def test_with_the_master_dead_stores_into_the_cpu_tier_all_land(dead: dict[str, Any]) -> None:
    """A 16-block CPU tier: write-through held CPU slots for 4.3 s per request, and
    stores were refused (prepare_store None), 14 of 24 landing. Now as with the master
    up."""
    assert dead["up"]["landed"] == 24
    assert dead["down"]["landed"] == 24
    assert dead["cpu_pinned"] == 0


def test_with_the_master_dead_flush_and_aclose_end_within_2_s(dead: dict[str, Any]) -> None:
    """Write-through failed fast, and a damaged object's removal, waiting for a lease
    when the master died, is deferred, never a call that blocks flush() or aclose()."""
    assert (
        dead["damaged_load"].startswith("TransferError")
        and "could not be read" in (dead["damaged_load"])
    )
    assert dead["flush_s"] < 2.0 and dead["flush_again_s"] < 2.0
    assert dead["aclose_s"] < 2.0


def test_with_the_master_back_the_same_helper_writes_and_reads_again(
    dead: dict[str, Any],
) -> None:
    assert dead["rejoined"], dead
    assert dead["load_after"] == "ok" and dead["load_equal"] == [True, True]
    assert dead["starts"] == 1  # no helper restart


def test_a_damaged_object_is_removed_under_steady_traffic() -> None:
    """A question to the store every 20 ms: the helper removed damaged objects only
    after 0.5 s of idle, so never under traffic, and put-if-absent kept them (issue 41).
    Now a thread of their own removes them once the read's lease (200 ms) ends."""
    seen = _scenario("damaged_steady")
    assert seen["planted"][-1] == 0 and seen["alookup"] == 2
    assert "could not be read" in seen["load"]
    assert seen["removed_s"] is not None, seen
    assert seen["traffic_running"] and seen["traffic_calls"] > 10
    assert seen["removed_s"] < 5.0  # measured ~0.3 s: the lease, then a try every 0.1 s
    assert seen["good_left"] == [1]


def test_the_helper_answers_a_read_before_the_writes_queued_ahead_of_it() -> None:
    """48 puts queued in a stopped helper, then a get: the get was answered after them
    all (one queue in order). Now reads go first, and every put is still written."""
    seen = _scenario("loads_first")
    assert seen["setup"] == [[0], [0]]
    assert seen["get"] == [64 << 10]
    assert seen["put_results"] == [0]
    assert seen["writes_before_read"] <= seen["writes"] // 4, seen


@pytest.fixture(scope="module")
def stopped() -> dict[str, Any]:
    return _scenario("stopped")


def test_a_stopped_helper_bounds_flush_and_aclose_by_timeout_s(stopped: dict[str, Any]) -> None:
    """SIGSTOP (as a helper stuck in a Mooncake call): requests to the helper had no
    deadline, so flush() and aclose() waited forever (issue 37, D2). Now the late
    requests fail, the helper is killed (a transfer may still write the slots: only its
    exit stops it), and the CPU slots the writes pinned come back."""
    t = stopped["timeout_s"]
    assert stopped["flush_s"] < t + 2.0
    # The first write in flight times out; those waiting behind it (the tier's writes
    # lag: a window at a time) fail at once: not tried (after_failure), or refused while
    # the tier is known down (unavailable).
    failures = stopped["failures"]
    assert failures.get("timeout", 0) >= 1 and sum(failures.values()) == 8, failures
    assert set(failures) <= {"timeout", "unavailable", "after_failure"}, failures
    assert stopped["cpu_pinned"] == 0 and stopped["helper_gone"]
    assert stopped["aclose_s"] < 2.0  # nothing left to wait for
    # Nothing pending: aclose waits timeout_s for the helper's exit, then kills it.
    assert stopped["aclose_idle_s"] < t + 2.0 and stopped["helper_gone_idle"]


def test_a_stopped_storage_node_fails_writes_by_their_deadline(stopped: dict[str, Any]) -> None:
    """Writes to a storage node that stopped answering waited Mooncake's own ~60 s with
    their CPU slots pinned (issue 37, D6): now timeout_s."""
    t = stopped["timeout_s"]
    assert stopped["node"] == "ready" and stopped["node_written"]
    assert stopped["node_flush_s"] < t + 2.0
    # By the deadline (timeout), or sooner where Mooncake itself gave up on the transfer
    # (TRANSFER_FAIL: EIO): either way within timeout_s, not 60 s.
    failures = stopped["node_failures"]
    # (Writes that waited behind the first, the tier's writes lagging, fail at once: not
    # tried, after_failure, or refused while the tier is known down, unavailable.) Every
    # block ends one way or another: a put can also complete, its bytes taken by the
    # stopped node's kernel (socket buffers) and the master up (beside four busy loops, 1
    # of 5 runs wrote one of the 4; CI failed the test counting failures only: 3 of 4).
    other = stopped["node_ended_otherwise"]
    ended = sum(failures.values()) + sum(other.values())
    assert ended == 4 and sum(failures.values()) >= 1, (failures, other)
    assert set(failures) <= {"timeout", "EIO", "unavailable", "after_failure"}, failures
    assert stopped["node_cpu_pinned"] == 0
    assert stopped["node_aclose_s"] < t + 2.0


def test_no_secret_reaches_the_helpers_environment_or_arguments() -> None:
    """Tiers from ASYNCOFFLOAD_TIERS: the helper inherited that variable, so the MAC key
    was in /proc/<helper>/environ, and its settings were in its arguments (D10)."""
    seen = _scenario("secrets")
    assert seen["written"] == 2
    assert not seen["env_has_tiers"] and not seen["env_has_any_ours"]
    assert not seen["env_has_key"] and not seen["cmdline_has_key"]
    assert not seen["cmdline_has_master"]
    assert seen["cmdline_args"] == 3  # python, the helper, the socket's fd


@pytest.mark.long  # two demo runs and the command line: about 27 s on the 2-vCPU VM
def test_the_demo_takes_a_mooncake_tier_and_a_second_run_loads_what_the_first_stored() -> None:
    """Two demo runs beside a storage client (blocks in the first run's own segment go
    with it; those in the storage client's stay): the second finds some of the first's
    blocks before it starts and loads them, checked bit for bit."""
    seen = _scenario("demo")
    first, second = seen["first"], seen["second"]
    assert first["ok"] and second["ok"]
    assert first["medium"] == "REMOTE" and first["written"] > 0
    assert first["write_failures"] == 0
    assert first["prelookup"][1] == 0  # nothing there before the first run
    assert second["prelookup"][0] == first["prelookup"][0]
    assert 0 < second["prelookup"][1] <= first["written"]
    assert second["remote_hits"] > 0 and second["read"] > 0
    assert second["verified"] == second["hit_blocks"]
    rows = second["rows"]
    assert rows["remote tier"].startswith("Mooncake Store, master 127.0.0.1:")
    assert "remote lookup (before the run)" in rows
    assert rows["verification"].startswith("OK")
    # The command line, a master that does not answer, and a malformed master.
    rc, out = seen["cli"]
    assert rc == 0 and "Mooncake Store, master" in out, out
    assert "the Mooncake tier at 127.0.0.1:9" in seen["no_master"]
    assert seen["cli_bad_master"] == 2


def test_a_block_in_tensor_parallel_slices_is_one_object_checked_whole() -> None:
    """Two ranks' host pools as two regions (as vLLM's scheduler maps them): a block is
    written from, and read back into, one slice in each, byte-exact; a block whose
    second slice was damaged in the store fails its read whole."""
    seen = _scenario("slices")
    assert seen["write"] == [8192, 8192] and seen["read"] == [8192, 8192]
    assert seen["equal"] == [True, True]
    assert seen["replanted"][-1] == 0
    assert seen["damaged_read"] == [-errno.EBADMSG]
    assert "2 slices (first delta 5)" in seen["set_segments_bad"]


def test_a_hinted_store_is_pinned_in_a_mooncake_tiers_index_through_a_flood() -> None:
    """Retention in the Mooncake tier too (issue 40; disk and Valkey in
    tests/test_retention_tiers.py): the hinted pair outlives a flood past the tier's
    index, the plain pair stored beside it does not, and hits keep the pins."""
    seen = _scenario("pins")
    assert seen["medium"] == "REMOTE"
    assert seen["kept_in_cpu"] == [False, False]
    assert seen["kept_ready"] == [True, True] and seen["kept_pinned"] == [True, True]
    assert seen["plain_ready"] == [False, False]
    assert seen["lookup_kept"] == 2 and seen["load_kept"] == "ok"
    assert seen["refreshed"] >= 2  # the promotion's hits below
    assert seen["pinned"] == 2 and seen["still_pinned"] == [True, True]
