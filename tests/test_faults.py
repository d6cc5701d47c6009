"""Fault injection (asyncoffload.transfer.faults) driving the engine (issue 11).

For each kind of fault, on both CPU copy engines and on asyncio's loop and uvloop, a
seeded random workload of stores, lookups and loads (with abandoned waits and
unawaited stores) runs against an engine whose backend injects that fault. Each run
proves that:

- every handle resolves: with a result, or with ``TransferError`` caused by the fault;
  each injected fault shows up exactly where documented (a failed handle, a
  ``KeyboardInterrupt`` out of ``prepare_*`` or out of the loop), no more, no less;
- ``aclose()`` returns within ``CLOSE_TIMEOUT_S`` and never takes the lost-job path;
- no slot leaked: nothing write-pending or pinned, each slot free or resident exactly
  once, and ``reset_cache`` gives the whole pool back;
- no thread and no fd outlives the engine;
- a load that reports success brought the stored bytes.

The runs drive their own event loop (``loop.run_until_complete``), since an interrupt
in a completion callback leaves the loop as it would in a server; the driver counts it
and goes on. CI runs ``SEEDS`` seeds per case; ``make soak`` (``ASYNCOFFLOAD_SOAK=1``)
runs ``SOAK_SEEDS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import pytest
import torch

import asyncoffload as ao
from asyncoffload.transfer.completion import CopyLane
from asyncoffload.transfer.faults import Fault, FaultPlan, InjectedFault, InjectedJob, delayer_idle
from tests.helpers import block_bytes, make_keys, random_kv

T = TypeVar("T")
SOAK = os.environ.get("ASYNCOFFLOAD_SOAK") == "1"
SEEDS = 3
SOAK_SEEDS = 60
CLOSE_TIMEOUT_S = 10.0
RUN_TIMEOUT_S = 30.0

NUM_KEYS = 40
SRC_BLOCKS = 24  # key i is always stored from block i % SRC_BLOCKS
WORKERS = 3
DST_PER_WORKER = 8  # each worker loads into its own blocks
GPU_BLOCKS = SRC_BLOCKS + WORKERS * DST_PER_WORKER
CPU_BLOCKS = 12
OPS_PER_WORKER = 40


def _native_available() -> bool:
    from asyncoffload._native import load_copy_engine

    return load_copy_engine() is not None


def _uvloop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop] | None] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": _uvloop(),
}
ENGINES = [
    "threads",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(not _native_available(), reason="no native copy engine"),
    ),
]
LOOP_PARAMS = [
    pytest.param(name, marks=pytest.mark.skipif(factory is None, reason=f"{name} missing"))
    for name, factory in LOOPS.items()
]

#: One plan per kind of fault (``all``: every kind at once), made for a seed; the third
#: eligible submission always gets the fault, so each run sees one at least.
PLANS: dict[str, Callable[[int], FaultPlan]] = {
    "copy_error": lambda seed: FaultPlan(Fault.copy_error(0.25, nth=3), seed=seed),
    "submit_error": lambda seed: FaultPlan(Fault.submit_error(0.25, nth=3), seed=seed),
    "interrupt_before_queue": lambda seed: FaultPlan(
        Fault.interrupt_at_submit(0.15, nth=3), seed=seed
    ),
    "interrupt_after_queue": lambda seed: FaultPlan(
        Fault.interrupt_at_submit(0.15, queued=True, nth=3), seed=seed
    ),
    "interrupt_in_callback": lambda seed: FaultPlan(
        Fault.interrupt_in_callback(0.15, nth=3), seed=seed
    ),
    "slow_lane": lambda seed: FaultPlan(Fault.slow_lane(0.002, 0.5, nth=3), seed=seed),
    "all": lambda seed: FaultPlan(
        Fault.copy_error(0.08, nth=3),
        Fault.submit_error(0.08, direction="load"),
        Fault.interrupt_at_submit(0.05),
        Fault.interrupt_at_submit(0.05, queued=True),
        Fault.interrupt_in_callback(0.05),
        Fault.slow_lane(0.001, 0.3),
        seed=seed,
    ),
}


# --- checks shared with test_sigint ---------------------------------------------------------


def slot_problems(engine: ao.AsyncOffloadEngine) -> tuple[int, list[str]]:
    """How many slots are neither free nor resident, and every inconsistency between
    the manager's counts, its slots and its resident set."""
    m = engine.manager
    s = m.stats()
    problems = []
    if s.write_pending:
        problems.append(f"{s.write_pending} slots still write-pending")
    if s.pinned:
        problems.append(f"{s.pinned} blocks still pinned")
    items = list(m.policy.items())
    used = [block.block_id for _, block in items]
    free = set(m._free_list) | set(range(m._num_allocated, m.num_blocks))
    if len(set(used)) != len(used) or free & set(used) or len(free) != m.num_free:
        problems.append("a slot is held twice")
    lost = set(range(m.num_blocks)) - set(used) - free
    if lost:
        problems.append(f"slots {sorted(lost)} are neither free nor resident")
    if sum(block.ref_cnt == 0 for _, block in items) != s.ready or len(items) != s.ready:
        problems.append(f"{s.ready} ready blocks counted, {len(items)} in the policy")
    if set(m.resident_keys()) != {key for key, _ in items}:
        problems.append("the resident set is not the policy's")
    if s.free + s.ready != s.num_blocks:
        problems.append(f"free {s.free} + ready {s.ready} != {s.num_blocks}")
    return s.num_blocks - s.free - s.ready, problems


def os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux
        import threading

        return threading.active_count()


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        return 0


def start_torch_threads() -> None:
    """Have torch start its intra-op thread pool now (it does on its first parallel
    op, for good): a thread count taken after this one is not thrown off by it. The
    tensor is small (256 KiB): freeing a large one would raise glibc's mmap threshold
    for the whole process."""
    torch.ones(1 << 16).sum()


def thread_ids() -> set[int]:
    """The OS ids of this process's threads (Python's own threads' only, off Linux)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:  # not Linux
        import threading

        return {t.native_id or 0 for t in threading.enumerate()}


def threads_left(before: set[int], timeout: float = 10.0) -> list[str]:
    """The threads started since ``before`` (see :func:`thread_ids`) that still run
    once they have all ended or ``timeout`` passed, each named by its id and its
    Python name (``native`` for a thread Python did not start). Ids, not a count: a
    thread that ends cannot hide one that stays. The slow-lane helper thread exits on
    its own once idle, a moment after the engine closed; the bound only matters when
    one never ends, so it leaves room for a machine that stalls this process."""
    import threading

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = thread_ids() - before
        if not new and delayer_idle():
            return []
        time.sleep(0.002)
    names = {t.native_id: t.name for t in threading.enumerate()}
    left = [f"{tid} ({names.get(tid, 'native')})" for tid in sorted(thread_ids() - before)]
    if not delayer_idle():
        left.append("the slow-lane helper is not idle")
    return left


def wait_for_threads(limit: int, timeout: float = 5.0) -> int:
    """Threads now, once at most ``limit`` are left (or ``timeout`` passed): a
    slow-lane helper thread exits on its own once idle."""
    deadline = time.monotonic() + timeout
    while (os_threads() > limit or not delayer_idle()) and time.monotonic() < deadline:
        time.sleep(0.002)
    return os_threads()


# --- the workload ---------------------------------------------------------------------------


@dataclass
class Outcomes:
    """What the workload saw."""

    handles: list[ao.Transfer] = field(default_factory=list)
    #: KeyboardInterrupts out of prepare_* (an interrupt at submission).
    submit_interrupts: int = 0
    #: KeyboardInterrupts out of run_until_complete (an interrupt in a callback).
    loop_interrupts: int = 0
    loads_checked: int = 0
    bad_loads: list[str] = field(default_factory=list)
    #: Waiters cancelled mid-wait: one whose handle failed first ends with its error,
    #: which the run takes at its end (a done callback could be dropped by an interrupt).
    waiters: list[asyncio.Future[Any]] = field(default_factory=list)


class Workload:
    """Workers storing, looking up and loading blocks; each load into the worker's own
    blocks, checked byte for byte when it reports success."""

    def __init__(
        self, engine: ao.AsyncOffloadEngine, kv: list[torch.Tensor], expected: list[bytes]
    ) -> None:
        self.engine = engine
        self.kv = kv
        self.expected = expected
        self.keys = make_keys(NUM_KEYS, prefix=b"flt")
        self.out = Outcomes()

    async def run(self, seed: int) -> None:
        workers = [
            asyncio.ensure_future(self.worker(w, random.Random(seed * 101 + w)))
            for w in range(WORKERS)
        ]
        await asyncio.gather(*workers)

    async def worker(self, w: int, rng: random.Random) -> None:
        engine = self.engine
        dst = [SRC_BLOCKS + w * DST_PER_WORKER + i for i in range(DST_PER_WORKER)]
        busy: ao.Transfer | None = None  # the last load into dst, until it resolves
        for _ in range(OPS_PER_WORKER):
            first = rng.randrange(NUM_KEYS - 4)
            idx = list(range(first, first + rng.randint(1, 4)))
            keys = [self.keys[i] for i in idx]
            op = rng.random()
            try:
                if op < 0.45:
                    handle = await engine.prepare_store(keys, [i % SRC_BLOCKS for i in idx])
                    if handle is not None:
                        self.out.handles.append(handle)
                        await self.settle(handle, rng)
                elif op < 0.9:
                    if busy is not None and not busy.done():
                        with contextlib.suppress(ao.TransferError):
                            await busy
                    n = engine.lookup(keys)
                    if n:
                        handle = await engine.prepare_load(keys[:n], dst[:n])
                        self.out.handles.append(handle)
                        busy = handle
                        if await self.settle(handle, rng):
                            self.check_load(idx[:n], dst[:n])
                else:
                    engine.touch(keys)
            except KeyboardInterrupt:
                self.out.submit_interrupts += 1
            except ao.TransferError:
                pass
            await asyncio.sleep(0)

    async def settle(self, handle: ao.Transfer, rng: random.Random) -> bool:
        """Await ``handle``, or give up on it in one way or another; True if this
        worker saw it succeed."""
        how = rng.random()
        if how < 0.65:
            await handle
            return True
        if how < 0.8:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(handle, 0)
                return True
            return False
        if how < 0.9:  # a waiter cancelled mid-wait
            waiter = asyncio.ensure_future(_await(handle))
            # The handle may fail (an injected fault) before the cancel lands: the
            # waiter's exception is then this run's to take, not asyncio's to log.
            self.out.waiters.append(waiter)
            await asyncio.sleep(0)
            waiter.cancel()
        return False  # or never awaited here

    def check_load(self, idx: list[int], dst: list[int]) -> None:
        self.out.loads_checked += 1
        for i, block in zip(idx, dst):
            if block_bytes(self.kv, block) != self.expected[i % SRC_BLOCKS]:
                self.out.bad_loads.append(f"key {i} loaded into block {block}: wrong bytes")


def _taken(task: asyncio.Future[Any]) -> None:
    if task.done() and not task.cancelled():
        task.exception()


async def _await(handle: ao.Transfer) -> ao.TransferResult:
    return await handle


async def _outcomes(handles: list[ao.Transfer]) -> list[ao.TransferResult | BaseException]:
    return await asyncio.gather(*(_await(h) for h in handles), return_exceptions=True)


def drive(loop: asyncio.AbstractEventLoop, task: asyncio.Future[Any], out: Outcomes) -> None:
    """Run ``task`` to its end; an interrupt out of a completion callback leaves the
    loop (counted), and the loop is entered again, as a server would."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not task.done():
        assert time.monotonic() < deadline, "the workload hung"
        try:
            loop.run_until_complete(asyncio.wait([task], timeout=RUN_TIMEOUT_S))
        except KeyboardInterrupt:
            out.loop_interrupts += 1


@dataclass
class RunReport:
    plan: FaultPlan
    out: Outcomes
    results: list[ao.TransferResult | BaseException]
    close_s: float
    leaked: int
    problems: list[str]
    threads: tuple[int, int]
    fds: tuple[int, int]
    lost_jobs: int


def run_workload(
    engine_kind: str, loop_name: str, plan: FaultPlan, seed: int, kv: list[torch.Tensor]
) -> RunReport:
    expected = [block_bytes(kv, b) for b in range(SRC_BLOCKS)]
    new_loop = LOOPS[loop_name]
    assert new_loop is not None
    new_loop().close()  # whatever a loop keeps for the process (uvloop: a few fds) is open now
    start_torch_threads()
    gc.collect()
    threads_before, fds_before = os_threads(), open_fds()
    config = ao.EngineConfig(
        cpu_blocks=CPU_BLOCKS,
        copy_engine=engine_kind,
        policy=random.Random(seed).choice(["lru", "arc", "s3fifo", "sieve", "kv"]),
    )
    engine = ao.AsyncOffloadEngine(kv, config)
    engine.backend.inject_faults(plan)
    workload = Workload(engine, kv, expected)
    loop = new_loop()
    lost = _LostJobs()
    logging.getLogger("asyncoffload").addHandler(lost)
    try:

        async def main() -> list[ao.TransferResult | BaseException]:
            await workload.run(seed)
            # Every handle resolves, awaited or not.
            return await asyncio.wait_for(_outcomes(workload.out.handles), CLOSE_TIMEOUT_S)

        task = loop.create_task(main())
        drive(loop, task, workload.out)
        done = task.result()
        start = time.monotonic()
        closing = loop.create_task(asyncio.wait_for(engine.aclose(), CLOSE_TIMEOUT_S))
        drive(loop, closing, workload.out)
        closing.result()
        close_s = time.monotonic() - start
        leaked, problems = slot_problems(engine)
        if engine.stats().in_flight:
            problems.append(f"{engine.stats().in_flight} transfers in flight after aclose")
        try:
            engine.manager.reset_cache()
        except RuntimeError as exc:
            problems.append(f"reset_cache refused: {exc}")
        else:
            if engine.manager.num_free != CPU_BLOCKS:
                problems.append(f"{engine.manager.num_free} slots free after reset_cache")
        for pending in asyncio.all_tasks(loop):
            pending.cancel()
        loop.run_until_complete(asyncio.sleep(0.01))
        for waiter in workload.out.waiters:
            _taken(waiter)
    finally:
        logging.getLogger("asyncoffload").removeHandler(lost)
        loop.close()
    del engine, workload.engine, task
    gc.collect()
    threads_after = wait_for_threads(threads_before)
    return RunReport(
        plan,
        workload.out,
        list(done),
        close_s,
        leaked,
        problems,
        (threads_before, threads_after),
        (fds_before, open_fds()),
        lost.count,
    )


class _LostJobs(logging.Handler):
    """Counts the engine's 'lost its copy job' errors (aclose's last resort)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "lost its copy job" in record.getMessage() or "keeps its slots" in record.getMessage():
            self.count += 1


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__


def expected_effects(plan: FaultPlan) -> Counter[str]:
    """What the faults the plan injected must show: failed handles (``injected``,
    ``callback_interrupt``), interrupts out of ``prepare_*`` (``submit_interrupt``) and
    out of the loop (``loop_interrupt``). The plan records only faults that act (see
    the faults module), but an interrupt after queueing still hides a copy error, and
    a callback interrupt hides one too."""
    effects: Counter[str] = Counter()
    for record in plan.history:
        kinds = set(record.kinds)
        if "interrupt_before_queue" in kinds or "interrupt_after_queue" in kinds:
            effects["submit_interrupt"] += 1
        elif "submit_error" in kinds:
            effects["injected"] += 1
        elif "interrupt_in_callback" in kinds:
            effects["loop_interrupt"] += 1
            effects["callback_interrupt"] += 1
        elif "copy_error" in kinds:
            effects["injected"] += 1
    return effects


def _failure_cause(exc: BaseException) -> str:
    """What made a failed handle fail, by the documented causes of each fault."""
    assert isinstance(exc, ao.TransferError), f"a handle raised {exc!r}, not TransferError"
    chain = list(_causes(exc))
    if any(isinstance(c, InjectedFault) for c in chain):
        return "injected"
    if any("completion interrupted" in str(c) for c in chain):
        return "callback_interrupt"
    raise AssertionError(f"a handle failed for no injected reason: {chain!r}")


@pytest.fixture(scope="module")
def kv() -> list[torch.Tensor]:
    return random_kv(2, GPU_BLOCKS, seed=3)


@pytest.fixture(autouse=True)
def _quiet_failures(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncoffload")


# --- the property, per kind of fault --------------------------------------------------------


@pytest.mark.parametrize("loop_name", LOOP_PARAMS)
@pytest.mark.parametrize("engine_kind", ENGINES)
@pytest.mark.parametrize("kind", list(PLANS))
@pytest.mark.timeout(1800 if SOAK else 120)
def test_injected_faults_never_hang_leak_or_corrupt(
    kind: str, engine_kind: str, loop_name: str, kv: list[torch.Tensor]
) -> None:
    checked = 0
    for seed in range(SOAK_SEEDS if SOAK else SEEDS):
        plan = PLANS[kind](seed)
        report = run_workload(engine_kind, loop_name, plan, seed, kv)
        where = f"{kind} seed {seed}: {plan}"
        assert sum(plan.fired.values()), f"{where}: no fault was injected"
        # Each fault shows up where documented, and nothing else fails.
        want = expected_effects(plan)
        failures = Counter(
            _failure_cause(r) for r in report.results if isinstance(r, BaseException)
        )
        assert failures["injected"] == want["injected"], (where, failures, want)
        assert failures["callback_interrupt"] == want["callback_interrupt"], (where, failures)
        if loop_name == "asyncio":
            assert report.out.loop_interrupts == want["loop_interrupt"], (where, want)
        else:  # uvloop lets one BaseException out per loop turn: two in one turn are one
            assert bool(report.out.loop_interrupts) == bool(want["loop_interrupt"]), where
            assert report.out.loop_interrupts <= want["loop_interrupt"], (where, want)
        assert report.out.submit_interrupts == want["submit_interrupt"], (where, want)
        assert len(report.results) == len(report.out.handles)
        # Closing was prompt, nothing leaked, loads were right.
        assert report.lost_jobs == 0, f"{where}: a handle had to be failed as lost"
        assert report.close_s < CLOSE_TIMEOUT_S
        assert not report.problems, f"{where}: {report.problems}"
        assert report.leaked == 0
        assert not report.out.bad_loads, (where, report.out.bad_loads)
        assert report.threads[1] <= report.threads[0], f"{where}: threads {report.threads}"
        assert report.fds[1] <= report.fds[0], f"{where}: fds {report.fds}"
        checked += report.out.loads_checked
    assert checked, "no load was checked"


# --- each kind, one transfer at a time --------------------------------------------------------


def _engine(
    engine_kind: str, cpu_blocks: int = 4, gpu_blocks: int = 16
) -> tuple[ao.AsyncOffloadEngine, list[torch.Tensor]]:
    kv = random_kv(2, gpu_blocks, seed=5)
    config = ao.EngineConfig(cpu_blocks=cpu_blocks, copy_engine=engine_kind)
    return ao.AsyncOffloadEngine(kv, config), kv


def _run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    return loop.run_until_complete(asyncio.wait_for(coro, CLOSE_TIMEOUT_S))


async def _store(
    engine: ao.AsyncOffloadEngine, keys: list[ao.OffloadKey], src: list[int]
) -> ao.TransferResult:
    handle = await engine.prepare_store(keys, src)
    assert handle is not None
    return await handle


@pytest.mark.parametrize("engine_kind", ENGINES)
def test_a_copy_error_fails_the_handle_and_frees_the_slots(engine_kind: str) -> None:
    engine, _ = _engine(engine_kind)
    loop = asyncio.new_event_loop()
    try:
        engine.backend.inject_faults(FaultPlan(Fault.copy_error(nth=1)))
        keys = make_keys(2)
        with pytest.raises(ao.TransferError) as info:
            _run(loop, _store(engine, keys, [0, 1]))
        assert isinstance(info.value.__cause__, InjectedFault)
        assert engine.manager.num_free == 4 and engine.lookup(keys) == 0
        _run(loop, _store(engine, keys, [0, 1]))  # the second store is not faulted
        assert engine.lookup(keys) == 2
        _run(loop, engine.aclose())
    finally:
        loop.close()


@pytest.mark.parametrize("engine_kind", ENGINES)
@pytest.mark.parametrize("queued", [False, True])
def test_an_interrupt_at_submission_gives_the_slots_back(engine_kind: str, queued: bool) -> None:
    engine, kv = _engine(engine_kind)
    loop = asyncio.new_event_loop()
    try:
        plan = FaultPlan(Fault.interrupt_at_submit(nth=1, queued=queued))
        engine.backend.inject_faults(plan)
        keys = make_keys(2)
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(engine.prepare_store(keys, [0, 1]))
        assert plan.fired == {"interrupt_after_queue" if queued else "interrupt_before_queue": 1}

        async def settled() -> None:
            while engine.stats().in_flight:  # noqa: ASYNC110 - the fence resolves on the loop
                await asyncio.sleep(0.001)

        _run(loop, settled())
        assert engine.manager.num_free == 4 and engine.manager.stats().write_pending == 0
        _run(loop, _store(engine, keys, [2, 3]))
        backend = engine.backend
        assert isinstance(backend, ao.CpuCopyBackend)
        for slot, block in zip(engine.manager.prepare_load(keys).block_ids, (2, 3)):
            assert backend.read_host_block(slot) == block_bytes(kv, block)
        engine.manager.complete_load(keys)
        _run(loop, engine.aclose())
    finally:
        loop.close()


@pytest.mark.parametrize("engine_kind", ENGINES)
@pytest.mark.parametrize("direction", ["store", "load"])
def test_an_interrupt_at_the_start_of_a_completion_callback_loses_nothing(
    engine_kind: str, direction: str
) -> None:
    """The interrupt leaves the loop from the callback; the completion still happens
    (the transfer fails, its slots are freed or unpinned) and closing is immediate."""
    engine, _ = _engine(engine_kind)
    loop = asyncio.new_event_loop()
    try:
        keys = make_keys(2)
        _run(loop, _store(engine, keys, [0, 1]))
        # Slow too, so that the interrupt comes in the wait below, not in the call.
        plan = FaultPlan(Fault.interrupt_in_callback(nth=1), Fault.slow_lane(0.05, nth=1))
        engine.backend.inject_faults(plan)
        handle: ao.Transfer | None
        if direction == "store":
            handle = _run(loop, engine.prepare_store(make_keys(2, b"s"), [2, 3]))
        else:
            handle = _run(loop, engine.prepare_load(keys, [4, 5]))
        assert handle is not None
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(_await(handle))
        assert handle.done(), "the interrupted completion left its handle unresolved"
        assert isinstance(handle.exception(), ao.TransferError)
        assert "completion interrupted" in str(handle.exception())
        start = time.monotonic()
        _run(loop, engine.aclose())
        assert time.monotonic() - start < 0.4, "aclose waited for a lost job"
        assert slot_problems(engine) == (0, [])
    finally:
        loop.close()


@pytest.mark.parametrize("engine_kind", ENGINES)
def test_a_slow_lane_delays_completion_and_keeps_keys_unready(engine_kind: str) -> None:
    engine, kv = _engine(engine_kind)
    loop = asyncio.new_event_loop()
    try:
        engine.backend.inject_faults(FaultPlan(Fault.slow_lane(0.1, nth=1)))
        keys = make_keys(2)

        async def slow_store() -> float:
            handle = await engine.prepare_store(keys, [0, 1])
            assert handle is not None
            start = time.monotonic()
            await asyncio.sleep(0.02)
            assert not handle.done() and engine.lookup(keys) == 0
            with pytest.raises(ao.KeyNotReadyError):
                await engine.prepare_load(keys, [4, 5])
            await handle
            return time.monotonic() - start + 0.02

        assert _run(loop, slow_store()) >= 0.09
        _run(loop, _await_load(engine, keys, [4, 5]))
        assert block_bytes(kv, 4) == block_bytes(kv, 0)
        _run(loop, engine.aclose())
    finally:
        loop.close()


def _interrupt_watch_after_queueing(engine: ao.AsyncOffloadEngine) -> None:
    """Make the bridge's next ``watch`` queue its job, then raise KeyboardInterrupt: a
    signal landing inside ``watch``, after the job reached its lane."""
    bridge = engine._bridge
    assert bridge is not None
    real = bridge.watch

    def watch(lane: CopyLane, job: ao.CopyJob, callback: Callable[[ao.CopyJob], None]) -> None:
        real(lane, job, callback)
        del bridge.watch
        raise KeyboardInterrupt

    bridge.watch = watch  # type: ignore[method-assign]


@pytest.mark.parametrize("engine_kind", ENGINES)
def test_an_interrupt_after_the_job_reached_its_lane_never_unpins_twice(engine_kind: str) -> None:
    """The interrupted load's own completion unpins; its fence must not unpin again
    (that would take the pin of another load still copying from the slot)."""
    engine, _ = _engine(engine_kind)
    loop = asyncio.new_event_loop()
    try:
        keys = make_keys(2)
        _run(loop, _store(engine, keys, [0, 1]))
        # Load submissions: 1 the interrupted load, 2 its fence, 3 another load, slower:
        # both loads hold their pins while the first one and its fence complete.
        plan = FaultPlan(
            Fault.slow_lane(0.05, nth=1, direction="load"),
            Fault.slow_lane(0.3, nth=3, direction="load"),
            include_empty=True,
        )
        engine.backend.inject_faults(plan)
        _interrupt_watch_after_queueing(engine)
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(engine.prepare_load(keys, [4, 5]))
        other = _run(loop, engine.prepare_load(keys, [6, 7]))

        async def pins_once_the_fence_is_done() -> list[int]:
            while engine.stats().in_flight > 1:  # noqa: ASYNC110 - resolves on the loop
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.02)  # the fence, right behind
            return [b.ref_cnt for _, b in engine.manager.policy.items()]

        assert _run(loop, pins_once_the_fence_is_done()) == [1, 1]
        assert not other.done()
        _run(loop, _await(other))
        _run(loop, engine.aclose())
        assert slot_problems(engine) == (0, [])
    finally:
        loop.close()


@pytest.mark.parametrize("engine_kind", ENGINES)
def test_aclose_waits_for_the_fence_of_an_interrupted_call(engine_kind: str) -> None:
    """Once the interrupted store's own job completed, only its (slow) fence is left,
    with no handle waiting for it: aclose must still wait for it before closing."""
    engine, _ = _engine(engine_kind)
    loop = asyncio.new_event_loop()
    try:
        _run(loop, _store(engine, make_keys(1, b"w"), [0]))
        plan = FaultPlan(Fault.slow_lane(0.1, nth=2, direction="store"), include_empty=True)
        engine.backend.inject_faults(plan)
        _interrupt_watch_after_queueing(engine)
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(engine.prepare_store(make_keys(2), [1, 2]))
        _run(loop, engine.aclose())  # RuntimeError("... closed with 1 jobs pending") before
        assert slot_problems(engine) == (0, [])
    finally:
        loop.close()


async def _await_load(
    engine: ao.AsyncOffloadEngine, keys: list[ao.OffloadKey], dst: list[int]
) -> ao.TransferResult:
    return await (await engine.prepare_load(keys, dst))


# --- the plan itself ----------------------------------------------------------------------------


def test_a_plan_is_deterministic_for_a_seed_and_counts_what_it_injected() -> None:
    def history(seed: int) -> list[object]:
        plan = FaultPlan(Fault.copy_error(rate=0.3), Fault.slow_lane(0.001, rate=0.5), seed=seed)
        for i in range(200):
            plan.draw("store" if i % 3 else "load", 2)
        assert plan.submissions == 200
        assert sum(plan.fired.values()) == sum(len(r.kinds) for r in plan.history)
        return [(r.submission, r.direction, r.kinds) for r in plan.history]

    assert history(1) == history(1)
    assert history(1) != history(2)
    plan = FaultPlan(Fault.copy_error(rate=0.3), seed=1)
    first = [plan.draw("store", 1) is not None for _ in range(50)]
    plan.reset()
    assert [plan.draw("store", 1) is not None for _ in range(50)] == first


def test_nth_direction_and_times_pick_the_submissions() -> None:
    plan = FaultPlan(
        Fault.submit_error(nth=[2, 4], direction="load"),
        Fault.copy_error(rate=1.0, times=2, direction="store"),
    )
    order: list[Literal["store", "load"]] = ["store", "load", "load", "store", "load", "load"]
    got = [plan.draw(d, 1) for d in [*order, "store"]]
    kinds = [None if g is None else g.kinds for g in got]
    assert kinds == [
        ["copy_error"],
        None,
        ["submit_error"],
        ["copy_error"],
        None,
        ["submit_error"],
        None,
    ]
    assert plan.draw("load", 0) is None  # a fence is never faulted by default
    assert FaultPlan(Fault.copy_error(rate=1.0), include_empty=True).draw("load", 0) is not None


def test_a_rule_says_what_is_wrong_with_it() -> None:
    with pytest.raises(ValueError, match="needs a rate or an nth"):
        Fault.copy_error()
    with pytest.raises(ValueError, match="rate"):
        Fault.copy_error(rate=1.5)
    with pytest.raises(ValueError, match="from 1"):
        Fault.copy_error(nth=0)
    with pytest.raises(ValueError, match="delay_s"):
        Fault.slow_lane(0, rate=1)
    with pytest.raises(ValueError, match="direction"):
        Fault.copy_error(rate=1, direction="up")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        FaultPlan("copy_error")  # type: ignore[arg-type]


def test_a_custom_exception_is_raised_where_asked() -> None:
    plan = FaultPlan(Fault.interrupt_at_submit(nth=1, error=SystemExit))
    decision = plan.draw("store", 1)
    assert decision is not None and isinstance(decision.raise_before, SystemExit)


@pytest.mark.parametrize("engine_kind", ENGINES)
def test_without_a_plan_nothing_wraps_the_submissions(engine_kind: str) -> None:
    engine, _ = _engine(engine_kind)
    backend = engine.backend
    assert backend.faults is None and "submit_store" not in vars(backend)
    plan = FaultPlan(Fault.copy_error(rate=1.0))
    backend.inject_faults(plan)
    assert backend.faults is plan and "submit_store" in vars(backend)
    backend.inject_faults(FaultPlan(Fault.copy_error(rate=1.0)))  # replaces, never stacks
    assert vars(backend)["submit_store"].real == type(backend).submit_store.__get__(backend)
    backend.inject_faults(None)
    assert backend.faults is None
    assert "submit_store" not in vars(backend) and "submit_load" not in vars(backend)
    backend.close()


def test_an_injected_job_reports_the_outcome_after_its_one_interrupt() -> None:
    inner = ao.CopyJob(1, 8)
    job = InjectedJob(
        inner, copy_error=None, delay_s=0.0, interrupt=KeyboardInterrupt("x"), wake=lambda: None
    )
    assert not job.query() and job.error is None  # not ended: nothing to interrupt yet
    inner.finish()
    assert job.query()
    with pytest.raises(KeyboardInterrupt):
        _ = job.error
    assert job.error is None


# --- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", list(PLANS))
def test_injected_faults_on_the_cuda_backend(kind: str) -> None:
    kv = random_kv(2, GPU_BLOCKS, seed=3)
    cuda_kv = [t.cuda() for t in kv]
    for seed in range(SEEDS):
        plan = PLANS[kind](seed)
        report = run_workload("auto", "asyncio", plan, seed, cuda_kv)
        where = f"{kind} seed {seed}: {plan}"
        assert sum(plan.fired.values()), where
        assert report.lost_jobs == 0 and not report.problems, (where, report.problems)
        assert not report.out.bad_loads, (where, report.out.bad_loads)
        assert report.out.loop_interrupts == plan.fired["interrupt_in_callback"], where
