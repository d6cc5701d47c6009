"""Cache policies, by name. ``register_policy`` adds one; ``EngineConfig.policy`` picks one."""

from __future__ import annotations

# The policy modules register their classes when imported.
from asyncoffload.manager.policies.adaptive import AdaptivePolicy
from asyncoffload.manager.policies.arc import ARCPolicy
from asyncoffload.manager.policies.base import (
    CachePolicy,
    RequestScope,
    available_policies,
    get_policy_cls,
    register_policy,
)
from asyncoffload.manager.policies.kv import KVPolicy
from asyncoffload.manager.policies.lru import LRUPolicy
from asyncoffload.manager.policies.lru_ranked import RankedLRUPolicy
from asyncoffload.manager.policies.s3fifo import S3FIFOPolicy
from asyncoffload.manager.policies.session import SessionPolicy
from asyncoffload.manager.policies.sieve import SIEVEPolicy

__all__ = [
    "ARCPolicy",
    "AdaptivePolicy",
    "CachePolicy",
    "KVPolicy",
    "LRUPolicy",
    "RankedLRUPolicy",
    "RequestScope",
    "S3FIFOPolicy",
    "SIEVEPolicy",
    "SessionPolicy",
    "available_policies",
    "get_policy_cls",
    "register_policy",
]
