"""The manager replay: a workload through the CPU tier's manager, and a disk tier's below
it (:func:`replay`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from asyncoffload.keys import OffloadKey
from asyncoffload.manager import CPUOffloadingManager, ReqContext
from asyncoffload.manager.admission import AdmissionFilter
from asyncoffload.manager.policies import CachePolicy
from asyncoffload.replay.result import (
    LLAMA3_8B_BYTES_PER_TOKEN,
    Progress,
    ReplayResult,
    _check_capacity,
    _share,
    _Tally,
)
from asyncoffload.workloads import Request, summarize

__all__ = ["DISK_ADMISSION", "parse_disk_admission", "replay", "serve_request"]

#: Default admission of the disk tier: a block is written to disk on its second offer
#: (like Dynamo KVBM's frequency filter). ``"frequencyN"`` writes on the N-th offer.
DISK_ADMISSION = "frequency2"


def serve_request(
    manager: CPUOffloadingManager,
    keys: Sequence[OffloadKey],
    n: int | None = None,
    ctx: ReqContext | None = None,
) -> int:
    """One request through ``manager`` as the engine serves it (its default
    touch_on_load and touch_on_store), the way :func:`replay` does: look up the prefix
    (unless ``n``, its hits, is given), load and touch the hits, touch the rest, store
    it, every call with the request's ``ctx``. Returns the prefix hits. The replay's own
    loop makes the same calls inline."""
    if n is None:
        n = manager.lookup_prefix(keys, ctx)
    if n:
        hits = keys[:n]
        manager.prepare_load(hits, ctx)
        manager.touch(hits, ctx)
        manager.complete_load(hits, ctx)
    if n < len(keys):
        manager.touch(keys[n:], ctx)
    out = manager.prepare_store(keys[n:], ctx)
    if out is not None and out.keys_to_store:
        manager.complete_store(out.keys_to_store, ctx)
    return n


def parse_disk_admission(spec: str | None) -> tuple[int, str | None]:
    """The disk tier's admission ``spec`` as ``(store_threshold, filter name)`` for its
    :class:`~asyncoffload.manager.CPUOffloadingManager`: ``"frequencyN"`` (N >= 2) writes
    a block on its N-th offer (``"frequency"``: the second, as ``DiskTier``'s default),
    a registered filter name (``"ghost"``...) uses that filter, ``None`` or ``"none"``
    writes every block. ``ValueError`` naming the choices otherwise."""
    from asyncoffload.manager.admission import available_admissions, get_admission_cls

    if spec is None or spec == "none":
        return 0, None
    if spec == "frequency":  # DiskTier's name for it (min_offers=2)
        return 2, None
    if spec.startswith("frequency"):
        count = spec[len("frequency") :]
        if count.isdigit() and int(count) >= 2:
            return int(count), None
    elif spec:
        try:
            get_admission_cls(spec)
        except ValueError:
            pass
        else:
            return 0, spec
    raise ValueError(
        f"unknown disk admission {spec!r}: use frequencyN (a block is written on its N-th "
        f"offer, N >= 2; default {DISK_ADMISSION}), none (every block), or a filter: "
        f"{', '.join(available_admissions())}"
    )


def replay(
    requests: Sequence[Request],
    capacity: int,
    *,
    policy: str | CachePolicy = "lru",
    admission: str | AdmissionFilter | None = None,
    store_threshold: int = 0,
    bytes_per_token: int = LLAMA3_8B_BYTES_PER_TOKEN,
    unique_blocks: int | None = None,
    share: float | None = None,
    progress: Progress | None = None,
    before_request: Callable[[int], None] | None = None,
    disk_capacity: int | None = None,
    disk_policy: str = "lru",
    disk_admission: str | None = DISK_ADMISSION,
    disk_share: float | None = None,
) -> ReplayResult:
    """Replay ``requests`` in order through a manager of ``capacity`` slots.

    Tokens per block are each request's own (``Request.block_tokens``); a policy that
    weighs time reads the trace's (each request's arrival, ``CachePolicy.use_clock``).
    ``share`` is the capacity share to report (default: ``capacity`` over the unique
    blocks). ``progress`` is called as ``progress(done, total)`` every few hundred
    requests; ``before_request(i)`` before request ``i`` (the offline bound uses it to
    advance its clock).

    ``disk_capacity`` (blocks) adds a disk tier below the CPU tier, with its own
    ``disk_policy`` and ``disk_admission`` (see :func:`parse_disk_admission`; default: write a
    block on its second offer; ``None``: every block); ``disk_share`` is its capacity
    share to report (default: ``disk_capacity`` over the unique blocks). Without it the
    replay is the CPU tier's alone, as it always was.
    """
    _check_capacity(capacity)
    if disk_capacity is not None:
        _check_capacity(disk_capacity, "disk capacity")
        return _replay_tiers(
            requests,
            capacity,
            policy=policy,
            admission=admission,
            store_threshold=store_threshold,
            bytes_per_token=bytes_per_token,
            unique_blocks=unique_blocks,
            share=share,
            progress=progress,
            disk_capacity=disk_capacity,
            disk_policy=disk_policy,
            disk_admission_spec=disk_admission,
            disk_share=disk_share,
        )
    manager = CPUOffloadingManager(
        capacity,
        policy,
        store_threshold,
        enable_events=False,
        admission=admission,
    )
    tally = _Tally(len(requests), progress)
    now = [0.0]  # the trace's time, for a policy that weighs time
    manager.policy.use_clock(lambda: now[0])
    lookup, touch = manager.lookup_prefix, manager.touch
    prepare_load, complete_load = manager.prepare_load, manager.complete_load
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    clock = time.perf_counter
    for i, req in enumerate(requests):
        if before_request is not None:
            before_request(i)
        now[0] = req.arrival_s
        keys = req.keys
        t0 = clock()
        # The engine's calls, with its default touch_on_load and touch_on_store.
        n = lookup(keys)
        if n:
            hits = keys[:n]
            prepare_load(hits)
            touch(hits)
            complete_load(hits)
        if n < len(keys):
            touch(keys[n:])
        out = prepare_store(keys[n:])
        if out is not None and out.keys_to_store:
            complete_store(out.keys_to_store)
        tally.add(req, n, None if out is None else out.keys_to_store, clock() - t0)
    return tally.result(
        manager.policy_name,
        manager.admission_name if store_threshold < 2 else f"threshold{store_threshold}",
        capacity,
        _share(share, capacity, requests, unique_blocks),
        manager.stats(),
        tally.stored_tokens * bytes_per_token,
        tally.hit_tokens * bytes_per_token,
    )


def _write_through(
    disk: CPUOffloadingManager, keys: Sequence[OffloadKey], tally: _Tally
) -> list[OffloadKey]:
    """Offer ``keys`` to the disk tier; the ones its admission takes are written."""
    if not keys:
        return []
    out = disk.prepare_store(keys)
    if out is None:  # no evictable room on disk
        tally.disk_refused += 1
        return []
    if out.keys_to_store:
        disk.complete_store(out.keys_to_store)
    return out.keys_to_store


def _replay_tiers(
    requests: Sequence[Request],
    capacity: int,
    *,
    policy: str | CachePolicy,
    admission: str | AdmissionFilter | None,
    store_threshold: int,
    bytes_per_token: int,
    unique_blocks: int | None,
    share: float | None,
    progress: Progress | None,
    disk_capacity: int,
    disk_policy: str,
    disk_admission_spec: str | None,
    disk_share: float | None,
) -> ReplayResult:
    """:func:`replay` with a disk tier below the CPU tier (inclusive, write-through)."""
    threshold, disk_filter = parse_disk_admission(disk_admission_spec)
    cpu = CPUOffloadingManager(
        capacity, policy, store_threshold, enable_events=False, admission=admission
    )
    disk = CPUOffloadingManager(
        disk_capacity, disk_policy, threshold, enable_events=False, admission=disk_filter
    )
    tally = _Tally(len(requests), progress)
    now = [0.0]  # the trace's time, for policies that weigh time
    cpu.policy.use_clock(lambda: now[0])
    disk.policy.use_clock(lambda: now[0])
    clock = time.perf_counter
    for req in requests:
        now[0] = req.arrival_s
        t0 = clock()
        n, from_disk, stored, written = _serve_tiered(cpu, disk, req.keys, tally)
        tally.add(req, n, stored, clock() - t0, from_disk, written)
    cpu_stats, disk_stats = cpu.stats(), disk.stats()
    unique = unique_blocks
    if share is None or disk_share is None:
        unique = unique if unique is not None else summarize(requests).unique_blocks
    result = tally.result(
        cpu.policy_name,
        cpu.admission_name if store_threshold < 2 else f"threshold{store_threshold}",
        capacity,
        _share(share, capacity, requests, unique),
        cpu_stats,
        tally.stored_tokens * bytes_per_token,
        tally.hit_tokens * bytes_per_token,
    )
    return dataclasses.replace(
        result,
        # The CPU tier's own: promotions are not stores from the GPU side.
        stored=cpu_stats.stored - tally.promoted,
        disk_capacity=disk_capacity,
        disk_capacity_share=_share(disk_share, disk_capacity, requests, unique),
        disk_policy=disk.policy_name,
        disk_admission=(f"frequency{threshold}" if threshold >= 2 else disk.admission_name),
        disk_hit_blocks=tally.disk_hit_blocks,
        disk_hit_tokens=tally.disk_hit_tokens,
        disk_stored=disk_stats.stored,
        disk_bytes_stored=tally.disk_stored_tokens * bytes_per_token,
        disk_evicted=disk_stats.evicted,
        disk_skipped=disk_stats.store_skipped,
        disk_refused=tally.disk_refused,
        promoted=tally.promoted,
        promote_failed=tally.promote_failed,
    )


def _serve_tiered(
    cpu: CPUOffloadingManager,
    disk: CPUOffloadingManager,
    keys: Sequence[OffloadKey],
    tally: _Tally,
) -> tuple[int, list[int], list[OffloadKey] | None, list[OffloadKey]]:
    """One request's ``keys`` against a CPU tier over a disk tier, as the engine serves
    it: the blocks of its prefix found (and the indices of those from disk), the keys
    its store took (None: refused), and those written through to disk."""
    # The prefix walk: on while each key is ready in one tier, the CPU tier first.
    n = cpu.lookup_prefix(keys)
    # After the lookup, which feeds `auto` (it may switch leaders, rebinding ``get``).
    cpu_get, disk_get = cpu.policy.get, disk.policy.get
    from_disk: list[int] = []
    for key in keys[n:]:
        block = cpu_get(key)
        if block is None or block.ref_cnt < 0:
            block = disk_get(key)
            if block is None or block.ref_cnt < 0:
                break
            from_disk.append(n)
        n += 1
    # The engine's touch goes to every tier.
    cpu.touch(keys)
    disk.touch(keys)
    if from_disk:
        on_disk = [keys[i] for i in from_disk]
        in_cpu = [key for key in keys[:n] if cpu_get(key) is not None]
        # As the engine's promotion: the CPU hits pinned, CPU slots reserved for the
        # disk hits (past the CPU tier's admission, evicting idle blocks), read in.
        cpu.prepare_load(in_cpu)
        promote = cpu.reserve(on_disk)
        if promote is None:
            # No idle CPU slot to bring them into: the engine fails the load, and
            # the request recomputes (and stores) its whole prompt.
            cpu.complete_load(in_cpu)
            tally.promote_failed += 1
            n, from_disk = 0, []
        else:
            disk.prepare_load(on_disk)
            cpu.complete_store(promote.keys_to_store)
            tally.promoted += len(promote.keys_to_store)
            disk.complete_load(on_disk)
            cpu.complete_load(in_cpu)
    elif n:
        hits = keys[:n]
        cpu.prepare_load(hits)
        cpu.complete_load(hits)
    rest = keys[n:]
    out = cpu.prepare_store(rest)
    written: list[OffloadKey] = []
    if out is not None:
        fresh = out.keys_to_store
        # Write-through, as the engine's: blocks of the store already in the CPU tier
        # are offered to disk at once, the ones it writes when they are written.
        if len(fresh) < len(rest):
            new = set(fresh)
            ready = [key for key in rest if key not in new and cpu_get(key) is not None]
            written += _write_through(disk, ready, tally)
        if fresh:
            cpu.complete_store(fresh)
            written += _write_through(disk, fresh, tally)
    return n, from_disk, None if out is None else out.keys_to_store, written
