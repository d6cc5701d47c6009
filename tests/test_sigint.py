"""A real SIGINT at a random moment of a running workload, many times over (issue 11).

Each run builds an engine and an event loop, and ``loop.run_until_complete`` drives
three tasks that store, look up and load blocks (some loads checked byte for byte),
abandon waits (``wait_for`` timeouts, cancelled waiters) and leave stores unawaited,
with slow copies now and then. A real SIGINT comes after a random delay, sent
by a helper process (so the moment does not depend on who holds the GIL) or, in half
the runs, by a thread (whose signal lands right after the loop drops the GIL: the
engine's copy hand-offs); the default handler raises ``KeyboardInterrupt`` wherever
Python code runs then. The run
then checks that:

- ``aclose()`` completes within ``ACLOSE_TIMEOUT_S`` (else: a hang) and never takes the
  lost-job path (half a second);
- no slot leaked: nothing write-pending or pinned, every slot free or resident exactly
  once, counts and resident set the manager's (else: a leak);
- nothing is in flight, and no thread or fd outlived the engine;
- every load that reported success brought the right bytes.

Leaks are counted by kind; ``manager_leaks`` (the interrupt landed inside the manager's
own Python code, between two of its updates) used to be the one kind the engine could
not prevent. The engine now holds SIGINT across each manager update and copy hand-off
(``engine._InterruptsHeld``: the interrupt is raised at the end of the step), so the test
asserts zero leaks of every kind. Counted and reported (``-s``) but not failed:
- ``stuck_tasks``: the interrupt landed inside asyncio's own scheduling (a future's
  done-callbacks half scheduled): a workload task is never woken again. ``aclose`` is
  not affected.
- ``swallowed``: Python drops an exception raised in a weakref callback ("Exception
  ignored in ..."), KeyboardInterrupt included.

The runs happen in a child process (``python -m tests.test_sigint``): no signal can
reach pytest, and a run that deadlocks is killed (the child's faulthandler prints where
it stuck) rather than hanging the suite. The child prints a JSON summary, which the test
asserts on and prints: runs, hangs, leaks by kind, and where the interrupts landed.

CI runs ``RUNS`` per copy engine and loop; ``make soak`` (``ASYNCOFFLOAD_SOAK=1``) runs
``SOAK_RUNS``; ``ASYNCOFFLOAD_SIGINT_RUNS`` sets the count outright.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
import torch

import asyncoffload as ao
from asyncoffload.transfer.faults import Fault, FaultPlan
from tests.helpers import block_bytes, make_keys, random_kv
from tests.test_faults import (
    _native_available,
    open_fds,
    slot_problems,
    start_torch_threads,
    thread_ids,
    threads_left,
)

REPO = Path(__file__).resolve().parents[1]
SOAK = os.environ.get("ASYNCOFFLOAD_SOAK") == "1"
RUNS = 40
#: ``make test-long``: ten times CI's runs per copy engine and loop.
LONG_RUNS = 400
SOAK_RUNS = 2000
ACLOSE_TIMEOUT_S = 5.0
#: The signal comes within this many seconds of the workload's start.
MAX_DELAY_S = 0.04
#: A run whose workload was never interrupted stops after this long (it should not).
WORKLOAD_LIMIT_S = 1.0

NUM_KEYS = 64
SRC_BLOCKS = 32  # key i is always stored from block i % SRC_BLOCKS: its bytes are known
WORKERS = 3
DST_PER_WORKER = 16  # each worker loads into its own blocks, after SRC_BLOCKS
GPU_BLOCKS = SRC_BLOCKS + WORKERS * DST_PER_WORKER
CPU_BLOCKS = 24
#: Keys per call: small batches, or large ones (more time in the manager's bookkeeping).
BATCHES = (4, 16)
POLICIES = ("lru", "arc", "s3fifo", "sieve", "kv")


def _runs(profile: str = "ci") -> int:
    explicit = os.environ.get("ASYNCOFFLOAD_SIGINT_RUNS")
    if explicit:
        return int(explicit)
    if SOAK:
        return SOAK_RUNS
    return LONG_RUNS if profile == "long" else RUNS


# --- the child: one run ---------------------------------------------------------------------


@dataclass
class Summary:
    engine: str
    loop: str
    runs: int = 0
    interrupted: int = 0
    #: Runs whose interrupt Python dropped (it landed in a weakref callback).
    swallowed: int = 0
    hangs: int = 0
    leaks: int = 0
    leaked_slots: int = 0
    #: Leaks of runs whose interrupt landed inside the manager (see MANAGER).
    manager_leaks: int = 0
    slow_closes: int = 0  # aclose took the lost-job path (half a second or more)
    bad_loads: int = 0
    thread_leaks: int = 0
    fd_leaks: int = 0
    other_errors: int = 0
    #: Runs where a workload task could not be ended: the interrupt landed inside
    #: asyncio's own scheduling (a future's callbacks half scheduled), leaving a task
    #: that no wake-up will ever step again.
    stuck_tasks: int = 0
    echoes: int = 0  # the interrupt raised again by a task that awaited one it ended
    max_aclose_s: float = 0.0
    slowest_run_s: float = 0.0
    seconds: float = 0.0
    landed: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def note(self, run: int, what: str) -> None:
        """Keep a line on what went wrong: up to 10 of the kinds the test tolerates
        (manager windows, stuck tasks), up to 40 others."""
        tolerated = MANAGER in what or "tasks never ended" in what
        if sum((MANAGER in p or "tasks never ended" in p) == tolerated for p in self.problems) < (
            10 if tolerated else 40
        ):
            self.problems.append(f"run {run}: {what}")


class Workload:
    """Three tasks storing, looking up and loading until the engine closes."""

    def __init__(
        self, engine: ao.AsyncOffloadEngine, kv: list[torch.Tensor], expected: list[bytes]
    ) -> None:
        self.engine = engine
        self.kv = kv
        self.expected = expected
        self.keys = make_keys(NUM_KEYS, prefix=b"sig")
        self.batch = BATCHES[0]
        self.bad_loads: list[str] = []
        self.errors: list[str] = []
        self.handles: list[ao.Transfer] = []

    async def run(self, seed: int, started: Callable[[], None]) -> None:
        started()  # the signal's delay runs from here
        tasks = [
            asyncio.ensure_future(self.worker(w, random.Random(seed * 31 + w)))
            for w in range(WORKERS)
        ]
        # wait, not gather: a task that the interrupt ended must not raise it again here
        await asyncio.wait(tasks)

    async def worker(self, w: int, rng: random.Random) -> None:
        engine = self.engine
        dst = list(range(SRC_BLOCKS + w * DST_PER_WORKER, SRC_BLOCKS + (w + 1) * DST_PER_WORKER))
        busy: ao.Transfer | None = None  # the last load into dst, until it resolves
        deadline = time.monotonic() + WORKLOAD_LIMIT_S
        while time.monotonic() < deadline:
            first = rng.randrange(NUM_KEYS - self.batch)
            idx = list(range(first, first + rng.randint(1, self.batch)))
            keys = [self.keys[i] for i in idx]
            op = rng.random()
            try:
                if op < 0.45:
                    handle = await engine.prepare_store(keys, [i % SRC_BLOCKS for i in idx])
                    if handle is not None:
                        await self.settle(handle, rng)
                elif op < 0.85:
                    if busy is not None and not busy.done():
                        await asyncio.sleep(0)
                        continue
                    n = engine.lookup(keys)
                    if n:
                        handle = await engine.prepare_load(keys[:n], dst[:n])
                        busy = handle
                        if await self.settle(handle, rng):
                            self.check_load(idx[:n], dst[:n])
                else:
                    engine.touch(keys)
                    await asyncio.sleep(0)
            except ao.EngineClosedError:
                return
            except ao.TransferError:
                pass
            except Exception as exc:  # reported (a manager left half updated raises)
                self.errors.append(f"a worker raised {exc!r}")
                return

    async def settle(self, handle: ao.Transfer, rng: random.Random) -> bool:
        """Await ``handle``, or give up on it one way or another; True if it completed
        and this worker saw it succeed."""
        how = rng.random()
        if how < 0.6:
            await handle
            return True
        if how < 0.75:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(handle, rng.choice((0, 0.0005)))
                return True
            return False
        if how < 0.9:  # a waiter cancelled mid-wait
            waiter = asyncio.ensure_future(_wait(handle))
            await asyncio.sleep(0)
            waiter.cancel()
            return False
        self.handles.append(handle)  # never awaited
        return False

    def check_load(self, idx: list[int], dst: list[int]) -> None:
        for i, block in zip(idx, dst):
            if block_bytes(self.kv, block) != self.expected[i % SRC_BLOCKS]:
                self.bad_loads.append(f"key {i} loaded into block {block} has the wrong bytes")


async def _wait(handle: ao.Transfer) -> None:
    await handle


def _fd_targets() -> list[str]:
    targets = []
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                targets.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
    return targets


def _frames(exc: BaseException) -> list[str]:
    """Where a KeyboardInterrupt went through, outermost first, each as path:function
    (the path inside the package for asyncoffload's modules, the file's name otherwise)."""
    out = []
    for frame in traceback.extract_tb(exc.__traceback__):
        parts = Path(frame.filename).parts
        if "asyncoffload" in parts:
            where = "/".join(parts[len(parts) - parts[::-1].index("asyncoffload") - 1 :])
        else:
            where = Path(frame.filename).name
        out.append(f"{where}:{frame.name}")
    return out or ["?"]


def _inside(frames: list[str]) -> str:
    """The frames from the first of the package's on: the path into asyncoffload."""
    for i, frame in enumerate(frames):
        if frame.startswith("asyncoffload/"):
            return " > ".join(frames[i:])
    return frames[-1]


#: Where an interrupt may still leak slots: inside the manager's own Python code (its
#: policies and records included), between its bookkeeping and its return (see the
#: module docstring).
MANAGER = "asyncoffload/manager/"


_SENDER = """
import os, signal, sys, time
parent = int(sys.argv[1])
for line in sys.stdin:
    time.sleep(float(line))
    os.kill(parent, signal.SIGINT)
    sys.stdout.write("sent\\n")
    sys.stdout.flush()
"""


class _Sender:
    """Sends this process a real SIGINT a given delay after each :meth:`arm`, from a
    helper process or from a thread of this one.

    From outside, the signal's moment does not depend on who holds the GIL here, so it
    lands anywhere Python code runs, as a terminal's Ctrl-C does. A thread of this
    process can only send it while the loop has dropped the GIL (a system call, a copy
    lane hand-off, select), so its interrupts land right after those: where the
    engine's own hand-offs are. Runs use both."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SENDER, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._armed = False
        self._thread: threading.Thread | None = None

    def arm(self, delay: float, from_thread: bool) -> None:
        if from_thread:
            self._thread = threading.Thread(target=_send_later, args=(delay,), name="sigint")
            self._thread.start()
        else:
            assert self._proc.stdin is not None
            self._proc.stdin.write(f"{delay}\n")
            self._proc.stdin.flush()
            self._armed = True

    def wait_sent(self) -> None:
        """Wait until the armed signal was sent."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._armed:
            assert self._proc.stdout is not None
            self._proc.stdout.readline()
            self._armed = False

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(10)


def _send_later(delay: float) -> None:
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGINT)


def one_run(
    run: int,
    engine_kind: str,
    new_loop: Callable[[], asyncio.AbstractEventLoop],
    kv: list[torch.Tensor],
    expected: list[bytes],
    summary: Summary,
    sender: _Sender,
) -> None:
    rng = random.Random(run)
    began = time.monotonic()
    threads_before, fds_before = thread_ids(), open_fds()
    config = ao.EngineConfig(
        cpu_blocks=CPU_BLOCKS,
        copy_engine=engine_kind,
        policy=rng.choice(POLICIES),
    )
    engine = ao.AsyncOffloadEngine(kv, config)
    if rng.random() < 0.5:  # copies that stay in flight longer
        delay = rng.choice((0.0005, 0.002))
        engine.backend.inject_faults(FaultPlan(Fault.slow_lane(delay, rate=0.3), seed=run))
    workload = Workload(engine, kv, expected)
    workload.batch = rng.choice(BATCHES)
    loop = new_loop()
    faulthandler.dump_traceback_later(60, exit=True)
    when = rng.uniform(0, MAX_DELAY_S)
    from_thread = rng.random() < 0.5
    main = loop.create_task(workload.run(run, lambda: sender.arm(when, from_thread)))
    try:
        landed = "-"
        path: list[str] = []
        try:
            loop.run_until_complete(main)
        except KeyboardInterrupt as exc:
            summary.interrupted += 1
            path = _frames(exc)
            landed = _inside(path)
            summary.landed[path[-1]] += 1
            sender.wait_sent()
        except Exception as exc:
            summary.other_errors += 1
            summary.note(run, f"the workload raised {exc!r}")
        if landed == "-":
            # No interrupt: Python drops an exception raised in a weakref callback
            # ("Exception ignored in ..."), and a KeyboardInterrupt is one. Else it is
            # late: let it land here.
            try:
                sender.wait_sent()
                time.sleep(0.1)
            except KeyboardInterrupt:
                summary.note(run, "the signal came after the workload's end")
            else:
                summary.swallowed += 1
        problems: list[str] = []
        start = time.monotonic()
        closing = loop.create_task(asyncio.wait_for(engine.aclose(), ACLOSE_TIMEOUT_S))
        while True:
            try:
                loop.run_until_complete(closing)
            except KeyboardInterrupt:
                # The same interrupt again: a task that awaited one it ended re-raises
                # it (asyncio's rule for BaseException); a server's shutdown sees it too.
                summary.echoes += 1
                continue
            except asyncio.TimeoutError:
                summary.hangs += 1
                summary.note(run, f"aclose hung: {engine!r}")
            except Exception as exc:
                problems.append(f"aclose raised {exc!r}")
            break
        took = time.monotonic() - start
        summary.max_aclose_s = max(summary.max_aclose_s, took)
        if took >= 0.4:
            summary.slow_closes += 1
            summary.note(run, f"aclose took {took:.2f} s (a lost job?), interrupted in {landed}")
        leaked = 0
        try:
            leaked, found = slot_problems(engine)
            problems += found
        except Exception as exc:  # a policy left half updated may fail to list its keys
            problems.append(f"the manager's state cannot be read: {exc!r}")
        if engine.stats().in_flight:
            problems.append(f"{engine.stats().in_flight} transfers in flight after aclose")
        problems += workload.errors
        if problems:
            summary.leaks += 1
            summary.leaked_slots += leaked
            if any(frame.startswith(MANAGER) for frame in path):
                summary.manager_leaks += 1
            summary.note(run, f"interrupted in {landed}: " + "; ".join(problems))
        # Whatever the workload left (waiters, tasks that saw EngineClosedError) ends now,
        # or is reported: an interrupt inside asyncio's own machinery can leave a task
        # that no wake-up will ever step again.
        rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in rest:
            task.cancel()
        deadline = time.monotonic() + 0.5
        while rest and time.monotonic() < deadline:
            with contextlib.suppress(KeyboardInterrupt):
                loop.run_until_complete(asyncio.sleep(0.005))
            rest = [t for t in rest if not t.done()]
        if rest:
            summary.stuck_tasks += 1
            summary.note(run, f"tasks never ended: {rest}, interrupted in {landed}")
        if main.done() and not main.cancelled() and isinstance(main.exception(), Exception):
            summary.other_errors += 1
            summary.note(run, f"the workload failed: {main.exception()!r}")
        if workload.bad_loads:
            summary.bad_loads += len(workload.bad_loads)
            summary.note(run, workload.bad_loads[0])
    finally:
        faulthandler.cancel_dump_traceback_later()
        loop.close()
    del engine, workload, main
    if thread_ids() - threads_before or open_fds() > fds_before:
        gc.collect()  # an interrupted task's traceback may hold what it made (a bridge)
    left = threads_left(threads_before)
    if left:
        summary.thread_leaks += 1
        summary.note(run, f"threads outlived the engine: {left}")
    if open_fds() > fds_before:
        summary.fd_leaks += 1
        summary.note(run, f"fds outlived the engine: {_fd_targets()}")
    summary.runs += 1
    summary.slowest_run_s = max(summary.slowest_run_s, time.monotonic() - began)


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def stress(engine_kind: str, loop_name: str, runs: int, seed: int) -> Summary:
    summary = Summary(engine_kind, loop_name)
    kv = random_kv(2, GPU_BLOCKS, seed=seed)
    expected = [block_bytes(kv, b) for b in range(SRC_BLOCKS)]
    new_loop = _loop_factory(loop_name)
    new_loop().close()  # what a loop keeps for the process (uvloop: a few fds) is open now
    start_torch_threads()
    sender = _Sender()
    start = time.monotonic()
    try:
        for run in range(seed * 1_000_000, seed * 1_000_000 + runs):
            one_run(run, engine_kind, new_loop, kv, expected, summary, sender)
    finally:
        sender.close()
    summary.seconds = round(time.monotonic() - start, 2)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("native", "threads"), default="native")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--runs", type=int, default=_runs())
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    import logging

    logging.disable(logging.CRITICAL)  # failed transfers log warnings by design
    summary = stress(args.engine, args.loop, args.runs, args.seed)
    out = asdict(summary)
    out["landed"] = dict(summary.landed.most_common())
    print(json.dumps(out))
    return 0


# --- the test -------------------------------------------------------------------------------


def _uvloop_installed() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


LOOPS = [
    "asyncio",
    pytest.param("uvloop", marks=pytest.mark.skipif(not _uvloop_installed(), reason="no uvloop")),
]


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
@pytest.mark.parametrize("loop_name", LOOPS)
@pytest.mark.parametrize("engine_kind", ["native", "threads"])
@pytest.mark.parametrize(
    "profile",
    [
        pytest.param("ci", marks=pytest.mark.timeout(3600 if SOAK else 120)),
        pytest.param("long", marks=[pytest.mark.long, pytest.mark.timeout(600)]),
    ],
)
def test_a_real_sigint_at_random_points_never_hangs_or_leaks(
    engine_kind: str, loop_name: str, profile: str
) -> None:
    if engine_kind == "native" and not _native_available():
        pytest.skip("the native copy engine cannot be built here")
    runs = _runs(profile)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.test_sigint",
            "--engine",
            engine_kind,
            "--loop",
            loop_name,
            "--runs",
            str(runs),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=3500 if SOAK else 580 if profile == "long" else 110,
    )
    assert proc.returncode == 0, (
        f"the stress child died ({proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(summary, indent=1))
    problems = summary["problems"]
    assert summary["runs"] == runs
    assert summary["interrupted"] + summary["swallowed"] == runs, problems
    assert summary["interrupted"] >= runs * 0.9, problems
    assert summary["hangs"] == 0, problems
    assert summary["slow_closes"] == 0, problems
    # None at all: the engine holds SIGINT across each manager update and copy hand-off
    # (engine._InterruptsHeld), so an interrupt never cuts its bookkeeping short.
    assert summary["leaks"] == 0 and summary["manager_leaks"] == 0, problems
    assert summary["bad_loads"] == 0, problems
    assert summary["thread_leaks"] == 0 and summary["fd_leaks"] == 0, problems
    assert summary["other_errors"] == 0, problems


if __name__ == "__main__":
    sys.exit(main())
