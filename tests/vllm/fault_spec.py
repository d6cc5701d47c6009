"""``AsyncOffloadSpec`` whose workers copy under an ``ao.FaultPlan``, for tests in real vLLM.

``kv_connector_extra_config["faults"]`` (removed before ``AsyncOffloadSpec`` sees the
config) lists fault rules as JSON; each worker runs its jobs under the plan::

    "faults": [{"kind": "copy_error", "direction": "load", "nth": [1, 3, 5]},
               {"kind": "copy_error", "direction": "store", "nth": [3]}]

A rule takes ``kind`` (``copy_error`` or ``submit_error``), ``direction``, ``nth`` (job
numbers of that direction, from 1), ``rate`` and ``times``; see
:class:`asyncoffload.transfer.faults.Fault`. A faulted job fails on both copy paths.

``kv_connector_extra_config["tier_read_delay_file"]``: a path; each read of a disk tier
(in the scheduler) then lasts at least the seconds the file holds when the read is
submitted (a slow device, per read; a test writes the file between rounds).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from asyncoffload.integrations.vllm.spec import AsyncOffloadSpec
from asyncoffload.integrations.vllm.worker import AsyncOffloadWorker
from asyncoffload.tiers.disk import DiskStore
from asyncoffload.transfer.faults import Fault, FaultPlan

__all__ = ["FaultyAsyncOffloadSpec", "fault_plan"]

_RULE_KEYS = frozenset({"kind", "direction", "nth", "rate", "times"})


def fault_plan(rules: Sequence[Mapping[str, Any]], seed: int = 0) -> FaultPlan:
    """The plan of ``rules`` (see the module docstring); ``ValueError`` names a bad rule."""
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise ValueError(f"kv_connector_extra_config['faults'] must be a list, got {rules!r}")
    faults = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, Mapping) or "kind" not in rule:
            raise ValueError(f"faults[{i}] must be an object with a 'kind', got {rule!r}")
        unknown = set(rule) - _RULE_KEYS
        if unknown:
            raise ValueError(f"faults[{i}]: unknown keys {sorted(unknown)}")
        faults.append(
            Fault(
                kind=rule["kind"],
                rate=float(rule.get("rate", 0.0)),
                nth=frozenset(int(n) for n in rule.get("nth", ())),
                direction=rule.get("direction"),
                times=rule.get("times"),
            )
        )
    return FaultPlan(*faults, seed=seed)


_OURS = ("faults", "tier_read_delay_file")


def _without_faults(extra: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in extra.items() if k not in _OURS}


class _SlowRead:
    """A disk tier's read job that ends no sooner than ``until`` (a slow device)."""

    def __init__(self, job: Any, until: float) -> None:
        self._job = job
        self._until = until

    def query(self) -> bool:
        return time.monotonic() >= self._until and bool(self._job.query())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)


def _slow_reads(store: Any, delay_file: Path) -> None:
    """From now on each read of ``store`` lasts at least the seconds ``delay_file`` says
    when it is submitted (none while it is absent or empty)."""
    submit = store.submit_read

    def slow(*args: Any, **kw: Any) -> Any:
        job = submit(*args, **kw)
        try:
            delay = float(delay_file.read_text() or 0)
        except (OSError, ValueError):
            delay = 0.0
        return _SlowRead(job, time.monotonic() + delay) if delay > 0 else job

    store.submit_read = slow


class FaultyAsyncOffloadSpec(AsyncOffloadSpec):
    """``AsyncOffloadSpec`` with ``extra_config["faults"]`` injected into its worker."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return super().build_metric_definitions(_without_faults(extra_config))

    def __init__(self, config: OffloadingConfig) -> None:
        self.fault_plan = fault_plan(config.extra_config.get("faults", ()))
        delay_file = config.extra_config.get("tier_read_delay_file")
        self.read_delay_file = Path(delay_file) if delay_file else None
        plain = dataclasses.replace(config, extra_config=_without_faults(config.extra_config))
        super().__init__(plain)

    def get_manager(self) -> OffloadingManager:
        """The manager; with ``tier_read_delay_file``, its disk tiers' reads take at
        least the seconds that file holds when each is submitted."""
        fresh = self._manager is None
        manager = super().get_manager()
        tiers = getattr(manager, "tiers", None)
        if fresh and self.read_delay_file is not None and tiers is not None:
            for store in tiers.stores:
                if isinstance(store, DiskStore):
                    _slow_reads(store, self.read_delay_file)
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        worker = super().get_worker(kv_caches)
        assert isinstance(worker, AsyncOffloadWorker)
        worker.inject_faults(self.fault_plan)
        return worker
