"""What both drivers of the tier core do with the tiers' ports, written once.

A port is a tier's I/O object (``DiskTier``'s store, ``RemoteTier``'s, ...): it reads,
writes, deletes and answers questions, and holds no rule. The core
(:mod:`asyncoffload.tiers.core`) decides; a driver carries its requests to the ports
with the helpers here and hands the results back:

- :func:`open_tiers` opens a list of tier settings (every one closed again if one
  fails), :func:`close_tiers` closes them;
- :func:`tier_states` gives the core its view of each port: a description and an index
  built from the port's ``index_spec`` (the core owns it from then on);
- :func:`submit` hands a read or write to its port (a submission that raises becomes a
  failed job), :func:`outcome` reads an ended job back as the core takes it,
  :func:`delete` has the port release what evicted or dropped keys held (a files-mode
  disk tier removes their files on its lanes: a job that the driver watches like a
  write's, whose outcome goes to ``core.delete_done``; nothing runs on the driver's
  thread), and :func:`reap` tells the core which jobs given up on really ended.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol, cast

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.quotas import resolve_quotas
from asyncoffload.tiers.base import LowerTier, new_index, outcomes
from asyncoffload.tiers.core import (
    Backpressure,
    Delete,
    Outcome,
    TierHierarchy,
    TierIo,
    TierState,
    WritePressure,
)
from asyncoffload.tiers.format import Namespace
from asyncoffload.transfer.base import CopyJob, FailedJob, HostRegion

__all__ = [
    "SharedTier",
    "close_tiers",
    "delete",
    "job_ended",
    "open_tiers",
    "outcome",
    "reap",
    "running",
    "shared",
    "submit",
    "tier_states",
]

log = logging.getLogger("asyncoffload")


class SharedTier(Protocol):
    """A port that answers which blocks it holds (a shared server)."""

    async def exists(self, keys: Sequence[OffloadKey]) -> list[bool]: ...


def shared(store: LowerTier) -> SharedTier:
    """``store`` as a shared tier (``TierState.shared`` says it is one)."""
    if not callable(getattr(store, "exists", None)):
        raise TypeError(f"tier {store.name} answers no questions")
    return cast(SharedTier, store)


class TierSettings(Protocol):
    """A tier's settings (``DiskTier``, ``RemoteTier``, ``MooncakeTier``)."""

    @property
    def kind(self) -> str: ...

    def open(self, namespace: Namespace, name: str) -> LowerTier: ...


def open_tiers(
    settings: Sequence[TierSettings],
    namespace: Namespace,
    regions: Sequence[HostRegion] | None = None,
    cpu_blocks: int | None = None,
) -> list[LowerTier]:
    """Open ``settings`` for ``namespace``, highest first, each named ``<kind><i>``, and
    give each the host slots' ``regions`` (if known now); if one fails, every tier
    opened so far is closed again and the error raised. With ``cpu_blocks``, warns of a
    tier no larger than the one above it."""
    stores: list[LowerTier] = []
    try:
        for i, tier in enumerate(settings):
            store = tier.open(namespace, f"{tier.kind}{i}")
            stores.append(store)
            if regions is not None:
                store.attach_host(regions)
    except BaseException:
        close_tiers(stores)
        raise
    if cpu_blocks is not None:
        above = cpu_blocks
        for store in stores:
            blocks = store.index_spec.num_blocks
            if blocks <= above:
                log.warning(
                    "tier %s holds %d blocks, no more than the %d of the tier above: "
                    "tiers are inclusive (every block below is also above until "
                    "evicted there), so it adds few hits; give it more capacity",
                    store.name,
                    blocks,
                    above,
                )
            above = blocks
    return stores


def close_tiers(stores: Sequence[LowerTier]) -> None:
    """Close every tier of ``stores``; a failure is logged and the others still close."""
    for store in stores:
        try:
            store.close()
        except Exception:
            log.exception("closing tier %s failed", store.name)


def tier_states(stores: Sequence[LowerTier]) -> list[TierState]:
    """The core's view of each port: what it is, and its index (built here, the core's
    from then on), with the tenant quotas of its settings (``quotas``, in the tier's
    blocks). A quota that does not fit its tier is a ``ValueError`` naming
    ``tiers[i].quotas``, every tier closed."""
    states = []
    for i, store in enumerate(stores):
        index = new_index(store.index_spec)
        table = getattr(getattr(store, "config", None), "quotas", None)
        if table:
            n = index.num_blocks
            try:
                caps = resolve_quotas(table, n, store.block_bytes, f"tiers[{i}].quotas")
            except ValueError:
                close_tiers(stores)
                raise
            index.tenants.set_caps(caps, n)
            index.tenants.tier = store.name
        states.append(
            TierState(
                name=store.name,
                medium=store.medium,
                block_bytes=store.block_bytes,
                deadline_s=store.deadline_s,
                index=index,
                shared=callable(getattr(store, "exists", None)),
                pressure=WritePressure(Backpressure.of(getattr(store, "config", None))),
            )
        )
    return states


def submit(store: LowerTier, io: TierIo, host: Sequence[int]) -> CopyJob:
    """Hand ``io`` to its port, its CPU slots at host addresses ``host``; the job is kept
    in ``io.job``. A submission that raises becomes a failed job, so the failure takes
    the job's normal way back."""
    fn = store.submit_write if io.write else store.submit_read
    try:
        job = fn(io.keys, io.tier_slots, host)
    except Exception as exc:
        log.warning("a tier I/O submission to %s failed: %r", store.name, exc)
        job = FailedJob(len(io.keys), exc.with_traceback(None))
    io.job = job
    return job


def outcome(job: CopyJob, n: int) -> Outcome:
    """An ended job of ``n`` blocks as the core takes it back."""
    return Outcome(outcomes(job, n), getattr(job, "late", False) is True)


def job_ended(job: object) -> bool:
    """Whether every op of a job given up on really ended."""
    return bool(getattr(job, "ended", True))


def delete(store: LowerTier, req: Delete) -> CopyJob | None:
    """Hand ``req`` (keys the index let go) to its port, which releases what they hold:
    the job doing it (kept in ``req.job``; the driver watches it like a write and hands
    its outcome to ``core.delete_done``), or ``None`` when nothing runs (slab slots are
    reused, a shared tier keeps its blocks). A submission that raises becomes a failed
    job: the index has moved on either way, and the core counts and logs the failure."""
    try:
        job = store.forget(req.keys)
    except Exception as exc:
        log.warning("releasing %d blocks of tier %s failed: %r", len(req.keys), store.name, exc)
        job = FailedJob(len(req.keys), exc.with_traceback(None))
    req.job = job
    return job


def reap(core: TierHierarchy, now: float) -> int:
    """Tell ``core`` which of its jobs given up on really ended (their slots go)."""
    late = core.late
    if not late:
        return 0
    return core.reap([io for io in late if job_ended(io.job)], now)


def running(core: TierHierarchy) -> bool:
    """Whether an op of a job ``core`` gave up on may still run (touch host memory)."""
    return any(not job_ended(io.job) for io in core.late)
