"""The TransferBackend protocol: submit copies of (source ids, destination ids), get jobs.

A backend owns the host tier's memory and one ordered copy queue per direction: jobs of
one direction complete in submission order. A job is a completion token the event loop
can poll cheaply (``query()``); when a job completes, the backend calls the ``wake``
function it was bound to, from whatever thread noticed, so the loop checks its lanes.

**Lifetime.** A backend's copy threads, streams and host memory are released by
``close()``, or, if it is dropped without one, by a finalizer that first stops its
copies (queued ones are discarded, the running one ends) and only then frees the memory
they touch. Threads start with the first copy: a backend never used holds none.

**Fork.** Copy threads do not survive ``os.fork``. In a child, a backend made before the
fork refuses every copy with ``RuntimeError``; its ``close()`` returns at once and
touches nothing of the parent's (no join, no stream, no unpinning). Make a new engine in
the child.
"""

from __future__ import annotations

import ctypes
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from asyncoffload.layout import KVLayout
from asyncoffload.transfer.faults import FaultDecision, FaultPlan, install, wrap_job

# CopyJob and FailedJob live in asyncoffload.transfer.jobs (which the fault injection
# imports too); this module, where they were first, still exports them.
from asyncoffload.transfer.jobs import CopyJob, FailedJob

__all__ = [
    "CopyJob",
    "FailedJob",
    "HostRegion",
    "TransferBackend",
    "check_process",
    "forked_since",
    "host_bytes",
]


@dataclass(frozen=True)
class HostRegion:
    """Host memory another process can map: ``size`` bytes of file descriptor ``fd``
    from offset 0, mapped in this process at ``address``. ``header_room``: bytes free
    before each host slot in it (where a lower tier may put a block's header, so that
    header and payload are one contiguous span)."""

    fd: int
    address: int
    size: int
    header_room: int = 0


class _Process:
    """This process's id, refreshed in a fork's child (cheaper than ``os.getpid()`` on
    every submission)."""

    pid = os.getpid()


def _after_fork_in_child() -> None:
    _Process.pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def forked_since(pid: int) -> bool:
    """Whether this is a forked child of process ``pid`` (not ``pid`` itself)."""
    return _Process.pid != pid


def check_process(pid: int, what: str) -> None:
    """Raise ``RuntimeError`` if ``what``, made in process ``pid``, is used in a fork's
    child: its copy threads (or CUDA context) exist only in the parent."""
    if _Process.pid != pid:
        raise RuntimeError(
            f"{what} was created in process {pid}, used in process {os.getpid()} after "
            "fork; its copy threads exist only in the parent: create a new engine in the child"
        )


class TransferBackend(ABC):
    """Copies whole blocks between the KV tensors and ``num_host_blocks`` host slots."""

    name: str = ""
    #: Whether finished jobs signal the loop (``wake`` / ``wake_fd``); if not, the engine
    #: polls them on a timer.
    can_wake: bool = True
    #: The fault plan submissions consult (see :meth:`inject_faults`); ``None``: none.
    faults: FaultPlan | None = None

    def __init__(self, layout: KVLayout, num_host_blocks: int) -> None:
        self.layout = layout
        self.num_host_blocks = num_host_blocks
        self._wake: Callable[[], None] = _no_wake
        self._wake_fd: int | None = None
        #: The process the backend was made in (see the module docstring on fork).
        self.pid = _Process.pid

    def check_process(self) -> None:
        """``RuntimeError`` when called in a fork's child (see the module docstring)."""
        if _Process.pid != self.pid:
            check_process(self.pid, type(self).__name__)

    def bind(self, wake: Callable[[], None], wake_fd: int | None = None) -> None:
        """Set how to signal that a job completed: ``wake()``, a thread-safe function,
        or, for native code that must not take the GIL, writing 1 (8 bytes) to
        ``wake_fd`` (``None`` when the loop polls instead)."""
        self._wake = wake
        self._wake_fd = wake_fd

    def inject_faults(self, plan: FaultPlan | None) -> None:
        """Consult ``plan`` at every submission from now on; ``None`` stops. For tests:
        copy errors, submission errors, interrupts at submission and in completion
        callbacks, slow lanes (see :mod:`asyncoffload.transfer.faults`). Without a plan
        submissions run unwrapped. Call it from the thread that submits."""
        install(self, plan)

    def _submit_faulted(
        self,
        submit: Callable[[Sequence[int], Sequence[int]], CopyJob],
        first: Sequence[int],
        second: Sequence[int],
        decision: FaultDecision,
    ) -> CopyJob:
        """Submit through ``submit`` under ``decision`` (the plan already raised what
        it raises at submission): the job ends late or failed, or interrupts its
        callback, as decided. Backends whose lanes can apply a delay or an error
        themselves override this."""
        return wrap_job(submit(first, second), decision, self._notify)

    def _notify(self) -> None:
        """Call the bound wake-up (the binding may change after a job is submitted)."""
        self._wake()

    def copy_now(
        self, store: bool, gpu_ids: Sequence[int], host_ids: Sequence[int]
    ) -> CopyJob | None:
        """Copy a job on this (the loop's) thread, now, where the backend can: a store
        (``store``) or load of ``gpu_ids[i]`` <-> ``host_ids[i]``. Returns the ended job
        (:meth:`CopyJob.finish_inline`), or ``None`` when it cannot (the job is too
        large, its lane is busy, ``submit_*`` is wrapped: a fault plan) and changed
        nothing: submit it then. A job that raises copied nothing. This default never
        copies now."""
        return None

    def copy_target(self, store: bool, n: int) -> tuple[int, int, int] | None:
        """Where a job of ``n`` blocks that :meth:`copy_now` would copy here can be
        copied by the engine's native one-step path instead: ``(fn, tables, direction)``
        for ``mgrcore.call_blocks`` (``fn`` the address of a C function of
        ``copy_engine.c``'s ``ao_copy_blocks`` signature). ``None`` (this default) where
        there is none; the engine then calls :meth:`copy_now`."""
        return None

    @abstractmethod
    def submit_store(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> CopyJob:
        """Copy KV blocks ``gpu_ids[i]`` into host slots ``host_ids[i]``."""

    @abstractmethod
    def submit_load(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> CopyJob:
        """Copy host slots ``host_ids[i]`` into KV blocks ``gpu_ids[i]``."""

    @abstractmethod
    def read_host_block(self, host_id: int) -> bytes:
        """The bytes of one host slot (for tests, lower tiers and debugging)."""

    def host_address(self, host_id: int) -> int:
        """The address of host slot ``host_id`` (``block_bytes`` bytes, in host memory
        that stays put for the backend's life): where lower tiers read and write. A
        backend that cannot say raises ``NotImplementedError`` (no lower tiers then)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose host slot addresses")

    def host_regions(self) -> tuple[HostRegion, ...]:
        """The host slots' memory as descriptors another process can map (a lower tier
        whose I/O runs in a helper process moves blocks straight in and out of them);
        empty where the slots are not in shareable memory."""
        return ()

    def describe(self) -> dict[str, object]:
        """Backend details for stats and logs (copy methods, memory, ...)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Finish queued copies, then release threads and memory. Idempotent. In a
        fork's child: marks the backend closed and touches nothing."""


def _no_wake() -> None:
    return None


def host_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a CPU tensor (without numpy, which torch does not require)."""
    c = t.contiguous()
    return ctypes.string_at(c.data_ptr(), c.numel() * c.element_size())
