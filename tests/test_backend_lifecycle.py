"""Backends dropped without close(), never used, or used after os.fork: no crash, no
hang, no leaked thread or fd (issue 11, defects 1, 6 and 7, the backend side).

A crash would kill pytest, so crashes and thread counts are checked in a fresh
interpreter; fork cases run in a forked child that reports over a pipe and is killed if it
hangs."""

from __future__ import annotations

import errno
import gc
import os
import sys

import pytest
import torch

import asyncoffload as ao
from asyncoffload import _native
from asyncoffload.transfer.base import CopyJob
from asyncoffload.transfer.paged_worker import PagedTransferWorker
from tests.processes import HUNG, describe, run_in_fork, run_python

HAS_NATIVE = _native.load_copy_engine() is not None
ENGINES = [
    pytest.param(
        "native", marks=pytest.mark.skipif(not HAS_NATIVE, reason="no native copy engine")
    ),
    "threads",
]
NATIVE_ONLY = pytest.mark.skipif(not HAS_NATIVE, reason="no native copy engine")
LINUX_ONLY = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="counts threads and fds through /proc"
)

# 16 blocks of 16 MiB: each load below moves 256 MiB, and 32 of them keep a lane busy
# long after the backend has been dropped.
BIG_SETUP = """
import gc, os, sys, threading, time
import torch
import asyncoffload as ao
BLOCK, N = 16 << 20, 16
def big_backend(engine):
    kv = [torch.zeros((N, BLOCK), dtype=torch.uint8)]
    return ao.CpuCopyBackend(kv, ao.KVLayout.infer(kv), N, copy_engine=engine)
"""

# Small backends, and thread counts that settle: a lane thread may still be letting go
# of its last job when the test looks, so it waits (bounded) for the count to come back.
SMALL_SETUP = """
import asyncio, gc, os, sys, threading, time
import torch
import asyncoffload as ao
def small_backend(engine):
    kv = [torch.zeros((8, 4, 16), dtype=torch.bfloat16)]
    return ao.CpuCopyBackend(kv, ao.KVLayout.infer(kv), 8, copy_engine=engine)
def run_store(backend):
    job = backend.submit_store(list(range(8)), list(range(8)))
    while not job.query():
        time.sleep(0.001)
def counts():
    return len(os.listdir("/proc/self/task")), threading.active_count()
def settled(baseline):
    deadline = time.monotonic() + 20
    while counts() != baseline and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return counts()
warm = small_backend(ENGINE)  # loads the library, starts torch's own threads
run_store(warm)
warm.close()
del warm
gc.collect()
"""


def _small(engine: str, body: str) -> str:
    return SMALL_SETUP.replace("ENGINE", repr(engine)) + body


def _cpu_backend(engine: str, blocks: int = 8) -> ao.CpuCopyBackend:
    kv = [torch.arange(blocks * 64, dtype=torch.int16).view(blocks, 4, 16).to(torch.bfloat16)]
    return ao.CpuCopyBackend(kv, ao.KVLayout.infer(kv), blocks, copy_engine=engine)  # type: ignore[arg-type]


def _wait(job: CopyJob) -> None:
    while not job.query():
        pass


# --- defect 1: dropping a backend mid-copy ---------------------------------------------


@NATIVE_ONLY
def test_dropping_a_native_backend_with_loads_queued_does_not_crash() -> None:
    proc = run_python(
        BIG_SETUP
        + """
backend = big_backend("native")
for _ in range(32):
    backend.submit_load(list(range(N)), list(range(N)))
del backend
gc.collect()  # the host pool and KV tensors go now: the lane must not copy into them
print("survived")
"""
    )
    assert proc.returncode == 0 and "survived" in proc.stdout, describe(proc)


@NATIVE_ONLY
def test_dropping_an_unclosed_engine_with_loads_queued_does_not_crash() -> None:
    proc = run_python(
        BIG_SETUP
        + """
import asyncio, warnings
from tests.helpers import make_keys
warnings.simplefilter("ignore", ResourceWarning)
def main():
    kv = [torch.zeros((N, BLOCK), dtype=torch.uint8)]
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=N, copy_engine="native"))
    keys = make_keys(N)
    async def run():
        handle = await engine.prepare_store(keys, list(range(N)))
        await handle
        for _ in range(32):
            await engine.prepare_load(keys, list(range(N)))
    asyncio.run(run())  # ends with the 32 loads still queued; never closed
    return engine
engine = main()
del engine
gc.collect()
print("survived")
"""
    )
    assert proc.returncode == 0 and "survived" in proc.stdout, describe(proc)


def test_exiting_with_a_threads_backend_mid_copy_does_not_abort() -> None:
    proc = run_python(
        BIG_SETUP
        + """
backend = big_backend("threads")
for _ in range(8):
    backend.submit_load(list(range(N)), list(range(N)))
print("exiting")
"""
    )
    assert proc.returncode == 0 and "exiting" in proc.stdout, describe(proc)


@NATIVE_ONLY
def test_copies_queued_on_a_dropped_backend_end_copied_or_discarded() -> None:
    backend = _cpu_backend("native", blocks=64)
    jobs = [backend.submit_load(list(range(64)), list(range(64))) for _ in range(200)]
    del backend
    gc.collect()
    # Nothing runs any more: every job has ended, well or as discarded unrun.
    assert all(job.query() for job in jobs)
    for job in jobs:
        assert job.error is None or (
            isinstance(job.error, OSError) and job.error.errno == errno.ECANCELED
        ), job.error


# --- defect 7: threads and fds ---------------------------------------------------------


@LINUX_ONLY
@pytest.mark.parametrize("engine", ENGINES)
def test_backends_never_used_start_no_threads(engine: str) -> None:
    proc = run_python(
        _small(
            engine,
            """
before = counts()
backends = [small_backend(ENGINE) for _ in range(10)]
print("extra", counts()[0] - before[0], counts()[1] - before[1])
""".replace("ENGINE", repr(engine)),
        )
    )
    assert proc.returncode == 0, describe(proc)
    assert "extra 0 0" in proc.stdout, describe(proc)


@LINUX_ONLY
@pytest.mark.parametrize("engine", ENGINES)
def test_backends_used_and_dropped_unclosed_leave_no_threads(engine: str) -> None:
    proc = run_python(
        _small(
            engine,
            """
before = counts()
for _ in range(10):
    backend = small_backend(ENGINE)
    run_store(backend)
    del backend
after = settled(before)
print("extra", after[0] - before[0], after[1] - before[1])
""".replace("ENGINE", repr(engine)),
        )
    )
    assert proc.returncode == 0, describe(proc)
    assert "extra 0 0" in proc.stdout, describe(proc)


@LINUX_ONLY
@pytest.mark.parametrize("engine", ENGINES)
def test_engines_used_and_dropped_unclosed_leave_no_threads(engine: str) -> None:
    proc = run_python(
        _small(
            engine,
            """
import warnings
from tests.helpers import make_keys
warnings.simplefilter("ignore", ResourceWarning)
def use_and_drop():
    kv = [torch.zeros((8, 4, 16), dtype=torch.bfloat16)]
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=8, copy_engine=ENGINE))
    async def run():
        handle = await engine.prepare_store(make_keys(8), list(range(8)))
        await handle
    asyncio.run(run())
before = counts()
for _ in range(10):
    use_and_drop()
after = settled(before)
print("extra", after[0] - before[0], after[1] - before[1])
""".replace("ENGINE", repr(engine)),
        )
    )
    assert proc.returncode == 0, describe(proc)
    assert "extra 0 0" in proc.stdout, describe(proc)


@LINUX_ONLY
@NATIVE_ONLY
def test_a_dropped_backend_closes_the_wake_fd_it_holds() -> None:
    wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        before = len(os.listdir("/proc/self/fd"))
        backend = _cpu_backend("native")
        backend.bind(lambda: None, wake_fd)
        _wait(backend.submit_store([0, 1], [0, 1]))
        del backend
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) == before
        assert os.eventfd_read(wake_fd) >= 1  # the lane did signal the fd it was given
    finally:
        os.close(wake_fd)


@NATIVE_ONLY
def test_the_owner_may_close_the_wake_fd_before_the_backend() -> None:
    wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    backend = _cpu_backend("native")
    backend.bind(lambda: None, wake_fd)
    os.close(wake_fd)  # the lanes write their own duplicate, never a reused fd number
    _wait(backend.submit_store([0, 1], [0, 1]))
    backend.close()


# --- defect 6: fork ----------------------------------------------------------------------


def _used_backend(engine: str) -> ao.CpuCopyBackend:
    backend = _cpu_backend(engine)
    _wait(backend.submit_store([0, 1], [0, 1]))  # its copy threads run now
    return backend


@pytest.mark.parametrize("engine", ENGINES)
def test_a_backend_refuses_copies_in_a_forked_child(engine: str) -> None:
    backend = _used_backend(engine)
    try:

        def child() -> str:
            backend.submit_load([0], [2])
            return "submitted"

        out = run_in_fork(child)
        assert out.startswith("raised RuntimeError"), out
        assert f"created in process {os.getpid()}" in out and "after fork" in out, out
    finally:
        backend.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_closing_a_backend_in_a_forked_child_returns(engine: str) -> None:
    backend = _used_backend(engine)
    try:

        def child() -> str:
            backend.close()
            return "closed"

        assert run_in_fork(child) == "closed"
    finally:
        backend.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_child_closing_a_backend_leaves_the_parents_lanes_working(engine: str) -> None:
    backend = _used_backend(engine)
    try:

        def child() -> str:
            backend.close()
            return "closed"

        assert run_in_fork(child) != HUNG
        job = backend.submit_load([0, 1], [2, 3])
        _wait(job)
        assert job.error is None
        assert backend.read_host_block(0) != bytes(len(backend.read_host_block(0)))
    finally:
        backend.close()


def _paged_worker(engine: str) -> PagedTransferWorker:
    tensors = [torch.arange(8 * 64, dtype=torch.int32).to(torch.uint8).view(8, 64)]
    return PagedTransferWorker(tensors, [64], [[(0, 64)]], 1, 8, copy_engine=engine)  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_paged_worker_refuses_work_in_a_forked_child(engine: str) -> None:
    worker = _paged_worker(engine)
    try:
        worker.submit_store(1, [0, 1], [2], [0], [0, 1])
        worker.wait([1])

        def child() -> str:
            worker.submit_store(2, [2], [1], [0], [2])
            return "submitted"

        out = run_in_fork(child)
        assert out.startswith("raised RuntimeError") and "after fork" in out, out
    finally:
        worker.shutdown()


@pytest.mark.parametrize("engine", ENGINES)
def test_shutting_down_a_paged_worker_in_a_forked_child_returns(engine: str) -> None:
    worker = _paged_worker(engine)
    try:
        worker.submit_store(1, [0, 1], [2], [0], [0, 1])
        worker.wait([1])
        worker.submit_store(2, [2], [1], [0], [2])  # maybe still in flight at the fork

        def child() -> str:
            worker.shutdown()
            return "shut down"

        assert run_in_fork(child) == "shut down"
    finally:
        worker.shutdown()
