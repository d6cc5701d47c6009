"""The spec as vLLM builds and drives it, without starting vLLM: a hand-built
``OffloadingConfig``, vLLM's spec factory, the manager and the worker on canonical KV
caches made here (CPU tensors, as on vLLM's CPU platform)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingHistogramMetadata,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

import asyncoffload.integrations.vllm.manager as manager_module
from asyncoffload.errors import UnknownKeyError
from asyncoffload.integrations.vllm import (
    AsyncOffloadManager,
    AsyncOffloadSpec,
    AsyncOffloadWorker,
    VllmOffloadSettings,
)
from asyncoffload.integrations.vllm.versions import installed_api
from asyncoffload.manager.native import native_manager_available
from asyncoffload.transfer.paged_worker import PagedTransferError

PAGE = 2048  # bytes of one block of one layer (K or V) in the canonical tensors
LAYERS = 2


def _extra(**settings: Any) -> dict[str, Any]:
    return {
        "spec_name": "AsyncOffloadSpec",
        "spec_module_path": "asyncoffload.integrations.vllm",
        "cpu_bytes_to_use": 64 * 4 * PAGE,
        **settings,
    }


def _config(
    extra: dict[str, Any],
    *,
    bpc: int = 1,
    world_size: int = 1,
    groups: int = 1,
    events: bool = True,
    per_block: int = 2 * LAYERS * PAGE,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(
                tokens_per_block=16, layer_names=(f"g{g}.l0", f"g{g}.l1"), group_id=g
            )
            for g in range(groups)
        ),
        worker_kv_bytes_per_block=per_block,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id="engine-0",
        model=OffloadingModelConfig(name="tiny", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def _spec(**settings: Any) -> AsyncOffloadSpec:
    spec = OffloadingSpecFactory.create_spec(_config(_extra(**settings)))
    assert isinstance(spec, AsyncOffloadSpec)
    return spec


def _caches(num_blocks: int, groups: int = 1, seed: int = 0) -> CanonicalKVCaches:
    """FlashAttention-like canonical caches: per layer a K and a V tensor of
    ``(num_blocks, PAGE)`` int8, random bytes; each group has its own layers."""
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    refs: list[list[CanonicalKVCacheRef]] = []
    for _ in range(groups):
        group = []
        for _ in range(LAYERS * 2):
            data = torch.randint(-128, 128, (num_blocks, PAGE), dtype=torch.int8, generator=gen)
            tensors.append(CanonicalKVCacheTensor(tensor=data, page_size_bytes=PAGE))
            group.append(CanonicalKVCacheRef(tensor_idx=len(tensors) - 1, page_size_bytes=PAGE))
        refs.append(group)
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def _block(caches: CanonicalKVCaches, group: int, block_id: int) -> list[bytes]:
    return [
        caches.tensors[ref.tensor_idx].tensor[block_id].numpy().tobytes()
        for ref in caches.group_data_refs[group]
    ]


def _keys(*names: str, group: int = 0) -> list[OffloadKey]:
    return [make_offload_key(name.encode() * 8, group) for name in names]


def _worker(spec: AsyncOffloadSpec, caches: CanonicalKVCaches) -> AsyncOffloadWorker:
    worker = spec.get_worker(caches)
    assert isinstance(worker, AsyncOffloadWorker)
    return worker


def _finish(worker: AsyncOffloadWorker, job_ids: set[int]) -> list[Any]:
    worker.wait(job_ids)
    return [r for r in worker.get_finished() if r.job_id in job_ids]


# --- settings -------------------------------------------------------------------------


def test_factory_loads_our_spec_by_module_path() -> None:
    spec = _spec(policy="arc")
    assert spec.settings.cache_policy == "arc"
    manager = spec.get_manager()
    assert isinstance(manager, AsyncOffloadManager)
    assert manager.manager.policy_name == "arc"
    assert manager.manager.num_blocks == spec.num_chunks
    assert spec.get_manager() is manager


@pytest.mark.parametrize(
    ("world_size", "bpc", "expected"),
    [(1, 1, 64), (2, 1, 32), (1, 4, 16), (2, 2, 16)],
)
def test_cpu_bytes_are_shared_by_workers_and_chunks(
    world_size: int, bpc: int, expected: int
) -> None:
    """As vLLM's CPU spec: cpu_bytes_to_use covers every worker's copy of each chunk."""
    spec = AsyncOffloadSpec(_config(_extra(), bpc=bpc, world_size=world_size))
    assert spec.num_chunks == expected
    assert spec.chunk_bytes == bpc * 2 * LAYERS * PAGE


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"polciy": "lru"}, r"\['polciy'\]: unknown key"),
        ({"policy": "mru"}, r"\['policy'\]: unknown cache policy 'mru'; known: arc, auto, kv, lru"),
        ({"store_threshold": -1}, r"\['store_threshold'\]"),
        ({"admission": "nope"}, r"\['admission'\]: unknown admission filter 'nope'"),
        ({"cpu_bytes_to_use": 0}, r"\['cpu_bytes_to_use'\]"),
        ({"canonical_layout": True}, r"\['canonical_layout'\]: asyncoffload keeps"),
        ({"copy_engine": "gpu"}, r"\['copy_engine'\]"),
        ({"policy": "lru", "eviction_policy": "arc"}, r"\['eviction_policy'\].*contradicts"),
        ({"admission": "ghost", "store_threshold": 2}, r"either 'store_threshold' or"),
        # JSON's true is no count (it was taken as 1 byte, 1 offer, ...).
        ({"cpu_bytes_to_use": True}, r"\['cpu_bytes_to_use'\]: expected a number, got True"),
        ({"store_threshold": True}, r"\['store_threshold'\]: expected a number, got True"),
        ({"staging_bytes": False}, r"\['staging_bytes'\]: expected a number, got False"),
        (
            {"tiers": [{"path": "/kv", "capacity": "1MiB", "deadline_s": float("inf")}]},
            r"\['tiers.0.deadline_s'\]: Input should be a finite number",
        ),
        ({"tiers": [{"url": "redis://h/0", "ttl_s": 1e300}]}, r"\['tiers.0.ttl_s'\]"),
        # json.loads recursed out of Python's stack: a RecursionError, naming nothing.
        ({"tiers": "[" * 100_000}, r"\['tiers'\]: expected a JSON list of tiers: nested too"),
        ({"tiers": "[" * 100_000 + "]" * 100_000}, r"\['tiers'\]: .* nested too deeply"),
    ],
)
def test_bad_settings_name_the_key(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AsyncOffloadSpec(_config(_extra(**settings)))


def test_missing_cpu_bytes_is_named() -> None:
    extra = _extra()
    del extra["cpu_bytes_to_use"]
    with pytest.raises(ValueError, match=r"\['cpu_bytes_to_use'\]: Field required"):
        AsyncOffloadSpec(_config(extra))


def test_a_tier_too_small_for_one_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cpu_bytes_to_use'\] = 100 holds no chunk"):
        AsyncOffloadSpec(_config(_extra(cpu_bytes_to_use=100)))


def test_vllm_cpu_spec_policy_key_is_accepted() -> None:
    spec = _spec(eviction_policy="arc")
    assert spec.get_manager().manager.policy_name == "arc"  # type: ignore[attr-defined]


def test_every_registered_policy_is_accepted() -> None:
    for policy in ("lru", "arc", "kv", "s3fifo", "sieve"):
        assert VllmOffloadSettings.from_extra_config(_extra(policy=policy)).policy == policy


# --- metrics --------------------------------------------------------------------------


def test_metric_definitions_cover_what_get_stats_reports() -> None:
    spec = _spec(store_threshold=2)
    definitions = AsyncOffloadSpec.build_metric_definitions(_extra(store_threshold=2))
    assert isinstance(definitions["vllm:kv_offload_stores_skipped"], OffloadingCounterMetadata)
    assert isinstance(
        definitions["vllm:kv_offload_cpu_allocation_size"], OffloadingHistogramMetadata
    )
    assert "vllm:kv_offload_stores_skipped" not in AsyncOffloadSpec.build_metric_definitions(
        _extra()
    )
    manager = spec.get_manager()
    for req_id in ("r0", "r"):  # the second request's offer reaches the threshold
        ctx = ReqContext(req_id=req_id)
        manager.on_new_request(ctx)
        out = manager.prepare_store(_keys("a", "b"), ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    stats = manager.get_stats()
    assert isinstance(stats, OffloadingConnectorStats)
    reported = stats.data["types"]
    assert set(reported) <= set(definitions)
    values = stats.reduce()
    assert values["vllm:asyncoffload_blocks_stored"] == 2
    assert values["vllm:kv_offload_stores_skipped"] == 2
    assert values["vllm:kv_offload_cpu_allocation_size_count"] == 1
    # Counters are increments: the next report holds only what happened since.
    later = manager.get_stats()
    assert later is not None
    assert "vllm:asyncoffload_blocks_stored" not in later.reduce()


def test_usage_gauges_count_slots_held_by_transfers() -> None:
    manager = AsyncOffloadManager(4, "lru")
    ctx = ReqContext(req_id="r")
    out = manager.prepare_store(_keys("a", "b", "c"), ctx)
    assert out is not None
    manager.complete_store(_keys("a"), ctx)
    manager.prepare_load(_keys("a"), ctx)
    values = manager.get_stats().reduce()
    assert values["vllm:kv_offload_cpu_cache_write_usage_perc"] == 0.5
    assert values["vllm:kv_offload_cpu_cache_read_usage_perc"] == 0.25
    assert values["vllm:kv_offload_cpu_cache_usage_perc"] == 0.75


# --- manager through the adapter ----------------------------------------------------


def test_events_come_out_in_vllms_form_only_when_vllm_drains_them() -> None:
    on = _spec().get_manager()
    off = AsyncOffloadSpec(_config(_extra(), events=False)).get_manager()
    ctx = ReqContext(req_id="r")
    for manager in (on, off):
        out = manager.prepare_store(_keys("a", "b"), ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
    (event,) = list(on.take_events())
    assert (event.keys, event.medium, event.removed) == (_keys("a", "b"), Medium.CPU, False)
    assert list(off.take_events()) == []  # nothing kept for a stream nobody reads


def test_lookup_reports_pending_stores_and_bad_loads_raise() -> None:
    manager = _spec().get_manager()
    ctx = ReqContext(req_id="r")
    (a,) = _keys("a")
    assert manager.lookup(a, ctx) is LookupResult.MISS
    manager.prepare_store([a], ctx)
    assert manager.lookup(a, ctx) is LookupResult.HIT_PENDING
    manager.complete_store([a], ctx)
    assert manager.lookup(a, ctx) is LookupResult.HIT
    with pytest.raises(UnknownKeyError, match="is not stored"):
        manager.prepare_load(_keys("a", "z"), ctx)
    spec = manager.prepare_load([a], ctx)  # the failed call pinned nothing
    assert isinstance(spec, CPULoadStoreSpec)
    assert list(spec.block_ids) == [0]


def test_reset_cache_drops_blocks_even_with_transfers_in_flight() -> None:
    """vLLM's scheduler fences in-flight jobs and ignores their completions."""
    manager = _spec().get_manager()
    ctx = ReqContext(req_id="r")
    manager.prepare_store(_keys("a", "b"), ctx)
    manager.reset_cache()
    assert manager.lookup(_keys("a")[0], ctx) is LookupResult.MISS
    assert manager.manager.stats().free == manager.manager.num_blocks  # type: ignore[attr-defined]


VLLM = installed_api()


def test_manager_runs_on_the_c_core_where_it_can() -> None:
    available = native_manager_available()
    # vLLM 0.33+'s lru ranks a running request's blocks: the Python manager runs it.
    assert AsyncOffloadManager(4, "lru").native is (available and not VLLM.ranked_lru)
    assert AsyncOffloadManager(4, "arc").native is available
    if VLLM.ranked_lru:
        with pytest.raises(ValueError, match="request ranks"):
            AsyncOffloadManager(4, "lru", native=True)
    assert AsyncOffloadManager(4, "sieve", store_threshold=1).native is available
    assert AsyncOffloadManager(4, "kv").native is available
    assert not AsyncOffloadManager(4, "lru", native=False).native
    for python_only in (
        AsyncOffloadManager(4, "arc", store_threshold=2),
        AsyncOffloadManager(4, "lru", admission="ghost"),
        AsyncOffloadManager(4, "kv", admission="ghost"),
    ):
        assert not python_only.native
    with pytest.raises(ValueError, match="admission filter"):
        AsyncOffloadManager(4, "kv", admission="ghost", native=True)
    with pytest.raises(ValueError, match="store_threshold"):
        AsyncOffloadManager(4, "lru", store_threshold=2, native=True)


def test_native_manager_required_where_it_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(manager_module, "native_manager_available", lambda: False)
    with pytest.raises(RuntimeError, match="native manager core is unavailable"):
        AsyncOffloadManager(4, "arc", native=True)
    assert not AsyncOffloadManager(4, "lru").native


def test_native_manager_takes_vllms_keyword_names() -> None:
    manager = AsyncOffloadManager(4, "lru", native=None)
    ctx = ReqContext(req_id="r")
    a, b = _keys("a", "b")
    manager.prepare_store([a, b], req_context=ctx)
    manager.complete_store({a, b}, req_context=ctx, success=True)  # a set, as vLLM may pass
    manager.prepare_load([a], req_context=ctx)
    manager.complete_load({a}, req_context=ctx)
    assert manager.lookup(key=a, req_context=ctx) is LookupResult.HIT


# --- worker ---------------------------------------------------------------------------


@pytest.mark.parametrize("copy_engine", ["native", "threads"])
def test_store_then_load_round_trips_bytes_through_the_worker(copy_engine: str) -> None:
    spec = _spec(copy_engine=copy_engine)
    caches = _caches(num_blocks=8)
    worker = _worker(spec, caches)
    manager = spec.get_manager()
    ctx = ReqContext(req_id="r")
    keys = _keys("a", "b", "c")
    expected = [_block(caches, 0, b) for b in (1, 4, 6)]
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    assert worker.submit_store(7, GPULoadStoreSpec([1, 4, 6], [3], [0]), out.store_spec)
    (result,) = _finish(worker, {7})
    assert (result.job_id, result.success) == (7, True)
    assert result.transfer_size == 3 * LAYERS * 2 * PAGE
    manager.complete_store(keys, ctx)
    for t in caches.tensors:  # the KV blocks are reused for something else
        t.tensor.zero_()
    load = manager.prepare_load(keys, ctx)
    assert worker.submit_load(8, load, GPULoadStoreSpec([5, 2, 0], [3], [0]))
    (result,) = _finish(worker, {8})
    assert result.success
    manager.complete_load(keys, ctx)
    assert [_block(caches, 0, b) for b in (5, 2, 0)] == expected
    worker.shutdown()


def test_chunks_of_several_blocks_and_groups_land_where_vllm_puts_them() -> None:
    """blocks_per_chunk 2, two groups, the first group starting mid-chunk (block index
    1: its first chunk's first block is skipped)."""
    spec = AsyncOffloadSpec(_config(_extra(), bpc=2, groups=2))
    caches = _caches(num_blocks=10, groups=2, seed=1)
    worker = _worker(spec, caches)
    # Group 0: logical blocks 1..3 (chunks 0 and 1); group 1: logical 0..1 (chunk 0).
    src = GPULoadStoreSpec([3, 7, 8, 2, 9], group_sizes=[3, 2], block_indices=[1, 0])
    slots = CPULoadStoreSpec([5, 2, 0])  # group 0's two chunks, then group 1's
    expected = {(0, b): _block(caches, 0, b) for b in (3, 7, 8)}
    expected.update({(1, b): _block(caches, 1, b) for b in (2, 9)})
    worker.submit_store(1, src, slots)
    _finish(worker, {1})
    for t in caches.tensors:
        t.tensor.zero_()
    dst = GPULoadStoreSpec([0, 1, 4, 5, 6], group_sizes=[3, 2], block_indices=[1, 0])
    worker.submit_load(2, slots, dst)
    _finish(worker, {2})
    assert _block(caches, 0, 0) == expected[(0, 3)]
    assert _block(caches, 0, 1) == expected[(0, 7)]
    assert _block(caches, 0, 4) == expected[(0, 8)]
    assert _block(caches, 1, 5) == expected[(1, 2)]
    assert _block(caches, 1, 6) == expected[(1, 9)]
    # Host layout: slot 5 holds group 0's logical blocks 0 (skipped) and 1 (GPU 3).
    page = worker.transfers.read_slot(5)
    first_tensor_second_sub = page[PAGE : 2 * PAGE]
    assert first_tensor_second_sub == expected[(0, 3)][0]
    worker.shutdown()


def _raise(message: str) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(message)

    return fail


def test_a_failed_copy_is_retried_and_reported_done_only_once_it_landed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = _spec()
    caches = _caches(num_blocks=4)
    worker = _worker(spec, caches)
    expected = _block(caches, 0, 2)
    monkeypatch.setattr(worker.transfers.engine, "submit_primary", _raise("injected"))
    worker.submit_store(3, GPULoadStoreSpec([2], [1], [0]), CPULoadStoreSpec([1]))
    (result,) = _finish(worker, {3})
    assert result.success
    assert worker.stats().store.retries == 1
    host = worker.transfers.read_slot(1)
    assert [host[i * PAGE : (i + 1) * PAGE] for i in range(2 * LAYERS)] == expected
    worker.shutdown()


def test_a_copy_failing_on_both_paths_raises_naming_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = _spec()
    worker = _worker(spec, _caches(num_blocks=4))
    worker.report_failures = False  # as under vLLM 0.32 and 0.33's own connector
    engine = worker.transfers.engine
    monkeypatch.setattr(engine, "submit_primary", _raise("primary broke"))
    monkeypatch.setattr(engine, "submit_fallback", _raise("fallback broke"))
    with pytest.raises(
        PagedTransferError, match=r"load job 11 failed.*primary broke.*fallback broke"
    ):
        worker.submit_load(11, CPULoadStoreSpec([0]), GPULoadStoreSpec([3], [1], [0]))


def _ids(spec: Any) -> Sequence[int]:
    return [int(x) for x in spec.block_ids]


def test_manager_and_worker_agree_on_slots_across_evictions() -> None:
    """A tier of 4 chunks: later stores reuse evicted slots, and every load still reads
    the bytes its key was stored with."""
    spec = AsyncOffloadSpec(_config(_extra(cpu_bytes_to_use=4 * 2 * LAYERS * PAGE)))
    caches = _caches(num_blocks=16, seed=3)
    worker = _worker(spec, caches)
    manager = spec.get_manager()
    ctx = ReqContext(req_id="r")
    saved: dict[OffloadKey, list[bytes]] = {}
    job = 0
    for i, name in enumerate("abcdefgh"):
        (key,) = _keys(name)
        out = manager.prepare_store([key], ctx)
        assert out is not None and out.keys_to_store == [key]
        saved[key] = _block(caches, 0, i)
        worker.submit_store(job, GPULoadStoreSpec([i], [1], [0]), out.store_spec)
        _finish(worker, {job})
        manager.complete_store([key], ctx)
        job += 1
    resident = [k for k in saved if manager.lookup(k, ctx) is LookupResult.HIT]
    assert len(resident) == 4
    load = manager.prepare_load(resident, ctx)
    worker.submit_load(job, load, GPULoadStoreSpec([12, 13, 14, 15], [4], [0]))
    _finish(worker, {job})
    for key, block in zip(resident, (12, 13, 14, 15), strict=True):
        assert _block(caches, 0, block) == saved[key]
    assert sorted(_ids(load)) == [0, 1, 2, 3]


def test_expedited_loads_of_vllm_033_are_accepted() -> None:
    """vLLM 0.33 passes ``expedited=True`` for loads it waits on within the step."""
    spec = _spec()
    caches = _caches(num_blocks=4, seed=5)
    worker = _worker(spec, caches)
    expected = _block(caches, 0, 1)
    worker.submit_store(1, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([2]))
    _finish(worker, {1})
    assert worker.submit_load(2, CPULoadStoreSpec([2]), GPULoadStoreSpec([3], [1], [0]), True)
    _finish(worker, {2})
    assert _block(caches, 0, 3) == expected
    worker.shutdown()
