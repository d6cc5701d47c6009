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
baseline: vLLM's own classes under the same tests.
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


class UpstreamManager:
    """Placeholder replaced in :func:`pytest_configure` (vLLM must be imported first)."""


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
            return getattr(self.manager, "_offers", None)

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
            self.t1, self.t2, self.b1, self.b2 = ours.t1, ours.t2, ours.b1, ours.b2
            self.cache_capacity = ours.capacity

        @property  # type: ignore[override]
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


def pytest_configure(config: pytest.Config) -> None:
    _check_offline()
    _platform()
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector as connector_module
    import vllm.v1.kv_offload.cpu.manager as manager_module

    # vLLM's tiering keeps vLLM's own CPU manager as its primary tier (it reads that
    # class's internals): imported before the replacement, it holds the original.
    import vllm.v1.kv_offload.tiering.manager  # noqa: F401
    import vllm.v1.kv_offload.tiering.spec  # noqa: F401

    from asyncoffload.integrations.vllm.connector import AsyncOffloadConnector

    global UpstreamManager
    UpstreamManager = _manager_class()  # type: ignore[misc]
    manager_module.CPUOffloadingManager = UpstreamManager  # type: ignore[misc,assignment]
    connector_module.OffloadingConnector = AsyncOffloadConnector  # type: ignore[misc]


def pytest_report_header(config: pytest.Config) -> str:
    import vllm

    return (
        f"vLLM {vllm.__version__}'s own tests against asyncoffload: CPUOffloadingManager -> "
        "AsyncOffloadManager, OffloadingConnector -> AsyncOffloadConnector"
    )
