"""The completion bridge on its own: lanes, wake-up mechanisms, the watchdog, closing."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import TypeVar

import pytest

import asyncoffload as ao
from asyncoffload.transfer import CompletionBridge, CopyJob

T = TypeVar("T")

#: How long a test waits for a completion: generous, so that a busy machine is slow, not
#: a failure.
WAIT_S = 30.0


async def resolved(future: asyncio.Future[T], what: str) -> T:
    """``future``'s result, failing after ``WAIT_S`` seconds with a message naming what
    was awaited."""
    try:
        return await asyncio.wait_for(future, WAIT_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"waited {WAIT_S:g} s for {what}") from None


class StuckJob(CopyJob):
    """A job whose end is never signalled; ``check_failed`` finds it failed."""

    def check_failed(self) -> bool:
        if not self._done:
            self.finish(RuntimeError("device error"))
        return True


async def test_jobs_of_a_lane_complete_in_order_even_if_a_later_one_ends_first() -> None:
    bridge = CompletionBridge(asyncio.get_running_loop(), "eventfd")
    lane = bridge.lane("store")
    first, second = CopyJob(1, 1), CopyJob(1, 1)
    order: list[int] = []
    bridge.watch(lane, first, lambda _j: order.append(1))
    bridge.watch(lane, second, lambda _j: order.append(2))
    second.finish()
    assert bridge.drain() == 0  # the head is still running: nothing behind it resolves
    assert order == []
    first.finish()
    assert bridge.drain() == 2
    assert order == [1, 2]
    bridge.close()


async def test_a_wake_up_from_another_thread_resolves_on_the_loop_thread() -> None:
    loop = asyncio.get_running_loop()
    bridge = CompletionBridge(loop, "eventfd")
    lane = bridge.lane("load")
    job = CopyJob(1, 1)
    done: asyncio.Future[int] = loop.create_future()
    bridge.watch(lane, job, lambda _j: done.set_result(threading.get_ident()))

    def copy_thread() -> None:
        job.finish()
        bridge.notify()

    threading.Thread(target=copy_thread).start()
    assert await resolved(done, "the job woken from another thread") == threading.get_ident()
    assert bridge.latency.count == 1
    bridge.close()


async def test_watchdog_fails_a_job_that_never_signals() -> None:
    bridge = CompletionBridge(asyncio.get_running_loop(), "eventfd", watchdog_interval=0.005)
    lane = bridge.lane("store")
    job = StuckJob(1, 1)
    got: asyncio.Future[CopyJob] = asyncio.get_running_loop().create_future()
    bridge.watch(lane, job, got.set_result)
    ended = await resolved(got, "the watchdog to fail the stuck job")
    assert isinstance(ended.error, RuntimeError)
    bridge.close()


async def test_pipe_wake_up_where_eventfd_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "eventfd", raising=False)
    bridge = CompletionBridge(asyncio.get_running_loop(), "auto")
    assert bridge.mechanism == "pipe"
    lane = bridge.lane("store")
    job = CopyJob(1, 1)
    got: asyncio.Future[CopyJob] = asyncio.get_running_loop().create_future()
    bridge.watch(lane, job, got.set_result)
    job.finish()
    bridge.notify()
    assert await resolved(got, "the job woken through the pipe") is job
    bridge.close()


async def test_close_refuses_while_jobs_are_pending() -> None:
    bridge = CompletionBridge(asyncio.get_running_loop(), "eventfd")
    lane = bridge.lane("store")
    job = CopyJob(1, 1)
    bridge.watch(lane, job, lambda _j: None)
    with pytest.raises(RuntimeError, match="1 jobs pending"):
        bridge.close()
    job.finish()
    assert bridge.drain() == 1
    bridge.close()
    with pytest.raises(RuntimeError, match="closed"):
        bridge.watch(lane, CopyJob(1, 1), lambda _j: None)


async def test_bad_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="completion mode"):
        CompletionBridge(asyncio.get_running_loop(), "spin")


def test_run_uses_uvloop_when_installed() -> None:
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    module = ao.run(loop_module())
    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert module.startswith("asyncio")
    else:
        assert module.startswith("uvloop")
    assert ao.run(loop_module(), use_uvloop=False).startswith("asyncio")
