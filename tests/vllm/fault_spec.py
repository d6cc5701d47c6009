"""``AsyncOffloadSpec`` whose workers copy under an ``ao.FaultPlan``, for tests in real vLLM.

``kv_connector_extra_config["faults"]`` (removed before ``AsyncOffloadSpec`` sees the
config) lists fault rules as JSON; each worker runs its jobs under the plan::

    "faults": [{"kind": "copy_error", "direction": "load", "nth": [1, 3, 5]},
               {"kind": "copy_error", "direction": "store", "nth": [3]}]

A rule takes ``kind`` (``copy_error`` or ``submit_error``), ``direction``, ``nth`` (job
numbers of that direction, from 1), ``rate`` and ``times``; see
:class:`asyncoffload.transfer.faults.Fault`. A faulted job fails on both copy paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingMetricMetadata, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from asyncoffload.integrations.vllm.spec import AsyncOffloadSpec
from asyncoffload.integrations.vllm.worker import AsyncOffloadWorker
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


def _without_faults(extra: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in extra.items() if k != "faults"}


class FaultyAsyncOffloadSpec(AsyncOffloadSpec):
    """``AsyncOffloadSpec`` with ``extra_config["faults"]`` injected into its worker."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return super().build_metric_definitions(_without_faults(extra_config))

    def __init__(self, config: OffloadingConfig) -> None:
        self.fault_plan = fault_plan(config.extra_config.get("faults", ()))
        plain = dataclasses.replace(config, extra_config=_without_faults(config.extra_config))
        super().__init__(plain)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        worker = super().get_worker(kv_caches)
        assert isinstance(worker, AsyncOffloadWorker)
        worker.inject_faults(self.fault_plan)
        return worker
