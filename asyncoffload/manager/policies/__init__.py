"""Cache policies, by name. ``register_policy`` adds one; ``EngineConfig.policy`` picks one."""

from __future__ import annotations

# The policy modules register their classes when imported.
from asyncoffload.manager.policies.arc import ARCPolicy
from asyncoffload.manager.policies.base import (
    CachePolicy,
    available_policies,
    get_policy_cls,
    register_policy,
)
from asyncoffload.manager.policies.lru import LRUPolicy

__all__ = [
    "ARCPolicy",
    "CachePolicy",
    "LRUPolicy",
    "available_policies",
    "get_policy_cls",
    "register_policy",
]
