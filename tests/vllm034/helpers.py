"""vLLM 0.34's tiering (``TieringOffloadingSpec``: vLLM's CPU primary tier in a shared
region, its ``TieringOffloadingManager``) with our ``AsyncOffloadTier`` beneath it, in
this process, on the CPU. Nothing of vLLM's worker runs: a test writes a chunk's bytes
into the primary region rows as vLLM's worker would (every rank's part of a row), and
reads them back from there.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from asyncoffload.integrations.vllm.secondary import AsyncOffloadTier

#: One worker's bytes of one block (and of one chunk: one block a chunk).
WORKER_BYTES = 2048
#: Where vLLM looks for an out-of-tree tier.
MODULE = "asyncoffload.integrations.vllm.secondary"
STEP_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
#: How long a test waits for the tiers' I/O to end (a busy 2-vCPU machine included).
SETTLE_S = 20.0


def tier_entry(tier: dict[str, Any], **more: Any) -> dict[str, Any]:
    """One ``secondary_tiers`` entry of ours."""
    return {"type": "AsyncOffloadTier", "module_path": MODULE, "tier": tier, **more}


def offloading_config(
    secondary: Sequence[dict[str, Any]],
    *,
    chunks: int = 8,
    world: int = 1,
    events: bool = True,
    replicated: bool = False,
) -> OffloadingConfig:
    """What vLLM's connector hands ``TieringOffloadingSpec``: ``chunks`` primary chunks
    (one block each, ``world`` workers' bytes in a row), our tiers beneath."""
    row = max(4096, WORKER_BYTES * (1 if replicated else world))
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers.0", "layers.1"), 0),),
        worker_kv_bytes_per_block=WORKER_BYTES,
        enable_kv_cache_events=events,
        extra_config={
            "cpu_bytes_to_use": chunks * row,
            "secondary_tiers": [dict(entry) for entry in secondary],
        },
        engine_id=f"ao-test-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name="test/model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=world,
            tp_size=world,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=replicated,
    )


def keys_of(*names: str) -> list[OffloadKey]:
    return [make_offload_key(name.encode().ljust(16, b"."), 0) for name in names]


class Engine:
    """vLLM's tiering manager (``TieringOffloadingSpec.get_manager``) over our tiers."""

    def __init__(self, secondary: Sequence[dict[str, Any]], **config: Any) -> None:
        self.spec = TieringOffloadingSpec(offloading_config(secondary, **config))
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        self.view = np.asarray(manager.primary_tier.get_kv_memoryview())
        self.tiers = [t for t in manager.secondary_tiers if isinstance(t, AsyncOffloadTier)]
        self._requests = 0

    @property
    def tier(self) -> AsyncOffloadTier:
        return self.tiers[0]

    def request(self) -> ReqContext:
        self._requests += 1
        ctx = ReqContext(req_id=f"r{self._requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def settle(self, what: str = "the tiers' I/O") -> None:
        """Step as vLLM does while the manager has pending work (bounded)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            self.manager.on_schedule_end(STEP_END)
            if not self.manager.has_pending_work():
                return
            assert time.monotonic() < deadline, f"{what} did not end within {SETTLE_S} s"
            time.sleep(0.002)

    def store(self, keys: Sequence[OffloadKey], rows: np.ndarray) -> None:
        """Store ``keys`` with the bytes ``rows`` (one row each) as vLLM's connector
        does: the primary tier's slots, the worker's copy into them, complete_store
        (which cascades to every secondary tier), then steps until the cascade ended."""
        ctx = self.request()
        out = self.manager.prepare_store(list(keys), ctx)
        assert out is not None and list(out.keys_to_store) == list(keys)
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        self.view[np.asarray(out.store_spec.chunk_ids)] = rows
        self.manager.complete_store(list(keys), ctx, success=True)
        self.manager.on_request_finished(ctx)
        self.settle("the cascade to the secondary tiers")

    def forget_primary(self) -> None:
        """Empty vLLM's primary tier (``reset_cache``: drains the tiers first) and zero
        its region, so a chunk is in our tier only."""
        self.manager.reset_cache()
        self.manager.on_reset_flushed()
        self.view[:] = 0

    def promote(self, keys: Sequence[OffloadKey]) -> tuple[list[LookupResult], ReqContext]:
        """Look ``keys`` up as vLLM's scheduler does, step by step, until each answer is
        final (``HIT`` or ``MISS``); the answers and the request."""
        ctx = self.request()
        deadline = time.monotonic() + SETTLE_S
        answers: dict[OffloadKey, LookupResult] = {}
        while len(answers) < len(keys):
            for key in keys:
                if key in answers:
                    continue
                result = self.manager.lookup(key, ctx)
                if result in (LookupResult.HIT, LookupResult.MISS):
                    answers[key] = result
            self.manager.on_schedule_end(STEP_END)
            assert time.monotonic() < deadline, f"lookups of {len(keys)} keys did not settle"
            time.sleep(0.002)
        return [answers[key] for key in keys], ctx

    def rows_of(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> np.ndarray:
        """The primary rows of ``keys`` (HIT), as vLLM's worker would load them."""
        spec = self.manager.prepare_load(list(keys), ctx)
        assert isinstance(spec, CPULoadStoreSpec)
        rows: np.ndarray = self.view[np.asarray(spec.chunk_ids)].copy()
        self.manager.complete_load(list(keys), ctx)
        return rows

    def events(self) -> list[Any]:
        return list(self.manager.take_events())

    def close(self) -> None:
        # vLLM releases its view of the region at shutdown: no export of it may remain.
        self.view = np.empty((0, 0), dtype=np.int8)
        self.manager.shutdown()


def random_rows(n: int, row_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-128, 128, (n, row_bytes), dtype=np.int8)
