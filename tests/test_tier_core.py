"""Every rule of the tier core (asyncoffload.tiers.core), with plain requests and a fake
clock: no loop, no lane, no port, no fake tier class. The time is a number the test
hands in, as each driver hands in its own (the engine its loop's, vLLM's scheduler
side ``time.monotonic()``).

The rules that used to live in one driver only are here for both: the stall of a
promotion (the engine's, now vLLM's too), the memory of negative answers and the down
window of a shared tier (vLLM's, now the engine's too), the wait for a CPU slot (vLLM's).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest

from asyncoffload.keys import OffloadKey, make_offload_key
from asyncoffload.manager import CPUOffloadingManager, Medium
from asyncoffload.tiers import ports
from asyncoffload.tiers.base import TierManager
from asyncoffload.tiers.core import (
    MAX_KEY_BYTES,
    REAP_S,
    STALL_GRACE_S,
    Delete,
    Exists,
    Outcome,
    TierHierarchy,
    TierIo,
    TierState,
)
from asyncoffload.tiers.core import hierarchy as core_hierarchy
from asyncoffload.tiers.core import shared as core_shared
from asyncoffload.tiers.disk import DiskStore, DiskTier
from asyncoffload.tiers.format import Namespace

BLOCK = 64
DEADLINE_S = 1.0


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(16, "big"), 0)


def tier(name: str, blocks: int = 16, *, shared: bool = False) -> TierState:
    medium = Medium.REMOTE if shared else Medium.DISK
    return TierState(name, medium, BLOCK, DEADLINE_S, TierManager(blocks, medium), shared=shared)


def setup(
    cpu_blocks: int = 4, *, shared: bool = True
) -> tuple[CPUOffloadingManager, TierHierarchy]:
    cpu = CPUOffloadingManager(cpu_blocks, "lru", enable_events=True)
    tiers = [tier("disk0")] + ([tier("remote1", shared=True)] if shared else [])
    return cpu, TierHierarchy(cpu, tiers)


def stored(state: TierState, keys: Sequence[OffloadKey]) -> None:
    assert state.index.prepare_store(list(keys)) is not None
    state.index.complete_store(list(keys))
    state.index.take_events()


def cpu_stored(cpu: CPUOffloadingManager, keys: Sequence[OffloadKey]) -> None:
    assert cpu.prepare_store(list(keys)) is not None
    cpu.complete_store(list(keys))
    cpu.take_events()


def of(kind: type, requests: Sequence[object]) -> list:  # type: ignore[type-arg]
    return [r for r in requests if isinstance(r, kind)]


def ok(io: TierIo) -> Outcome:
    return Outcome([BLOCK] * len(io.keys))


# --- promotions stall ----------------------------------------------------------------


def test_a_read_that_outlives_its_deadline_fails_its_promotion_and_keeps_its_slots() -> None:
    cpu, core = setup(shared=False)
    disk = core.tiers[0]
    stored(disk, [key(1)])
    promotion = core.promote(core.sources([key(1)]))
    assert promotion is not None and core.next_deadline() is None  # nothing handed out yet
    (io,) = of(TierIo, core.take_io(10.0))
    due = 10.0 + DEADLINE_S + STALL_GRACE_S
    assert core.next_deadline() == due
    assert core.check(due - 0.001) == [] and not promotion.failed
    assert core.check(due) == [promotion]
    assert promotion.stalled and promotion.failed and not promotion.done
    assert core.stalled(key(1)) and core.next_deadline() is None
    assert core.check(due + 5) == []  # once
    # The CPU slot stays reserved (being written) until the read really ends.
    assert cpu.stats().write_pending == 1
    assert core.read_done(io, ok(io), due + 30) == [promotion]
    assert not core.stalled(key(1)) and cpu.stats().write_pending == 0
    assert cpu.lookup_prefix([key(1)]) == 1  # the block came up after all


def test_a_promotion_over_two_tiers_stalls_at_the_slower_tiers_deadline() -> None:
    cpu = CPUOffloadingManager(4, "lru")
    slow = TierState("slow", Medium.DISK, BLOCK, 5.0, TierManager(8, Medium.DISK))
    core = TierHierarchy(cpu, [tier("disk0"), slow])
    stored(core.tiers[0], [key(1)])
    stored(slow, [key(2)])
    promotion = core.promote(core.sources([key(1), key(2)]))
    assert promotion is not None
    assert len(of(TierIo, core.take_io(0.0))) == 2
    assert core.next_deadline() == 5.0 + STALL_GRACE_S
    assert core.check(DEADLINE_S + STALL_GRACE_S) == []


def test_a_promotion_that_ends_in_time_never_stalls() -> None:
    _, core = setup(shared=False)
    stored(core.tiers[0], [key(1)])
    promotion = core.promote(core.sources([key(1)]))
    (io,) = of(TierIo, core.take_io(0.0))
    assert core.read_done(io, ok(io), 0.5) == [promotion]
    assert core.next_deadline() is None and core.check(100.0) == []


# --- jobs given up on --------------------------------------------------------------


def test_a_late_read_holds_its_slots_until_the_driver_says_it_ended() -> None:
    cpu, core = setup(shared=False)
    stored(core.tiers[0], [key(1)])
    core.promote(core.sources([key(1)]))
    (io,) = of(TierIo, core.take_io(0.0))
    core.read_done(io, Outcome([-errno.ETIMEDOUT], late=True), 2.0)
    assert core.late == [io] and cpu.stats().write_pending == 1  # held
    assert core.next_deadline() == 2.0 + REAP_S  # look again then
    assert core.reap([], 2.25) == 0 and core.next_deadline() == 2.25 + REAP_S
    assert core.reap([io], 3.0) == 1
    assert core.late == [] and cpu.stats().write_pending == 0 and core.next_deadline() is None


# --- waiting for a CPU slot ----------------------------------------------------------


def test_a_key_waits_for_a_slot_held_by_tier_io_and_no_longer() -> None:
    cpu, core = setup(cpu_blocks=1, shared=False)
    disk = core.tiers[0]
    cpu_stored(cpu, [key(0)])
    stored(disk, [key(1)])
    # Nothing in flight: no wait, a no_slot miss.
    cpu.prepare_load([key(0)])  # pinned: no idle slot
    assert not core.promote_key(key(1), 0.0)
    assert disk.counters.failures == {"no_slot": 1}
    # A write-through in flight holds the slot: the key waits (pending) until it ended.
    cpu.complete_load([key(0)])
    core.write_through([key(0)])
    (write,) = of(TierIo, core.take_io(0.0))
    assert core.promote_key(key(1), 0.0) and core.waits_for_slot(key(1))
    assert core.promote_key(key(1), 0.5)  # still waiting
    core.write_done(write, ok(write), 0.6)
    # The write ended: the slot is idle now, the promotion takes it.
    assert core.promote_key(key(1), 0.7) and not core.waits_for_slot(key(1))
    assert core.batched == 1


def test_a_slot_wait_ends_with_the_io_it_waited_for_or_its_deadline() -> None:
    cpu, core = setup(cpu_blocks=2, shared=False)
    disk = core.tiers[0]
    cpu_stored(cpu, [key(0), key(9)])
    stored(disk, [key(1), key(2)])
    cpu.prepare_load([key(0), key(9)])  # pinned by loads: no idle slot
    core.write_through([key(0)])
    (first,) = of(TierIo, core.take_io(0.0))
    assert core.promote_key(key(1), 0.0)  # waits for the first write
    core.write_through([key(9)])
    (second,) = of(TierIo, core.take_io(0.001))  # (1 ms in flight: nothing waits)
    core.write_done(first, ok(first), 0.2)
    # What it waited for ended, still no slot: a miss (the later write is not waited for).
    assert not core.promote_key(key(1), 0.3)
    assert disk.counters.failures == {"no_slot": 1}
    # Bounded in time too: the tiers' deadline plus the grace.
    assert core.promote_key(key(2), 1.0)
    assert core.promote_key(key(2), 1.0 + DEADLINE_S + STALL_GRACE_S - 0.01)
    assert not core.promote_key(key(2), 1.0 + DEADLINE_S + STALL_GRACE_S)
    assert second.seq > first.seq


def test_slot_waits_are_a_bounded_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_hierarchy, "SLOT_WAIT_KEYS", 3)
    cpu, core = setup(cpu_blocks=1, shared=False)
    cpu_stored(cpu, [key(0)])
    stored(core.tiers[0], [key(i) for i in range(1, 6)])
    core.write_through([key(0)])
    core.take_io(0.0)
    cpu.prepare_load([key(0)])
    for i in range(1, 6):
        assert core.promote_key(key(i), 0.0)
    assert [core.waits_for_slot(key(i)) for i in range(1, 6)] == [False, False, True, True, True]


def test_a_lookahead_neither_waits_nor_counts() -> None:
    cpu, core = setup(cpu_blocks=1, shared=False)
    cpu_stored(cpu, [key(0)])
    stored(core.tiers[0], [key(1)])
    cpu.prepare_load([key(0)])
    assert not core.promote_key(key(1), 0.0, ask=False)
    assert core.tiers[0].counters.failures == {} and not core.waits_for_slot(key(1))


def test_a_blocked_driver_counts_the_cause_once_and_reads_nothing() -> None:
    _, core = setup()
    stored(core.tiers[0], [key(1)])
    assert not core.promote_key(key(1), 0.0, blocked="no_pool")
    assert not core.promote_key(key(2), 0.0, blocked="no_pool")  # asked of no server
    assert core.tiers[0].counters.failures == {"no_pool": 1}
    assert core.tiers[1].counters.failures == {"no_pool": 1}
    assert core.batched == 0 and core.take_io(0.0) == []


# --- shared tiers: questions, negative answers, down windows ------------------------------


def test_a_key_in_no_tier_is_asked_once_and_a_no_is_remembered_for_the_ttl() -> None:
    _, core = setup()
    remote = core.tiers[1]
    assert core.promote_key(key(1), 0.0)  # pending while asked
    assert core.promote_key(key(1), 0.0)  # once: still pending
    (q,) = of(Exists, core.take_io(0.0))
    assert q.tier is remote and q.keys == [key(1)]
    assert core.answered(q, [False], None, 0.1) == []
    assert not core.promote_key(key(1), 0.2)  # a miss, not asked again
    assert core.take_io(0.2) == []
    ttl = core.questions.miss_ttl_s
    assert not core.promote_key(key(1), 0.1 + ttl - 0.01)
    assert core.promote_key(key(1), 0.1 + ttl)  # forgotten: asked again
    assert of(Exists, core.take_io(0.1 + ttl))[0].keys == [key(1)]
    assert remote.asked == 2


def test_a_key_found_joins_the_index_and_promotes_from_there() -> None:
    _, core = setup()
    assert core.promote_key(key(1), 0.0)
    (q,) = of(Exists, core.take_io(0.0))
    assert core.answered(q, [True], None, 0.1) == [key(1)]
    assert core.answered(q, [False], None, 0.1) == []  # a second hand-back: nothing
    assert core.tiers[1].index.ready(key(1)) and core.tiers[1].found == 1
    assert core.promote_key(key(1), 0.2) and core.batched == 1  # read from the tier now


def test_a_key_a_tier_knows_but_cannot_read_yet_is_a_miss_not_a_question() -> None:
    cpu, core = setup()
    cpu_stored(cpu, [key(1)])
    core.write_through([key(1)])  # being written to both tiers
    assert not core.promote_key(key(1), 0.0)
    assert not of(Exists, core.take_io(0.0))


def test_negative_answers_are_a_bounded_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_shared, "MISS_KEYS", 2)
    _, core = setup()
    for i in range(3):
        core.promote_key(key(i), 0.0)
    (q,) = of(Exists, core.take_io(0.0))
    core.answered(q, [False] * 3, None, 0.0)
    assert list(core.questions.misses) == [key(1), key(2)]  # the oldest went
    assert core.promote_key(key(0), 0.1)  # asked again


def test_a_failed_question_puts_the_tier_down_and_is_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, core = setup()
    remote = core.tiers[1]
    caplog.set_level(logging.WARNING, "asyncoffload")
    core.promote_key(key(1), 0.0)
    (q,) = of(Exists, core.take_io(0.0))
    core.answered(q, None, ConnectionRefusedError("down"), 1.0)
    assert remote.counters.failures == {"lookup_failed": 1}
    ttl = core.questions.miss_ttl_s
    assert remote.down_until == 1.0 + ttl
    # Down: nothing is asked (every shared tier is down: a miss at once).
    assert not core.promote_key(key(2), 1.5) and core.take_io(1.5) == []
    assert core.ask([key(3)], 1.5) == []
    # Up again: asked; a malformed answer fails the same way, and is not logged again.
    assert core.promote_key(key(2), 1.0 + ttl)
    (q,) = of(Exists, core.take_io(1.0 + ttl))
    core.answered(q, [True, True], None, 1.0 + ttl)
    assert remote.counters.failures == {"lookup_failed": 2}
    assert len([r for r in caplog.records if "did not answer" in r.message]) == 1
    # A minute later the next failure is logged, with the count of those not logged.
    at = 1.0 + core_shared.LOG_EVERY_S
    assert core.promote_key(key(4), at)
    (q,) = of(Exists, core.take_io(at))
    core.answered(q, None, TimeoutError(), at)
    logged = [r.message for r in caplog.records if "did not answer" in r.message]
    assert len(logged) == 2 and "1 more failed" in logged[1]


def test_an_unanswered_question_fails_at_its_deadline() -> None:
    _, core = setup()
    core.promote_key(key(1), 0.0)
    (q,) = of(Exists, core.take_io(0.0))
    due = DEADLINE_S + STALL_GRACE_S
    assert core.next_deadline() == due
    core.check(due)
    assert q.settled and core.tiers[1].counters.failures == {"lookup_failed": 1}
    assert not core.questions.asking and core.next_deadline() is None
    assert core.answered(q, [True], None, due + 1) == []  # the late answer changes nothing
    assert not core.promote_key(key(1), due + 1)  # a miss, and the tier is down


def test_a_failed_read_is_remembered_as_a_miss_of_the_shared_tiers() -> None:
    _, core = setup()
    remote = core.tiers[1]
    stored(remote, [key(1)])
    core.promote(core.sources([key(1)]))
    (io,) = of(TierIo, core.take_io(0.0))
    core.read_done(io, Outcome([-errno.EBADMSG]), 0.5)
    assert not core.promote_key(key(1), 0.6) and of(Exists, core.take_io(0.6)) == []


def test_ask_skips_keys_known_remembered_or_too_long() -> None:
    _, core = setup()
    remote = core.tiers[1]
    stored(remote, [key(1)])
    core.questions.remember_miss(key(2), 0.0)
    long_key = OffloadKey(b"x" * (MAX_KEY_BYTES + 1))
    (q,) = core.ask([key(1), key(2), key(3), long_key], 0.5)
    assert q.keys == [key(3)] and remote.asked == 1


# --- write-through, re-offers, deletes, throttled warnings -----------------------------


def test_stored_keys_are_offered_again_and_long_keys_never() -> None:
    cpu, core = setup(shared=False)
    long_key = OffloadKey(b"y" * (MAX_KEY_BYTES + 1))
    cpu_stored(cpu, [key(1), long_key])
    core.reoffer([key(1), key(2)], [key(1), key(2)])  # the store took every key: nothing
    assert core.take_io(0.0) == []
    core.reoffer([key(1), key(2), long_key], [key(2)])
    (write,) = of(TierIo, core.take_io(0.0))
    assert write.write and write.keys == [key(1)]


def test_evictions_and_drops_are_deletes_for_the_port() -> None:
    cpu = CPUOffloadingManager(4, "lru")
    disk = tier("disk0", blocks=1)
    core = TierHierarchy(cpu, [disk])
    cpu_stored(cpu, [key(1), key(2)])
    core.write_through([key(1)])
    (w,) = of(TierIo, core.take_io(0.0))
    core.write_done(w, ok(w), 0.0)
    core.write_through([key(2)])  # evicts key(1) from the one slot
    out = core.take_io(0.0)
    assert [(d.tier, d.keys) for d in of(Delete, out)] == [(disk, [key(1)])]


def test_write_failures_are_warned_of_at_most_every_ten_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cpu, core = setup(shared=False)
    caplog.set_level(logging.WARNING, "asyncoffload")
    cpu_stored(cpu, [key(i) for i in range(3)])
    for i, now in enumerate((0.0, 5.0, 10.0)):
        core.write_through([key(i)])
        (w,) = of(TierIo, core.take_io(now))
        core.write_done(w, Outcome([-errno.ENOSPC]), now)
    warned = [r for r in caplog.records if "could not be written" in r.message]
    assert len(warned) == 2 and core.tiers[0].counters.failures == {"ENOSPC": 3}


def test_failed_deletes_are_counted_and_warned_of_at_most_every_ten_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A release that failed leaves a block file behind: the core counts it per key in
    the tier's stats and warns at most every ten seconds (a given-up one always); a
    release that worked changes nothing."""
    _, core = setup(shared=False)
    disk = core.tiers[0]
    caplog.set_level(logging.WARNING, "asyncoffload")
    core.delete_done(Delete(disk, [key(1), key(2)]), Outcome([0, 0]), 0.0)
    assert disk.counters.delete_failures == 0 and not caplog.records
    for now in (0.0, 5.0, 10.0):
        core.delete_done(Delete(disk, [key(1), key(2)]), Outcome([0, -errno.EACCES]), now)
    core.delete_done(Delete(disk, [key(3)]), Outcome([-errno.ETIMEDOUT], late=True), 11.0)
    warned = [r.getMessage() for r in caplog.records if "could not be removed" in r.message]
    assert len(warned) == 3 and "EACCES 1" in warned[0] and "given up on" in warned[2]
    assert disk.counters.delete_failures == 4
    (stats,) = core.stats()
    assert stats.delete_failures == 4 and stats.failures == {}  # not a read or write failure


def test_a_closed_core_writes_asks_and_waits_for_nothing() -> None:
    cpu, core = setup()
    cpu_stored(cpu, [key(1)])
    assert core.promote_key(key(5), 0.0)
    core.take_io(0.0)  # the question goes out
    (q,) = core.close()
    assert q.settled and not core.questions.asking
    core.write_through([key(1)])
    assert core.take_io(0.0) == [] and not core.promote_key(key(6), 0.0)


# --- opening tiers (the drivers' one way) ------------------------------------------------


def test_opening_tiers_closes_every_one_opened_when_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[str] = []
    close = DiskStore.close

    def spy(self: DiskStore) -> None:
        closed.append(self.name)
        close(self)

    monkeypatch.setattr(DiskStore, "close", spy)
    namespace = Namespace(model="m", kv_dtype="f16", layout="l", block_bytes=4096)
    good = DiskTier(tmp_path / "a", 1 << 20, "slab")
    too_small = DiskTier(tmp_path / "b", 1, "slab")
    with pytest.raises(ValueError, match="holds no block"):
        ports.open_tiers([good, too_small], namespace)
    assert closed == ["disk0"]
    stores = ports.open_tiers([good], namespace)
    try:
        (state,) = ports.tier_states(stores)
        assert state.name == "disk0" and not state.shared
        assert state.index.stats().num_blocks == stores[0].index_spec.num_blocks
    finally:
        ports.close_tiers(stores)
