"""Shared test fixtures: small KV caches, keys, and backends that block or fail on demand."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

import asyncoffload as ao
from asyncoffload.tiers.base import TierManager
from asyncoffload.transfer.base import host_bytes


class FakeClock:
    """Seconds a test moves by hand (``now``): the clock of a policy or a pin table."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_keys(n: int, prefix: bytes = b"k", group: int = 0) -> list[ao.OffloadKey]:
    return [ao.make_offload_key(prefix + i.to_bytes(8, "big"), group) for i in range(n)]


def random_kv(
    num_layers: int,
    num_blocks: int,
    *,
    kv_split: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Per-layer KV tensors filled with random bit patterns of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, 4, 2, 8) if kv_split else (num_blocks, 4, 16)
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = []
    for _ in range(num_layers):
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=gen)
        out.append(raw.to(torch.uint8).view(dtype).contiguous())
    return out


def block_bytes(kv: Sequence[torch.Tensor], block: int, kv_split: bool = True) -> bytes:
    """Every byte of one block across layers, in host (block-major) order."""
    parts = []
    for t in kv:
        if kv_split:
            parts.append(host_bytes(t[0, block].cpu()))
            parts.append(host_bytes(t[1, block].cpu()))
        else:
            parts.append(host_bytes(t[block].cpu()))
    return b"".join(parts)


class GatedBackend(ao.CpuCopyBackend):
    """Copies wait until their direction's gate opens; lets tests hold copies in flight."""

    def __init__(self, kv: Sequence[torch.Tensor], layout: ao.KVLayout, n: int) -> None:
        super().__init__(kv, layout, n, copy_engine="threads")
        self.store_gate = threading.Event()
        self.load_gate = threading.Event()
        self.store_gate.set()
        self.load_gate.set()

    def _copy_store(self, gpu_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        if not self.store_gate.wait(timeout=30):
            raise TimeoutError("store gate never opened")
        super()._copy_store(gpu_idx, host_idx)

    def _copy_load(self, host_idx: torch.Tensor, gpu_idx: torch.Tensor) -> None:
        if not self.load_gate.wait(timeout=30):
            raise TimeoutError("load gate never opened")
        super()._copy_load(host_idx, gpu_idx)

    def close(self) -> None:
        self.store_gate.set()
        self.load_gate.set()
        super().close()


class FailingBackend(ao.CpuCopyBackend):
    """Copies fail while the matching flag is set (an injected device error)."""

    def __init__(self, kv: Sequence[torch.Tensor], layout: ao.KVLayout, n: int) -> None:
        super().__init__(kv, layout, n, copy_engine="threads")
        self.fail_store = False
        self.fail_load = False
        self.fail_submit = False

    def submit_store(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> ao.CopyJob:
        if self.fail_submit:
            raise RuntimeError("injected submission failure")
        return super().submit_store(gpu_ids, host_ids)

    def _copy_store(self, gpu_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        if self.fail_store:
            raise RuntimeError("injected store failure")
        super()._copy_store(gpu_idx, host_idx)

    def _copy_load(self, host_idx: torch.Tensor, gpu_idx: torch.Tensor) -> None:
        if self.fail_load:
            raise RuntimeError("injected load failure")
        super()._copy_load(host_idx, gpu_idx)


def make_engine(
    cpu_blocks: int = 16,
    gpu_blocks: int = 32,
    *,
    backend_cls: type[ao.CpuCopyBackend] | None = None,
    kv: list[torch.Tensor] | None = None,
    **config: object,
) -> tuple[ao.AsyncOffloadEngine, list[torch.Tensor]]:
    kv = kv if kv is not None else random_kv(2, gpu_blocks)
    cfg = ao.EngineConfig.model_validate({"cpu_blocks": cpu_blocks, **config})
    backend = None
    if backend_cls is not None:
        backend = backend_cls(kv, ao.KVLayout.infer(kv), cpu_blocks)
    return ao.AsyncOffloadEngine(kv, cfg, backend=backend), kv


def state_of(engine: ao.AsyncOffloadEngine) -> tuple[object, ...]:
    """Everything a rejected call must leave unchanged."""
    m = engine.manager
    blocks = [(k, b.block_id, b.ref_cnt) for k, b in m.policy.items()]
    return (m.stats(), blocks, m.num_free, m.last_seq, engine.stats().in_flight)


def trace_path(name: str = "conversation_trace.jsonl") -> Path:
    """Where a Mooncake trace is: ``$ASYNCOFFLOAD_TRACE_DIR/<name>`` when that is set,
    else ``../shared/traces/<name>`` beside the checkout (docs/policies.md says where to
    get the traces). Tests that need one skip, naming this path, when it is absent."""
    root = os.environ.get("ASYNCOFFLOAD_TRACE_DIR")
    base = Path(root) if root else Path(__file__).resolve().parents[2] / "shared" / "traces"
    return base / name


def record_completions(
    engine: ao.AsyncOffloadEngine, log: list[tuple[str, int, tuple[bytes, ...]]]
) -> None:
    """Record (kind, thread, keys) of every complete_store / complete_load of ``engine``."""
    manager = engine.manager
    real_store, real_load = manager.complete_store, manager.complete_load

    def complete_store(
        keys: Sequence[ao.OffloadKey], ctx: ao.ReqContext | None = None, success: bool = True
    ) -> None:
        log.append(("store", threading.get_ident(), tuple(keys)))
        real_store(keys, ctx, success)

    def complete_load(keys: Sequence[ao.OffloadKey], ctx: ao.ReqContext | None = None) -> None:
        log.append(("load", threading.get_ident(), tuple(keys)))
        real_load(keys, ctx)

    manager.complete_store = complete_store  # type: ignore[method-assign]
    manager.complete_load = complete_load  # type: ignore[method-assign]


class InterruptOnce:
    """``real``, except that its first call raises KeyboardInterrupt instead (a signal
    landing there); ``calls`` counts the calls."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise KeyboardInterrupt
        return self.real(*args, **kwargs)


def tier_index(engine: ao.AsyncOffloadEngine, i: int = 0) -> TierManager:
    """The index of ``engine``'s ``i``-th lower tier (the tier core's: a port holds none)."""
    tiers = engine._tiers
    assert tiers is not None, "the engine has no lower tiers"
    return cast(TierManager, tiers.core.tiers[i].index)
