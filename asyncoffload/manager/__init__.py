"""Scheduler-side bookkeeping: pure Python, never imports torch, never blocks."""

from __future__ import annotations

from asyncoffload.manager.base import (
    BlockStatus,
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from asyncoffload.manager.cpu import CPUOffloadingManager, ManagerStats
from asyncoffload.manager.native import NativeManager
from asyncoffload.manager.policies import (
    CachePolicy,
    available_policies,
    get_policy_cls,
    register_policy,
)

__all__ = [
    "BlockStatus",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CachePolicy",
    "LookupResult",
    "ManagerStats",
    "Medium",
    "NativeManager",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "available_policies",
    "get_policy_cls",
    "register_policy",
]
