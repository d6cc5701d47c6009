"""Replays a request stream through vLLM ``OffloadingManager``\\ s the way vLLM's
OffloadingConnector (0.32) calls them, step by step, to compare managers decision by
decision and to time them.

The model of one engine step, in the connector's order: requests that arrived look up
their chunks (one ``lookup`` per key, up to the first miss; a pending key defers the
request to the next step) and ``prepare_load`` their hits; requests whose prefill runs
now ``prepare_store`` the rest (``None``: retried next step); requests that ended get
``on_request_finished``; transfers whose time has come complete
(``complete_load`` / ``complete_store``); then ``take_events``. A request arrives each
step; loads take ``load_steps``, stores ``store_steps``, and a request ends
``decode_steps`` after its prefill, so stores, loads and requests overlap as in serving.
Only full chunks have keys, as in vLLM.

:func:`replay_like_connector` drives several managers in lockstep and raises
:class:`ManagerMismatch` at the first call whose answers differ.
:func:`record_calls` keeps the calls one manager saw, and :func:`time_calls` replays
them on a fresh manager with no driver in between, for benchmarks.
"""

# vLLM is imported only once its version is checked:
# ruff: noqa: E402
from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The installed vLLM is checked before anything of it is imported (see versions.py).
from asyncoffload.integrations.vllm.versions import installed_api

VLLM = installed_api()

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)

__all__ = [
    "ManagerMismatch",
    "ReplayStats",
    "record_calls",
    "replay_like_connector",
    "time_calls",
]


class ManagerMismatch(AssertionError):
    """Two managers answered one call differently."""


@dataclass
class ReplayStats:
    """What a replay did (the first manager's answers; all agree when checked)."""

    requests: int = 0
    #: Keys of all requests (the blocks a request stream offers).
    blocks: int = 0
    lookups: int = 0
    #: Keys loaded (prefix hits), keys stored, keys evicted.
    hit_blocks: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    #: prepare_store calls answered None, and lookups that deferred a request.
    refused_stores: int = 0
    deferrals: int = 0
    events: int = 0
    steps: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0


@dataclass
class _Request:
    index: int
    keys: list[OffloadKey]
    contexts: list[ReqContext]
    hits: int = 0
    store_at: int | None = None
    finish_at: int | None = None
    jobs: int = 0


Call = tuple[str, tuple[Any, ...]]


@dataclass
class _Calls:
    """Every call made to one manager, in order (for :func:`time_calls`)."""

    calls: list[Call] = field(default_factory=list)


def _describe(value: Any) -> Any:
    """A comparable form of a manager's answer."""
    if value is None or isinstance(value, (LookupResult, bool, int)):
        return value
    if isinstance(value, PrepareStoreOutput):
        return (
            list(value.keys_to_store),
            list(value.evicted_keys),
            _describe(value.store_spec),
        )
    if isinstance(value, BlockIDsLoadStoreSpec):
        return [int(x) for x in np.asarray(value.block_ids)]
    if isinstance(value, list):
        return [_describe(v) for v in value]
    if hasattr(value, "removed") and hasattr(value, "keys"):
        return (bool(value.removed), list(value.keys), getattr(value, "medium", None))
    return value


class _Lockstep:
    def __init__(
        self, managers: Sequence[OffloadingManager], check: bool, recorders: list[_Calls] | None
    ) -> None:
        if not managers:
            raise ValueError("replay_like_connector needs at least one manager")
        self.managers = list(managers)
        self.check = check
        self.recorders = recorders
        self.step = 0

    def call(self, method: str, *args: Any, ctxs: Sequence[ReqContext] | None = None) -> Any:
        answers = []
        for i, manager in enumerate(self.managers):
            call_args = args if ctxs is None else (*args, ctxs[i])
            answer = getattr(manager, method)(*call_args)
            if method == "take_events":
                answer = list(answer)
            if self.recorders is not None:
                self.recorders[i].calls.append((method, call_args))
            answers.append(answer)
        if self.check and len(answers) > 1:
            first = _describe(answers[0])
            for i, other in enumerate(answers[1:], 1):
                described = _describe(other)
                if described != first:
                    raise ManagerMismatch(
                        f"step {self.step}: {method}{_short(args)} answered "
                        f"{_short(first)} by manager 0 but {_short(described)} by "
                        f"manager {i} ({type(self.managers[i]).__name__})"
                    )
        return answers[0]


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def replay_like_connector(
    requests: Iterable[Sequence[OffloadKey]],
    managers: Sequence[OffloadingManager],
    *,
    tokens_per_chunk: int = 512,
    load_steps: int = 1,
    store_steps: int = 2,
    decode_steps: int = 3,
    check: bool = True,
    recorders: list[_Calls] | None = None,
) -> ReplayStats:
    """Drive ``managers`` in lockstep with ``requests`` (each the keys of one prompt's
    full chunks, in order); with ``check``, raise :class:`ManagerMismatch` at the first
    call whose answers differ (lookups, load and store slots, evictions, events)."""
    for name, value in (
        ("load_steps", load_steps),
        ("store_steps", store_steps),
        ("decode_steps", decode_steps),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    run = _Lockstep(managers, check, recorders)
    replay = _Replay(run, tokens_per_chunk, load_steps, store_steps, decode_steps)
    incoming = iter(requests)
    exhausted = False
    while True:
        if not exhausted:
            keys = next(incoming, None)
            if keys is None:
                exhausted = True
            else:
                replay.arrive(list(keys))
        if exhausted and not replay.active:
            break
        replay.schedule()
        replay.build_connector_meta()
        replay.update_connector_output()
    replay.stats.steps = replay.run.step
    return replay.stats


@dataclass
class _Replay:
    """The scheduler's side of vLLM's offloading connector, one step at a time: which
    request waits for its lookups, which stores and loads are in flight until when."""

    run: _Lockstep
    tokens_per_chunk: int
    load_steps: int
    store_steps: int
    decode_steps: int
    stats: ReplayStats = field(default_factory=ReplayStats)
    #: Arrived, lookup not yet resolved; to prepare_store (now or on retry).
    waiting: list[_Request] = field(default_factory=list)
    storing: list[_Request] = field(default_factory=list)
    #: Transfers and request ends, by the step they complete at.
    loads: dict[int, list[tuple[_Request, list[OffloadKey]]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    stores: dict[int, list[tuple[_Request, list[OffloadKey]]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    finishing: dict[int, list[_Request]] = field(default_factory=lambda: defaultdict(list))
    active: int = 0
    arrived: int = 0

    def arrive(self, keys: list[OffloadKey]) -> None:
        req = _new_request(self.arrived, keys, len(self.run.managers), self.tokens_per_chunk)
        self.arrived += 1
        self.active += 1
        self.stats.requests += 1
        self.stats.blocks += len(req.keys)
        self.run.call("on_new_request", ctxs=req.contexts)
        self.waiting.append(req)

    def schedule(self) -> None:
        """Scheduling: each waiting request's lookups, and its load if it has hits."""
        run, stats, step = self.run, self.stats, self.run.step
        still_waiting = []
        for req in self.waiting:
            hits = 0
            deferred = False
            for key in req.keys:
                stats.lookups += 1
                result = run.call("lookup", key, ctxs=req.contexts)
                if result is LookupResult.MISS:
                    break
                if result is LookupResult.HIT_PENDING:
                    deferred = True
                hits += 1
            if deferred:
                stats.deferrals += 1
                still_waiting.append(req)
                continue
            req.hits = hits
            stats.hit_blocks += hits
            if hits:
                loaded = req.keys[:hits]
                run.call("prepare_load", loaded, ctxs=req.contexts)
                self.loads[step + self.load_steps].append((req, loaded))
                req.jobs += 1
                req.store_at = step + self.load_steps + 1
            else:
                req.store_at = step
            self.storing.append(req)
        self.waiting = still_waiting

    def build_connector_meta(self) -> None:
        """Stores (a refused one is retried while its request runs), then requests that
        ended."""
        run, stats, step = self.run, self.stats, self.run.step
        retry = []
        for req in self.storing:
            assert req.store_at is not None
            if req.store_at > step:
                retry.append(req)
                continue
            if req.finish_at is None:
                req.finish_at = step + self.decode_steps
                self.finishing[req.finish_at].append(req)
            rest = req.keys[req.hits :]
            if not rest:
                continue
            out = run.call("prepare_store", rest, ctxs=req.contexts)
            if out is None:
                stats.refused_stores += 1
                if step + 1 < req.finish_at:  # still running: the scheduler retries
                    retry.append(req)
                continue
            stats.evicted_blocks += len(out.evicted_keys)
            if out.keys_to_store:
                self.stores[step + self.store_steps].append((req, list(out.keys_to_store)))
                req.jobs += 1
        self.storing = retry
        for req in self.finishing.pop(step, []):
            run.call("on_request_finished", ctxs=req.contexts)
            req.finish_at = -1
            if not req.jobs:
                self.active -= 1

    def update_connector_output(self) -> None:
        """The transfers that completed this step, then the step's events."""
        run, step = self.run, self.run.step
        for req, keys in self.loads.pop(step, []):
            run.call("complete_load", keys, ctxs=req.contexts)
            self.active -= _job_done(req)
        for req, keys in self.stores.pop(step, []):
            run.call("complete_store", keys, ctxs=req.contexts)
            self.stats.stored_blocks += len(keys)
            self.active -= _job_done(req)
        self.stats.events += len(run.call("take_events"))
        run.step += 1


def _job_done(req: _Request) -> int:
    """Count a finished transfer of ``req``; 1 when the request is now entirely done."""
    req.jobs -= 1
    return 1 if req.jobs == 0 and req.finish_at == -1 else 0


def _new_request(
    index: int, keys: list[OffloadKey], copies: int, tokens_per_chunk: int
) -> _Request:
    contexts = []
    for _ in range(copies):
        ctx = ReqContext(req_id=f"req-{index}")
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * tokens_per_chunk)
        contexts.append(ctx)
    return _Request(index, keys, contexts)


def record_calls(
    requests: Iterable[Sequence[OffloadKey]], manager: OffloadingManager, **options: Any
) -> tuple[list[Call], ReplayStats]:
    """The calls :func:`replay_like_connector` makes to ``manager`` alone, and its stats."""
    recorder = _Calls()
    stats = replay_like_connector(requests, [manager], recorders=[recorder], **options)
    return recorder.calls, stats


def time_calls(
    calls: Sequence[Call],
    make_manager: Callable[[], OffloadingManager],
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds (of ``clock``) a fresh manager takes to answer ``calls`` (from
    :func:`record_calls`), with fresh request contexts, nothing else timed. The garbage
    collector is paused while it runs."""
    fresh: dict[int, ReqContext] = {}
    prepared: list[tuple[str, tuple[Any, ...]]] = []
    for method, args in calls:
        if args and isinstance(args[-1], ReqContext):
            old = args[-1]
            ctx = fresh.get(id(old))
            if ctx is None:
                ctx = fresh[id(old)] = ReqContext(req_id=old.req_id)
                for key, pos in old._offload_key_positions.items():
                    ctx.set_offload_key_position(key, pos)
            args = (*args[:-1], ctx)
        prepared.append((method, args))
    manager = make_manager()
    bound = [(getattr(manager, method), args) for method, args in prepared]
    gc.collect()
    gc.disable()
    try:
        start = clock()
        for fn, args in bound:
            fn(*args)
        return clock() - start
    finally:
        gc.enable()
