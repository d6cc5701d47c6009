"""asyncoffload: an asyncio-native KV-cache offload engine for LLM serving.

import asyncoffload as ao
engine = ao.AsyncOffloadEngine(kv_caches, ao.EngineConfig(cpu_blocks=1024))
async with engine:
    n = engine.lookup(keys, ctx)
    await (await engine.prepare_load(keys[:n], gpu_blocks[:n], ctx))
"""

from __future__ import annotations

# First: in the command line, a Ctrl-C while the package (torch) imports exits with
# "interrupted" and status 130, not a traceback (see asyncoffload._interrupt).
from asyncoffload import _interrupt

_interrupt.guard_startup()

import warnings

# torch warns at import when numpy is missing; nothing here needs numpy, so that one
# warning is noise for asyncoffload's users (the filter matches it alone).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from asyncoffload import logs as _logs
from asyncoffload._version import __version__
from asyncoffload.config import EngineConfig
from asyncoffload.engine import AsyncOffloadEngine, EngineStats, TierStats
from asyncoffload.errors import (
    AsyncOffloadError,
    BlockIdError,
    CapacityError,
    DuplicateKeyError,
    EngineClosedError,
    HostMemoryError,
    KeyNotReadyError,
    LengthMismatchError,
    PromotionError,
    TransferError,
    UnknownKeyError,
)
from asyncoffload.events import EventSubscription, Lagged, SubscriptionStats
from asyncoffload.handles import Transfer, TransferResult
from asyncoffload.histogram import HistogramSnapshot
from asyncoffload.keys import (
    BlockTokens,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    hash_token_blocks,
    keys_for_tokens,
    make_offload_key,
    tenant_key,
)
from asyncoffload.layout import KVLayout
from asyncoffload.loops import new_event_loop, run
from asyncoffload.manager import (
    CachePolicy,
    CPULoadStoreSpec,
    CPUOffloadingManager,
    LookupResult,
    ManagerStats,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    available_policies,
    register_policy,
)
from asyncoffload.manager.admission import (
    AdmissionFilter,
    available_admissions,
    register_admission,
)
from asyncoffload.manager.pins import PinStats
from asyncoffload.manager.policies.kv import KVPolicy
from asyncoffload.manager.retention import RETENTION_CLASSES, Retention
from asyncoffload.tiers.disk import DiskTier
from asyncoffload.tiers.format import Namespace
from asyncoffload.tiers.mooncake import MooncakeTier
from asyncoffload.tiers.remote import RemoteTier
from asyncoffload.transfer import (
    CopyJob,
    CpuCopyBackend,
    Fault,
    FaultPlan,
    InjectedFault,
    TransferBackend,
)

__all__ = [
    "RETENTION_CLASSES",
    "AdmissionFilter",
    "AsyncOffloadEngine",
    "AsyncOffloadError",
    "BlockIdError",
    "BlockTokens",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CachePolicy",
    "CapacityError",
    "CopyJob",
    "CpuCopyBackend",
    "DiskTier",
    "DuplicateKeyError",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "EventSubscription",
    "Fault",
    "FaultPlan",
    "HistogramSnapshot",
    "HostMemoryError",
    "InjectedFault",
    "KVLayout",
    "KVPolicy",
    "KeyNotReadyError",
    "Lagged",
    "LengthMismatchError",
    "LookupResult",
    "ManagerStats",
    "Medium",
    "MooncakeTier",
    "Namespace",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PinStats",
    "PrepareStoreOutput",
    "PromotionError",
    "RemoteTier",
    "ReqContext",
    "Retention",
    "SubscriptionStats",
    "TierStats",
    "Transfer",
    "TransferBackend",
    "TransferError",
    "TransferResult",
    "UnknownKeyError",
    "__version__",
    "available_admissions",
    "available_policies",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "hash_token_blocks",
    "keys_for_tokens",
    "make_offload_key",
    "new_event_loop",
    "register_admission",
    "register_policy",
    "run",
    "tenant_key",
]

_logs.apply_env_level()  # ASYNCOFFLOAD_LOG_LEVEL sets the package logger's level
