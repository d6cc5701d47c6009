"""The sans-I/O tier core: the indices of the tiers below the CPU tier and every rule
of them (:class:`TierHierarchy`), the plain requests it hands out and the types of its
results. It imports no I/O module (asyncio, time, os, threads, sockets, the backends,
the transfer stack): import-linter holds it to that, indirect imports included."""

from asyncoffload.tiers.core.backpressure import Backpressure, WritePressure
from asyncoffload.tiers.core.cost import CostedHierarchy, CostModel, ReadModel, RecomputeModel
from asyncoffload.tiers.core.hierarchy import MAX_BATCH, REAP_S, STALL_GRACE_S, TierHierarchy
from asyncoffload.tiers.core.requests import (
    Delete,
    Exists,
    Promotion,
    Request,
    TierIo,
    TierState,
)
from asyncoffload.tiers.core.shared import MISS_KEYS, MISS_TTL_S, Questions
from asyncoffload.tiers.core.types import (
    MAX_KEY_BYTES,
    CpuIndex,
    IndexSpec,
    Outcome,
    TierCounters,
    TierIndex,
    TierStats,
    count_failures,
    failure_cause,
    results_of,
)

__all__ = [
    "MAX_BATCH",
    "MAX_KEY_BYTES",
    "MISS_KEYS",
    "MISS_TTL_S",
    "REAP_S",
    "STALL_GRACE_S",
    "Backpressure",
    "CostModel",
    "CostedHierarchy",
    "CpuIndex",
    "Delete",
    "Exists",
    "IndexSpec",
    "Outcome",
    "Promotion",
    "Questions",
    "ReadModel",
    "RecomputeModel",
    "Request",
    "TierCounters",
    "TierHierarchy",
    "TierIndex",
    "TierIo",
    "TierState",
    "TierStats",
    "WritePressure",
    "count_failures",
    "failure_cause",
    "results_of",
]
