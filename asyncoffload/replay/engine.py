"""The engine replay: :func:`replay_engine`, the manager replay's sequence through the
async engine on the CPU backend, with real bytes checked bit for bit."""

from __future__ import annotations

import time
from collections.abc import Sequence

from asyncoffload.replay.result import Progress, ReplayResult, _check_capacity, _share, _Tally
from asyncoffload.workloads import Request

__all__ = ["replay_engine"]


async def replay_engine(
    requests: Sequence[Request],
    capacity: int,
    *,
    policy: str = "lru",
    admission: str | None = None,
    unique_blocks: int | None = None,
    share: float | None = None,
    progress: Progress | None = None,
) -> tuple[ReplayResult, int]:
    """:func:`replay` through the async engine with real bytes on the CPU backend.

    A small simulated KV cache (1 layer, 16-token blocks of 1 x 8 bf16 heads, as many
    blocks as the longest request) holds each block's deterministic content; hits are
    loaded into it and checked bit for bit. Returns the result and the number of loaded
    blocks whose bytes did not match (0 when all is well). Requests run one at a time,
    so the hits equal :func:`replay`'s: a store of more new blocks than the tier holds
    (:class:`~asyncoffload.CapacityError`) stores nothing and counts as refused, as the
    manager's ``None`` does there; ``extra["too_large"]`` counts those stores.
    """
    from asyncoffload.config import EngineConfig
    from asyncoffload.engine import AsyncOffloadEngine
    from asyncoffload.errors import CapacityError
    from asyncoffload.simkv import SimulatedKVCache

    _check_capacity(capacity)
    width = max((len(req.keys) for req in requests), default=1) or 1
    cache = SimulatedKVCache(1, width, 16, 1, 8)
    config = EngineConfig(cpu_blocks=capacity, policy=policy, admission=admission)
    tally = _Tally(len(requests), progress)
    mismatches = too_large = 0
    clock = time.perf_counter
    async with AsyncOffloadEngine(cache.kv_caches, config) as engine:
        now = [0.0]  # the trace's time, for a policy that weighs time
        engine.manager.policy.use_clock(lambda: now[0])
        for req in requests:
            now[0] = req.arrival_s
            keys = list(req.keys)
            ids = list(range(len(keys)))
            t0 = clock()
            n = engine.lookup(keys)  # then the engine's own touches (touch_on_load/_store)
            if n:
                load = await engine.prepare_load(keys[:n], ids[:n])
                await load
                mismatches += cache.check(keys[:n], ids[:n])
            cache.write(keys[n:], ids[n:])
            try:
                handle = await engine.prepare_store(keys[n:], ids[n:])
            except CapacityError:
                handle = None
                too_large += 1
            if handle is not None:
                await handle
            stored = None if handle is None else handle.keys_to_store
            tally.add(req, n, stored, clock() - t0)
        st = engine.manager.stats()
        block_bytes = cache.storage[:, :, :1].numel() * cache.storage.element_size()
        result = tally.result(
            policy,
            admission,
            capacity,
            _share(share, capacity, requests, unique_blocks),
            st,
            st.stored * block_bytes,
            st.loaded * block_bytes,
        )
    result.extra["too_large"] = float(too_large)
    return result, mismatches
