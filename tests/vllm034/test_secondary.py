"""Our tiers as vLLM 0.34 secondary tiers (``AsyncOffloadTier``) under vLLM's own
tiering, in this process on the CPU: vLLM's ``TieringOffloadingSpec`` builds its CPU
primary tier (a shared region) and loads ours by ``module_path`` through its factory;
chunks go to our tier by vLLM's cascade and come back by its promotions."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from asyncoffload.integrations.vllm.secondary import AsyncOffloadTier
from asyncoffload.tiers.disk import DiskStore
from asyncoffload.tiers.format import HEADER_BYTES, block_file_bytes
from asyncoffload.tiers.ports import running
from tests.vllm034.helpers import (
    WORKER_BYTES,
    Engine,
    keys_of,
    offloading_config,
    random_rows,
    tier_entry,
)

ROW = 4096  # a primary row: one chunk (WORKER_BYTES per worker, padded to a page)
_OURS = "vllm:asyncoffload_secondary_"


def _disk(path: Path, **over: Any) -> dict[str, Any]:
    return {"kind": "disk", "path": str(path), "capacity": "1MiB", **over}  # no admission


def _file_of(tier: AsyncOffloadTier, key: bytes) -> Path:
    (store,) = tier.stores
    assert isinstance(store, DiskStore)
    return store.path_of(key)  # type: ignore[arg-type]


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


# --- round trips ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["slab", "files"])
def test_chunks_round_trip_byte_exact_through_vllms_primary_and_a_disk_tier(
    tmp_path: Path, mode: str
) -> None:
    engine = Engine([tier_entry(_disk(tmp_path / "disk", mode=mode))])
    try:
        tier = engine.tier
        assert tier.tier_type == "AsyncOffloadTier" and tier.locality is Locality.LOCAL
        keys = keys_of("a", "b", "c")
        rows = random_rows(3, ROW, seed=1)
        engine.store(keys, rows)
        events = engine.events()
        ours = [e for e in events if e.ownership == tier.name]
        assert [list(e.keys) for e in ours] == [keys]
        assert ours[0].medium is Medium.STORAGE and ours[0].locality is Locality.LOCAL
        assert ours[0].removal_expected and not ours[0].removed
        engine.forget_primary()
        assert not engine.view.any()
        answers, ctx = engine.promote(keys)
        assert answers == [LookupResult.HIT] * 3
        assert np.array_equal(engine.rows_of(keys, ctx), rows)
        stats = tier.get_stats()
        assert stats is not None
        data = stats.data["data"]
        label = (tier.name,)
        assert data[_OURS + "blocks_written"][label] == 3
        assert data[_OURS + "blocks_read"][label] == 3
        assert data[_OURS + "ready_blocks"][label] == 3
    finally:
        engine.close()


def test_vllms_spec_declares_our_metrics() -> None:
    metrics = TieringOffloadingSpec.build_metric_definitions(
        {"secondary_tiers": [tier_entry({"path": "/unused", "capacity": "1MiB"})]}
    )
    assert metrics[_OURS + "blocks_written"].labelnames == ("tier",)
    assert metrics[_OURS + "failures"].labelnames == ("tier", "cause")


def test_a_fresh_engine_is_served_what_another_stored_through_valkey(
    tmp_path: Path, valkey_server: Any
) -> None:
    remote = {"kind": "remote", "url": valkey_server.url, "admission": None, "timeout_s": 5.0}
    first = Engine([tier_entry(remote)])
    keys = keys_of("x", "y")
    rows = random_rows(2, ROW, seed=2)
    try:
        assert first.tier.locality is Locality.REMOTE
        first.store(keys, rows)
    finally:
        first.close()
    second = Engine([tier_entry(remote)])  # another engine id, nothing in its index
    try:
        ctx = second.request()
        # Unknown to this engine: the server is asked (RETRY) before any promotion.
        assert second.manager.lookup(keys[0], ctx) is LookupResult.RETRY
        answers, ctx = second.promote(keys)
        assert answers == [LookupResult.HIT] * 2
        assert np.array_equal(second.rows_of(keys, ctx), rows)
    finally:
        second.close()


# --- damage, removals, the byte bound ------------------------------------------------------


def test_a_damaged_chunk_is_a_miss_never_its_bytes_and_its_removal_is_published(
    tmp_path: Path,
) -> None:
    engine = Engine([tier_entry(_disk(tmp_path / "disk", mode="files"))])
    try:
        tier = engine.tier
        keys = keys_of("a", "b", "c")
        rows = random_rows(3, ROW, seed=3)
        engine.store(keys, rows)
        engine.events()
        _flip(_file_of(tier, keys[1]), HEADER_BYTES + 100)  # one byte of b's payload
        engine.forget_primary()
        answers, ctx = engine.promote(keys)
        assert answers == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
        assert np.array_equal(engine.rows_of([keys[0], keys[2]], ctx), rows[[0, 2]])
        removed = [e for e in engine.events() if e.removed and e.ownership == tier.name]
        assert [list(e.keys) for e in removed] == [[keys[1]]]
        assert removed[0].medium is Medium.STORAGE and removed[0].removal_expected
        # Dropped from our tier: a later request finds it nowhere.
        assert tier.lookup(keys[1], ctx) is LookupResult.MISS
        assert engine.promote([keys[1]])[0] == [LookupResult.MISS]
        (stats,) = tier.tier_stats()
        assert stats.failures == {"corrupt": 1} and stats.dropped == 1
    finally:
        engine.close()


def test_a_damaged_value_in_valkey_is_a_miss_and_its_removal_is_published(
    tmp_path: Path, valkey_server: Any
) -> None:
    remote = {"kind": "remote", "url": valkey_server.url, "admission": None, "timeout_s": 5.0}
    engine = Engine([tier_entry(remote)])
    try:
        tier = engine.tier
        keys = keys_of("p", "q")
        rows = random_rows(2, ROW, seed=4)
        engine.store(keys, rows)
        engine.events()
        (name,) = valkey_server.command("KEYS", f"*{keys[0].hex()}")
        value = valkey_server.command("GET", name)
        at = len(value) - 7  # in the payload, behind the header
        valkey_server.command("SETRANGE", name, at, bytes([value[at] ^ 1]))
        engine.forget_primary()
        answers, ctx = engine.promote(keys)
        assert answers == [LookupResult.MISS, LookupResult.HIT]
        assert np.array_equal(engine.rows_of([keys[1]], ctx), rows[[1]])
        removed = [e for e in engine.events() if e.removed and e.ownership == tier.name]
        assert [list(e.keys) for e in removed] == [[keys[0]]]
        assert removed[0].locality is Locality.REMOTE
    finally:
        engine.close()


def test_the_tier_holds_its_byte_bound_evicts_and_publishes_the_evictions(
    tmp_path: Path,
) -> None:
    """vLLM's fs tier grows without bound; ours evicts within its capacity and says so."""
    capacity = 3 * block_file_bytes(ROW)
    engine = Engine([tier_entry(_disk(tmp_path / "disk", mode="files", capacity=capacity))])
    try:
        tier = engine.tier
        keys = keys_of("k0", "k1", "k2", "k3", "k4", "k5")
        rows = random_rows(6, ROW, seed=5)
        engine.store(keys[:3], rows[:3])
        engine.store(keys[3:], rows[3:])
        events = engine.events()
        removed = [k for e in events if e.removed and e.ownership == tier.name for k in e.keys]
        assert sorted(removed) == sorted(keys[:3])  # the least recently stored
        directory = _file_of(tier, keys[0]).parent.parent
        files = sorted(directory.glob("*/*.kv"))
        assert len(files) == 3 and sum(f.stat().st_size for f in files) <= capacity
        stats = tier.get_stats()
        assert stats is not None
        data = stats.data["data"]
        assert data[_OURS + "blocks_evicted"][(tier.name,)] == 3
        assert data[_OURS + "ready_blocks"][(tier.name,)] == 3
        assert data[_OURS + "capacity_blocks"][(tier.name,)] == 3
        engine.forget_primary()
        answers, ctx = engine.promote(keys)
        assert answers == [LookupResult.MISS] * 3 + [LookupResult.HIT] * 3
        assert np.array_equal(engine.rows_of(keys[3:], ctx), rows[3:])
    finally:
        engine.close()


# --- tensor parallelism -----------------------------------------------------------------------


def test_tp2_a_chunk_with_one_ranks_part_damaged_fails_whole(tmp_path: Path) -> None:
    """vLLM's region holds a chunk's rank slices side by side in one row
    (``|W0|W1|``): one value of ours, checked whole. Damage in either rank's part fails
    the chunk for both; a TP 1 engine never reads a TP 2 engine's chunks."""
    disk = _disk(tmp_path / "disk", mode="files")
    engine = Engine([tier_entry(disk)], world=2)
    try:
        tier = engine.tier
        assert engine.view.shape[1] == 2 * WORKER_BYTES == ROW
        keys = keys_of("t0", "t1", "t2")
        rows = random_rows(3, ROW, seed=6)
        engine.store(keys, rows)
        _flip(_file_of(tier, keys[0]), HEADER_BYTES + WORKER_BYTES + 5)  # rank 1's part
        _flip(_file_of(tier, keys[1]), HEADER_BYTES + 5)  # rank 0's part
        engine.forget_primary()
        answers, ctx = engine.promote(keys)
        assert answers == [LookupResult.MISS, LookupResult.MISS, LookupResult.HIT]
        assert np.array_equal(engine.rows_of([keys[2]], ctx), rows[[2]])
        tp2 = tier.namespace()
    finally:
        engine.close()
    other = Engine([tier_entry(disk)], world=1)
    try:
        assert other.tier.namespace().identity() != tp2.identity()
        assert other.promote([keys[2]])[0] == [LookupResult.MISS]
    finally:
        other.close()


def test_tp2_with_a_mac_key_round_trips_and_a_keyless_engine_finds_nothing(
    tmp_path: Path,
) -> None:
    """Authenticated chunks (a keyed BLAKE2b MAC, checked on every read): a TP 2 engine
    gets its chunks back byte-exact; an engine without the key, or with another, files
    its chunks under another identity and never reads these."""
    key = "k" * 32
    disk = _disk(tmp_path / "disk", mode="files", mac_key=key)
    engine = Engine([tier_entry(disk)], world=2)
    keys = keys_of("m0", "m1")
    rows = random_rows(2, ROW, seed=10)
    try:
        engine.store(keys, rows)
        engine.forget_primary()
        answers, ctx = engine.promote(keys)
        assert answers == [LookupResult.HIT] * 2
        assert np.array_equal(engine.rows_of(keys, ctx), rows)
    finally:
        engine.close()
    for other in ({k: v for k, v in disk.items() if k != "mac_key"}, {**disk, "mac_key": "o" * 32}):
        stranger = Engine([tier_entry(other)], world=2)
        try:
            assert stranger.promote(keys)[0] == [LookupResult.MISS] * 2
        finally:
            stranger.close()


# --- vLLM's contracts: deferred release, backpressure ----------------------------------------


def test_a_read_stuck_in_the_kernel_defers_the_release_of_vllms_chunks(tmp_path: Path) -> None:
    """A promotion whose read outlives its deadline fails at once (the keys are
    misses), but vLLM keeps its chunks out of the free pool until the read really
    ended (``JobResult.deferred_release``)."""
    engine = Engine([tier_entry(_disk(tmp_path / "disk", deadline_s=0.2))])
    try:
        keys = keys_of("s0", "s1")
        engine.store(keys, random_rows(2, ROW, seed=7))
        engine.forget_primary()
        (store,) = engine.tier.stores
        assert isinstance(store, DiskStore)
        primary = engine.manager.primary_tier
        gate, opener = os.pipe()
        try:
            store.pool.set_gate(gate)  # every lane op waits until the gate opens
        finally:
            os.close(gate)
        try:
            answers, _ = engine.promote(keys)
            assert answers == [LookupResult.MISS] * 2
            assert primary.num_deferred_release_chunks == 2
        finally:
            os.close(opener)
        engine.settle("the stuck read, let go")
        assert primary.num_deferred_release_chunks == 0
    finally:
        engine.close()


def test_a_shutdown_while_a_read_is_stuck_keeps_vllms_region_mapped(tmp_path: Path) -> None:
    """vLLM keeps its primary region when a tier's shutdown fails: ours fails it while a
    read it gave up on may still fill a chunk, so the late read never writes into
    unmapped memory."""
    engine = Engine([tier_entry(_disk(tmp_path / "disk", deadline_s=0.2))])
    keys = keys_of("u0")
    engine.store(keys, random_rows(1, ROW, seed=9))
    engine.forget_primary()
    (store,) = engine.tier.stores
    assert isinstance(store, DiskStore)
    gate, opener = os.pipe()
    try:
        store.pool.set_gate(gate)
    finally:
        os.close(gate)
    try:
        assert engine.promote(keys)[0] == [LookupResult.MISS]
        engine.view = np.empty((0, 0), dtype=np.int8)
        with pytest.raises(RuntimeError, match="must stay mapped"):
            engine.manager.shutdown()
    finally:
        os.close(opener)
    deadline = time.monotonic() + 10.0
    while running(engine.tier._tiers.core):
        assert time.monotonic() < deadline, "the read let go did not end within 10 s"
        time.sleep(0.005)
    engine.manager.primary_tier.shutdown()  # what vLLM would have unmapped


def test_vllms_backpressure_detector_gets_the_bytes_each_store_wrote(tmp_path: Path) -> None:
    seen: list[int] = []
    backpressure = {"backpressure_cls": "EMABackpressureDetector"}
    entries = [
        tier_entry(_disk(tmp_path / "every"), backpressure=backpressure),
        # The second offer of a chunk is written: the first writes nothing.
        tier_entry(_disk(tmp_path / "second", admission="frequency"), backpressure=backpressure),
    ]
    engine = Engine(entries)
    try:
        for index, tier in enumerate(engine.tiers):
            detector = tier.bp_detector
            assert detector is not None

            def spy(elapsed: float, num_bytes: int, index: int = index) -> None:
                seen.append(index * 1_000_000 + num_bytes)

            setattr(detector, "on_store_completed", spy)  # noqa: B010 (a spy)
        engine.store(keys_of("b0", "b1", "b2"), random_rows(3, ROW, seed=8))
        assert seen == [3 * ROW]  # the second tier wrote nothing: no sample
    finally:
        engine.close()


# --- bad input ------------------------------------------------------------------------------


def _entry(**keys: Any) -> dict[str, Any]:
    entry = tier_entry({"path": "/unused", "capacity": "1MiB"})
    entry.update(keys)
    return {k: v for k, v in entry.items() if v is not None}


# --- load or recompute -------------------------------------------------------------------


def _tier_stats(tier: AsyncOffloadTier) -> Any:
    (stats,) = tier.tier_stats()
    return stats


@pytest.mark.parametrize("rate", [16_000.0, None])
def test_a_tier_slower_than_recomputing_answers_misses_then_is_probed(
    tmp_path: Path, rate: float | None
) -> None:
    """With vLLM's prefill rate configured (16,000 tokens/s: a 16-token chunk is 1 ms to
    recompute), a tier measured at 0.3 s a read answers the chunks it holds as misses
    (counted, no read), and is read again, once, after ``load_probe_every_s``. Without
    a rate every chunk it holds is loaded, however slow."""
    entry = tier_entry(
        _disk(tmp_path / "disk"),
        recompute_tokens_per_s=rate,
        load_deadline_floor_s=5.0,  # the slow reads end in time: measured, not failed
        load_probe_every_s=3.0,  # round 2 comes well within it, on a busy machine too
    )
    engine = Engine([{k: v for k, v in entry.items() if v is not None}])
    try:
        tier = engine.tier
        keys = keys_of("c0", "c1", "c2", "c3")
        engine.store(keys, random_rows(4, ROW, seed=11))
        engine.forget_primary()
        (store,) = tier.stores
        assert isinstance(store, DiskStore)
        store.pool.set_delay(0.3)
        # Nothing measured yet: taken (and measured: 0.3 s).
        answers, _ = engine.promote(keys[:2])
        assert answers == [LookupResult.HIT] * 2
        engine.settle("the slow reads")
        read = _tier_stats(tier).blocks_read
        assert read == 2
        answers, _ = engine.promote(keys[2:])
        engine.settle("the second round")
        if rate is None:
            assert answers == [LookupResult.HIT] * 2
            assert _tier_stats(tier).recomputed_by_choice == 0
            return
        assert answers == [LookupResult.MISS] * 2
        stats = _tier_stats(tier)
        assert (stats.recomputed_by_choice, stats.blocks_read) == (2, read)
        data = tier.get_stats().data["data"]  # type: ignore[union-attr]
        assert data[_OURS + "recomputed_by_choice"][(tier.name,)] == 2
        assert data[_OURS + "loaded"][(tier.name,)] == 2
        # A probe, once its interval passed: one chunk read (measured), the next declined.
        store.pool.set_delay(0)
        time.sleep(3.05)
        answers, _ = engine.promote(keys[2:])
        engine.settle("the probe")
        assert answers == [LookupResult.HIT, LookupResult.MISS]
        stats = _tier_stats(tier)
        assert (stats.recomputed_by_choice, stats.blocks_read) == (3, read + 1)
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        (_entry(tier=None), r"\['tier'\]: missing"),
        (_entry(tier={"path": "/x", "capacity": "1MiB", "capcity": 1}), r"\['tier.capcity'\]"),
        (_entry(tier={"kind": "nvme", "path": "/x"}), r"\['tier'\]: unknown tier kind 'nvme'"),
        (_entry(tenat="a"), r"\['tenat'\]: unknown key"),
        (_entry(recompute_tokens_per_s=0), r"\['recompute_tokens_per_s'\]: .*greater than 0"),
        (_entry(load_probe_every_s=-1.0), r"\['load_probe_every_s'\]"),
        (_entry(load_deadline_factor=1000), r"\['load_deadline_factor'\]"),
    ],
)
def test_a_bad_entry_is_one_error_at_start_up_naming_the_setting(
    entry: dict[str, Any], named: str
) -> None:
    config = offloading_config([entry])
    spec = TieringOffloadingSpec(config)
    with pytest.raises(ValueError, match=r"secondary_tiers\[AsyncOffloadTier\]" + named):
        spec.get_manager()
    assert not os.path.exists(f"/dev/shm/vllm_offload_{config.engine_id}.mmap")


def test_an_unwritable_path_is_one_error_at_start_up_naming_the_setting(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    config = offloading_config([tier_entry(_disk(tmp_path / "a-file" / "kv"))])
    spec = TieringOffloadingSpec(config)
    with pytest.raises(OSError, match=r"secondary_tiers\[AsyncOffloadTier\]\['tier.path'\]") as exc:
        spec.get_manager()  # the OSError of the path, the setting named
    assert "a-file" in str(exc.value)
    assert not os.path.exists(f"/dev/shm/vllm_offload_{config.engine_id}.mmap")
