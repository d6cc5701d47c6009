"""What both paged copy engines share: the directions, the :class:`PagedEngine`
protocol the :class:`~asyncoffload.transfer.paged_worker.PagedTransferWorker` drives,
and torch access to host slots (the torch copy paths of both engines).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

import torch

from asyncoffload.transfer.base import CopyJob
from asyncoffload.transfer.paged import CopyPlan, PageLayout

__all__ = ["EXPEDITED", "LANES", "LOAD", "STORE", "PagedEngine"]

#: Lanes (directions): a store copies KV -> host, a load host -> KV; an expedited load is
#: a load on a lane of its own, queued behind no store and no other load (vLLM waits for
#: it within the step).
STORE, LOAD, EXPEDITED = 0, 1, 2
LANES = 3


class PagedEngine(Protocol):
    """What the worker needs of a copy engine: two ways to run a plan, ordered lanes
    (:data:`STORE`, :data:`LOAD`, :data:`EXPEDITED`: every lane but the first loads)."""

    #: Names of the primary and fallback paths (for stats and errors).
    primary_name: str
    fallback_name: str

    def submit_primary(self, direction: int, plan: CopyPlan) -> CopyJob:
        """Queue ``plan`` on ``direction``'s lane, by the fast path. Raises if nothing or
        only part was queued; then the lane holds no unfinished part of it."""

    def submit_fallback(self, direction: int, plan: CopyPlan) -> CopyJob:
        """Run ``plan`` by the slower, independent path (maybe synchronously)."""

    def wait(self, job: CopyJob, timeout: float | None = None) -> None:
        """Block until ``job`` has ended (well or not); ``TimeoutError`` if it has not
        after ``timeout`` seconds (``None``: no limit)."""

    def quiesce(self, direction: int) -> None:
        """Block until every copy queued on ``direction`` has ended (before a retry
        rewrites what a failed attempt may still touch)."""

    def read_slot(self, slot_id: int) -> bytes: ...

    def close(self) -> None:
        """Finish queued copies and release host memory. In a fork's child: touches
        nothing of the parent's (threads, streams, pinning)."""


class _HostPages:
    """Torch access to host slots stored in ``chunks`` (``[rows, slot_bytes]`` uint8
    tensors of ``rows_per_chunk`` slots each), for the torch copy paths.

    Indexed writes in torch move one element at a time, and are far slower on bytes
    than on int64 (and slower still when intra-op threads contend): copies run on the
    widest integer view both sides allow, and one sub-page position at a time, so every
    indexed op works on whole rows of one 2-D view.
    """

    def __init__(
        self, layout: PageLayout, chunks: Sequence[torch.Tensor], rows_per_chunk: int
    ) -> None:
        self.layout = layout
        self.chunks = chunks
        self.rows_per_chunk = rows_per_chunk

    def split(
        self, plan: CopyPlan, t: int, lo: int, hi: int
    ) -> list[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        """Descriptors ``[lo, hi)`` (a segment of tensor ``t``), split by (chunk,
        sub-page): ``(chunk, sub, rows in the chunk, positions in [0, hi - lo) or None
        for all)``. Every segment of a group splits alike."""
        layout = self.layout
        slots = plan.host_slot[lo:hi]
        bpc = layout.blocks_per_chunk
        rows = self.rows_per_chunk
        if bpc == 1 and len(self.chunks) == 1:
            return [(0, 0, slots, None)]
        sub = (plan.host_offset[lo:hi] - layout.tensor_offset[t]) // layout.page_bytes[t]
        key = sub if len(self.chunks) == 1 else (slots // rows) * bpc + sub
        keys = torch.unique(key).tolist()
        if len(keys) == 1:
            k = keys[0]
            return [(k // bpc, k % bpc, slots - (k // bpc) * rows, None)]
        out: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        for k in keys:
            pos = torch.nonzero(key == k).view(-1)
            out.append((k // bpc, k % bpc, slots[pos] - (k // bpc) * rows, pos))
        return out

    def page_view(self, chunk: int, t: int, sub: int, nbytes: int) -> torch.Tensor:
        """``[rows, nbytes]`` uint8 view of sub-page ``sub`` of tensor ``t`` in a chunk."""
        start = self.layout.tensor_offset[t] + sub * self.layout.page_bytes[t]
        return self.chunks[chunk][:, start : start + nbytes]

    def scatter(
        self,
        parts: list[tuple[int, int, torch.Tensor, torch.Tensor | None]],
        t: int,
        rows: torch.Tensor,
    ) -> None:
        """Write ``rows`` (``[n, nbytes]`` CPU uint8, the group's descriptors in order)
        into the host sub-pages of tensor ``t``."""
        for chunk, sub, slot_rows, pos in parts:
            src = rows if pos is None else rows.index_select(0, pos)
            dst, src = _widest(self.page_view(chunk, t, sub, rows.shape[1]), src)
            dst.index_copy_(0, slot_rows, src)

    def gather(
        self,
        parts: list[tuple[int, int, torch.Tensor, torch.Tensor | None]],
        t: int,
        out: torch.Tensor,
    ) -> None:
        """Fill ``out`` (``[n, nbytes]`` CPU uint8) from the host sub-pages of ``t``."""
        for chunk, sub, slot_rows, pos in parts:
            src, dst = _widest(self.page_view(chunk, t, sub, out.shape[1]), out)
            if pos is None:
                torch.index_select(src, 0, slot_rows, out=dst)
            else:
                dst.index_copy_(0, pos, src.index_select(0, slot_rows))

    def copy_cpu(self, direction: int, plan: CopyPlan) -> None:
        """Run ``plan`` between CPU KV tensors and the host slots."""
        layout = self.layout
        parts: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        block_parts: list[torch.Tensor] = []
        group = -1
        for t, nb, lo, hi, g in plan.segments:
            if g != group:  # a group's refs share their blocks, slots and sub-pages
                group = g
                parts = self.split(plan, t, lo, hi)
                blocks = plan.kv_block[lo:hi]
                block_parts = [blocks if p is None else blocks[p] for _, _, _, p in parts]
            kv = layout.byte_views[t][:, :nb]
            for (chunk, sub, slot_rows, _), b in zip(parts, block_parts):
                host, kv_w = _widest(self.page_view(chunk, t, sub, nb), kv)
                if direction == STORE:
                    host.index_copy_(0, slot_rows, kv_w.index_select(0, b))
                else:
                    kv_w.index_copy_(0, b, host.index_select(0, slot_rows))


def _widest(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` (uint8, same row length) viewed as the widest integer type both
    allow (alignment, strides and length permitting), else as they are."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return a.view(dtype), b.view(dtype)
        except RuntimeError:
            continue
    return a, b


def _pid() -> int:
    return os.getpid()
