"""SGLang's own ``HiCacheController`` on a CPU, with our backend attached, driven as the
scheduler drives it: ``write_storage`` (its backup thread calls ``batch_set_v1``),
``prefetch`` (its prefetch thread calls ``batch_exists``; the scheduler then lends host
pages and its prefetch I/O thread calls ``batch_get_v1``), and the acks back.

What stands in for SGLang's scheduler here: the device KV pool (the controller only
reads its device, layer count and layer-transfer counter on the storage paths), the
parallel context (TP 1, set with SGLang's own ``get_parallel().override``), and the
scheduler thread's part of a prefetch (lending host pages once the hit is known).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

from tests.sglang.harness import LAYERS, PAGE, WAIT_S, extra, mha_pool, pages_bytes

#: Device tokens of the rig's pool (its host pool holds twice as many).
TOKENS = 2048


class _DevicePool:
    device = torch.device("cpu")
    layer_num = LAYERS

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


class _Allocator:
    def __init__(self) -> None:
        self.pool = _DevicePool()

    def get_kvcache(self) -> _DevicePool:
        return self.pool


class Rig:
    """A controller over an MHA host pool in ``layout``, storage attached."""

    def __init__(self, tiers: list[dict[str, Any]], layout: str = "page_first") -> None:
        self.pool = mha_pool(layout, tokens=TOKENS)
        self.lock = threading.Lock()  # the pool's allocator is the scheduler's alone
        with get_parallel().override(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
        ):
            self.ctrl = HiCacheController(
                _Allocator(),
                self.pool,
                PAGE,
                tp_group=None,
                load_cache_event=threading.Event(),
                io_backend="direct",
                storage_backend="dynamic",
                model_name="tiny-llama",
                storage_backend_extra_config=extra(tiers),
            )
        self.backend = self.ctrl.storage_backend

    def alloc(self, tokens: int) -> torch.Tensor:
        with self.lock:
            indices: torch.Tensor | None = self.pool.alloc(tokens)
        assert indices is not None, f"the host pool has no {tokens} tokens free"
        return indices

    def free(self, indices: torch.Tensor) -> None:
        with self.lock:
            self.pool.free(indices)

    def backup(self, tokens: list[int], indices: torch.Tensor) -> int:
        """Back ``indices`` up as ``tokens``' pages; the tokens the backup thread stored."""
        keys = get_storage_hash_str(tokens, None, page_size=PAGE)
        op_id = self.ctrl.write_storage(indices, tokens, hash_value=keys)
        op = _take(self.ctrl.ack_backup_queue, lambda o: o.id == op_id, "the backup ack")
        return int(op.completed_tokens)

    def prefetch(self, rid: str, tokens: list[int]) -> tuple[int, list[bytes], list[str]]:
        """Prefetch ``tokens``; the tokens that arrived, their pages' bytes (read before
        the host pages go back) and the page keys the hit query confirmed."""
        op = self.ctrl.prefetch(rid, tokens)
        hit = _take(self.ctrl.prefetch_hit_queue, lambda o: o is op, "the hit query")
        confirmed = list(op.hash_value)
        if op.storage_hit_count == 0:
            return 0, [], confirmed
        op.host_indices = self.alloc(op.storage_hit_count)
        self.ctrl.prefetch_buffer.put(hit)
        done = 0
        while True:
            ack = _take(self.ctrl.ack_prefetch_queue, lambda a: a.operation is op, "a prefetch ack")
            if ack.completed_tokens is not None:
                done = max(done, int(ack.completed_tokens))
            if ack.completed_req:
                break
        got = pages_bytes(self.pool, op.host_indices[:done])
        self.free(op.host_indices)
        return done, got, confirmed

    def close(self) -> None:
        self.ctrl.detach_storage_backend()


def _take(q: queue.Queue[Any], match: Any, what: str) -> Any:
    """The next item of ``q`` that ``match``es (others are put back), within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    skipped = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{what} did not come within {WAIT_S} s")
            try:
                item = q.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if match(item):
                return item
            skipped.append(item)
    finally:
        for item in skipped:
            q.put(item)


def prompt(seed: int, pages: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32_000, (pages * PAGE,), generator=gen).tolist()
