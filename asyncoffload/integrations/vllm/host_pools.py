"""The workers' host pools as vLLM's scheduler maps them, for the lower tiers' I/O.

With ``tiers`` set, each vLLM worker keeps its host slots in a
:class:`~asyncoffload.transfer.host_file.SharedHostFile` named after the engine and its
rank (:func:`host_pool_path`); the scheduler maps every rank's file, lazily, the first
time tier I/O needs it, so that the lower tiers' lanes move blocks straight between the
slots and the tier (:class:`HostPools`). A block below the CPU tier is one value holding
the same slot of every rank's pool.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

from asyncoffload.tiers.base import LowerTier
from asyncoffload.transfer.host_file import SharedHostFile

__all__ = ["HostPools", "host_pool_path"]

log = logging.getLogger("asyncoffload.vllm")

#: How often the scheduler looks for a host pool file not there yet, and after how long
#: it warns (once) that it is still missing.
_RETRY_S = 0.1
_WARN_AFTER_S = 60.0


def host_pool_path(directory: str | os.PathLike[str], engine_id: str, rank: int) -> Path:
    """The shared host pool file of ``engine_id``'s worker ``rank``: the worker makes it,
    the scheduler finds it by the same name. Characters outside ``[A-Za-z0-9_.-]`` in
    the engine id are replaced, with a hash of the id so that names stay distinct."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:64]
    if safe != engine_id:
        safe += "-" + hashlib.blake2b(engine_id.encode(), digest_size=6).hexdigest()
    return Path(directory) / f"asyncoffload-{safe}-rank{rank}.pool"


class HostPools:
    """Every rank's host pool file (``paths``, rank order; ``num_slots`` slots of
    ``slot_bytes``), mapped in this process the first time :meth:`base` finds them all.
    ``unlink``: whether a file's name goes once it is mapped here (not for a pool that
    other workers still have to find: a replicated layout's)."""

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        num_slots: int,
        slot_bytes: int,
        *,
        unlink: bool = True,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.pool_paths = [Path(p) for p in paths]
        if not self.pool_paths:
            raise ValueError("lower tiers need at least one worker's host pool")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.unlink_pools = unlink
        #: The pools mapped so far, by rank (all of them before any tier I/O).
        self._pools: list[SharedHostFile | None] = [None] * len(self.pool_paths)
        self._views: list[object] = []
        self._mapped = False
        self._base = 0
        self._pool_error: str | None = None
        self._first_try = 0.0
        self._next_try = 0.0
        self._warned = False
        self.closed = False

    @property
    def mapped(self) -> bool:
        return self._mapped

    def address(self, slot: int) -> int:
        """The address of rank 0's ``slot`` (once mapped)."""
        return self._base + slot * self.slot_bytes

    def base(self, stores: Sequence[LowerTier]) -> int | None:
        """The address of rank 0's slot 0 in this process, mapping each worker's file
        the first time it is there; ``None`` (tier I/O is skipped) until every rank's
        is, or for good where a file is not a pool of this engine. With several ranks,
        each of ``stores`` is told where the other ranks' slots are (``set_segments``): a block
        is written from, and read into, the same slot of every rank's pool at once."""
        if self._mapped:
            return self._base
        if self._pool_error is not None or self.closed:
            return None
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + _RETRY_S
        if not self._first_try:
            self._first_try = now
        pools = self._pools
        for rank, path in enumerate(self.pool_paths):
            if pools[rank] is not None:
                continue
            try:
                pool = SharedHostFile.open(path, self.num_slots, self.slot_bytes, keep_fd=True)
            except FileNotFoundError:
                if not self._warned and now - self._first_try > _WARN_AFTER_S:
                    self._warned = True
                    log.warning(
                        "the host pool of worker %d (%s) is still missing after %.0fs: "
                        "tier I/O is skipped until every worker's is there",
                        rank,
                        path,
                        now - self._first_try,
                    )
                continue
            except (OSError, ValueError) as exc:
                self._pool_error = str(exc)
                log.error("cannot map the host pool of worker %d (%s): tier I/O is off", rank, exc)
                return None
            if not pool.creator_alive():  # a stale file of a dead worker: not ours
                pool.close()
                continue
            if self.unlink_pools:
                with contextlib.suppress(OSError):  # mapped by both: nothing need name it now
                    os.unlink(path)
            pools[rank] = pool
            log.info("mapped the host pool of worker %d: %s", rank, path)
        if any(pool is None for pool in pools):
            return None
        views = [pool.tensor() for pool in pools if pool is not None]
        bases = [view.data_ptr() for view in views]
        try:  # a tier whose I/O runs in a helper process maps the files there
            regions = [pool.region() for pool in pools if pool is not None]
            for store in stores:
                store.attach_host(regions)
        except (ValueError, RuntimeError, OSError) as exc:
            self._pool_error = str(exc)
            log.error("the lower tiers cannot map the host pools (%s): tier I/O is off", exc)
            return None
        if len(bases) > 1:
            deltas = [b - bases[0] for b in bases]
            try:
                for store in stores:
                    store.set_segments(deltas)
            except (ValueError, NotImplementedError, RuntimeError) as exc:
                self._pool_error = str(exc)
                log.error(
                    "the lower tiers cannot take %d ranks' slices (%s): tier I/O is off",
                    len(bases),
                    exc,
                )
                return None
        self._views = list(views)
        self._base = bases[0]
        self._mapped = True
        return self._base

    def describe(self) -> dict[str, object]:
        info: dict[str, object] = {"host_pool": str(self.pool_paths[0])}
        if len(self.pool_paths) > 1:
            info["host_pools"] = [str(p) for p in self.pool_paths]
        info["host_pool_mapped"] = self._mapped
        return info

    def close(self) -> None:
        """Unmap every pool. Idempotent."""
        self.closed = True
        pools, self._pools = self._pools, [None] * len(self.pool_paths)
        self._views = []
        self._mapped = False
        for pool in pools:
            if pool is not None:
                pool.close()
