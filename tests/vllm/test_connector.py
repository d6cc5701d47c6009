"""``AsyncOffloadConnector``: a failed load is recomputed, not fatal (issue 21, part 3).

Unit level: the worker side of vLLM's offloading connector (vLLM's
``OffloadingConnectorWorker`` and ours) driven by hand on canonical CPU KV caches, with
``ao.FaultPlan`` faults in our worker's copies. End to end: real vLLM on CPU with the
tiny random-weight model, every other load failing on both copy paths and one store
failing; under ``AsyncOffloadConnector`` + ``kv_load_failure_policy="recompute"`` every
request gives the baseline's greedy tokens and logprobs, and under vLLM's plain
``OffloadingConnector`` the run ends at once with an error naming the job and the cause.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadingManager,
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

import asyncoffload as ao
from asyncoffload.integrations.vllm import AsyncOffloadConnector, AsyncOffloadWorker
from asyncoffload.integrations.vllm.connector import (
    AsyncOffloadConnectorWorker,
    AsyncOffloadWorkerMetadata,
    _StoreOutcomes,
    failure_metric_definitions,
)
from asyncoffload.integrations.vllm.versions import installed_api
from asyncoffload.transfer.paged_worker import PagedTransferError
from tests.vllm.conftest import RunVLLM, baseline_rounds
from tests.vllm.fault_spec import FaultyAsyncOffloadSpec, fault_plan
from tests.vllm.harness import (
    BLOCK_SIZE,
    LOGPROB_ATOL,
    LLMRunError,
    generation_diff,
    requests_of,
)
from tests.vllm.test_spec import _config, _extra

VLLM_TIMEOUT = 900
#: The tiny model's KV per 32-token block: 4 layers x (K, V) x 2 heads x 64 x 4 bytes.
BLOCK_BYTES = 4 * 2 * 2 * 64 * BLOCK_SIZE * 4
A_BLOCKS = 6
PAGE = 256
NUM_BLOCKS = 8


# --- the worker side, by hand -----------------------------------------------------------


def _caches(seed: int) -> CanonicalKVCaches:
    """Two layers' K and V tensors of ``(NUM_BLOCKS, PAGE)`` random bytes, one group."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(
            tensor=torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen),
            page_size_bytes=PAGE,
        )
        for _ in range(4)
    ]
    refs = [[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(4)]]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def _block(caches: CanonicalKVCaches, block_id: int) -> list[bytes]:
    return [t.tensor[block_id].numpy().tobytes() for t in caches.tensors]


def _connector_worker(
    caches: CanonicalKVCaches,
    *,
    ours: bool = True,
    recompute: bool = True,
    per_request: bool = False,
    faults: ao.FaultPlan | None = None,
) -> OffloadingConnectorWorker:
    """vLLM's connector worker (``ours=False``) or ours over an ``AsyncOffloadSpec`` of
    16 slots, its worker registered on ``caches`` (what ``register_kv_caches`` ends in)."""
    spec = OffloadingSpecFactory.create_spec(
        _config(_extra(cpu_bytes_to_use=16 * 4 * PAGE), per_block=4 * PAGE)
    )
    # The connector worker only keeps these two until register_kv_caches, not called here.
    vllm_config = cast(VllmConfig, None)
    kv_cache_config = cast(KVCacheConfig, None)
    connector: OffloadingConnectorWorker
    if ours:
        connector = AsyncOffloadConnectorWorker(
            spec, vllm_config, kv_cache_config, recompute=recompute, per_request=per_request
        )
    else:
        connector = OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)
    connector._init_worker(caches)
    worker = connector.worker
    assert isinstance(worker, AsyncOffloadWorker)
    worker.inject_faults(faults)
    return connector


def _step(
    connector: OffloadingConnectorWorker,
    *,
    loads: dict[int, tuple[str, list[int], list[int]]] | None = None,
    stores: dict[int, tuple[str, list[int], list[int]]] | None = None,
) -> tuple[set[str], OffloadingWorkerMetadata | None]:
    """An engine step's transfers as vLLM's model runner drives them: stores queued by
    ``wait_for_save`` (``prepare_store_kv``) are submitted with the next step's loads
    (``start_kv_transfers``), then everything is waited for (bounded: the CPU copies
    end within the call) and collected.
    ``loads``/``stores``: job id -> (request id, slot ids, GPU block ids)."""
    load_jobs = {
        job_id: TransferJob(req, CPULoadStoreSpec(slots), GPULoadStoreSpec(gpu, [len(gpu)], [0]))
        for job_id, (req, slots, gpu) in (loads or {}).items()
    }
    store_jobs = {
        job_id: TransferJob(req, GPULoadStoreSpec(gpu, [len(gpu)], [0]), CPULoadStoreSpec(slots))
        for job_id, (req, slots, gpu) in (stores or {}).items()
    }
    if store_jobs:
        connector.prepare_store_kv(OffloadingConnectorMetadata(load_jobs={}, store_jobs=store_jobs))
    connector.start_kv_transfers(OffloadingConnectorMetadata(load_jobs=load_jobs, store_jobs={}))
    assert connector.worker is not None
    connector.worker.wait(set(load_jobs) | set(store_jobs))
    _, recving = connector.get_finished(set())
    return recving, connector.build_connector_worker_meta()


def test_the_connector_is_exported_lazily_and_loads_by_module_path() -> None:
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    module = importlib.import_module("asyncoffload.integrations.vllm")
    assert "AsyncOffloadConnector" in module.__all__
    config = type(
        "Cfg",
        (),
        {"kv_connector": "AsyncOffloadConnector", "kv_connector_module_path": module.__name__},
    )()
    assert KVConnectorFactory.get_connector_class(cast(Any, config)) is AsyncOffloadConnector


def test_a_failed_load_is_reported_with_its_blocks_instead_of_killing_the_worker() -> None:
    """The defect: under vLLM's connector a load failing on both copy paths raises out of
    the worker (see the next test); under ours the request is released, its GPU blocks
    go to vLLM for recomputation and the job is marked failed for the scheduler."""
    caches = _caches(seed=1)
    faults = ao.FaultPlan(ao.Fault.copy_error(nth=2, direction="load"))
    connector = _connector_worker(caches, faults=faults)
    assert isinstance(connector, AsyncOffloadConnectorWorker)
    # Store blocks 1 and 2 into slots 0 and 1, then load them back into blocks 5 and 6.
    stored = [_block(caches, 1), _block(caches, 2)]
    recving, meta = _step(connector, stores={1: ("r0", [0, 1], [1, 2])})
    assert recving == set()
    assert isinstance(meta, AsyncOffloadWorkerMetadata)
    assert (meta.completed_jobs, meta.failed_stores, meta.failed_loads) == ({1: 1}, set(), {})

    recving, meta = _step(connector, loads={2: ("r1", [0, 1], [5, 6])})
    assert recving == {"r1"} and connector.take_block_ids_with_load_errors() == set()
    assert [_block(caches, 5), _block(caches, 6)] == stored
    before = [_block(caches, 3), _block(caches, 4)]

    recving, meta = _step(connector, loads={3: ("r2", [0, 1], [4, 3])})  # load #2: faulted
    assert recving == {"r2"}  # released from the transfer wait all the same
    assert connector.take_block_ids_with_load_errors() == {3, 4}
    assert connector.take_block_ids_with_load_errors() == set()  # reported once
    assert isinstance(meta, AsyncOffloadWorkerMetadata)
    assert (meta.completed_jobs, meta.failed_loads) == ({3: 1}, {3: 2})
    assert [_block(caches, 3), _block(caches, 4)] == before  # nothing was copied
    assert (connector.load_jobs_failed, connector.load_blocks_failed) == (1, 2)
    worker = connector.worker
    assert isinstance(worker, AsyncOffloadWorker)
    assert worker.stats().load.failures == 1
    assert worker.pop_failure(3) is None  # the connector took the cause for its log
    assert faults.fired["copy_error"] == 1
    connector.shutdown()


def test_under_vllms_connector_a_failed_load_raises_naming_job_blocks_and_cause() -> None:
    """vLLM 0.32 and 0.33's connector cannot take a failed job: the worker raises,
    naming it. vLLM 0.34's takes it: the worker reports it, and vLLM fails the whole
    request's load (``failed_recving``)."""
    caches = _caches(seed=2)
    faults = ao.FaultPlan(ao.Fault.copy_error(nth=1, direction="load"))
    connector = _connector_worker(caches, ours=False, faults=faults)
    load = {7: TransferJob("r1", CPULoadStoreSpec([2]), GPULoadStoreSpec([5], [1], [0]))}
    connector.start_kv_transfers(OffloadingConnectorMetadata(load_jobs=load, store_jobs={}))
    if installed_api().failed_jobs:
        _, recving = connector.get_finished(set())
        assert recving == {"r1"}
        assert connector.take_failed_recving() == {"r1"}  # type: ignore[attr-defined]
        worker = connector.worker
        assert isinstance(worker, AsyncOffloadWorker)
        error = worker.pop_failure(7)
        assert error is not None and error.gpu_ids == [5]
        return
    with pytest.raises(PagedTransferError) as info:
        connector.get_finished(set())
    message = str(info.value)
    for part in ("load job 7", "GPU blocks [5]", "host slots [2]", "injected copy error"):
        assert part in message, (part, message)
    assert info.value.job_id == 7 and info.value.gpu_ids == [5]


def test_a_failed_store_is_skipped_and_counted_never_asserted() -> None:
    caches = _caches(seed=3)
    faults = ao.FaultPlan(ao.Fault.submit_error(nth=1, direction="store"))
    connector = _connector_worker(caches, faults=faults)
    assert isinstance(connector, AsyncOffloadConnectorWorker)
    recving, meta = _step(connector, stores={4: ("r0", [3], [1]), 5: ("r0", [4], [2])})
    assert recving == set()
    assert isinstance(meta, AsyncOffloadWorkerMetadata)
    assert meta.completed_jobs == {4: 1, 5: 1}
    assert (meta.failed_stores, meta.failed_loads) == ({4}, {})
    assert connector.store_jobs_failed == 1
    assert connector.take_block_ids_with_load_errors() == set()
    worker = connector.worker
    assert isinstance(worker, AsyncOffloadWorker)
    assert worker.transfers.read_slot(4)[:PAGE] == _block(caches, 2)[0]  # job 5 landed
    stats = worker.stats().store
    assert (stats.jobs, stats.failures, stats.in_flight) == (1, 1, 0)


def test_several_kv_cache_groups_report_the_failed_request_instead_of_blocks() -> None:
    caches = _caches(seed=4)
    faults = ao.FaultPlan(ao.Fault.copy_error(nth=1, direction="load"))
    connector = _connector_worker(caches, per_request=True, faults=faults)
    assert isinstance(connector, AsyncOffloadConnectorWorker)
    recving, _ = _step(connector, loads={1: ("r9", [0], [2])})
    assert recving == {"r9"}
    assert connector.take_block_ids_with_load_errors() == set()
    assert connector.take_failed_req_ids() == {"r9"}


def test_the_worker_reports_failures_only_when_asked() -> None:
    """Alone (vLLM's connector) the worker raises from submit, wait and get_finished as
    before; with ``report_failures`` every failed job comes back once from get_finished
    as ``success=False`` with its error, and wait() does not raise."""
    spec = OffloadingSpecFactory.create_spec(
        _config(_extra(cpu_bytes_to_use=16 * 4 * PAGE), per_block=4 * PAGE)
    )
    worker = spec.get_worker(_caches(seed=5))
    assert isinstance(worker, AsyncOffloadWorker)
    # vLLM 0.34's own connector takes failed jobs: the worker reports them by default.
    assert worker.report_failures is installed_api().failed_jobs
    worker.report_failures = False
    worker.inject_faults(ao.FaultPlan(ao.Fault.submit_error(nth=1), ao.Fault.copy_error(nth=2)))
    with pytest.raises(PagedTransferError, match=r"store job 1 .*injected submit error"):
        worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
    worker.submit_store(2, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([1]))
    with pytest.raises(PagedTransferError, match=r"store job 2 .*injected copy error"):
        worker.wait({2})

    worker.report_failures = True
    worker.inject_faults(ao.FaultPlan(ao.Fault.submit_error(nth=1), ao.Fault.copy_error(nth=2)))
    assert worker.submit_store(3, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
    assert worker.submit_load(4, CPULoadStoreSpec([1]), GPULoadStoreSpec([2], [1], [0]))
    worker.submit_store(5, GPULoadStoreSpec([3], [1], [0]), CPULoadStoreSpec([3]))
    worker.wait({4, 5})
    results = {r.job_id: r.success for r in worker.get_finished()}
    assert results == {3: False, 4: False, 5: True}
    assert worker.get_finished() == []
    error = worker.pop_failure(4)
    assert isinstance(error, PagedTransferError)
    assert (error.job_id, error.direction, error.gpu_ids) == (4, "load", [2])
    assert worker.pop_failure(4) is None
    worker.shutdown()


def test_worker_metadata_aggregates_failures_over_workers() -> None:
    a = AsyncOffloadWorkerMetadata(failed_loads={1: 3}, failed_stores={7})
    a.mark_completed(1)
    a.mark_completed(7)
    b = AsyncOffloadWorkerMetadata(failed_loads={1: 3, 2: 1})
    b.mark_completed(1)
    b.mark_completed(2)
    merged = a.aggregate(b)
    assert isinstance(merged, AsyncOffloadWorkerMetadata)
    assert merged.completed_jobs == {1: 2, 7: 1, 2: 1}
    assert (merged.failed_loads, merged.failed_stores) == ({1: 3, 2: 1}, {7})


def test_a_failed_stores_keys_complete_unsuccessfully() -> None:
    calls: list[tuple[list[OffloadKey], bool]] = []

    class Manager:
        def complete_store(
            self, keys: set[OffloadKey], req_context: ReqContext, success: bool = True
        ) -> None:
            calls.append((sorted(keys), success))

        def complete_load(self, keys: set[OffloadKey], req_context: ReqContext) -> None:
            calls.append((sorted(keys), True))

    a, b = cast(OffloadKey, b"a"), cast(OffloadKey, b"b")
    failed = {a}
    equal_but_other = {a}
    wrapped = _StoreOutcomes(cast(OffloadingManager, Manager()), [failed])
    ctx = cast(ReqContext, None)
    wrapped.complete_store(failed, ctx)
    wrapped.complete_store(equal_but_other, ctx)  # another job's keys: by identity
    wrapped.complete_load({b}, ctx)
    assert calls == [([a], False), ([a], True), ([b], True)]


def test_the_connector_checks_the_failure_policy() -> None:
    transfer = type("T", (), {"kv_load_failure_policy": "retry"})()
    config = cast(VllmConfig, type("V", (), {"kv_transfer_config": transfer})())
    with pytest.raises(ValueError, match=r"kv_load_failure_policy must be one of.*'retry'"):
        AsyncOffloadConnector(config, cast(Any, None), cast(KVCacheConfig, None))


def test_fault_rules_from_the_extra_config_are_checked() -> None:
    plan = fault_plan([{"kind": "copy_error", "direction": "load", "nth": [1, 3]}])
    assert plan.faults == (ao.Fault.copy_error(nth=[1, 3], direction="load"),)
    with pytest.raises(ValueError, match=r"faults\[0\]: unknown keys \['every'\]"):
        fault_plan([{"kind": "copy_error", "every": 2}])
    with pytest.raises(ValueError, match="must be a list"):
        fault_plan(cast(Any, "copy_error"))
    with pytest.raises(ValueError, match="unknown fault kind"):
        fault_plan([{"kind": "melt", "rate": 1.0}])


def test_the_paged_worker_refuses_faults_it_cannot_apply() -> None:
    spec = OffloadingSpecFactory.create_spec(
        _config(_extra(cpu_bytes_to_use=16 * 4 * PAGE), per_block=4 * PAGE)
    )
    worker = spec.get_worker(_caches(seed=6))
    assert isinstance(worker, AsyncOffloadWorker)
    with pytest.raises(ValueError, match="slot_error faults, not slow_lane"):
        worker.inject_faults(ao.FaultPlan(ao.Fault.slow_lane(0.01, rate=1.0)))
    with pytest.raises(TypeError, match="FaultPlan or None"):
        worker.transfers.inject_faults(cast(Any, [ao.Fault.copy_error(rate=1.0)]))
    assert worker.transfers.faults is None
    worker.shutdown()


def test_failure_metrics_are_counters_distinct_from_the_specs() -> None:
    ours = failure_metric_definitions()
    spec_metrics = FaultyAsyncOffloadSpec.build_metric_definitions(_extra(faults=[]))
    assert ours and not set(ours) & set(spec_metrics)
    assert all(name.startswith("vllm:asyncoffload_") for name in ours)


# --- end to end in vLLM -----------------------------------------------------------------

#: Every other load job (1st, 3rd, ...) and the third store job fail on both copy paths.
LOAD_FAULTS: list[dict[str, Any]] = [
    {"kind": "copy_error", "direction": "load", "nth": list(range(1, 200, 2))},
    {"kind": "copy_error", "direction": "store", "nth": [3]},
]


def _faulty_config(
    connector: str, policy: str | None, faults: list[dict[str, Any]] = LOAD_FAULTS
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "FaultyAsyncOffloadSpec",
            "spec_module_path": "tests.vllm.fault_spec",
            "cpu_bytes_to_use": 64 << 20,
            "policy": "lru",
            "faults": faults,
        },
    }
    if connector == "AsyncOffloadConnector":
        config["kv_connector_module_path"] = "asyncoffload.integrations.vllm"
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    return config


@pytest.mark.timeout(VLLM_TIMEOUT)
def test_failed_loads_are_recomputed_with_the_baselines_outputs(
    run_vllm: RunVLLM, reuse_baseline: dict[str, Any]
) -> None:
    """The baseline's rounds: A's 6 blocks are loaded in round 2 (load 1: fails), A's
    first 3 blocks for A changed at token 100 in round 3 (load 2: lands), A's 6 blocks
    in round 5 (load 3: fails). Both failed loads are recomputed by vLLM."""
    config = _faulty_config("AsyncOffloadConnector", "recompute")
    result = run_vllm(baseline_rounds(), name="connector-recompute", kv_transfer_config=config)

    ours = sorted(result["requests"], key=lambda r: (r["round"], int(r["index"])))
    ref = sorted(reuse_baseline["requests"], key=lambda r: (r["round"], int(r["index"])))
    assert len(ours) == len(ref)
    for mine, theirs in zip(ours, ref, strict=True):
        where = f"round {mine['round']} request {mine['index']}"
        assert mine["finish_reason"] == "length", where
        same, lp_diff = generation_diff(mine, theirs)
        assert same, f"{where}: tokens differ from the baseline"
        assert lp_diff < LOGPROB_ATOL, f"{where}: logprobs differ by {lp_diff}"
    # Load 2 landed: A changed at token 100 was served its first 3 blocks.
    assert requests_of(result, 3)[1]["num_cached_tokens"] == 3 * BLOCK_SIZE

    metrics = result["metrics"]
    assert metrics["vllm:asyncoffload_load_jobs_failed"] == 2
    assert metrics["vllm:asyncoffload_load_blocks_failed"] == 2 * A_BLOCKS
    assert metrics["vllm:asyncoffload_blocks_recomputed"] == 2 * A_BLOCKS
    assert metrics["vllm:asyncoffload_store_jobs_failed"] == 1
    assert metrics["vllm:asyncoffload_blocks_store_failed"] >= 1
    assert metrics["vllm:kv_offload_load_bytes"] == 3 * BLOCK_BYTES  # only load 2's
    log = Path(result["log_path"]).read_text(errors="replace")
    assert log.count("vLLM recomputes them (kv_load_failure_policy='recompute')") == 2
    assert "injected copy error" in log
    assert "Recovered from KV load failure" in log  # vLLM's scheduler recomputed
    for fatal in ("PagedTransferError", "EngineDeadError", "AssertionError"):
        assert fatal not in log  # no worker died


@pytest.mark.long  # vLLM's own behaviour without our connector, for contrast: `make test-long`
@pytest.mark.timeout(VLLM_TIMEOUT)
def test_without_the_connector_a_failed_load_stops_vllm_with_a_clear_error(
    run_vllm: RunVLLM,
) -> None:
    """vLLM's own OffloadingConnector asserts success: the worker raises our error,
    naming the job, its blocks and the cause, and the run ends (bounded) instead of
    hanging."""
    config = _faulty_config("OffloadingConnector", None, faults=LOAD_FAULTS[:1])
    t0 = time.monotonic()
    with pytest.raises(LLMRunError) as info:
        run_vllm(baseline_rounds(), name="plain-faulty", kv_transfer_config=config, timeout=300)
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert "timed out" not in message, message[-3000:]
    assert elapsed < 300
    assert "EngineDeadError" in message  # what vLLM's front end says
    found = re.search(r"\nlog (\S+\.log), last lines", message)
    assert found, message[-3000:]
    log = Path(found.group(1)).read_text(errors="replace")
    # The worker's error, as vLLM logs it, names the job, the blocks and the cause.
    cause = re.search(r"PagedTransferError: (load job \d+ failed \(6 GPU blocks \[.*)", log)
    assert cause, log[-3000:]
    # Both paths (cpu-native or cpu-torch, then cpu-torch) failed, with the cause.
    assert re.search(
        r"copy: InjectedFault: injected copy error .*; retry on cpu-torch: "
        r"InjectedFault: injected copy error",
        cause.group(1),
    ), cause.group(1)


@pytest.mark.timeout(VLLM_TIMEOUT)
def test_under_policy_fail_only_the_requests_needing_failed_loads_fail(
    run_vllm: RunVLLM, reuse_baseline: dict[str, Any]
) -> None:
    """``kv_load_failure_policy="fail"`` (vLLM's default) under our connector: loads 1 and
    3 fail, so A in rounds 2 and 5 finishes with ``error``; every other request, A
    changed at token 100 served by load 2 included, gives the baseline's outputs, and
    the engine keeps serving."""
    config = _faulty_config("AsyncOffloadConnector", "fail", faults=LOAD_FAULTS[:1])
    result = run_vllm(baseline_rounds(), name="connector-fail", kv_transfer_config=config)

    ours = sorted(result["requests"], key=lambda r: (r["round"], int(r["index"])))
    ref = sorted(reuse_baseline["requests"], key=lambda r: (r["round"], int(r["index"])))
    failed = [(r["round"], r["index"]) for r in ours if r["finish_reason"] == "error"]
    assert failed == [(2, 0), (5, 0)]
    for mine, theirs in zip(ours, ref, strict=True):
        if (mine["round"], mine["index"]) in failed:
            continue
        where = f"round {mine['round']} request {mine['index']}"
        assert mine["finish_reason"] == "length", where
        same, lp_diff = generation_diff(mine, theirs)
        assert same and lp_diff < LOGPROB_ATOL, where
    assert requests_of(result, 3)[1]["num_cached_tokens"] == 3 * BLOCK_SIZE
    metrics = result["metrics"]
    assert metrics["vllm:asyncoffload_load_jobs_failed"] == 2
    assert metrics.get("vllm:asyncoffload_blocks_recomputed", 0) == 0
    log = Path(result["log_path"]).read_text(errors="replace")
    assert log.count("vLLM fails the requests that need them") == 2
    assert log.count("due to KV load failure (failure_policy=fail") == 2
