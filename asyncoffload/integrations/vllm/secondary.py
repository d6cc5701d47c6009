"""asyncoffload's tiers as vLLM 0.34 secondary tiers, beneath vLLM's own CPU cache.

vLLM 0.34's ``TieringOffloadingSpec`` keeps vLLM's CPU primary tier and loads secondary
tiers by ``module_path`` from ``kv_connector_extra_config["secondary_tiers"]``::

    {"type": "AsyncOffloadTier",
     "module_path": "asyncoffload.integrations.vllm.secondary",
     "tier": {"kind": "disk", "path": "/nvme/kv", "capacity": "64GiB", "mode": "slab",
              "admission": null}}

:class:`AsyncOffloadTier` is a thin driver: it maps vLLM's calls onto
:class:`~asyncoffload.tiers.lent.LentTiers` (our tier core, driven over memory that a
framework owns) and holds no tier rule of its own. Every rule (index, admission,
eviction within the tier's capacity, events, checks, stall deadlines, questions to a
shared tier) is the core's.

- **Chunks.** vLLM's primary tier is one shared region, ``num_chunks`` rows of
  ``strides[0]`` bytes (``SharedOffloadRegion``): a row is one chunk with every
  worker's bytes in rank order, ``|W0|W1|...|Wn|pad|``. A row is one value in our tier
  (``block_bytes`` = the row), checked whole: a chunk with one rank's part damaged fails
  whole, and a tier of another tensor-parallel size never reads it (the world size is
  part of the namespace, unless vLLM calls the bytes parallelism-agnostic). Rank slices
  as separate values would cost one I/O per rank for bytes that are contiguous here.
- **Calls.** ``lookup`` asks the core (``hit`` / ``miss`` / ``pending`` ->
  ``HIT`` / ``MISS`` / ``RETRY``: a shared tier is being asked); ``submit_store`` and
  ``submit_load`` hand the job's chunks to ``store`` / ``load``; ``get_finished_jobs``
  polls. A load with failed keys (damaged, missing, stalled) is a failed
  :class:`JobResult` naming the keys that did load; its ``deferred_release`` is the
  job's ``released`` event when an op of ours may still write the chunks. A store ends
  for vLLM (which then unpins its chunks) only once no op of ours reads them.
- **Events** (when vLLM's KV events are on): each stored and removed event of the tier,
  evictions and dropped damaged blocks included, as vLLM's ``OffloadingEvent`` with
  medium ``STORAGE``, the tier's locality, ``ownership`` the tier's name and
  ``removal_expected``: vLLM's fs and obj tiers publish no removals.
- **Backpressure.** vLLM's manager owns its detector: it asks it before each store and
  feeds it each store's end (``transfer_bytes``: the bytes this job put in the tier).
  The tier passes it on, as vLLM's own tiers do.
"""

# vLLM is imported only once its version is checked:
# ruff: noqa: E402
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np

from asyncoffload.integrations.vllm.versions import VllmVersionError, installed_api

VLLM = installed_api()
if VLLM.release < (0, 34):
    raise VllmVersionError(
        f"asyncoffload's vLLM secondary tier needs vLLM 0.34's TieringOffloadingSpec; "
        f"vLLM {VLLM.version} is installed"
    )

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from asyncoffload.integrations.vllm.secondary_settings import SecondaryTierSettings
from asyncoffload.keys import OffloadKey as OurKey
from asyncoffload.tiers.base import LowerTier
from asyncoffload.tiers.core import TierStats
from asyncoffload.tiers.format import Namespace
from asyncoffload.tiers.lent import LentJob, LentTiers
from asyncoffload.tiers.ports import close_tiers, open_tiers, running
from asyncoffload.transfer.base import HostRegion

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["AsyncOffloadTier", "SecondaryTierSettings", "secondary_namespace"]

_OURS = "vllm:asyncoffload_secondary_"
#: Counters, each labelled with the tier's name: metric -> (TierStats field, help).
_COUNTERS: dict[str, tuple[str, str]] = {
    _OURS + "blocks_written": ("blocks_written", "Chunks written to the tier."),
    _OURS + "blocks_present": (
        "blocks_present",
        "Chunks offered that the tier held already (another engine's copy): nothing written.",
    ),
    _OURS + "blocks_read": ("blocks_read", "Chunks read back into vLLM's CPU tier."),
    _OURS + "write_failures": ("write_failures", "Chunks whose write failed (skipped)."),
    _OURS + "read_failures": (
        "read_failures",
        "Chunks whose read failed a check or the system call: misses, dropped from the tier.",
    ),
    _OURS + "blocks_dropped": (
        "dropped",
        "Chunks dropped from the tier because a read of them failed its checks.",
    ),
    _OURS + "loaded": (
        "loaded",
        "Load or recompute: chunks loaded from the tier (a promotion that ended in time).",
    ),
    _OURS + "recomputed_by_choice": (
        "recomputed_by_choice",
        "Load or recompute: chunks the tier held, answered as misses because reading them "
        "was expected to lose to recomputing them.",
    ),
    _OURS + "recomputed_after_deadline": (
        "recomputed_after_deadline",
        "Load or recompute: chunks whose read overran its deadline (recomputed).",
    ),
}
_EVICTED = _OURS + "blocks_evicted"
_FAILURES = _OURS + "failures"
_READY = _OURS + "ready_blocks"
_CAPACITY = _OURS + "capacity_blocks"
_LOOKUP = {"hit": LookupResult.HIT, "miss": LookupResult.MISS, "pending": LookupResult.RETRY}


def secondary_namespace(spec: OffloadingSpec, row_bytes: int, tenant: str = "") -> Namespace:
    """The identity of ``spec``'s chunks in our tiers: the model, the KV dtype, the
    layout of a row of vLLM's primary region (``row_bytes``: every worker's bytes of a
    chunk, padded), the tokens of a chunk, the world size and the tenant. Bytes vLLM
    calls parallelism-agnostic (``is_parallelism_agnostic``, or one replicated copy)
    are shared by every topology, as vLLM's fs tier shares them; otherwise another
    tensor-, pipeline- or context-parallel shape never reads these chunks."""
    config = spec.config
    parallel = config.parallel
    # vLLM's tiering holds a replicated layout (MLA under TP) once in its region.
    replicated = bool(config.replicated_layout)
    world = max(1, int(parallel.world_size))
    copies = 1 if replicated else world
    agnostic = bool(parallel.is_parallelism_agnostic) or replicated
    blocks_per_chunk = int(spec.blocks_per_chunk)
    layers = [name for group in config.groups for name in group.layer_names]
    layer_hash = hashlib.blake2b("\0".join(layers).encode(), digest_size=8).hexdigest()
    tokens = ",".join(str(group.tokens_per_block) for group in config.groups)
    layout = (
        f"vllm-tiering,groups={len(config.groups)}:{tokens},layers={len(layers)}:"
        f"{layer_hash},kv_cache_layout={config.kv_cache_layout},"
        f"chunk_bytes={config.worker_kv_bytes_per_block * copies * blocks_per_chunk},"
        f"row_bytes={row_bytes}"
    )
    if config.canonical_layout:
        layout += ",canonical"
    if replicated:
        layout += ",replicated"
    if not agnostic:
        layout += (
            f",tp={parallel.tp_size},pp={parallel.pp_size},pcp={parallel.pcp_size},"
            f"dcp={parallel.dcp_size}"
        )
    return Namespace(
        model=str(config.model.name),
        kv_dtype=str(config.model.dtype),
        layout=layout,
        block_bytes=row_bytes,
        tokens_per_block=int(config.cache.tokens_per_hash) * blocks_per_chunk,
        rank=0,  # every worker's bytes are in the value
        world_size=1 if agnostic else world,
        tenant=tenant,
    )


class _Rows:
    """vLLM's primary region as the core sees it: row ``i`` (a chunk) starts at
    ``base + i * stride``. The address is read once; no export of the view is kept
    (vLLM releases the view at shutdown, after its secondary tiers)."""

    def __init__(self, view: memoryview) -> None:
        if not isinstance(view, memoryview) or view.ndim < 1 or not view.c_contiguous:
            raise ValueError(
                "AsyncOffloadTier: vLLM's primary_kv_view must be a C-contiguous "
                "memoryview of rows (num_chunks, row bytes)"
            )
        if view.readonly:
            raise ValueError("AsyncOffloadTier: vLLM's primary_kv_view is read-only")
        self.count = int(view.shape[0]) if view.shape else 0
        self.stride = int(view.strides[0]) if view.strides else 0
        if self.count <= 0 or self.stride <= 0:
            raise ValueError(
                f"AsyncOffloadTier: vLLM's primary tier has {self.count} chunks of "
                f"{self.stride} bytes: nothing to offload"
            )
        array = np.asarray(view)
        self.base = int(array.ctypes.data)
        del array

    def address(self, slot: int) -> int:
        return self.base + slot * self.stride

    def regions(self) -> list[HostRegion]:
        """The rows as another process can map them: each file mapped over them (vLLM's
        shared region: one file in /dev/shm, or several back to back), opened again
        from ``/proc/self/maps``; none where the rows are not all in mapped files."""
        start, end = self.base, self.base + self.count * self.stride
        spans: dict[str, list[int]] = {}  # path -> [address of offset 0, end]
        covered = 0
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                low, high = (int(x, 16) for x in fields[0].split("-"))
                if high <= start or low >= end:
                    continue
                path = fields[5].strip() if len(fields) > 5 else ""
                if not path.startswith("/") or path.endswith(" (deleted)"):
                    return []
                at = low - int(fields[2], 16)
                span = spans.setdefault(path, [at, high])
                if span[0] != at:
                    return []  # the same file twice, at two places
                span[1] = max(span[1], high)
                covered += min(high, end) - max(low, start)
        if covered != end - start:
            return []
        regions: list[HostRegion] = []
        try:
            for path, (at, high) in spans.items():
                regions.append(HostRegion(os.open(path, os.O_RDWR | os.O_CLOEXEC), at, high - at))
        except OSError:
            for region in regions:
                os.close(region.fd)
            return []
        return regions

    def slots(self, job: TransferJob) -> list[int]:
        """The job's chunks, checked: ``ValueError`` for one outside the region or a
        count that is not the keys'."""
        ids = np.asarray(job.chunk_ids)
        if ids.ndim != 1 or len(ids) != len(job.keys):
            raise ValueError(
                f"AsyncOffloadTier: job {job.job_id} has {len(job.keys)} keys and "
                f"chunk_ids of shape {ids.shape}"
            )
        slots: list[int] = ids.tolist()
        if slots and (min(slots) < 0 or max(slots) >= self.count):
            raise ValueError(
                f"AsyncOffloadTier: job {job.job_id} names chunks outside "
                f"[0, {self.count}): {slots}"
            )
        return slots


class AsyncOffloadTier(SecondaryTierManager):
    """One of our tiers (disk files or slab, Redis / Valkey, Mooncake) as a vLLM 0.34
    secondary tier; see the module docstring. ``config``: the entry's other keys
    (:class:`SecondaryTierSettings`); an error names the key."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = settings = SecondaryTierSettings.from_config(config, tier_type)
        self._rows = _Rows(primary_kv_view)
        self.locality = Locality(settings.tier_locality)
        #: The tier's name: its events' ``ownership``, its metrics' ``tier`` label.
        self.name = settings.tier_name
        self._events_on = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        namespace = self.namespace()
        self._tiers = self._open(namespace)
        # Load or recompute: a chunk's tokens, and vLLM's prefill rate if configured.
        self._tiers.configure_cost(
            settings.load_or_recompute,
            namespace.tokens_per_block,
            settings.recompute_tokens_per_s,
            settings.load_deadline_factor,
            settings.load_deadline_floor_s,
            settings.load_probe_every_s,
        )
        #: Per request, the chunks this step's lookups answered HIT from the tier: the
        #: run a read would bring (vLLM batches a request's promotions into one job).
        self._runs: dict[str, int] = {}
        #: Results taken from the tiers (by a drain) and not yet given to vLLM.
        self._finished: list[JobResult] = []
        #: Stores that ended while an op of theirs may still read their chunks.
        self._held: list[LentJob] = []
        #: The request of each key of the stores that ended since the last take_events
        #: (vLLM 0.34 builds a stored event's payload from it).
        self._stored_by: dict[OurKey, ReqContext] = {}
        self._reported: dict[str, int] = {}

    @property
    def stores(self) -> tuple[LowerTier, ...]:
        """The running tier's port (one)."""
        return self._tiers.stores

    def tier_stats(self) -> tuple[TierStats, ...]:
        """The tier's :class:`~asyncoffload.tiers.core.TierStats` (failures by cause)."""
        return self._tiers.stats()

    def namespace(self) -> Namespace:
        """The identity of this engine's chunks (:func:`secondary_namespace`)."""
        return secondary_namespace(self._offloading_spec, self._rows.stride, self.settings.tenant)

    def _open(self, namespace: Namespace) -> LentTiers:
        """Open the tier: an error names the setting (an unwritable path, a server
        refused, a capacity that holds no chunk)."""
        kind = self.settings.kind
        key = "tier.path" if kind == "disk" else "tier"
        where = f"secondary_tiers[{self.tier_type}][{key!r}]: cannot open the {kind} tier"
        # A tier whose I/O runs in another process (Mooncake's helper) maps the rows.
        regions = self._rows.regions() if kind == "mooncake" else None
        try:
            stores = open_tiers([self.settings.tier], namespace, regions)
        except OSError as exc:  # the same OSError, the setting named
            if exc.errno is None or exc.strerror is None:
                raise type(exc)(f"{where}: {exc}") from exc
            what = f"{exc.strerror}: {exc.filename!r}" if exc.filename else exc.strerror
            raise type(exc)(exc.errno, f"{where}: {what}") from exc
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        finally:
            for region in regions or ():
                os.close(region.fd)  # the tier keeps its own
        try:
            return LentTiers(stores, self._rows.address, self.settings.tenant)
        except BaseException:
            close_tiers(stores)
            raise

    # --- vLLM's calls ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """The core's answer; a hit is a miss when reading the request's run of chunks
        from the tier, this one its last, loses to recomputing them (load or recompute:
        vLLM then computes from this chunk on)."""
        run = self._runs.get(req_context.req_id, 0) + 1
        found = self._tiers.lookup(OurKey(key), run)
        if found == "hit":
            self._runs[req_context.req_id] = run
        return _LOOKUP[found]

    def submit_store(self, job_metadata: TransferJob) -> None:
        slots = self._rows.slots(job_metadata)
        self._tiers.store(_ours(job_metadata), slots, owner=job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        slots = self._rows.slots(job_metadata)
        self._tiers.load(_ours(job_metadata), slots, owner=job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._finished = self._finished, []
        self._take(results)
        return results

    def _take(self, results: list[JobResult]) -> None:
        """The jobs that ended, as vLLM's results (a store once no op reads its chunks)."""
        for job in self._tiers.ended():
            if not job.write:
                results.append(self._load_result(job))
            elif job.released.is_set():
                results.append(self._store_result(job))
            else:
                self._held.append(job)
        if not self._events_on:
            self._tiers.take_events()  # vLLM takes none: they must not pile up
        if self._held:
            held, self._held = self._held, []
            for job in held:
                if job.released.is_set():
                    results.append(self._store_result(job))
                else:
                    self._held.append(job)

    def _store_result(self, job: LentJob) -> JobResult:
        transfer: TransferJob = job.owner
        if self._events_on:
            self._stored_by.update(dict.fromkeys(job.keys, transfer.req_context))
        return JobResult(
            job_id=transfer.job_id,
            success=all(job.ok),
            transfer_time=job.finished - job.submitted,
            transfer_bytes=job.moved * self._rows.stride,
        )

    def _load_result(self, job: LentJob) -> JobResult:
        transfer: TransferJob = job.owner
        loaded = sum(job.ok)
        nbytes = job.moved * self._rows.stride
        took = job.finished - job.submitted
        if loaded == len(job.keys):
            return JobResult(
                job_id=transfer.job_id, success=True, transfer_time=took, transfer_bytes=nbytes
            )
        good = tuple(OffloadKey(key) for key, ok in zip(job.keys, job.ok) if ok)
        released = job.released
        return JobResult(
            job_id=transfer.job_id,
            success=False,
            successful_keys=good or None,
            transfer_time=took,
            transfer_bytes=nbytes,
            deferred_release=None if released.is_set() else released,
        )

    def has_pending_work(self) -> bool:
        return bool(self._finished or self._held) or self._tiers.pending()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # Sends the step's questions to a shared tier; what ended waits for vLLM's poll.
        # The step's promotions go out as one job a request: runs start again.
        self._runs.clear()
        self._take(self._finished)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._runs.pop(req_context.req_id, None)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The tier's stored and removed events as vLLM's, a stored event with the
        request whose store wrote its keys (one event per request)."""
        events = self._tiers.take_events()
        stored_by, self._stored_by = self._stored_by, {}
        if not self._events_on:
            return ()
        out: list[OffloadingEvent] = []
        for event in events:
            if event.retention is not None:  # a pin change: vLLM's events have none
                continue
            groups: dict[int, tuple[ReqContext | None, list[OffloadKey]]] = {}
            for key in event.keys:
                ctx = None if event.removed else stored_by.get(key)
                groups.setdefault(id(ctx), (ctx, []))[1].append(OffloadKey(key))
            out.extend(
                OffloadingEvent(
                    keys=keys,
                    medium=Medium.STORAGE,
                    removed=event.removed,
                    locality=self.locality,
                    ownership=self.name,
                    removal_expected=True,
                    req_context=ctx,
                )
                for ctx, keys in groups.values()
            )
        return out

    def drain_jobs(self) -> None:
        """Wait for every job (bounded by the tier's deadline and the core's grace);
        their results go to the next :meth:`get_finished_jobs`. ``RuntimeError`` if an
        op of ours may still touch vLLM's chunks then (stuck in the kernel: a hung disk
        or mount), whose deferred release cannot be given: vLLM must not reuse them."""
        ended = self._tiers.drain()
        self._take(self._finished)
        if not ended or self._held:
            raise RuntimeError(
                f"secondary tier {self.name}: I/O still runs in the kernel after the "
                "tier's deadline (a stalled disk or server): the CPU chunks it may touch "
                "cannot be reused safely"
            )

    def shutdown(self) -> None:
        """Close the tier (its jobs drained, bounded). ``RuntimeError`` if an op of ours
        may still touch vLLM's region (stuck in the kernel): vLLM then keeps the region
        mapped rather than unmap memory that a late read may still fill."""
        self._tiers.close()
        if running(self._tiers.core):
            raise RuntimeError(
                f"secondary tier {self.name}: I/O still runs in the kernel at shutdown (a "
                "stalled disk or server): vLLM's CPU region must stay mapped"
            )

    # --- metrics --------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        label = ("tier",)
        definitions: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(doc, labelnames=label)
            for name, (_, doc) in _COUNTERS.items()
        }
        definitions[_EVICTED] = OffloadingCounterMetadata(
            "Chunks evicted from the tier to make room (its capacity holds).", labelnames=label
        )
        definitions[_FAILURES] = OffloadingCounterMetadata(
            "Failed or skipped chunk I/O by cause (corrupt, short, missing, timeout, an "
            "errno name; full, no_slot).",
            labelnames=("tier", "cause"),
        )
        definitions[_READY] = OffloadingGaugeMetadata(
            "Chunks the tier holds, ready to load.", labelnames=label
        )
        definitions[_CAPACITY] = OffloadingGaugeMetadata(
            "Chunks the tier can hold.", labelnames=label
        )
        return definitions

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        label = (self.name,)
        before = self._reported
        now: dict[str, int] = {}
        ready = capacity = 0
        for tier in self._tiers.stats():
            for name, (field, _) in _COUNTERS.items():
                now[name] = now.get(name, 0) + int(getattr(tier, field))
            now[_EVICTED] = now.get(_EVICTED, 0) + tier.manager.evicted
            for cause, n in tier.failures.items():
                now[cause] = now.get(cause, 0) + n
            ready += tier.manager.ready
            capacity += tier.manager.num_blocks
        for name, value in now.items():
            delta = value - before.get(name, 0)
            if not delta:
                continue
            if name.startswith(_OURS):
                stats.increase_counter(name, delta, label)
            else:
                stats.increase_counter(_FAILURES, delta, (self.name, name))
        self._reported = now
        stats.set_gauge(_READY, ready, label)
        stats.set_gauge(_CAPACITY, capacity, label)
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("asyncoffload_tier",)

    def config_info(self) -> ConfigInfoMapping:
        return {"asyncoffload_tier": self.name}

    def __repr__(self) -> str:
        return f"AsyncOffloadTier({self.name!r})"


def _ours(job: TransferJob) -> list[OurKey]:
    """A job's keys as our tiers take them (the same bytes: vLLM's key convention)."""
    return cast("list[OurKey]", list(job.keys))
