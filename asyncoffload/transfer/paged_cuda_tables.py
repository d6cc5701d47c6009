"""The CUDA paged engine's per-layout tables, built once, and the plans made from them:
per group, the copy kernel's ref tables (:class:`_RefSet`) and the templates of the host
bytes a slot holds (:class:`_GroupRuns`); from those, the host runs a staged job moves
(:func:`staged_job_runs`) and their merge into DMA descriptors (:func:`_merge_runs`).

CPU-side torch only: nothing here touches a CUDA stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from asyncoffload.transfer.paged import CopyPlan, PageLayout, _cat

__all__ = ["build_tables", "staged_job_runs"]


class _RefSet(NamedTuple):
    """Refs of one group that one kernel launch moves: a device table ``[5, k]``
    (kv_base, kv_stride, host_off, page, nbytes) and what the launch needs to know."""

    table: torch.Tensor
    #: Every address and size of these refs is 8-byte aligned (host rows permitting).
    aligned: bool
    #: The largest ``nbytes`` of the refs.
    max_bytes: int


class _GroupRuns(NamedTuple):
    """A group's host bytes per slot, for the staged DMAs: refs moving whole pages
    (``full_*``, by tensor offset) and refs moving part of a page (``part_*``)."""

    #: The whole-page refs tile every slot: a full slot is one run of slot_bytes.
    dense: bool
    full_off: torch.Tensor  # [1, F] tensor offsets in the slot
    full_page: torch.Tensor  # [1, F]
    part_off: torch.Tensor  # [P, 1]
    part_page: torch.Tensor  # [P, 1]
    part_bytes: torch.Tensor  # [P, 1]


def build_tables(
    layout: PageLayout, device: torch.device
) -> tuple[list[list[_RefSet]], list[_GroupRuns]]:
    """Per group of ``layout``: the kernel's ref tables (refs with 8-byte aligned addresses
    and sizes apart from the others; the tables on ``device``) and the run templates of
    the staged DMAs."""
    ref_sets: list[list[_RefSet]] = []
    group_runs: list[_GroupRuns] = []
    for refs in layout.group_refs:
        rows: list[tuple[list[int], bool]] = []
        for t, nb in refs:
            tensor = layout.tensors[t]
            row = [
                tensor.data_ptr(),
                tensor.stride(0),
                layout.tensor_offset[t],
                layout.page_bytes[t],
                nb,
            ]
            rows.append((row, all(v % 8 == 0 for v in row)))
        sets: list[_RefSet] = []
        for aligned in (True, False):
            cols = [r for r, a in rows if a == aligned]
            if cols:
                table = torch.tensor(cols, dtype=torch.int64).t().contiguous()
                sets.append(_RefSet(table.to(device), aligned, max(c[4] for c in cols)))
        ref_sets.append(sets)
        full = sorted(
            (layout.tensor_offset[t], layout.page_bytes[t])
            for t, nb in refs
            if nb == layout.page_bytes[t]
        )
        part = [
            (layout.tensor_offset[t], layout.page_bytes[t], nb)
            for t, nb in refs
            if nb != layout.page_bytes[t]
        ]
        bpc = layout.blocks_per_chunk
        covered = sum(bpc * p for _, p in full)
        dense = (
            not part
            and covered == layout.slot_bytes
            and all(
                off == (full[i - 1][0] + bpc * full[i - 1][1] if i else 0)
                for i, (off, _) in enumerate(full)
            )
        )

        def col(v: list[int], shape: tuple[int, int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64).view(shape)

        group_runs.append(
            _GroupRuns(
                dense,
                col([o for o, _ in full], (1, -1)),
                col([p for _, p in full], (1, -1)),
                col([o for o, _, _ in part], (-1, 1)),
                col([p for _, p, _ in part], (-1, 1)),
                col([n for _, _, n in part], (-1, 1)),
            )
        )
    return ref_sets, group_runs


def staged_job_runs(
    layout: PageLayout, group_runs: Sequence[_GroupRuns], plan: CopyPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The host bytes a staged job of ``plan`` moves, as runs ``(slot position, offset in
    the slot, bytes)`` (int64 CPU tensors), by slot position within each group;
    ``group_runs``: :func:`build_tables`' templates for ``layout``."""
    bpc = layout.blocks_per_chunk
    slot_bytes = layout.slot_bytes
    pos_parts: list[torch.Tensor] = []
    off_parts: list[torch.Tensor] = []
    size_parts: list[torch.Tensor] = []

    def slot_runs(k: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, r: _GroupRuns) -> None:
        # Per slot k (relative), sub-pages s0 .. s1 - 1 of every whole-page ref.
        nf = r.full_off.shape[1]
        if not nf or not k.numel():
            return
        pos_parts.append((k + lo).view(-1, 1).expand(-1, nf).reshape(-1))
        off_parts.append((r.full_off + s0.view(-1, 1) * r.full_page).view(-1))
        size_parts.append(((s1 - s0).view(-1, 1) * r.full_page).view(-1))

    for g, _, n, lo, nslots, skip in plan.spans:
        r = group_runs[g]
        end = skip + n  # sub-pages in use: skip .. end - 1 over the group's slots
        if r.dense:
            first_partial = skip != 0 or end < bpc
            last_partial = end % bpc != 0
            a = 1 if first_partial else 0
            b = nslots - 1 if last_partial and nslots - 1 >= a else nslots
            if first_partial:
                one = torch.tensor([0], dtype=torch.int64)
                slot_runs(one, one * 0 + skip, one * 0 + min(end, bpc), r)
            if b > a:
                pos_parts.append(torch.arange(lo + a, lo + b, dtype=torch.int64))
                off_parts.append(torch.zeros(b - a, dtype=torch.int64))
                size_parts.append(torch.full((b - a,), slot_bytes, dtype=torch.int64))
            if last_partial and b < nslots and (nslots - 1 != 0 or not first_partial):
                last = torch.tensor([nslots - 1], dtype=torch.int64)
                slot_runs(last, last * 0, last * 0 + end - (nslots - 1) * bpc, r)
            continue
        k = torch.arange(nslots, dtype=torch.int64)
        s0 = torch.zeros(nslots, dtype=torch.int64)
        s0[0] = skip
        s1 = torch.clamp(end - k * bpc, max=bpc)
        slot_runs(k, s0, s1, r)
        if r.part_off.numel():
            p = torch.arange(skip, end, dtype=torch.int64).view(1, -1)
            np_ = r.part_off.shape[0]
            pos_parts.append((lo + p // bpc).expand(np_, -1).reshape(-1))
            off_parts.append((r.part_off + (p % bpc) * r.part_page).reshape(-1))
            size_parts.append(r.part_bytes.expand(-1, n).reshape(-1))
    return _cat(pos_parts), _cat(off_parts), _cat(size_parts)


def _merge_runs(
    dev: torch.Tensor, host: torch.Tensor, size: torch.Tensor, key: torch.Tensor, *, store: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, dst, size, key) DMA descriptors for runs between device addresses ``dev``
    and host addresses ``host``: neighbours contiguous on both sides and of one ``key``
    (host chunk, one registration; staging chunk) become one descriptor."""
    n = size.numel()
    if n > 1:
        dev_end = dev + size
        cont = (
            (dev[1:] == dev_end[:-1]) & (host[1:] == host[:-1] + size[:-1]) & (key[1:] == key[:-1])
        )
        if bool(cont.any()):
            first = torch.ones(n, dtype=torch.bool)
            first[1:] = ~cont
            starts = torch.nonzero(first).view(-1)
            ends = torch.empty_like(starts)
            ends[:-1] = starts[1:] - 1
            ends[-1] = n - 1
            size = dev_end[ends] - dev[starts]
            dev, host, key = dev[starts], host[starts], key[starts]
    return (dev, host, size, key) if store else (host, dev, size, key)
