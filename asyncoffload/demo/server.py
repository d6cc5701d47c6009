"""The simulated server: requests served against one engine and a simulated GPU KV cache.

Each request takes KV blocks from a :class:`BlockAllocator`, looks up its prompt's prefix
in the CPU tier, loads the hit blocks into the :class:`~asyncoffload.simkv.SimulatedKVCache`
and checks them bit for bit, "computes" the rest (writes their deterministic content and
sleeps for a time proportional to the tokens) and stores its new blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence

from asyncoffload.demo.progress import _Progress
from asyncoffload.demo.settings import DemoConfig
from asyncoffload.engine import AsyncOffloadEngine
from asyncoffload.errors import CapacityError, PromotionError, TransferError
from asyncoffload.manager import ReqContext
from asyncoffload.simkv import SimulatedKVCache
from asyncoffload.workloads import Request

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """A free list of KV blocks; ``allocate`` waits, first come first served, while
    too few are free."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._waiters: deque[tuple[int, asyncio.Future[list[int]]]] = deque()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _take(self, n: int) -> list[int]:
        free = self._free
        ids = free[len(free) - n :]
        del free[len(free) - n :]
        return ids

    async def allocate(self, n: int) -> list[int]:
        if n > self.num_blocks:
            raise ValueError(f"{n} blocks asked for, the KV cache has {self.num_blocks}")
        if not self._waiters and n <= len(self._free):
            return self._take(n)
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.free(fut.result())  # handed over just as we were cancelled
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)
        self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= len(self._free):
            n, fut = waiters.popleft()
            if not fut.done():
                fut.set_result(self._take(n))


class _Server:
    """Serves requests against one engine."""

    def __init__(
        self,
        cfg: DemoConfig,
        engine: AsyncOffloadEngine,
        kv: SimulatedKVCache,
        progress: _Progress,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.kv = kv
        self.p = progress
        self.alloc = BlockAllocator(kv.num_blocks)
        self.sem = asyncio.Semaphore(cfg.concurrency)
        self.block_bytes = engine.layout.block_bytes
        scale = cfg.time_scale * 1e-6
        self.prefill_s = cfg.prefill_us_per_token * scale
        self.decode_s = cfg.decode_us_per_token * scale

    async def serve(self, req: Request, arrived: float) -> None:
        engine, p = self.engine, self.p
        keys = req.keys
        async with self.sem:
            if self.cfg.settle:
                await engine.flush()
            blocks = await self.alloc.allocate(len(keys))
            try:
                ctx = ReqContext(req.req_id)
                # No await between the lookup and prepare_load: the hits stay resident.
                n = engine.lookup(keys, ctx)
                if n:
                    try:
                        load = await engine.prepare_load(keys[:n], blocks[:n], ctx)
                    except PromotionError:
                        # Disk (or remote) hits need CPU slots to come up through, and every slot
                        # is pinned or being written: recompute, as the engine advises.
                        p.promotions_refused += 1
                        n = 0
                if n:
                    await load
                    # Checks and writes run off the loop, as a GPU's kernels would.
                    # (Not `p.mismatches += await ...`: that reads the counter before
                    # the await and loses the updates of concurrent requests.)
                    bad = await asyncio.to_thread(self.kv.check, keys[:n], blocks[:n])
                    p.mismatches += bad
                    p.verified_blocks += n
                    p.bytes_moved += n * self.block_bytes
                # "Compute" the rest of the prompt and the reply.
                if n < len(keys):
                    await asyncio.to_thread(self.kv.write, keys[n:], blocks[n:])
                hit_tokens = min(n * self.cfg.block_size, req.input_tokens)
                compute_s = (
                    req.input_tokens - hit_tokens
                ) * self.prefill_s + req.output_tokens * self.decode_s
                if compute_s > 0:
                    await asyncio.sleep(compute_s)
                if n < len(keys):
                    try:
                        handle = await engine.prepare_store(keys[n:], blocks[n:], ctx)
                    except CapacityError as exc:
                        # More new blocks than the CPU tier holds: store the part of the
                        # prompt that fits, its front (what a later lookup can hit).
                        p.stores_cut += 1
                        end = n + exc.num_blocks
                        handle = await engine.prepare_store(keys[n:end], blocks[n:end], ctx)
                    if handle is None:
                        p.stores_rejected += 1
                    else:
                        result = await handle
                        p.bytes_moved += result.nbytes
            except TransferError:
                p.failed += 1
                return
            finally:
                self.alloc.free(blocks)
        p.done += 1
        p.prompt_tokens += req.input_tokens
        p.hit_tokens += hit_tokens
        p.hit_blocks += n
        p.computed_blocks += len(keys) - n
        p.latencies_s.append(time.perf_counter() - arrived)

    async def run(self, requests: Sequence[Request]) -> None:
        """Start every request as a task at its (scaled) arrival time; wait for all."""
        tasks: list[asyncio.Task[None]] = []
        errors: list[BaseException] = []

        def on_done(task: asyncio.Task[None]) -> None:
            exc = None if task.cancelled() else task.exception()
            if exc is not None:
                errors.append(exc)

        scale = self.cfg.time_scale
        t0 = time.perf_counter()
        try:
            for req in requests:
                if errors:
                    break
                delay = t0 + req.arrival_s * scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(self.serve(req, time.perf_counter()))
                task.add_done_callback(on_done)
                tasks.append(task)
            if tasks and not errors:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)
        if errors:
            raise errors[0]
