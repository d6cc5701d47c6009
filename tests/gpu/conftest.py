"""Helpers of the CUDA test suite: KV caches on the GPU, byte views, a failing backend.

Every test module here carries ``pytestmark = GPU`` (below), so without a CUDA device
each test is reported as skipped and nothing touches CUDA, at collection or later.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

import asyncoffload as ao
from asyncoffload.transfer.cuda import CopyMethod, CudaCopyBackend, CudaJob

HAS_CUDA = torch.cuda.is_available()
_NO_CUDA_REASON = "needs a CUDA device (torch.cuda.is_available())"

#: The marks of every GPU test module: ``pytestmark = GPU``.
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason=_NO_CUDA_REASON),
]
_NO_CUDA = "the GPU suite needs a CUDA device (torch.cuda.is_available())"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Without a GPU, every skip of this suite is reported at one place, so that the
    run's summary says it on one line ("SKIPPED [350] tests/gpu: ...") instead of one
    line per test."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if not HAS_CUDA and report.skipped and isinstance(report.longrepr, tuple):
        report.longrepr = ("tests/gpu", None, _NO_CUDA)  # type: ignore[assignment]


#: Copy methods a transfer can be forced to use.
METHODS: tuple[CopyMethod, ...] = ("batch", "kernel", "staged", "gather")
#: Those, and the per-transfer choice.
ALL_METHODS: tuple[CopyMethod, ...] = (*METHODS, "auto")

DTYPES = [torch.bfloat16, torch.float16, torch.int8, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

SPLIT_INNER = (16, 8, 128)  # [2, num_blocks, block_size, heads, head_dim]
UNSPLIT_INNER = (16, 576)  # [num_blocks, block_size, latent_dim] (MLA-like)


@pytest.fixture(autouse=True)
def _synchronize_after_test() -> Iterator[None]:
    """Leave no GPU work of one test running into the next."""
    yield
    if HAS_CUDA:
        torch.cuda.synchronize()


# --- KV caches and their bytes ------------------------------------------------------------


def random_kv(
    num_layers: int,
    num_blocks: int,
    *,
    kv_split: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    inner: tuple[int, ...] | None = None,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Per-layer KV tensors on the GPU holding random bit patterns of ``dtype`` (NaNs and
    all: made as bytes on the CPU, then viewed as ``dtype``)."""
    if inner is None:
        inner = SPLIT_INNER if kv_split else UNSPLIT_INNER
    shape = (2, num_blocks, *inner) if kv_split else (num_blocks, *inner)
    itemsize = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    for _ in range(num_layers):
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=gen)
        out.append(raw.to(torch.uint8).view(dtype).to("cuda"))
    return out


def fragments(t: torch.Tensor, kv_split: bool) -> list[torch.Tensor]:
    """``[num_blocks, fragment_bytes]`` uint8 views of one layer, in host order."""
    num_blocks = t.shape[1] if kv_split else t.shape[0]
    raw = t.reshape(-1).view(torch.uint8)
    if kv_split:
        both = raw.view(2, num_blocks, -1)
        return [both[0], both[1]]
    return [raw.view(num_blocks, -1)]


def index(blocks: Sequence[int]) -> torch.Tensor:
    """Block ids as a GPU index tensor. Made with a synchronous copy: build it before
    queueing work the test must not wait for."""
    return torch.tensor(list(blocks), dtype=torch.int64, device="cuda")


def gather_rows(kv: Sequence[torch.Tensor], idx: torch.Tensor, kv_split: bool) -> torch.Tensor:
    """A GPU uint8 ``[len(idx), block_bytes]`` copy of KV blocks ``idx``, each row in host
    (block-major) order: layer 0 K, layer 0 V, layer 1 K, ... Queued on the current
    stream; nothing waits for it."""
    return torch.cat([f.index_select(0, idx) for t in kv for f in fragments(t, kv_split)], dim=1)


def block_rows(kv: Sequence[torch.Tensor], blocks: Sequence[int], kv_split: bool) -> torch.Tensor:
    """:func:`gather_rows` of ``blocks``, on the CPU."""
    return gather_rows(kv, index(blocks), kv_split).cpu()


def as_bytes(row: torch.Tensor) -> bytes:
    """The bytes of a CPU uint8 tensor (without numpy, which torch does not require)."""
    c = row.contiguous()
    return ctypes.string_at(c.data_ptr(), c.numel())


def fill_blocks(
    kv: Sequence[torch.Tensor], blocks: Sequence[int], kv_split: bool, byte: int
) -> None:
    """Set every byte of KV blocks ``blocks`` to ``byte``: kernels queued on the current
    stream, nothing synchronizes."""
    for t in kv:
        for f in fragments(t, kv_split):
            for b in blocks:
                f[b].fill_(byte)


def write_rows(
    kv: Sequence[torch.Tensor], blocks: Sequence[int], rows: torch.Tensor, kv_split: bool
) -> None:
    """Write ``rows`` (uint8 ``[len(blocks), block_bytes]`` on the GPU, host order) into
    KV blocks ``blocks``, on the current stream."""
    idx = index(blocks)
    offset = 0
    for t in kv:
        for f in fragments(t, kv_split):
            width = f.shape[1]
            f.index_copy_(0, idx, rows[:, offset : offset + width])
            offset += width


def overwrite(kv: Sequence[torch.Tensor], seed: int) -> None:
    """Replace every byte of every KV tensor with fresh random bits."""
    gen = torch.Generator().manual_seed(seed)
    for t in kv:
        raw = t.reshape(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def host_slots(engine: ao.AsyncOffloadEngine, keys: Sequence[ao.OffloadKey]) -> list[int]:
    """The host slot of each stored key."""
    slots: list[int] = []
    for key in keys:
        block = engine.manager.block_of(key)
        assert block is not None, key.hex()
        slots.append(block.block_id)
    return slots


def make_keys(n: int, prefix: bytes = b"g", group: int = 0) -> list[ao.OffloadKey]:
    return [ao.make_offload_key(prefix + i.to_bytes(8, "big"), group) for i in range(n)]


# --- engines ------------------------------------------------------------------------------


def require_method(kv: Sequence[torch.Tensor], method: str, *, pin: bool = True) -> None:
    """Skip the test if the CUDA backend reports ``method`` unavailable here."""
    if method in ("auto", "gather"):
        return
    probe = CudaCopyBackend(kv, ao.KVLayout.infer(kv), 1, pin=pin)
    try:
        available = probe._available(method)
    finally:
        probe.close()
    if not available:
        why = {
            "batch": "cuMemcpyBatchAsync (driver 12.8+ and the native CUDA helper)",
            "kernel": "the Triton copy kernel (Triton, a pinned pool, 8-byte fragments)",
        }[method]
        pytest.skip(f"copy_method={method!r} unavailable here: needs {why}")


def cuda_backend(engine: ao.AsyncOffloadEngine) -> CudaCopyBackend:
    backend = engine.backend
    assert isinstance(backend, CudaCopyBackend), backend
    return backend


#: 32 KiB fragments in bf16: ``auto`` takes the native kernel for few blocks.
NATIVE_INNER = (16, 8, 128)


def needs_native(backend: CudaCopyBackend) -> CudaCopyBackend:
    """``backend``, or a skip where the native copy path is unavailable."""
    if not backend.has_native:
        pytest.skip("the native copy path is unavailable here")
    return backend


def make_engine(
    kv: Sequence[torch.Tensor], method: str = "auto", *, cpu_blocks: int = 32, **config: Any
) -> ao.AsyncOffloadEngine:
    """An engine on the CUDA backend with ``copy_method=method``; skips the test if the
    backend reports the method unavailable."""
    require_method(kv, method, pin=bool(config.get("pin_memory", True)))
    cfg = ao.EngineConfig.model_validate(
        {"cpu_blocks": cpu_blocks, "copy_method": method, **config}
    )
    engine = ao.AsyncOffloadEngine(kv, cfg)
    assert engine.backend.name == "cuda"
    return engine


def methods_used(engine: ao.AsyncOffloadEngine) -> dict[str, int]:
    used = engine.stats().backend_info["transfers_by_method"]
    assert isinstance(used, dict)
    return {str(k): int(v) for k, v in used.items()}


class FailingCudaBackend(CudaCopyBackend):
    """Submissions of the directions in ``fail`` (0: store, 1: load) raise, as a CUDA
    error at enqueue time would."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail: set[int] = set()

    def _enqueue(
        self, method: str, direction: int, gpu_ids: list[int], host_ids: list[int]
    ) -> list[Any]:
        if direction in self.fail:
            raise RuntimeError("injected CUDA error")
        return super()._enqueue(method, direction, gpu_ids, host_ids)

    def _queue_native(
        self, job: CudaJob, direction: int, gpu_ids: Sequence[int], host_ids: Sequence[int]
    ) -> None:
        if direction in self.fail:
            raise RuntimeError("injected CUDA error")
        super()._queue_native(job, direction, gpu_ids, host_ids)


# --- GPU timing ---------------------------------------------------------------------------


@functools.cache
def _cycles_per_second() -> float:
    """Clock cycles ``torch.cuda._sleep`` spins per second, at the highest rate seen: the
    SM clock ramps up under load, so a sleep lasts at least what was asked, often more."""
    cycles = 50_000_000
    rates: list[float] = []
    for _ in range(4):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
        end.record()
        end.synchronize()
        rates.append(cycles / (float(start.elapsed_time(end)) / 1e3))
    return max(rates)


def gpu_sleep(seconds: float) -> None:
    """Queue a kernel that keeps the current stream busy for about ``seconds``."""
    torch.cuda._sleep(int(seconds * _cycles_per_second()))  # type: ignore[no-untyped-call]


async def spin(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def record_store_callbacks(engine: ao.AsyncOffloadEngine, log: list[tuple[int, int]]) -> None:
    """Log ``(thread id, number of keys)`` of every ``complete_store`` call."""
    manager = engine.manager
    real = manager.complete_store

    def complete_store(
        keys: Sequence[ao.OffloadKey], ctx: ao.ReqContext | None = None, success: bool = True
    ) -> None:
        log.append((threading.get_ident(), len(keys)))
        real(keys, ctx, success)

    manager.complete_store = complete_store  # type: ignore[method-assign]
