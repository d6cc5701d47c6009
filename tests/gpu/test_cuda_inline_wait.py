"""A small native CUDA copy waited for on the loop's thread (issue 25,
``EngineConfig.inline_wait_us``): once the bandwidth of its direction is measured, a copy
expected to end within the bound completes inside ``prepare_store`` / ``prepare_load``
(the handle is resolved when the call returns, with no wake-up round trip); a copy that
does not end within twice the bound (queued behind the caller's work) is handed to its
wake-up and completes as usual; ``inline_wait_us=0`` never waits. Bytes are checked in
every case."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import asyncoffload as ao
from asyncoffload.transfer.cuda import CudaCopyBackend
from tests.gpu.conftest import (
    GPU,
    NATIVE_INNER,
    as_bytes,
    block_rows,
    cuda_backend,
    gpu_sleep,
    make_keys,
    needs_native,
    random_kv,
)
from tests.test_faults import GPU_BLOCKS, PLANS, SEEDS, run_workload

pytestmark = GPU


def _native(engine: ao.AsyncOffloadEngine) -> CudaCopyBackend:
    return needs_native(cuda_backend(engine))


async def _measure(engine: ao.AsyncOffloadEngine, first: int) -> None:
    """Round trips that give both directions a measured bandwidth."""
    for i in range(3):
        keys = make_keys(1, prefix=b"warm%d" % (first + i))
        h = await engine.prepare_store(keys, [0])
        assert h is not None
        await h
        await (await engine.prepare_load(keys, [1]))


def _slot_bytes(engine: ao.AsyncOffloadEngine, key: ao.OffloadKey) -> bytes:
    block = engine.manager.block_of(key)
    assert block is not None
    return cuda_backend(engine).read_host_block(block.block_id)


async def test_a_small_copy_ends_inside_the_call_once_its_bandwidth_is_known() -> None:
    kv = random_kv(4, 16, inner=NATIVE_INNER, seed=11)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=16, inline_wait_us=2000))
    backend = _native(engine)
    async with engine:
        await _measure(engine, 0)
        assert backend._rate[0] and backend._rate[1]
        keys = make_keys(1)
        want = as_bytes(block_rows(kv, [5], True)[0].cpu())
        h = await engine.prepare_store(keys, [5])
        assert h is not None
        assert h.done(), "a measured 1-block store was not waited for in the call"
        assert (await h).duration_s > 0
        assert _slot_bytes(engine, keys[0]) == want
        h = await engine.prepare_load(keys, [9])
        assert h.done(), "a measured 1-block load was not waited for in the call"
        torch.cuda.synchronize()
        assert as_bytes(block_rows(kv, [9], True)[0].cpu()) == want
        assert backend.inline_waits_missed == 0
    assert engine.stats().backend_info["inline_waits_missed"] == 0


async def test_a_copy_behind_the_callers_work_stops_waiting_and_completes_by_wake_up() -> None:
    kv = random_kv(4, 16, inner=NATIVE_INNER, seed=12)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=16, inline_wait_us=50))
    backend = _native(engine)
    async with engine:
        await _measure(engine, 0)
        gpu_sleep(0.05)  # the fill below, and so the store after it, run 50 ms late
        for t in kv:
            t[:, 5].fill_(7)
        keys = make_keys(1)
        h = await engine.prepare_store(keys, [5])
        assert h is not None
        assert not h.done(), "the store behind 50 ms of queued work ended in the call"
        assert backend.inline_waits_missed == 1
        await h
        assert _slot_bytes(engine, keys[0]) == as_bytes(block_rows(kv, [5], True)[0].cpu())
        # Waiting resumes for the next copy once nothing is queued ahead of it.
        h2 = await engine.prepare_store(make_keys(1, prefix=b"next"), [6])
        assert h2 is not None and h2.done()
        await h2


async def test_zero_never_waits_and_the_copy_still_completes() -> None:
    kv = random_kv(4, 16, inner=NATIVE_INNER, seed=13)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=16, inline_wait_us=0))
    backend = _native(engine)
    async with engine:
        await _measure(engine, 0)
        keys = make_keys(1)
        gpu_sleep(0.01)  # so that the copy cannot have ended before the call returns
        h = await engine.prepare_store(keys, [3])
        assert h is not None and not h.done()
        await h
        assert _slot_bytes(engine, keys[0]) == as_bytes(block_rows(kv, [3], True)[0].cpu())
        assert backend.inline_waits_missed == 0


async def test_a_copy_expected_past_the_bound_is_not_waited_for() -> None:
    kv = random_kv(4, 64, inner=NATIVE_INNER, seed=14)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=64, inline_wait_us=1))
    backend = _native(engine)
    async with engine:
        await _measure(engine, 0)
        keys = make_keys(32)
        h = await engine.prepare_store(keys, list(range(32)))
        assert h is not None and not h.done()  # 8 MiB: longer than 1 us at any bandwidth
        await h
        assert backend.inline_waits_missed == 0  # not tried, so not missed


@pytest.mark.parametrize("kind", list(PLANS))
def test_the_fault_matrix_holds_with_copies_waited_for_in_the_call(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault matrix's CUDA workload (tests/test_faults.py) on a layout whose small
    copies take the native path, so that most of them are waited for in the call: a
    fault plan wraps every submission, and what it injects is seen and survived the same
    way."""
    settled: list[int] = []
    real = CudaCopyBackend._settle

    def counting(self: CudaCopyBackend, *args: Any) -> None:
        settled.append(args[3])  # the wait's outcome
        real(self, *args)

    monkeypatch.setattr(CudaCopyBackend, "_settle", counting)
    kv = random_kv(2, GPU_BLOCKS, inner=NATIVE_INNER, seed=3)
    for seed in range(SEEDS):
        plan = PLANS[kind](seed)
        report = run_workload("auto", "asyncio", plan, seed, kv)
        where = f"{kind} seed {seed}: {plan}"
        assert sum(plan.fired.values()), where
        assert report.lost_jobs == 0 and not report.problems, (where, report.problems)
        assert not report.out.bad_loads, (where, report.out.bad_loads)
        assert report.out.loop_interrupts == plan.fired["interrupt_in_callback"], where
    if not settled:
        pytest.skip("the native copy path is unavailable here")
    assert settled.count(0) > 0, "no copy was waited for in the call"
