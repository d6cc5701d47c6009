"""What the installed vLLM's offloading API asks of us, release by release (run on vLLM
0.32 here, and by `make test-vllm` on vLLM 0.33's and 0.34's modules): the version check,
sync (expedited) loads, device pointers, ``IOCompletion``\\ s, the failure channel by
block, and the events' request."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.v1.kv_offload import base as vllm_base
from vllm.v1.kv_offload.base import GPULoadStoreSpec, Medium, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

import asyncoffload as ao
from asyncoffload.integrations.vllm import AsyncOffloadManager, AsyncOffloadWorker
from asyncoffload.integrations.vllm.connector import (
    AsyncOffloadConnectorWorker,
    AsyncOffloadWorkerMetadata,
)
from asyncoffload.integrations.vllm.versions import (
    SUPPORTED,
    VllmVersionError,
    api_of,
    installed_api,
    parse_vllm_version,
)
from tests.vllm.test_connector import _block, _caches, _connector_worker, _step

VLLM = installed_api()
needs_sync_loads = pytest.mark.skipif(
    not VLLM.expedited_loads, reason=f"vLLM {VLLM.version} has no sync loads (0.33+)"
)
needs_pointers = pytest.mark.skipif(
    not VLLM.device_pointers, reason=f"vLLM {VLLM.version} gives block ids (pointers: 0.34)"
)


# --- the version check ------------------------------------------------------------------


def test_the_installed_vllm_is_supported_and_recognised() -> None:
    import vllm

    assert VLLM.version == vllm.__version__
    assert VLLM.release in SUPPORTED


@pytest.mark.parametrize(
    ("version", "release"),
    [("0.32.0", (0, 32)), ("0.32.0+cpu", (0, 32)), ("0.34.1", (0, 34)), ("v0.33.0", (0, 33))],
)
def test_versions_are_parsed(version: str, release: tuple[int, int]) -> None:
    assert parse_vllm_version(version) == release


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0", "0.35.0rc1"])
def test_an_unsupported_vllm_is_refused_naming_both_versions(version: str) -> None:
    with pytest.raises(VllmVersionError) as caught:
        api_of(version)
    message = str(caught.value)
    assert f"vLLM {version}" in message
    assert "0.32 to 0.34" in message and "0.34.0" in message


def test_a_version_that_names_no_release_is_refused() -> None:
    with pytest.raises(VllmVersionError, match="cannot tell which vLLM release 'dev'"):
        api_of("dev")


def test_what_each_release_offers() -> None:
    assert not api_of("0.32.0").expedited_loads and api_of("0.32.0").touch
    assert api_of("0.33.0").ranked_lru and not api_of("0.33.0").count_once
    v034 = api_of("0.34.0")
    assert v034.device_pointers and v034.count_once and v034.failed_jobs and not v034.touch


# --- sync (expedited) loads, and loads that fail ---------------------------------------


def _sync_load(job: int, req: str, slots: list[int], gpu: list[int]) -> OffloadingConnectorMetadata:
    entry = TransferJob(  # type: ignore[call-arg]
        req, CPULoadStoreSpec(slots), GPULoadStoreSpec(gpu, [len(gpu)], [0]), sync=True
    )
    return OffloadingConnectorMetadata(load_jobs={job: entry}, store_jobs={})


@needs_sync_loads
def test_a_sync_load_runs_on_the_expedited_lane_and_lands() -> None:
    caches = _caches(seed=11)
    connector = _connector_worker(caches)
    stored = [_block(caches, 1), _block(caches, 2)]
    _step(connector, stores={1: ("r0", [0, 1], [1, 2])})
    connector.start_kv_transfers(_sync_load(2, "r1", [0, 1], [5, 6]))  # waits within
    assert [_block(caches, 5), _block(caches, 6)] == stored
    _, recving = connector.get_finished(set())
    assert recving == set()  # a sync load's request already ran this step
    worker = connector.worker
    assert isinstance(worker, AsyncOffloadWorker)
    assert worker.stats().expedited.jobs == 1 and worker.stats().load.jobs == 0
    connector.shutdown()


@needs_sync_loads
def test_a_failed_sync_load_is_reported_by_block_and_never_raised() -> None:
    """vLLM 0.34's own connector raises for a failed sync load (its request ran on the
    unloaded KV this step). Ours reports the blocks: vLLM's scheduler then drops the
    step's output for the request and recomputes from the first failed block."""
    caches = _caches(seed=12)
    faults = ao.FaultPlan(ao.Fault.copy_error(nth=1, direction="load"))
    connector = _connector_worker(caches, faults=faults)
    assert isinstance(connector, AsyncOffloadConnectorWorker)
    _step(connector, stores={1: ("r0", [0, 1], [1, 2])})
    before = [_block(caches, 5), _block(caches, 6)]
    connector.start_kv_transfers(_sync_load(2, "r1", [0, 1], [5, 6]))
    _, recving = connector.get_finished(set())
    assert recving == set()
    assert connector.take_block_ids_with_load_errors() == {5, 6}
    assert [_block(caches, 5), _block(caches, 6)] == before
    meta = connector.build_connector_worker_meta()
    assert isinstance(meta, AsyncOffloadWorkerMetadata)
    assert meta.completed_jobs == {2: 1} and meta.failed_loads == {2: 2}
    if VLLM.failed_jobs:
        assert getattr(meta, "failed_jobs", None) == {2}
    connector.shutdown()


@needs_sync_loads
def test_under_vllms_own_connector_a_failed_sync_load_kills_the_step() -> None:
    caches = _caches(seed=13)
    faults = ao.FaultPlan(ao.Fault.copy_error(nth=1, direction="load"))
    connector = _connector_worker(caches, ours=False, faults=faults)
    with pytest.raises((RuntimeError, ao.TransferError)):  # in the step's wait, or after
        connector.start_kv_transfers(_sync_load(2, "r1", [0], [5]))
        connector.get_finished(set())


def test_a_load_failing_on_one_slot_reports_only_that_slots_blocks() -> None:
    """A damaged host slot: the load is retried slot by slot, the other slots' blocks
    land, and only the damaged slot's are reported (vLLM recomputes from the first of
    them: block 6 here, keeping block 5)."""
    caches = _caches(seed=14)
    faults = ao.FaultPlan(ao.Fault.slot_error([1], direction="load"))
    connector = _connector_worker(caches, faults=faults)
    stored = [_block(caches, b) for b in (1, 2, 3)]
    _step(connector, stores={1: ("r0", [0, 1, 2], [1, 2, 3])})
    recving, meta = _step(connector, loads={2: ("r1", [0, 1, 2], [5, 6, 7])})
    assert recving == {"r1"}
    assert isinstance(connector, AsyncOffloadConnectorWorker)
    assert connector.take_block_ids_with_load_errors() == {6}
    assert _block(caches, 5) == stored[0] and _block(caches, 7) == stored[2]
    assert isinstance(meta, AsyncOffloadWorkerMetadata) and meta.failed_loads == {2: 1}
    connector.shutdown()


# --- device pointers and completions (vLLM 0.34) -----------------------------------------


def _pointers(caches: Any, gpu: list[int]) -> Any:
    import importlib

    pointer_utils: Any = importlib.import_module("vllm.v1.kv_offload.pointer_utils")  # 0.34
    return pointer_utils.resolve_device_pointers(GPULoadStoreSpec(gpu, [len(gpu)], [0]), caches)


@needs_pointers
def test_the_worker_takes_device_pointers_and_completions_are_io_completions() -> None:
    caches = _caches(seed=15)
    connector = _connector_worker(caches)
    worker = connector.worker
    assert isinstance(worker, AsyncOffloadWorker)
    worker.submit_store(1, _pointers(caches, [1, 2]), CPULoadStoreSpec([3, 4]))
    completion = worker.completion(1)
    assert isinstance(completion, vllm_base.IOCompletion)  # type: ignore[attr-defined]
    assert completion.result(timeout=30).job_id == 1 and completion.done()
    for t, tensor in enumerate(caches.tensors):
        assert worker.transfers.read_slot(3)[t * 256 : (t + 1) * 256] == _block(caches, 1)[t]
        del tensor
    worker.submit_load(2, CPULoadStoreSpec([3, 4]), _pointers(caches, [6, 7]), expedited=True)
    worker.wait({2})
    assert [_block(caches, 6), _block(caches, 7)] == [_block(caches, 1), _block(caches, 2)]
    assert {r.job_id for r in worker.get_finished()} == {1, 2}
    connector.shutdown()


@needs_pointers
def test_a_pointer_outside_the_kv_cache_is_refused_and_nothing_copied() -> None:
    caches = _caches(seed=16)
    connector = _connector_worker(caches)
    worker = connector.worker
    assert isinstance(worker, AsyncOffloadWorker)
    pointers = _pointers(caches, [1, 2])
    pointers.ptrs = np.array(pointers.ptrs, dtype=np.uint64)
    pointers.ptrs[1] = np.uint64(4096)
    with pytest.raises(IndexError, match="at block 1 is not the start of a row"):
        worker.submit_store(1, pointers, CPULoadStoreSpec([3, 4]))
    assert worker.stats().store.in_flight == 0
    with pytest.raises(TypeError, match="expected vLLM's DevicePointers"):
        worker.submit_store(1, cast(Any, [1, 2]), CPULoadStoreSpec([3, 4]))
    connector.shutdown()


# --- events --------------------------------------------------------------------------------


def test_stored_events_carry_the_request_and_failed_stores_release_their_keys() -> None:
    manager = AsyncOffloadManager(4, "lru", enable_events=True)
    ctx = ReqContext(req_id="r")
    a, b = (vllm_base.make_offload_key(name.encode() * 4, 0) for name in "ab")
    out = manager.prepare_store([a, b], ctx)
    assert out is not None
    manager.complete_store([a], ctx)
    manager.complete_store([b], ctx, success=False)
    events = list(manager.take_events())
    stored = [e for e in events if not e.removed]
    assert [e.keys for e in stored] == [[a]] and stored[0].medium is Medium.CPU
    if VLLM.event_request:
        assert getattr(stored[0], "req_context", None) is ctx and stored[0].removal_expected
    released = [e for e in events if e.removed]
    if VLLM.metadata_only_events:
        assert [(e.keys, getattr(e, "metadata_only", None)) for e in released] == [([b], True)]
    else:
        assert released == []


# --- an unsupported vLLM at start-up ---------------------------------------------------------

_START_UP = """
import json, sys, traceback
import vllm.version
vllm.version.__version__ = sys.argv[1]  # what another vLLM would report
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
extra = {"spec_name": "AsyncOffloadSpec", "spec_module_path": "asyncoffload.integrations.vllm"}
try:
    OffloadingSpecFactory.get_spec_cls(extra)  # the first thing vLLM does with our spec
except BaseException as exc:
    frames = traceback.extract_tb(exc.__traceback__)
    print(json.dumps({"type": type(exc).__name__, "message": str(exc),
                      "raised_in": frames[-1].filename}))
"""


@pytest.mark.parametrize("version", ["0.31.0", "0.35.0"])
def test_vllm_start_up_with_an_unsupported_vllm_is_refused_by_us_by_name(version: str) -> None:
    """What vLLM does first with our spec at start-up, in every process (the front end
    for its metrics, the scheduler, each worker): find its class through the factory.
    Another vLLM release is refused there by our check, before any of its classes is
    used, with a message that names the version found and those supported."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _START_UP, version],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["type"] == "VllmVersionError"
    assert f"vLLM {version}" in report["message"] and "0.32 to 0.34" in report["message"]
    assert report["raised_in"].endswith("asyncoffload/integrations/vllm/versions.py")


def test_our_secondary_tier_is_vllm_034s_and_refused_by_name_before() -> None:
    """vLLM 0.34's tiering loads our secondary tier by module path
    (``asyncoffload.integrations.vllm.secondary``); an older vLLM has no tiering, and
    the import there is refused by name, before anything of vLLM's is used."""
    import importlib

    name = "asyncoffload.integrations.vllm.secondary"
    if VLLM.release >= (0, 34):
        module: Any = importlib.import_module(name)
        bases = [cls.__name__ for cls in module.AsyncOffloadTier.__mro__]
        assert "SecondaryTierManager" in bases
        return
    with pytest.raises(VllmVersionError, match=rf"needs vLLM 0.34.*vLLM {VLLM.version} is"):
        importlib.import_module(name)
