"""Pinned host memory: the host tier's slots, and scratch for ids in flight.

- :class:`PinnedHostPool`: block-major slots in chunks of page-aligned anonymous memory
  (no single huge allocation), or of a :class:`~asyncoffload.transfer.host_file.
  SharedHostFile` (:meth:`PinnedHostPool.shared`), each chunk registered with CUDA
  (pinned, mapped for UVA). If pinning fails the chunk stays pageable: a warning is
  logged and ``pageable_chunks`` counts it.
- :class:`PinnedRing`: pinned int64 scratch for the block ids of transfers in flight.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from asyncoffload._native import CudaFeature, load_cuda_helpers
from asyncoffload.transfer.base import forked_since
from asyncoffload.transfer.host_file import SharedHostFile

__all__ = ["PinnedHostPool", "PinnedRing"]

log = logging.getLogger("asyncoffload.transfer")

_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_MAPPED = 0x02


class _Registrar:
    """Pins host memory: through the driver API where the native helper is loaded (its
    failures do not linger as the runtime's last error, which the next unrelated kernel
    launch would raise), else through the CUDA runtime."""

    def __init__(self) -> None:
        helpers = load_cuda_helpers()
        self._lib = helpers[0] if helpers and helpers[1] & CudaFeature.HOST_REGISTER else None

    def register(self, ptr: int, nbytes: int) -> int:
        if self._lib is not None:
            return int(self._lib.ao_cuda_host_register(ptr, nbytes))
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
        return int(cudart.cudaHostRegister(ptr, nbytes, flags))

    def unregister(self, ptr: int) -> None:
        if self._lib is not None:
            self._lib.ao_cuda_host_unregister(ptr)
        else:
            torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]

    def device_pointer(self, ptr: int) -> int:
        """The address a kernel uses for registered host memory (UVA: usually ``ptr``)."""
        if self._lib is None:
            return ptr
        out = ctypes.c_uint64(0)
        if self._lib.ao_cuda_host_device_pointer(ptr, ctypes.addressof(out)) != 0:
            raise RuntimeError("cuMemHostGetDevicePointer failed for a pinned chunk")
        return int(out.value)


class _Chunks(Protocol):
    """Where a pool's chunks come from: ``rows`` slots' memory at a time."""

    def take(self, first: int, rows: int) -> torch.Tensor: ...


class _AnonymousChunks:
    """Chunks of fresh anonymous memory (page-aligned, zero-filled); the maps are kept in
    ``maps`` until the pool lets them go."""

    def __init__(self, block_bytes: int, maps: list[mmap.mmap]) -> None:
        self.block_bytes = block_bytes
        self.maps = maps

    def take(self, first: int, rows: int) -> torch.Tensor:
        mm = mmap.mmap(-1, rows * self.block_bytes)
        self.maps.append(mm)
        return torch.frombuffer(mm, dtype=torch.uint8).view(rows, self.block_bytes)


class _FileChunks:
    """Chunks of a shared file's slots."""

    def __init__(self, shared: SharedHostFile) -> None:
        self.whole = shared.tensor()

    def take(self, first: int, rows: int) -> torch.Tensor:
        return self.whole[first : first + rows]


class PinnedHostPool:
    """``num_blocks`` host slots of ``block_bytes``, in chunks of about ``chunk_bytes``,
    pinned (``pin``) where CUDA lets it. :meth:`shared` makes one over a shared file."""

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        chunk_bytes: int = 1 << 30,
        pin: bool = True,
        *,
        _shared: SharedHostFile | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.rows_per_chunk = max(1, chunk_bytes // block_bytes)
        #: The shared file the slots live in (``None``: private anonymous memory).
        self.shared_file = _shared
        self.chunks: list[torch.Tensor] = []
        self._maps: list[mmap.mmap] = []
        self._registered: list[int] = []
        self.pinned_chunks = 0
        self.pageable_chunks = 0
        self._registrar = _Registrar() if pin else None
        # Dropped unclosed, the pool unpins its chunks before their memory goes (the
        # finalizer holds the maps until then).
        self._finalizer = weakref.finalize(
            self, _unpin, os.getpid(), self._registrar, self._registered, self._maps
        )
        source: _Chunks = (
            _AnonymousChunks(block_bytes, self._maps) if _shared is None else _FileChunks(_shared)
        )
        device_bases = [
            self._pin(source.take(first, min(self.rows_per_chunk, num_blocks - first)))
            for first in range(0, num_blocks, self.rows_per_chunk)
        ]
        ids = torch.arange(num_blocks, dtype=torch.int64)
        row_offset = (ids % self.rows_per_chunk) * block_bytes
        chunk_of = ids // self.rows_per_chunk
        #: Host address of each slot.
        self.block_address = (
            torch.tensor([c.data_ptr() for c in self.chunks], dtype=torch.int64)[chunk_of]
            + row_offset
        )
        #: The address of each slot for a kernel (UVA device pointer of pinned memory).
        self.device_block_address = (
            torch.tensor(device_bases, dtype=torch.int64)[chunk_of] + row_offset
        )

    @classmethod
    def shared(
        cls, shared: SharedHostFile, chunk_bytes: int = 1 << 30, pin: bool = True
    ) -> PinnedHostPool:
        """A pool over ``shared``'s slots; :meth:`close` unpins every chunk, then closes
        the file (unlinked by its creator)."""
        return cls(shared.num_slots, shared.slot_bytes, chunk_bytes, pin, _shared=shared)

    def _pin(self, chunk: torch.Tensor) -> int:
        """Register ``chunk`` (pageable where that fails, logged); its kernel address."""
        ptr, nbytes = chunk.data_ptr(), chunk.numel()
        self.chunks.append(chunk)
        err = self._registrar.register(ptr, nbytes) if self._registrar else None
        if err == 0:
            assert self._registrar is not None
            self._registered.append(ptr)
            self.pinned_chunks += 1
            return self._registrar.device_pointer(ptr)
        self.pageable_chunks += 1
        if err is not None:
            where = "" if self.shared_file is None else f" of {self.shared_file.path}"
            log.warning(
                "could not pin a %d MiB host chunk%s (CUDA error %s): using pageable "
                "memory, copies from it are slower and synchronous",
                nbytes >> 20,
                where,
                err,
            )
        return ptr

    @property
    def pinned(self) -> bool:
        return self.pageable_chunks == 0

    def block(self, host_id: int) -> torch.Tensor:
        return self.chunks[host_id // self.rows_per_chunk][host_id % self.rows_per_chunk]

    def runs(self, host_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """``(position in host_ids, first id, length)`` of runs of consecutive ids that lie
        in one chunk: each is one contiguous host range."""
        out: list[tuple[int, int, int]] = []
        rows = self.rows_per_chunk
        i = 0
        n = len(host_ids)
        while i < n:
            start = host_ids[i]
            j = i + 1
            while j < n and host_ids[j] == start + (j - i) and host_ids[j] // rows == start // rows:
                j += 1
            out.append((i, start, j - i))
            i = j
        return out

    def view(self, first: int, length: int) -> torch.Tensor:
        rows = self.rows_per_chunk
        row = first % rows
        return self.chunks[first // rows][row : row + length]

    def close(self) -> None:
        """Unpin and free the chunks (and close the shared file). The caller first makes
        sure that no copy still reads or writes them (synchronizes its streams).
        Idempotent; in a fork's child only drops the memory (the pinning belongs to the
        parent's CUDA context)."""
        self._finalizer()
        self.chunks.clear()  # with the tensors that viewed them, the maps go
        if self.shared_file is not None:
            self.block_address = self.device_block_address = torch.empty(0, dtype=torch.int64)
            self.shared_file.close()


def _unpin(
    pid: int, registrar: _Registrar | None, registered: list[int], maps: list[mmap.mmap]
) -> None:
    """Unregister the pinned chunks at ``registered``, then let their ``maps`` go."""
    if registered and registrar is not None and not forked_since(pid):
        for ptr in registered:
            try:
                registrar.unregister(ptr)
            except Exception as exc:  # a CUDA context torn down at exit
                log.debug("could not unpin a host chunk: %s", exc)
    registered.clear()
    maps.clear()


class _Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class PinnedRing:
    """Pinned int64 scratch for the block ids of transfers in flight.

    Host-to-device copies from pinned memory are asynchronous, so a region may be reused
    only once the copy that reads it has run: each region is returned with the event of
    its transfer, and ``take`` waits (rarely) for the oldest overlapping region. Pageable
    memory would make every such copy wait for the stream instead.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buf = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.head = 0
        self.busy: deque[tuple[int, int, _Event]] = deque()

    def take(self, n: int) -> torch.Tensor:
        if n > self.capacity:
            return torch.empty(n, dtype=torch.int64, pin_memory=True)
        start = self.head if self.head + n <= self.capacity else 0
        end = start + n
        busy = self.busy
        while busy and busy[0][2].query():
            busy.popleft()
        while busy and any(s < end and start < e for s, e, _ in busy):
            busy.popleft()[2].synchronize()
        self.head = end
        return self.buf[start:end]

    def release(self, region: torch.Tensor, event: _Event) -> None:
        """``region`` (from :meth:`take`) is free once ``event`` has completed."""
        if region.untyped_storage().data_ptr() == self.buf.untyped_storage().data_ptr():
            start = int(region.storage_offset())
            self.busy.append((start, start + int(region.numel()), event))
