"""A pytest plugin that runs vLLM's own offloading tests against asyncoffload's classes.

`make test-vllm` lays out vLLM 0.34.0's source-distribution tests of the offloading API in
``.vllm-0.34/tests`` (scripts/vllm_overlay.py; nothing of them is in this repository) and
runs the ones that apply to asyncoffload's classes with this plugin loaded
(``-p upstream_plugin``):

- ``tests/v1/kv_offload/cpu/test_manager.py``: vLLM's CPU-manager tests, with
  ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` replaced by
  :class:`UpstreamManager` (our :class:`AsyncOffloadManager` behind vLLM's constructor);
- ``tests/v1/kv_connector/unit/offloading_connector/``: vLLM's connector tests, with
  ``OffloadingConnector`` replaced by our :class:`AsyncOffloadConnector` (the connector
  vLLM builds by the name ``OffloadingConnector`` is then ours).

The replacement happens before the test modules import vLLM's names. Which tests fail,
and why, is in docs/vllm.md ("vLLM's own tests").

vLLM's connector tests build a ``ModelConfig`` of ``facebook/opt-125m``, which asks the
Hugging Face hub for its ``config.json``. No test here may use the network: they run with
the hub offline, on a cache holding only a config of that shape (written by the overlay
script, not downloaded). ``upstream_hub`` (the same without any class replaced) gives the
baseline: vLLM's own classes under the same tests (``--vllm-own``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from asyncoffload.manager.policies.arc import ARCPolicy


def _check_offline() -> None:
    """vLLM's connector tests build a ``ModelConfig`` of ``facebook/opt-125m``, which
    asks the Hugging Face hub for its config: run offline, from the cache the overlay
    script writes (scripts/vllm_upstream.sh sets both), never from the network."""
    if os.environ.get("HF_HUB_OFFLINE") != "1" or not os.environ.get("HF_HOME"):
        raise pytest.UsageError(
            "vLLM's tests run offline: set HF_HUB_OFFLINE=1 and HF_HOME to the overlay's "
            "hf/ folder (scripts/vllm_upstream.sh does)"
        )


def _platform() -> None:
    """vLLM's CUDA build on a machine without a GPU finds no platform
    (``UnspecifiedPlatform``: no device, no hybrid KV cache manager), and its CPU platform
    needs triton-cpu. The offloading tests run on vLLM's CI with CUDA: the platform gets
    the two things of CUDA's that they use, the ``cpu`` device for the tensors the
    worker-side tests make, and the hybrid KV cache manager their scheduler configs ask
    for. Nothing here runs a kernel."""
    from vllm.platforms import current_platform

    if type(current_platform).__name__ == "UnspecifiedPlatform":
        current_platform.device_type = "cpu"
        current_platform.support_hybrid_kv_cache = lambda: True  # type: ignore[method-assign]


def _manager_class() -> type:
    from asyncoffload.integrations.vllm.manager import AsyncOffloadManager

    class UpstreamManager(AsyncOffloadManager):
        """Our manager behind vLLM 0.34's ``CPUOffloadingManager`` constructor."""

        def __init__(
            self,
            num_chunks: int,
            cache_policy: str = "lru",
            cache_policy_module_path: str | None = None,
            enable_events: bool = False,
            store_threshold: int = 1,
            max_tracker_size: int = 64_000,
            info: Any = None,
        ) -> None:
            if cache_policy_module_path is not None:
                raise ValueError(
                    "asyncoffload runs its own policies; an out-of-tree vLLM CachePolicy "
                    f"({cache_policy_module_path}) is not one of them"
                )
            super().__init__(
                num_chunks,
                cache_policy,
                enable_events=enable_events,
                store_threshold=store_threshold,
                max_tracker_size=max_tracker_size,
                # ARC on the Python manager, whose state vLLM's ARC tests read (the C
                # core decides alike, call for call: tests/test_mgrcore.py).
                native=False if cache_policy == "arc" else None,
            )

        # vLLM's tests read some of its manager's state by its private names. Where ours
        # keeps the same state under other names, these read it (they change nothing).

        @property
        def _policy(self) -> Any:
            policy = getattr(self.manager, "policy", None)
            if isinstance(policy, ARCPolicy):
                return _arc_view(policy)
            return policy

        @property
        def counts(self) -> Any:
            """vLLM's offer counts of keys not stored yet (store_threshold >= 2)."""
            offers = getattr(self.manager, "_offers", None)
            return None if offers is None else offers.counts

        @property
        def stores_skipped_in_current_batch(self) -> int:
            return int(self.manager.stats().store_skipped - self._reported.store_skipped)

        @property
        def _num_evictable_cache_chunks(self) -> int:
            stats = self.manager.stats()
            return int(stats.ready - stats.pinned)

    return UpstreamManager


def _arc_view(policy: ARCPolicy) -> Any:
    """Our ARC policy under vLLM's names, as an instance of vLLM's ``ARCCachePolicy``
    (its tests check the type): the same four lists (T1 and T2 map keys to our block
    records, ``block_id`` and ``ref_cnt``), ``target_t1_size``, ``cache_capacity``;
    ``evict`` is ours. None of vLLM's ARC code runs: every method it has is ours."""
    from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy

    class ARCView(ARCCachePolicy):
        def __init__(self, ours: ARCPolicy) -> None:  # vLLM's __init__ is not run
            self._ours = ours
            lists: Any = (ours.t1, ours.t2, ours.b1, ours.b2)
            self.t1, self.t2, self.b1, self.b2 = lists
            self.cache_capacity = ours.capacity

        @property
        def target_t1_size(self) -> float:
            return self._ours.target_t1

        @target_t1_size.setter
        def target_t1_size(self, value: float) -> None:
            self._ours.target_t1 = value

        def evict(self, n: int, protected: set[Any]) -> Any:
            return self._ours.evict(n, protected)

        def get(self, key: Any) -> Any:
            return self._ours.get(key)

    return ARCView(policy)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--vllm-own",
        action="store_true",
        help="the baseline: vLLM's own classes under the same tests (nothing replaced)",
    )


def pytest_configure(config: pytest.Config) -> None:
    _check_offline()
    _platform()
    if config.getoption("--vllm-own"):
        return
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector as connector_module
    import vllm.v1.kv_offload.cpu.manager as manager_module

    # vLLM's tiering keeps vLLM's own CPU manager as its primary tier (it reads that
    # class's internals): imported before the replacement, it holds the original.
    import vllm.v1.kv_offload.tiering.manager
    import vllm.v1.kv_offload.tiering.spec  # noqa: F401

    from asyncoffload.integrations.vllm.connector import AsyncOffloadConnector

    setattr(manager_module, "CPUOffloadingManager", _manager_class())  # noqa: B010
    setattr(connector_module, "OffloadingConnector", AsyncOffloadConnector)  # noqa: B010


#: vLLM 0.34's tests that fail against ours, each for a reason that is vLLM's
#: implementation, not the contract: strict xfails, so one that starts to pass fails the
#: run until it leaves this list (docs/vllm.md, "vLLM's own tests").
_MANAGER = "tests/v1/kv_offload/cpu/test_manager.py::"
KNOWN_FAILURES: dict[str, str] = {
    _MANAGER + "test_cpu_manager_reports_cache_usage_gauge": (
        "builds a manager of 0 chunks; ours refuses a CPU tier that holds nothing (the "
        "spec names cpu_bytes_to_use then)"
    ),
    _MANAGER + "test_cpu_manager_reports_allocation_size_on_allocation_failure": (
        "patches vLLM's private _allocate_chunks"
    ),
    _MANAGER + "test_lru_batch_eviction_failure_is_atomic": (
        "reads vLLM's LRUCachePolicy internals (its type, its heap)"
    ),
    _MANAGER + "test_lru_repeated_pin_cycles_compact_lazy_heap_entries": (
        "measures vLLM's LRU heap (its compaction), not a decision"
    ),
    _MANAGER + "TestARCPolicy::test_batch_eviction_scans_t1_and_t2_once": (
        "counts how often vLLM's ARC iterates its lists (it swaps in counting dicts)"
    ),
    _MANAGER + "TestARCPolicy::test_batch_eviction_falls_back_after_t1_iterator_exhausted": (
        "counts how often vLLM's ARC iterates its lists (it swaps in counting dicts)"
    ),
    _MANAGER + "test_request_finish_forwards_grouped_deduplicated_accesses": (
        "checks the argument types of vLLM's policy hook (tuples and the request "
        "context); ours passes the same keys as lists, with their positions"
    ),
    _MANAGER + "test_failed_store_records_access_once_and_uses_store_miss_hook": (
        "patches vLLM's private _record_request_cache_access"
    ),
    _MANAGER + "test_lru_incremental_stores_do_not_rescan_the_prefix": (
        "counts calls of ReqContext.get_offload_key_position; ours reads the positions "
        "map directly (as often: once per key, the prefix never rescanned)"
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--vllm-own"):
        return
    for item in items:
        name = item.nodeid.split("[")[0]
        reason = KNOWN_FAILURES.get(name)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=reason))


def pytest_report_header(config: pytest.Config) -> str:
    import vllm

    return (
        f"vLLM {vllm.__version__}'s own tests against asyncoffload: CPUOffloadingManager -> "
        "AsyncOffloadManager, OffloadingConnector -> AsyncOffloadConnector"
    )
