"""The demo's run: :func:`run_demo` builds the engine (and its disk, remote tiers and
integrations), serves the workload on the running loop and returns a
:class:`~asyncoffload.demo.DemoReport`."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

import torch
from pydantic import ValidationError

from asyncoffload.config import EngineConfig
from asyncoffload.demo.progress import ProgressMode, _Progress, _show_progress
from asyncoffload.demo.report import DemoReport, EventCounts
from asyncoffload.demo.server import _Server
from asyncoffload.demo.settings import DemoConfig, DemoConfigError, _check_workload_size
from asyncoffload.engine import AsyncOffloadEngine
from asyncoffload.errors import HostMemoryError
from asyncoffload.events import EventSubscription, Lagged
from asyncoffload.hostmem import check_host_bytes, format_bytes
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.policies import AdaptivePolicy, CachePolicy
from asyncoffload.simkv import SimulatedKVCache
from asyncoffload.tiers.disk import DiskTier
from asyncoffload.tiers.mooncake import MooncakeStore, MooncakeTier
from asyncoffload.tiers.remote import RemoteTier
from asyncoffload.workloads import Request, summarize

if TYPE_CHECKING:
    from asyncoffload.integrations.kv_events import KVEventPublisher

__all__ = ["run_demo"]


async def run_demo(
    cfg: DemoConfig | None = None,
    progress: bool | ProgressMode = "auto",
    *,
    stream: TextIO | None = None,
) -> DemoReport:
    """Run the demo on the running loop and report.

    ``progress``: ``"auto"`` (or ``True``) draws a progress bar on ``stream`` (default
    stderr) when it is a terminal, ``"always"`` draws it anyway, ``"never"`` (or
    ``False``) never. While it runs, torch's intra-op thread count is
    ``cfg.torch_threads`` (process-wide; restored afterwards). Raises
    :class:`DemoConfigError` when the settings don't fit the workload.
    """
    cfg = cfg if cfg is not None else DemoConfig()
    mode: ProgressMode = "auto" if progress is True else "never" if progress is False else progress
    out = stream if stream is not None else sys.stderr
    show = mode == "always" or (mode == "auto" and out.isatty())
    saved_threads = torch.get_num_threads()
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    try:
        return await _run(cfg, out if show else None)
    finally:
        torch.set_num_threads(saved_threads)


async def _run(cfg: DemoConfig, progress_stream: TextIO | None) -> DemoReport:
    _check_workload_size(cfg)
    requests = cfg.workload()
    summary = summarize(requests)
    gpu_blocks = _gpu_blocks(cfg, summary.max_request_blocks)
    if cfg.remote_url is not None:
        await _check_server(cfg.remote_url)
    kv = SimulatedKVCache(
        cfg.layers, max(gpu_blocks, 1), cfg.block_size, cfg.kv_heads, cfg.head_dim, cfg.seed
    )
    engine = _open_engine(cfg, kv)
    if cfg.mooncake_master is not None:
        await _check_mooncake(engine, cfg.mooncake_master)
    state = _Progress()
    counts = EventCounts()
    finished = asyncio.Event()
    loop = asyncio.get_running_loop()
    bar: asyncio.Task[None] | None = None
    integrations = _Integrations(cfg, engine)
    async with contextlib.AsyncExitStack() as stack:
        # Started before the first request, closed after the engine: the publisher sends
        # every event, the last ones included.
        await integrations.start(stack)
        async with engine:
            # Subscribed before the first request: the subscriber sees every event. The
            # subscription ends when the engine closes, after its buffered events.
            counter = asyncio.create_task(_count_events(engine.events(), counts))
            if progress_stream is not None:
                bar = asyncio.create_task(
                    _show_progress(state, len(requests), progress_stream, finished)
                )
            t0 = time.perf_counter()
            prelookup = None
            prelookup_hits: tuple[int, tuple[int, ...]] = (0, ())
            if cfg.remote_url is not None or cfg.mooncake_master is not None:
                prelookup = await _remote_prelookup(engine, requests)
                before = engine.stats()
                prelookup_hits = (before.lookup_hits, tuple(t.lookup_hits for t in before.tiers))
            try:
                await _Server(cfg, engine, kv, state).run(requests)
            finally:
                finished.set()
                if bar is not None:
                    await bar
        # aclose waited for every copy.
        wall = time.perf_counter() - t0
    await counter
    stats = engine.stats()
    lat = sorted(state.latencies_s)
    return DemoReport(
        config=cfg,
        loop=_loop_name(loop),
        requests=state.done + state.failed,
        failed_requests=state.failed,
        prompt_tokens=state.prompt_tokens,
        hit_tokens=state.hit_tokens,
        hit_blocks=state.hit_blocks,
        computed_blocks=state.computed_blocks,
        stores_rejected=state.stores_rejected,
        verified_blocks=state.verified_blocks,
        mismatches=state.mismatches,
        unique_blocks=summary.unique_blocks,
        gpu_blocks=gpu_blocks,
        wall_s=wall,
        request_latency_p50_ms=_percentile(lat, 50) * 1e3,
        request_latency_p99_ms=_percentile(lat, 99) * 1e3,
        events=counts,
        stats=stats,
        publisher=integrations.publisher.stats() if integrations.publisher else None,
        publish_endpoints=integrations.endpoints,
        metrics_url=integrations.metrics_url,
        promotions_refused=state.promotions_refused,
        stores_cut=state.stores_cut,
        remote_prelookup=prelookup,
        prelookup_hits=prelookup_hits,
        policy_run=policy_run(engine.manager.policy),
    )


def policy_run(policy: CachePolicy) -> str:
    """How the demo names the policy it ran: its name, ``(the default)`` where it is
    the engine's default, and for ``auto`` the candidate it followed at the end."""
    name = policy.name or type(policy).__name__
    if name == EngineConfig.model_fields["policy"].default:
        name += " (the default)"
    if isinstance(policy, AdaptivePolicy):
        name += f", following {policy.leader} at the end after {policy.switches} switches"
    return name


def _gpu_blocks(cfg: DemoConfig, largest: int) -> int:
    """The simulated GPU KV cache's blocks; raises :class:`DemoConfigError` when it cannot
    hold the workload's ``largest`` request, or the host cannot hold it and the CPU tier."""
    gpu_blocks = cfg.gpu_blocks if cfg.gpu_blocks is not None else cfg.concurrency * largest
    if gpu_blocks < largest:
        raise DemoConfigError(
            f"gpu_blocks={gpu_blocks} cannot hold the largest request of the workload "
            f"({largest} blocks)"
        )
    block_bytes = cfg.block_bytes
    try:
        check_host_bytes(
            (max(gpu_blocks, 1) + cfg.cpu_blocks) * block_bytes,
            f"the demo ({max(gpu_blocks, 1)} simulated GPU blocks and {cfg.cpu_blocks} CPU "
            f"blocks of {format_bytes(block_bytes)} each: --layers {cfg.layers})",
        )
    except HostMemoryError as exc:
        raise DemoConfigError(f"{exc}; lower --layers, --cpu-blocks or --concurrency") from None
    return gpu_blocks


def _open_engine(cfg: DemoConfig, kv: SimulatedKVCache) -> AsyncOffloadEngine:
    """The demo's engine over ``kv``; a tier that cannot open is a :class:`DemoConfigError`
    naming it."""
    engine_cfg = EngineConfig(
        cpu_blocks=cfg.cpu_blocks,
        policy=cfg.policy,
        completion=cfg.completion,
        event_buffer=cfg.event_buffer,
        tiers=[*_disk_tiers(cfg), *_remote_tiers(cfg), *_mooncake_tiers(cfg)],
        model="asyncoffload-demo",
    )
    try:
        return AsyncOffloadEngine(kv.kv_caches, engine_cfg)
    except (OSError, RuntimeError, ValueError) as exc:
        if not engine_cfg.tiers:
            raise
        where = (
            f"the disk tier in {cfg.disk_path}"
            if cfg.disk_path
            else "the remote tier"
            if cfg.remote_url
            else f"the Mooncake tier at {cfg.mooncake_master}"
        )
        raise DemoConfigError(f"{where}: {exc}") from None


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    idx = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[idx]


def _loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


async def _count_events(sub: EventSubscription, counts: EventCounts) -> None:
    async for item in sub:
        if isinstance(item, Lagged):
            counts.lagged += 1
            counts.missed += item.missed
        elif item.removed:
            counts.events += 1
            counts.removed_events += 1
            counts.removed_keys += len(item.keys)
        else:
            counts.events += 1
            counts.stored_events += 1
            counts.stored_keys += len(item.keys)


def _disk_tiers(cfg: DemoConfig) -> list[DiskTier]:
    """The disk tier of ``cfg.disk_path``: a slab that writes every block the CPU tier
    stores (no admission filter: the demo stores each block once, so the default
    second-offer rule would write almost nothing)."""
    if cfg.disk_path is None:
        return []
    from asyncoffload.tiers.format import block_file_bytes

    slot = block_file_bytes(cfg.block_bytes)
    if cfg.disk_bytes < slot:
        raise DemoConfigError(
            f"--disk-bytes {cfg.disk_bytes} holds no block: one takes {format_bytes(slot)} on disk"
        )
    try:
        return [DiskTier(cfg.disk_path, cfg.disk_bytes, "slab", admission=None)]
    except ValueError as exc:
        # The tier's own checks (a capacity no file can have...): one line, no traceback.
        problems = (
            [str(e["msg"]).removeprefix("Value error, ") for e in exc.errors()]
            if isinstance(exc, ValidationError)
            else [str(exc)]
        )
        raise DemoConfigError(
            f"the disk tier (--disk, --disk-bytes): {'; '.join(problems)}"
        ) from None


def _remote_tiers(cfg: DemoConfig) -> list[RemoteTier]:
    """The shared tier at ``cfg.remote_url``: every block the CPU tier stores is written
    to it (no admission filter, as for the disk tier: a shared tier is for sharing)."""
    if cfg.remote_url is None:
        return []
    return [RemoteTier(cfg.remote_url, admission=None)]


def _mooncake_tiers(cfg: DemoConfig) -> list[MooncakeTier]:
    """The shared tier on Mooncake Store at ``cfg.mooncake_master``: every block the CPU
    tier stores is written to it. The demo's client gives the pool 256 MiB, so a master
    without storage nodes holds blocks too (while this demo runs)."""
    if cfg.mooncake_master is None:
        return []
    return [
        MooncakeTier(
            cfg.mooncake_master, admission=None, segment_bytes=256 << 20, start_timeout_s=10.0
        )
    ]


async def _check_mooncake(engine: AsyncOffloadEngine, master: str) -> None:
    """Fail early, naming the master, when the tier's client cannot be set up."""
    store = next(t for t in engine.tiers if isinstance(t, MooncakeStore))
    try:
        await store.connect()
    except OSError as exc:
        await engine.aclose()
        raise DemoConfigError(f"the Mooncake tier at {master}: {exc}") from None


async def _check_server(url: str) -> None:
    """Fail early, with the URL in the message, when the server does not answer."""
    from redis.asyncio import Redis

    client = Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        await client.ping()
    except Exception as exc:
        host = url.split("@")[-1]  # never a password
        raise DemoConfigError(f"the remote tier at {host} does not answer: {exc}") from None
    finally:
        await client.aclose()


async def _remote_prelookup(
    engine: AsyncOffloadEngine, requests: Sequence[Request]
) -> tuple[int, int, float]:
    """Every prompt looked up with ``alookup`` before the workload starts, so that the
    blocks another process stored on the server join the shared tier's index (and load
    from it). Returns (distinct blocks, blocks found on the server, seconds)."""
    t0 = time.perf_counter()
    distinct: set[OffloadKey] = set()
    seen: set[tuple[OffloadKey, ...]] = set()
    # The longest prompt of a prefix chain first: its lookup covers the shorter ones.
    for req in sorted(requests, key=lambda r: len(r.keys), reverse=True):
        keys = tuple(req.keys)
        if not keys or keys in seen:
            continue
        seen.add(keys)
        fresh = [key for key in keys if key not in distinct]
        if not fresh:
            continue
        distinct.update(fresh)
        await engine.alookup(keys)
    found = sum(t.manager.ready for t in engine.stats().tiers if t.medium == "REMOTE")
    return len(distinct), found, time.perf_counter() - t0


class _Integrations:
    """The demo's optional KV-event publisher and Prometheus endpoint."""

    def __init__(self, cfg: DemoConfig, engine: AsyncOffloadEngine) -> None:
        self.cfg = cfg
        self.engine = engine
        self.publisher: KVEventPublisher | None = None
        self.endpoints: tuple[str, str | None] | None = None
        self.metrics_url: str | None = None

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        cfg = self.cfg
        if cfg.publish is not None:
            try:
                from asyncoffload.integrations.kv_events import KVEventPublisher, KVEventsConfig
            except ImportError as exc:
                raise DemoConfigError(
                    f"--publish needs pyzmq and msgspec ({exc}): pip install 'asyncoffload[events]'"
                ) from None
            pub_cfg = KVEventsConfig(
                endpoint=cfg.publish, replay_endpoint=cfg.replay_endpoint, topic=cfg.publish_topic
            )
            try:
                pub = KVEventPublisher(self.engine, pub_cfg)
                await pub.start()
            except OSError as exc:
                raise DemoConfigError(str(exc)) from None
            stack.push_async_callback(pub.aclose)
            self.publisher = pub
            self.endpoints = (pub.endpoint, pub.replay_endpoint)
        if cfg.metrics_port is not None:
            try:
                from asyncoffload.integrations.prometheus import EngineMetrics
            except ImportError as exc:
                raise DemoConfigError(
                    f"--metrics-port needs prometheus_client ({exc}): "
                    "pip install 'asyncoffload[prometheus]'"
                ) from None
            metrics = EngineMetrics(
                self.engine, publishers=[self.publisher] if self.publisher else ()
            )
            try:
                port = metrics.serve(cfg.metrics_port)
            except OSError as exc:
                metrics.close()
                raise DemoConfigError(
                    f"cannot serve metrics on port {cfg.metrics_port}: {exc}"
                ) from None
            stack.callback(metrics.close)
            self.metrics_url = f"http://127.0.0.1:{port}/metrics"
