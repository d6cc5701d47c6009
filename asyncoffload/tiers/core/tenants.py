"""Which tenant a lower tier's store is for: the core passes it to each tier's index,
whose quota (:mod:`asyncoffload.manager.quotas`) counts it.

A driver that stores with a request context (the engine) says the tenant in it. One
that does not (vLLM's ``complete_store``, which names only keys) leaves it to the CPU
tier, which knows the tenant of each block it holds once a lower tier has quotas
(:func:`track_tenants`)."""

from __future__ import annotations

from collections.abc import Sequence

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import NO_STORE_KEY, ReqContext
from asyncoffload.tiers.core.requests import TierState
from asyncoffload.tiers.core.types import CpuIndex

__all__ = ["by_tenant", "opted_out", "track_tenants"]


def opted_out(ctx: ReqContext | None) -> bool:
    """Whether a store's request opted out of caching (the engine checked the value)."""
    if ctx is None:
        return False
    params = ctx.kv_transfer_params
    return ctx.no_store or bool(params and params.get(NO_STORE_KEY) is True)


def track_tenants(cpu: CpuIndex, tiers: Sequence[TierState]) -> None:
    """Where a lower tier has quotas, the CPU tier remembers every block's tenant."""
    tenants = getattr(cpu, "tenants", None)
    if tenants is not None and any(getattr(t.index, "tenants", None) for t in tiers):
        tenants.track = any(t.index.tenants.caps for t in tiers)  # type: ignore[attr-defined]


def by_tenant(
    cpu: CpuIndex, keys: list[OffloadKey], ctx: ReqContext | None
) -> list[tuple[ReqContext | None, list[OffloadKey]]]:
    """``keys`` to offer a lower tier, with the context each group is offered with:
    ``ctx`` when the driver gave one, else per tenant as the CPU tier knows it."""
    tenants = getattr(cpu, "tenants", None)
    if ctx is not None or tenants is None or not tenants.track:
        return [(ctx, keys)]
    groups: dict[str | None, list[OffloadKey]] = {}
    owner = tenants.owner
    for key in keys:
        groups.setdefault(owner(key), []).append(key)
    if len(groups) == 1 and None in groups:
        return [(None, keys)]
    return [
        (None if tenant is None else ReqContext("", tenant=tenant), group)
        for tenant, group in groups.items()
    ]
