"""asyncoffload's tiers as SGLang's HiCache L3 storage: ``AsyncOffloadStorage``.

SGLang builds it from ``--hicache-storage-backend dynamic`` and the extra config (see
docs/sglang.md), hands it its host pool (``register_mem_pool_host``), then calls it
from three threads at once: ``batch_exists`` (the prefetch thread), ``batch_get_v1``
(the prefetch I/O thread) and ``batch_set_v1`` (the backup thread).

It is a driver of :class:`~asyncoffload.tiers.lent.LentTiers` and holds no tier rule:

- a page is one block of the tiers, keyed by SGLang's page hash, in a namespace naming
  the model, the KV dtype, the page's byte order and shape (:mod:`.pages`), the TP
  rank and size (MLA: rank 0 of 1, as every rank holds the same KV), the pipeline and
  context-parallel shard, and the tenant;
- ``batch_exists`` asks the tiers (:meth:`LentTiers.exists`) and counts the leading
  pages they hold; ``batch_get_v1`` loads pages into their pool pages (a load whose
  bytes fail a check is dropped from its tier by the core: the next ``batch_exists`` of
  this rank stops before it, and SGLang's MIN over the ranks' counts makes that page a
  miss on every rank); ``batch_set_v1`` stores them, on MLA's writer only;
- every call returns only once no I/O of ours can touch the pool pages it was lent
  (the job's ``released``), waiting at most the tiers' deadline plus the core's grace;
- every failure is a miss (``False``, a shorter count); nothing raises into SGLang's
  threads.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from asyncoffload.integrations.sglang.pages import PageMap, Staging, page_map
from asyncoffload.integrations.sglang.settings import SETTING, SglangStorageSettings
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import OffloadingEvent
from asyncoffload.tiers.core import STALL_GRACE_S, TierStats
from asyncoffload.tiers.format import Namespace
from asyncoffload.tiers.lent import LentJob, LentTiers
from asyncoffload.tiers.ports import close_tiers, open_tiers
from asyncoffload.transfer.base import HostRegion

__all__ = ["AsyncOffloadStorage"]

log = logging.getLogger("asyncoffload.sglang")

#: Stored and removed events kept for :meth:`AsyncOffloadStorage.take_events` (the oldest
#: go first when nobody takes them).
MAX_EVENTS = 65_536


class AsyncOffloadStorage(HiCacheStorage):
    """SGLang's HiCache L3 storage over asyncoffload's disk, Valkey/Redis and Mooncake
    tiers. Built by SGLang's ``StorageBackendFactory`` as ``cls(storage_config,
    kwargs)``; ``ValueError`` naming the setting for bad extra config."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.settings = SglangStorageSettings.from_extra_config(storage_config.extra_config)
        if storage_config.should_split_heads:
            raise ValueError(
                f"{SETTING}['tp_lcm_size']: split heads across TP sizes are not supported"
            )
        self.storage_config = storage_config
        #: MLA: only the writer (rank 0) stores; the others find its pages.
        self.writer = storage_config.is_storage_writer
        self.pages: PageMap | None = None
        self.staging: Staging | None = None
        self.tiers: LentTiers | None = None
        self.namespace: Namespace | None = None
        self._events: collections.deque[OffloadingEvent] = collections.deque(maxlen=MAX_EVENTS)
        self._events_lock = threading.Lock()
        self._closed = False

    # --- start-up -----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the tiers over ``mem_pool_host``'s pages (SGLang calls this once, at
        attach; an error here fails the attach, which then closes us)."""
        if self.tiers is not None:
            raise RuntimeError("AsyncOffloadStorage: a host pool is registered already")
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        if type(pool) is MHATokenToKVPoolHost:
            kind = "mha"
        elif type(pool) is MLATokenToKVPoolHost:
            kind = "mla"
        else:
            raise ValueError(
                f"AsyncOffloadStorage serves MHATokenToKVPoolHost and MLATokenToKVPoolHost "
                f"host pools, not {type(pool).__name__}"
            )
        pages = page_map(pool.kv_buffer, kind, pool.layout, pool.page_size, pool.size)
        shared_fd = getattr(getattr(pool, "allocator", None), "fd", None)
        needs_shm = any(getattr(spec, "shares_host", False) for spec in self.settings.tiers)
        regions: list[HostRegion] | None = None
        address: Callable[[int], int]
        if not pages.direct or (needs_shm and not isinstance(shared_fd, int)):
            self.staging = Staging(
                self.settings.staging_pages, pages.page_bytes, pages.dtype, pages.shape
            )
            regions = [HostRegion(self.staging.fd, self.staging.base, self.staging.size)]
            address = self.staging.address
        else:
            if needs_shm:
                assert isinstance(shared_fd, int)
                kv = pool.kv_buffer
                regions = [HostRegion(shared_fd, kv.data_ptr(), kv.numel() * kv.element_size())]
            address = pages.address
        self.pages = pages
        self.namespace = self._namespace(pages)
        try:
            stores = open_tiers(self.settings.tiers, self.namespace, regions)
        except Exception as exc:
            self._close_staging()
            raise ValueError(f"{SETTING}['tiers']: the tiers did not open: {exc}") from exc
        try:
            deltas = pages.deltas if self.staging is None else (0,)
            if len(deltas) > 1:
                for store in stores:
                    store.set_segments(deltas)
            self.tiers = LentTiers(stores, address, self.settings.tenant)
        except BaseException:
            close_tiers(stores)
            self._close_staging()
            raise
        log.info(
            "asyncoffload HiCache storage: %d tiers, pages of %d B (%s, %s), %s",
            len(stores),
            pages.page_bytes,
            pool.layout,
            pages.order,
            "in place" if self.staging is None else "through a staging area",
        )

    def _namespace(self, pages: PageMap) -> Namespace:
        cfg = self.storage_config
        replicated = cfg.is_mla_model
        shard = f"pp{cfg.pp_rank}/{cfg.pp_size},cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}"
        if cfg.dcp_size > 1:
            shard += f",dcp{cfg.dcp_rank}/{cfg.dcp_size}"
        return Namespace(
            model=cfg.model_name or "",
            kv_dtype=str(pages.dtype),
            layout=pages.describe(),
            block_bytes=pages.page_bytes,
            tokens_per_block=pages.page_size,
            rank=0 if replicated else cfg.tp_rank,
            world_size=1 if replicated else cfg.tp_size,
            tenant=self.settings.tenant,
            extra=shard,
        )

    # --- the v1 interface -----------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages of ``keys`` the tiers hold (0 on any failure)."""
        tiers = self.tiers
        if tiers is None or not keys:
            return 0
        try:
            found = tiers.exists(_keys(keys), tiers.deadline_s + STALL_GRACE_S)
        except Exception:
            log.exception("batch_exists of %d pages failed: counted as none", len(keys))
            return 0
        finally:
            self._take_events()
        return found.index(False) if False in found else len(found)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load ``keys`` into the pool pages ``host_indices`` names; per page, whether
        its bytes are there and passed their checks."""
        return self._io(keys, host_indices, write=False)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the pool pages ``host_indices`` names as ``keys``; per page, whether it
        failed nowhere. MLA's other ranks store nothing (True: the writer does)."""
        if not self.writer:
            return [True] * len(keys)
        return self._io(keys, host_indices, write=True)

    def _io(self, keys: list[str], host_indices: torch.Tensor, *, write: bool) -> list[bool]:
        n = len(keys)
        pages, tiers = self.pages, self.tiers
        if pages is None or tiers is None or n == 0:
            return [False] * n
        try:
            slots = pages.pages_of(host_indices, n)
            if self.staging is None:
                ok = self._run(tiers, _keys(keys), slots, write)
            else:
                ok = self._staged(tiers, pages, self.staging, _keys(keys), slots, write)
        except Exception:
            log.exception("%s of %d pages failed: all missed", "a store" if write else "a load", n)
            ok = [False] * n
        finally:
            self._take_events()
        return ok

    def _run(
        self, tiers: LentTiers, keys: Sequence[OffloadKey], slots: list[int], write: bool
    ) -> list[bool]:
        """One job over ``slots``; its results once it released them (else all failed)."""
        job = tiers.store(keys, slots) if write else tiers.load(keys, slots)
        if not self._settled(tiers, job):
            return [False] * len(keys)
        return list(job.ok)

    def _settled(self, tiers: LentTiers, job: LentJob) -> bool:
        """Wait for ``job`` to end and let go of its slots, at most the tiers' deadline
        plus the grace each; whether it did."""
        bound = tiers.deadline_s + STALL_GRACE_S
        if tiers.wait([job], bound) and job.released.wait(bound):
            return True
        log.error(
            "a tier %s of %d pages still holds them %.1f s on (a stalled disk or server): "
            "counted as failed",
            "store" if job.write else "load",
            len(job.keys),
            2 * bound,
        )
        return False

    def _staged(
        self,
        tiers: LentTiers,
        pages: PageMap,
        staging: Staging,
        keys: Sequence[OffloadKey],
        slots: list[int],
        write: bool,
    ) -> list[bool]:
        """Pages through the staging area, as many at a time as it lends: a store
        copies them in first, a load copies out those that passed."""
        ok: list[bool] = []
        bound = tiers.deadline_s + STALL_GRACE_S
        ps = pages.page_size
        while len(ok) < len(keys):
            lent = staging.take(len(keys) - len(ok), bound)
            if not lent:
                log.warning("no staging slot came free in %.1f s: pages missed", bound)
                return ok + [False] * (len(keys) - len(ok))
            i = len(ok)
            part = list(keys[i : i + len(lent)])
            firsts = [page * ps for page in slots[i : i + len(lent)]]
            if write:
                for s, first in zip(lent, firsts):
                    staging.slot(s).copy_(pages.view(first))
            job = tiers.store(part, lent) if write else tiers.load(part, lent)
            if not self._settled(tiers, job):
                ok += [False] * len(part)
                staging.give_when(job.released, lent)
                continue
            if not write:
                for s, first, good in zip(lent, firsts, job.ok):
                    if good:
                        pages.view(first).copy_(staging.slot(s))
            staging.give(lent)
            ok += job.ok
        return ok

    # --- events, stats, closing -------------------------------------------------------------

    def _take_events(self) -> None:
        tiers = self.tiers
        if tiers is not None:
            events = tiers.take_events()
            if events:
                with self._events_lock:
                    self._events.extend(events)

    def take_events(self) -> list[OffloadingEvent]:
        """The tiers' stored and removed events since the last call (at most the last
        ``MAX_EVENTS``)."""
        self._take_events()
        with self._events_lock:
            out = list(self._events)
            self._events.clear()
        return out

    def tier_stats(self) -> tuple[TierStats, ...]:
        return () if self.tiers is None else self.tiers.stats()

    def close(self) -> None:
        """Finish what is in flight, close the tiers, unmap the staging area. Idempotent."""
        if self._closed:
            return
        self._closed = True
        tiers, self.tiers = self.tiers, None
        if tiers is not None:
            tiers.close()
        self._close_staging()

    def _close_staging(self) -> None:
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.close()

    # --- the deprecated interface (SGLang uses it only without "interface_v1": 1) ---------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        return None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        return [None] * len(keys)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return False

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return False

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1


def _keys(keys: Sequence[str]) -> list[OffloadKey]:
    """SGLang's page hashes (hex strings) as our keys."""
    return [OffloadKey(key.encode()) for key in keys]
