"""Transfer handles: an awaiter wakes one loop pass after the transfer ends, any number
may wait, and cancelling a wait never cancels the transfer."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from asyncoffload.errors import TransferError
from asyncoffload.handles import Completion, Transfer, TransferResult

RESULT = TransferResult(1, 4096, 0.001)


def handle() -> tuple[Completion, Transfer]:
    fut = Completion(loop=asyncio.get_running_loop())
    return fut, Transfer(fut, "load", [b"k" * 16])  # type: ignore[list-item]


async def passes_until_woken(end: str) -> int:
    """Loop passes between ending the transfer and its awaiter running again."""
    fut, transfer = handle()
    woke_at: list[int] = []
    passes = 0

    async def awaiter() -> None:
        with contextlib.suppress(TransferError):
            await transfer
        woke_at.append(passes)

    task = asyncio.create_task(awaiter())
    await asyncio.sleep(0)  # the awaiter waits
    if end == "result":
        fut.set_result(RESULT)
    else:
        fut.set_exception(TransferError("failed"))
    while not woke_at:
        passes += 1
        await asyncio.sleep(0)
    await task
    return woke_at[0]


@pytest.mark.parametrize("end", ["result", "exception"])
async def test_an_awaiter_resumes_at_the_next_loop_pass(end: str) -> None:
    # asyncio.shield took two passes: one for its done callback, one to wake the task.
    assert await passes_until_woken(end) == 1


async def test_many_awaiters_and_a_cancelled_one() -> None:
    fut, transfer = handle()

    async def wait() -> TransferResult:
        return await transfer

    tasks = [asyncio.create_task(wait()) for _ in range(3)]
    await asyncio.sleep(0)
    tasks[1].cancel()
    await asyncio.sleep(0)
    assert tasks[1].cancelled() and not fut.done()  # only that wait ended
    assert fut._waiters is not None and len(fut._waiters) == 2  # its waiter was dropped
    fut.set_result(RESULT)
    assert await tasks[0] == RESULT and await tasks[2] == RESULT
    assert await transfer == RESULT  # after the end: at once
    assert list(await asyncio.gather(transfer, transfer)) == [RESULT, RESULT]


async def test_a_failure_reaches_every_awaiter_and_a_cancelled_transfer_cancels_them() -> None:
    fut, transfer = handle()

    async def wait() -> TransferResult:
        return await transfer

    tasks = [asyncio.create_task(wait()) for _ in range(2)]
    await asyncio.sleep(0)
    fut.set_exception(TransferError("the copy failed"))
    for task in tasks:
        with pytest.raises(TransferError, match="the copy failed"):
            await task
    fut2, transfer2 = handle()
    waiting = asyncio.create_task(wait_for(transfer2))
    await asyncio.sleep(0)
    fut2.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def wait_for(transfer: Transfer) -> TransferResult:
    return await transfer


async def test_a_plain_future_still_works() -> None:
    fut: asyncio.Future[TransferResult] = asyncio.get_running_loop().create_future()
    transfer = Transfer(fut, "store", [])
    task = asyncio.create_task(wait_for(transfer))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    assert not fut.cancelled()  # shielded
    fut.set_result(RESULT)
    assert await transfer == RESULT
