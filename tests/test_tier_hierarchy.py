"""The tier hierarchy's sans-I/O core (asyncoffload.tiers.core), with plain calls.

No event loop, no lane, no file: the core hands out I/O requests and takes their results
back, so each rule (which tier holds a key, how a promotion reserves, reads,
settles or fails, write-through, joining a shared tier's answer, counters and events)
is checked here on its own. The engine (tests/test_tiers.py, tests/test_remote.py) and
vLLM's scheduler side (tests/vllm/test_tiers_vllm.py) drive this same object.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence

import pytest

from asyncoffload.errors import DuplicateKeyError, KeyNotReadyError, UnknownKeyError
from asyncoffload.keys import OffloadKey, make_offload_key
from asyncoffload.manager import CPUOffloadingManager, Medium
from asyncoffload.tiers import ports
from asyncoffload.tiers.base import LowerTier, TierManager
from asyncoffload.tiers.core import Delete, Outcome, TierHierarchy, TierIo, TierState
from asyncoffload.transfer.base import CopyJob, FailedJob

BLOCK = 64
#: The driver's clock: these rules take no time.
NOW = 0.0


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(16, "big"), 0)


def Ended(results: Sequence[int]) -> Outcome:
    """How an I/O request ended: per-block ``results`` (bytes, or ``-errno``)."""
    return Outcome(list(results))


class Port(LowerTier):
    """A port that records submissions (reads end at once, writes fail): for the
    driver's submission helper (``ports.submit``); the core never sees a port."""

    def __init__(self) -> None:
        self.name = "port"
        self.submitted: list[tuple[bool, list[OffloadKey], list[int]]] = []

    def bind(self, wake_fd: int | None) -> None:
        pass

    def submit_read(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        self.submitted.append((False, list(keys), list(host)))
        return _Done(len(keys))

    def submit_write(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        raise OSError(errno.ENOSPC, "full")

    def forget(self, keys: Sequence[OffloadKey]) -> None:
        pass

    def close(self) -> None:
        pass


class _Done(CopyJob):
    def __init__(self, n: int) -> None:
        self.results = [BLOCK] * n
        self.num_blocks = n
        self.nbytes = 0
        self.error: BaseException | None = None

    def query(self) -> bool:
        return True


def tier(name: str, blocks: int, *, shared: bool = False) -> TierState:
    return TierState(name, Medium.DISK, BLOCK, 1.0, TierManager(blocks, Medium.DISK), shared=shared)


def reads(core: TierHierarchy) -> list[TierIo]:
    """The reads of the promotions reserved since the last call (``take_io``)."""
    return [r for r in core.take_io(NOW) if isinstance(r, TierIo)]


def take_writes(core: TierHierarchy) -> list[TierIo]:
    return [r for r in core.take_io(NOW) if isinstance(r, TierIo) and r.write]


def stored(tier: TierState, keys: Sequence[OffloadKey]) -> None:
    """Put ``keys`` in ``tier``'s index, ready."""
    out = tier.index.prepare_store(list(keys))
    assert out is not None
    tier.index.complete_store(list(keys))
    tier.index.take_events()


def cpu_stored(cpu: CPUOffloadingManager, keys: Sequence[OffloadKey]) -> None:
    out = cpu.prepare_store(list(keys))
    assert out is not None
    cpu.complete_store(list(keys))
    cpu.take_events()


def setup(
    cpu_blocks: int = 4, tier_blocks: int = 16
) -> tuple[CPUOffloadingManager, TierState, TierState, TierHierarchy]:
    cpu = CPUOffloadingManager(cpu_blocks, "lru", enable_events=True)
    disk, remote = tier("disk0", tier_blocks), tier("remote1", tier_blocks, shared=True)
    return cpu, disk, remote, TierHierarchy(cpu, [disk, remote])


def test_which_tier_holds_a_key_and_lookup_counts_it() -> None:
    cpu, disk, remote, core = setup()
    cpu_stored(cpu, [key(0)])
    stored(disk, [key(1)])
    stored(remote, [key(1), key(2)])
    assert core.source(key(1)) is core.tiers[0]  # the highest tier wins
    assert core.source(key(2)) is core.tiers[1]
    assert core.source(key(3)) is None
    keys = [key(0), key(1), key(2), key(3), key(4)]
    assert core.lookup(keys, cpu.lookup_prefix(keys)) == 3
    assert [t.counters.lookup_hits for t in core.tiers] == [1, 1]
    assert [t.shared for t in core.tiers] == [False, True]
    assert core.shared_tiers == [core.tiers[1]]


def test_sources_refuse_bad_loads_and_change_nothing() -> None:
    cpu, disk, _, core = setup()
    stored(disk, [key(1)])
    with pytest.raises(DuplicateKeyError, match="appears more than once"):
        core.sources([key(1), key(1)])
    with pytest.raises(UnknownKeyError, match="not stored in any tier"):
        core.sources([key(1), key(9)])
    out = cpu.prepare_store([key(5)])
    assert out is not None  # being written
    with pytest.raises(KeyNotReadyError, match="still being stored"):
        core.sources([key(5)])
    assert core.sources([key(1)]) == {key(1): core.tiers[0]}
    assert disk.index.stats().pinned == 0


def test_promotion_reserves_reads_and_settles() -> None:
    cpu, disk, remote, core = setup()
    stored(disk, [key(1)])
    stored(remote, [key(2)])
    sources = core.sources([key(1), key(2)])
    promotion = core.promote(sources)
    assert promotion is not None and promotion.left == 2 and core.batched == 2
    # Reserved in the CPU tier (being written), pinned in each tier until read.
    assert cpu.stats().write_pending == 2
    assert disk.index.stats().pinned == remote.index.stats().pinned == 1
    ios = reads(core)
    assert core.batched == 0 and reads(core) == []
    assert [(io.tier.name, io.keys, io.write) for io in ios] == [
        ("disk0", [key(1)], False),
        ("remote1", [key(2)], False),
    ]
    assert all(t.counters.reads == 1 for t in core.tiers)
    jobs = [Ended([BLOCK] * len(io.keys)) for io in ios]
    assert core.read_done(ios[0], jobs[0], NOW) == []  # one of two keys read
    assert core.read_done(ios[1], jobs[1], NOW) == [promotion]
    assert core.read_done(ios[1], jobs[1], NOW) == []  # a rerun changes nothing
    assert promotion.done and not promotion.failed
    assert cpu.lookup_prefix([key(1), key(2)]) == 2
    assert disk.index.stats().pinned == 0 and disk.index.ready(key(1))
    assert core.tiers[0].counters.blocks_read == 1
    assert core.tiers[0].counters.bytes_read == BLOCK


def test_a_failed_read_is_a_miss_dropped_from_its_tier() -> None:
    cpu, disk, _, core = setup()
    stored(disk, [key(1), key(2)])
    promotion = core.promote(core.sources([key(1), key(2)]))
    assert promotion is not None
    (io,) = reads(core)
    finished = core.read_done(io, Ended([BLOCK, -errno.EBADMSG]), NOW)
    assert finished == [promotion] and promotion.failed and promotion.bad == 1
    assert promotion.causes == ["disk0: {'corrupt': 1}"]
    assert io.bad == [key(2)]
    # The good block is ready in the CPU tier; the bad one is gone everywhere.
    assert cpu.block_of(key(1)) is not None and cpu.block_of(key(2)) is None
    forgotten = [(d.tier, d.keys) for d in core.take_io(NOW) if isinstance(d, Delete)]
    assert not disk.index.ready(key(2)) and forgotten == [(disk, [key(2)])]
    counters = core.tiers[0].counters
    assert counters.failures == {"corrupt": 1} and counters.read_failures == 1
    events = core.take_events()
    assert [(e.keys, e.removed, e.medium) for e in events] == [((key(2),), True, Medium.DISK)]


def test_a_defect_while_settling_fails_the_promotion_never_leaves_it_open() -> None:
    _, disk, _, core = setup()
    stored(disk, [key(1)])
    promotion = core.promote(core.sources([key(1)]))
    assert promotion is not None
    (io,) = reads(core)

    def broken(keys: Sequence[OffloadKey], pinned: bool = True) -> None:
        raise RuntimeError("a defect in the tier")

    disk.index.drop = broken  # type: ignore[method-assign]
    assert core.read_done(io, Ended([-errno.EBADMSG]), NOW) == [promotion]
    assert promotion.done and promotion.failed
    assert isinstance(promotion.error, RuntimeError)


def test_no_idle_cpu_slot_counts_no_slot_and_changes_nothing() -> None:
    cpu, disk, _, core = setup(cpu_blocks=1)
    stored(disk, [key(1), key(2)])
    assert cpu.prepare_store([key(0)]) is not None  # the one slot, being written
    assert core.promote(core.sources([key(1)])) is None
    assert core.tiers[0].counters.failures == {"no_slot": 1}
    assert core.batched == 0 and disk.index.stats().pinned == 0
    assert cpu.stats().write_pending == 1


def test_protected_keys_are_never_evicted_and_lookup_counts_promotions() -> None:
    cpu, disk, _, core = setup(cpu_blocks=1)
    cpu_stored(cpu, [key(0)])
    stored(disk, [key(1)])
    sources = {key(1): core.tiers[0]}
    assert core.promote(sources, protect=[key(0)], lookup=True) is None
    assert cpu.block_of(key(0)) is not None
    assert core.promote(sources, lookup=True) is not None  # evicts key(0)
    assert cpu.block_of(key(0)) is None
    assert core.tiers[0].counters.lookup_hits == 1


def test_cancelled_reads_release_their_slots_and_pins() -> None:
    cpu, disk, _, core = setup()
    stored(disk, [key(1)])
    promotion = core.promote(core.sources([key(1)]))
    assert promotion is not None
    assert core.cancel_reads() == [promotion]
    assert promotion.failed and core.batched == 0 and reads(core) == []
    assert cpu.block_of(key(1)) is None and cpu.stats().write_pending == 0
    assert disk.index.stats().pinned == 0 and disk.index.ready(key(1))


def test_write_through_pins_cpu_slots_until_each_write_ends() -> None:
    cpu, disk, remote, core = setup()
    cpu_stored(cpu, [key(1), key(2)])
    out = cpu.prepare_store([key(3)])
    assert out is not None  # being written: not offered
    core.write_through([key(1), key(2), key(1), key(3)])
    writes = take_writes(core)
    assert [(io.tier.name, io.keys, io.write) for io in writes] == [
        ("disk0", [key(1), key(2)], True),
        ("remote1", [key(1), key(2)], True),
    ]
    assert cpu.stats().pinned == 2  # each slot pinned once per write
    core.write_done(writes[0], Ended([BLOCK, -errno.ENOSPC]), NOW)
    core.write_done(writes[0], Ended([BLOCK, BLOCK]), NOW)  # a rerun changes nothing
    # A failed submission is a failed job: every block of it fails, by its errno.
    job = ports.submit(Port(), writes[1], [0, 0])
    assert isinstance(job, FailedJob)
    core.write_done(writes[1], ports.outcome(job, 2), NOW)
    assert cpu.stats().pinned == 0
    assert disk.index.ready(key(1)) and disk.index.block_of(key(2)) is None
    assert remote.index.block_of(key(1)) is None
    stats = {s.name: s for s in core.stats()}
    assert stats["disk0"].blocks_written == 1 and stats["disk0"].bytes_written == BLOCK
    assert stats["disk0"].failures == {"ENOSPC": 1} and stats["disk0"].write_failures == 1
    assert stats["remote1"].failures == {"ENOSPC": 2}
    assert stats["remote1"].info == {"keys_asked": 0, "keys_found": 0}
    # A tier that cannot be written now counts why, and nothing is offered or pinned.
    core.write_through([key(2)], blocked="no_pool")
    assert core.take_io(NOW) == []
    assert cpu.stats().pinned == 0
    assert core.stats()[0].failures == {"ENOSPC": 1, "no_pool": 1}


def test_write_through_of_a_block_already_there_counts_it_present() -> None:
    cpu, disk, _, core = setup()
    cpu_stored(cpu, [key(1)])
    core.write_through([key(1)])
    io = take_writes(core)[0]
    core.write_done(io, Ended([0]), NOW)  # a put-if-absent that found it there
    (stats, _) = core.stats()
    assert stats.blocks_present == 1 and stats.blocks_written == 0
    assert disk.index.ready(key(1))


def test_a_shared_tiers_answer_joins_its_index() -> None:
    _, _, remote, core = setup(tier_blocks=2)
    tier = core.tiers[1]
    stored(remote, [key(1)])
    (question,) = core.ask([key(1), key(2), key(3)], NOW)
    asked = question.keys
    assert asked == [key(2), key(3)] and tier.asked == 2
    assert core.join(tier, asked, [True, False]) == [key(2)]
    assert remote.index.ready(key(2)) and tier.found == 1
    events = core.take_events()
    assert [(e.keys, e.removed) for e in events] == [((key(2),), False)]
    # A full index (every block pinned by a read) cannot take more: counted "full".
    remote.index.prepare_load([key(1), key(2)])
    assert core.join(tier, [key(5)], [True]) == []
    assert tier.counters.failures == {"full": 1}
    assert core.stats()[1].info == {"keys_asked": 2, "keys_found": 1}


def test_requests_carry_what_a_driver_needs_to_submit() -> None:
    _, disk, _, core = setup()
    stored(disk, [key(1)])
    assert core.promote(core.sources([key(1)])) is not None
    (io,) = reads(core)
    assert isinstance(io, TierIo) and len(io.cpu_slots) == len(io.tier_slots) == 1
    port = Port()
    job = ports.submit(port, io, [4096])
    assert port.submitted == [(False, [key(1)], [4096])]
    assert core.read_done(io, ports.outcome(job, 1), NOW)[0].done


def test_a_delete_goes_to_its_port_and_a_failed_one_back_to_the_core() -> None:
    """``ports.delete`` hands keys the index let go to their port: ``None`` when nothing
    runs; a port that raises becomes a failed job (kept in the request), which the core
    counts per key like one that failed on the lanes."""
    _, disk, _, core = setup()
    req = Delete(disk, [key(1), key(2)])
    assert ports.delete(Port(), req) is None and req.job is None

    class Broken(Port):
        def forget(self, keys: Sequence[OffloadKey]) -> None:
            raise OSError(errno.EROFS, "read-only file system")

    job = ports.delete(Broken(), req)
    assert isinstance(job, FailedJob) and req.job is job and job.query()
    core.delete_done(req, ports.outcome(job, len(req.keys)), NOW)
    assert disk.counters.delete_failures == 2 and core.stats()[0].delete_failures == 2
