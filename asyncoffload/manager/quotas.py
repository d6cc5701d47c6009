"""Tenant quotas and opt-out: the rules every tier's index applies to a request's tenant.

A tier may cap each tenant (``ReqContext.tenant``; under vLLM, the request's
``cache_salt``) at a quota of its blocks. A quota is a cap, never a reservation:

- a tenant's store or promotion that would take it over its quota first evicts the
  tenant's own idle blocks, in the policy's order, never one of the call's keys nor a
  pinned one (retention classes weigh as in any eviction: :mod:`~asyncoffload.manager.pins`);
- another tenant's block is never evicted for it;
- what still does not fit is refused: the trailing keys of a store (the head of a prompt
  is worth more than its tail), a promotion whole. Refusals are counted per tenant
  (:class:`~asyncoffload.manager.base.TenantStats`), logged at most every
  ``LOG_EVERY_S`` per tier and tenant, and a store's refused keys are declined keys of
  its handle;
- a tenant below its quota takes room as any store does (the policy's victims, of any
  tenant): with quotas summing to at most the tier, a tenant's blocks are never pushed
  out by another's.

A request that opts out (``ReqContext.no_store``, or ``kv_transfer_params``
``{NO_STORE_KEY: true}``) stores nothing in any tier; its keys are counted
(``opted_out``).

A quota is written as blocks (an int), a share of the tier (``"25%"``) or bytes
(``"512MiB"``, converted with the tier's block size): :func:`resolve_quotas`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import NO_STORE_KEY, BlockStatus, TenantStats
from asyncoffload.validators import parse_bytes

__all__ = [
    "LOG_EVERY_S",
    "NO_STORE_KEY",
    "Tenancy",
    "Tenants",
    "check_quota_table",
    "no_store_param",
    "parse_quota",
    "resolve_quotas",
    "tenancy",
]

log = logging.getLogger("asyncoffload.quotas")

#: A tier logs a tenant's refusals at most this often.
LOG_EVERY_S = 10.0

#: A quota as settings take it: blocks, a share ("25%") or bytes ("512MiB").
QuotaValue = int | str
#: A parsed quota: ("blocks", n), ("share", percent) or ("bytes", n).
Quota = tuple[str, float]


class Tenancy(NamedTuple):
    """A request's tenant and whether it opted out: what a framework's own request
    context carries for us (vLLM's ``ReqContext.set_state``)."""

    tenant: str | None
    no_store: bool


_NOBODY = Tenancy(None, False)
#: What a framework's context without a ``tenant`` field answers for it.
_FOREIGN: Any = object()


def no_store_param(params: Mapping[str, Any] | None, where: str = "kv_transfer_params") -> bool:
    """Whether ``params`` (a request's ``kv_transfer_params``) opt it out of caching;
    ``ValueError`` naming the key for a value that is not a bool."""
    if not params:
        return False
    value = params.get(NO_STORE_KEY)
    if value is None or value is False:
        return False
    if value is True:
        return True
    raise ValueError(f"{where}[{NO_STORE_KEY!r}] must be true or false, got {value!r}")


def tenancy(ctx: object) -> Tenancy:
    """The tenant of a request context and whether it opted out. Ours
    (:class:`~asyncoffload.manager.base.ReqContext`) says so in ``tenant`` and
    ``no_store`` (or ``kv_transfer_params``); a framework's carries a :class:`Tenancy`
    in its state (vLLM's ``get_state``). ``ValueError`` for a bad opt-out value, ``TypeError``
    for a tenant that is not a str."""
    if ctx is None:
        return _NOBODY
    tenant = getattr(ctx, "tenant", _FOREIGN)
    if tenant is _FOREIGN:
        get_state: Callable[[type], Any] | None = getattr(ctx, "get_state", None)
        state = get_state(Tenancy) if get_state is not None else None
        return state if isinstance(state, Tenancy) else _NOBODY
    if tenant is not None and not isinstance(tenant, str):
        raise TypeError(f"ctx.tenant must be a str or None, got {type(tenant).__name__}")
    no_store = getattr(ctx, "no_store", False)
    if not isinstance(no_store, bool):
        raise TypeError(f"ctx.no_store must be a bool, got {type(no_store).__name__}")
    if not no_store:
        no_store = no_store_param(getattr(ctx, "kv_transfer_params", None))
    return Tenancy(tenant, no_store) if tenant is not None or no_store else _NOBODY


# --- settings --------------------------------------------------------------------------


def parse_quota(value: object, where: str) -> Quota:
    """One quota of a table (``where`` names it in errors): a positive int of blocks,
    a share ``"p%"`` with ``0 < p <= 100``, or a byte size (``"512MiB"``)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(
            f"{where}: a quota is a number of blocks, a share like '25%' or a size like "
            f"'512MiB', got {value!r}"
        )
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{where}: a quota must be positive, got {value} blocks")
        return ("blocks", value)
    text = value.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise ValueError(f"{where}: {value!r} is not a share; write e.g. '25%'") from None
        if not (math.isfinite(share) and 0 < share <= 100):
            raise ValueError(f"{where}: a share must be above 0% and at most 100%, got {value!r}")
        return ("share", share)
    size = parse_bytes(text, where)
    if size <= 0:
        raise ValueError(f"{where}: a quota must be positive, got {value!r}")
    return ("bytes", size)


def check_quota_table(table: object, tenants: Collection[str], where: str) -> dict[str, Quota]:
    """A quota table ``{tenant: quota}`` checked against the known ``tenants``: each
    quota well formed (:func:`parse_quota`), each tenant known. ``ValueError`` naming
    ``where`` and the entry."""
    if not isinstance(table, Mapping):
        raise ValueError(f"{where}: expected a table of {{tenant: quota}}, got {table!r}")
    out: dict[str, Quota] = {}
    for tenant, value in table.items():
        if not isinstance(tenant, str):
            raise ValueError(f"{where}: a tenant is a str, got {tenant!r}")
        if tenant not in tenants:
            known = ", ".join(map(repr, sorted(tenants))) or "none (set tenants)"
            raise ValueError(f"{where}: {tenant!r} is not a known tenant; known: {known}")
        out[tenant] = parse_quota(value, f"{where}[{tenant!r}]")
    return out


def resolve_quotas(
    table: Mapping[str, QuotaValue], num_blocks: int, block_bytes: int, where: str
) -> dict[str, int]:
    """``table``'s quotas in blocks of a tier of ``num_blocks`` blocks of
    ``block_bytes`` each. ``ValueError`` naming ``where`` for a quota larger than the
    tier or smaller than one block. ``block_bytes`` 0: not known yet, byte quotas are
    left out."""
    out: dict[str, int] = {}
    for tenant, value in table.items():
        name = f"{where}[{tenant!r}]"
        kind, amount = parse_quota(value, name)
        if kind == "bytes" and block_bytes <= 0:
            continue
        if kind == "blocks":
            blocks = int(amount)
        elif kind == "share":
            blocks = int(num_blocks * amount / 100)
        else:
            blocks = int(amount) // block_bytes
        if blocks > num_blocks:
            raise ValueError(
                f"{name}: quota {value!r} ({blocks} blocks) is larger than the tier "
                f"({num_blocks} blocks)"
            )
        if blocks < 1:
            raise ValueError(
                f"{name}: quota {value!r} is less than one block of the tier "
                f"({block_bytes} bytes; {num_blocks} blocks)"
            )
        out[tenant] = blocks
    return out


# --- the rule --------------------------------------------------------------------------


class _NotOwn(Collection[OffloadKey]):
    """The ``protected`` of an eviction that may take only ``tenant``'s blocks outside
    ``keep``: every other key counts as protected."""

    __slots__ = ("keep", "owner", "tenant")

    def __init__(self, owner: dict[OffloadKey, str], tenant: str, keep: set[OffloadKey]) -> None:
        self.owner, self.tenant, self.keep = owner, tenant, keep

    def __contains__(self, key: object) -> bool:
        return self.owner.get(key) != self.tenant or key in self.keep  # type: ignore[call-overload]

    def __iter__(self) -> Iterator[OffloadKey]:  # pragma: no cover - policies only test membership
        return iter(self.keep)

    def __len__(self) -> int:  # pragma: no cover
        return len(self.keep)


#: Evicts victims from a manager's slots (its bookkeeping, events): the manager's own.
Evict = Callable[[list[tuple[OffloadKey, BlockStatus]]], list[OffloadKey]]


class _Policy(Protocol):
    def get(self, key: OffloadKey) -> BlockStatus | None: ...
    def remove(self, key: OffloadKey) -> None: ...
    def insert_many(self, items: list[tuple[OffloadKey, BlockStatus]]) -> None: ...
    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None: ...


class _Pins(Protocol):
    """The tier's retention pins (:class:`~asyncoffload.manager.pins.PinTable`), which
    choose a tenant's own victims: never a pinned block, low classes first."""

    def evict_among(
        self,
        policy: _Policy,
        n: int,
        guard: Collection[OffloadKey],
        among: Callable[[], Iterable[OffloadKey]],
        partial: bool,
    ) -> list[tuple[OffloadKey, BlockStatus]] | None: ...


class Tenants:
    """One tier's tenants: each capped tenant's quota, which keys each holds, refusals
    and opt-outs. A tier tracks the keys of tenants with a quota here, and those of
    every tenant once ``track`` is set (a lower tier has quotas and learns each block's
    tenant from here: :meth:`owner`)."""

    def __init__(self, policy: _Policy, evict: Evict, pins: _Pins, tier: str = "CPU") -> None:
        self._policy = policy
        self._evict = evict
        self._pins = pins
        #: The tier's name in log lines.
        self.tier = tier
        self.caps: dict[str, int] = {}
        self.track = False
        self._owner: dict[OffloadKey, str] = {}
        self._held: dict[str, int] = {}
        self._refused: dict[str, int] = {}
        self._evicted: dict[str, int] = {}
        self._opted: dict[str, int] = {}
        self.refused = 0
        self.opted_out = 0
        self._logged: dict[str, float] = {}

    def set_caps(self, caps: Mapping[str, int], num_blocks: int) -> None:
        """Cap each tenant of ``caps`` at that many blocks (``ValueError``, changing
        nothing, for a quota outside ``[1, num_blocks]``), before the tier holds a
        tenant's block (blocks of no tenant, found at open, may be there)."""
        for tenant, cap in caps.items():
            if not isinstance(tenant, str):
                raise TypeError(f"quotas: a tenant is a str, got {tenant!r}")
            if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= num_blocks:
                raise ValueError(
                    f"quotas[{tenant!r}]: {cap!r} is not a quota of 1 to {num_blocks} blocks "
                    f"(the tier's size)"
                )
        if self._owner:
            raise RuntimeError("quotas are set before the tier holds a tenant's block")
        self.caps = dict(caps)

    def owner(self, key: OffloadKey) -> str | None:
        """The tenant whose store brought ``key`` here (tracked tenants only)."""
        return self._owner.get(key)

    # -- stores and promotions ----------------------------------------------------------

    def admit(
        self,
        who: Tenancy,
        to_store: list[OffloadKey],
        keys: Sequence[OffloadKey],
    ) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """The part of ``to_store`` (a store's keys that admission took; ``keys``: all
        of the call's, never evicted) that ``who`` may store: nothing when it opted out,
        else what fits its quota once its own idle blocks made room (the head); and the
        keys evicted for it (their removed event is out)."""
        if who.no_store:
            self._opted_out(who.tenant, len(to_store))
            return [], []
        tenant = who.tenant
        cap = self.caps.get(tenant) if tenant is not None else None
        if cap is None or not to_store:
            return to_store, []
        room = cap - self._held.get(tenant, 0)  # type: ignore[arg-type]
        n = len(to_store)
        evicted: list[OffloadKey] = []
        if n > room:
            assert tenant is not None
            evicted = self._evict_own(tenant, min(n, cap) - room, keys, whole=False)
            room += len(evicted)
            if n > room:
                self._refuse(tenant, n - max(room, 0), cap)
                return to_store[: max(room, 0)], evicted
        return to_store, evicted

    def promotion(
        self, ctx: object, n: int, keep: Sequence[OffloadKey]
    ) -> tuple[Tenancy, list[OffloadKey] | None]:
        """A promotion of ``n`` blocks for ``ctx``'s request: its tenancy, and
        :meth:`admit_all`'s answer (``[]`` for a tenant without a quota)."""
        who = tenancy(ctx)
        return who, (self.admit_all(who, n, keep) if who.tenant in self.caps else [])

    def admit_all(
        self,
        who: Tenancy,
        n: int,
        keep: Sequence[OffloadKey],
    ) -> list[OffloadKey] | None:
        """Whether ``n`` more blocks of ``who`` fit its quota, all or none (a
        promotion), once its own idle blocks outside ``keep`` made room: the keys
        evicted for it, or ``None`` (a refusal, counted; the evictions stand)."""
        tenant = who.tenant
        cap = self.caps.get(tenant) if tenant is not None else None
        if cap is None:
            return []
        assert tenant is not None
        room = cap - self._held.get(tenant, 0)
        evicted: list[OffloadKey] = []
        if n > room:
            if n <= cap:
                evicted = self._evict_own(tenant, n - room, keep, whole=True)
            if n > room + len(evicted):
                self._refuse(tenant, n, cap)
                return None
        return evicted

    def _evict_own(
        self, tenant: str, need: int, keep: Sequence[OffloadKey], whole: bool
    ) -> list[OffloadKey]:
        """Evict ``need`` of ``tenant``'s idle, unpinned blocks outside ``keep``, in the
        order of their retention class and then the policy's, or as many as there are
        (``whole``: all or none); the keys evicted."""
        if need <= 0:
            return []
        owner = self._owner
        victims = self._pins.evict_among(
            self._policy,
            need,
            _NotOwn(owner, tenant, set(keep)),
            # Fewer idle blocks of its own than it needs: a scan of the tier's tracked
            # keys counts those there are (only on this path).
            lambda: [key for key, who in owner.items() if who == tenant],
            partial=not whole,
        )
        if not victims:
            return []
        self._evicted[tenant] = self._evicted.get(tenant, 0) + len(victims)
        return self._evict(victims)

    def _refuse(self, tenant: str, n: int, cap: int) -> None:
        self.refused += n
        total = self._refused[tenant] = self._refused.get(tenant, 0) + n
        now = time.monotonic()
        last = self._logged.get(tenant)
        if last is None or now - last >= LOG_EVERY_S:
            self._logged[tenant] = now
            log.warning(
                "tenant %r: %d blocks refused in tier %s, over its quota of %d blocks "
                "(%d refused so far)",
                tenant,
                n,
                self.tier,
                cap,
                total,
            )

    def _opted_out(self, tenant: str | None, n: int) -> None:
        self.opted_out += n
        if tenant is not None and tenant in self.caps:
            self._opted[tenant] = self._opted.get(tenant, 0) + n

    # -- what the tier holds ------------------------------------------------------------

    def added(self, keys: Sequence[OffloadKey], who: Tenancy) -> None:
        """``keys`` (absent until now) take slots for ``who``."""
        tenant = who.tenant
        if tenant is None or not keys or (not self.track and tenant not in self.caps):
            return
        owner = self._owner
        for key in keys:
            owner[key] = tenant
        self._held[tenant] = self._held.get(tenant, 0) + len(keys)

    def removed(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` left the tier (evicted, dropped, failed)."""
        owner = self._owner
        if not owner:
            return
        held = self._held
        for key in keys:
            tenant = owner.pop(key, None)
            if tenant is not None:
                left = held[tenant] - 1
                if left or tenant in self.caps:
                    held[tenant] = left
                else:
                    del held[tenant]

    def clear(self) -> None:
        """The tier dropped every block (counters stay)."""
        self._owner.clear()
        self._held.clear()

    def totals(self) -> dict[str, Any]:
        """The tier's ``ManagerStats`` fields of tenants."""
        return {"quota_refused": self.refused, "opted_out": self.opted_out, "tenants": self.stats()}

    def stats(self) -> tuple[TenantStats, ...]:
        return tuple(
            TenantStats(
                tenant=tenant,
                quota=cap,
                held=self._held.get(tenant, 0),
                refused=self._refused.get(tenant, 0),
                evicted=self._evicted.get(tenant, 0),
                opted_out=self._opted.get(tenant, 0),
            )
            for tenant, cap in sorted(self.caps.items())
        )
