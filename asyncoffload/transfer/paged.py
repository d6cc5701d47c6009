"""Paged KV caches in vLLM's canonical form, the host slots they offload to, and copy plans.

vLLM (0.32+) hands an offloading worker its KV cache as *canonical* tensors and refs:

- a list of tensors, each a ``(num_blocks, page_bytes_t)`` view of one byte per element
  (int8 or uint8) whose rows may be further apart than ``page_bytes_t`` (packed layouts),
  page sizes differing between tensors;
- per KV-cache group ``g``, refs ``(tensor_idx, nbytes)``: the layers of the group, each
  moving ``nbytes`` (at most its tensor's page, the un-padded size) per block. Groups
  may share tensors (hybrid models overlay them);
- ``blocks_per_chunk`` (bpc): one host slot holds bpc consecutive GPU blocks of a group.

**Host layout.** One slot of :attr:`PageLayout.slot_bytes` holds, for each tensor ``t``
in order, bpc sub-pages of ``page_bytes_t`` each: sub-page ``sub`` of tensor ``t`` starts
at ``bpc * sum(page_bytes[:t]) + sub * page_bytes_t``. A slot is one contiguous buffer,
so it moves to a lower tier as one piece.

**Transfers.** A transfer names ``gpu_ids`` (ordered by group), ``group_sizes`` (blocks
per group), ``block_indices`` (per group, the logical index of its first block in the
request) and ``slot_ids`` (per group ``ceil((size + skip) / bpc)`` slots, groups in the
same order, none for an empty group), where ``skip = block_indices[g] % bpc`` sub-blocks
of the group's first slot are left alone. Logical block ``j`` of group ``g`` lives in
slot ``slot_ids_of_g[(skip + j) // bpc]``, sub-page ``(skip + j) % bpc``; for each ref
``(t, nbytes)`` of the group, ``nbytes`` move between row ``gpu_id`` of tensor ``t`` and
that sub-page. Stores and loads use the same mapping.

:meth:`PageLayout.plan` checks a transfer and turns it into a :class:`CopyPlan`: one
descriptor per (block, ref), computed with vectorised torch ops (a Python loop over the
groups only, never over blocks). Invalid input raises ``TypeError`` / ``ValueError`` /
``IndexError`` naming the argument, before anything is copied.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    import numpy as np

__all__ = ["CopyPlan", "GroupSpan", "IdsLike", "PageLayout", "Segment"]

#: Block or slot ids: a list of ints, a 1-D integer numpy array, or a 1-D integer tensor.
IdsLike = Any


class Segment(NamedTuple):
    """Descriptors ``[lo, hi)`` of a plan: one ref ``(tensor_idx, nbytes)`` of group
    ``group``, one descriptor per block of the group, in the group's block order (so the
    segments of one group share their blocks, slots and sub-pages)."""

    tensor_idx: int
    nbytes: int
    lo: int
    hi: int
    group: int


class GroupSpan(NamedTuple):
    """The blocks of one group of a transfer that move bytes (a group with blocks and
    refs): ``gpu_ids[gpu_lo : gpu_lo + n]`` and ``slot_ids[slot_lo : slot_lo + num_slots]``
    of the plan; logical block ``j`` is in slot position ``slot_lo + (skip + j) // bpc``,
    sub-page ``(skip + j) % bpc``."""

    group: int
    gpu_lo: int
    n: int
    slot_lo: int
    num_slots: int
    skip: int


class CopyPlan:
    """The copies of one transfer: descriptor ``i`` moves ``size[i]`` bytes between the KV
    address ``kv_addr[i]`` (row ``kv_block[i]`` of a tensor) and byte ``host_offset[i]``
    of host slot ``host_slot[i]``. All int64 CPU tensors of one length, contiguous.

    Descriptors come group by group and, within a group, ref by ref (``segments``), each
    ref's blocks in the group's order. No two descriptors write the same bytes.

    The descriptor columns are computed on first use: engines that copy from the per-group
    ``spans`` (the CUDA kernels) never build them.
    """

    __slots__ = ("_cols", "gpu_ids", "layout", "nbytes", "num_copies", "slot_ids", "spans")

    def __init__(
        self,
        layout: PageLayout,
        gpu_ids: torch.Tensor,
        slot_ids: torch.Tensor,
        spans: tuple[GroupSpan, ...],
    ) -> None:
        self.layout = layout
        #: The transfer's GPU block ids and slot ids (int64 CPU tensors), as given.
        self.gpu_ids = gpu_ids
        self.slot_ids = slot_ids
        #: The groups that move bytes, in group order.
        self.spans = spans
        #: Bytes the plan moves: the sum of ``size``.
        self.nbytes: int = sum(s.n * layout.group_block_bytes[s.group] for s in spans)
        #: Descriptors: one per (block, ref).
        self.num_copies: int = sum(s.n * len(layout.group_refs[s.group]) for s in spans)
        self._cols: tuple[tuple[torch.Tensor, ...], tuple[Segment, ...]] | None = None

    def _columns(self) -> tuple[tuple[torch.Tensor, ...], tuple[Segment, ...]]:
        if self._cols is None:
            self._cols = self.layout._descriptors(self)
        return self._cols

    @property
    def kv_addr(self) -> torch.Tensor:
        return self._columns()[0][0]

    @property
    def kv_block(self) -> torch.Tensor:
        return self._columns()[0][1]

    @property
    def host_slot(self) -> torch.Tensor:
        return self._columns()[0][2]

    @property
    def host_offset(self) -> torch.Tensor:
        return self._columns()[0][3]

    @property
    def size(self) -> torch.Tensor:
        return self._columns()[0][4]

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self._columns()[1]


_EMPTY = torch.empty(0, dtype=torch.int64)
#: Transfers of at most this many ids (blocks and slots) are checked on Python lists.
_LIST_CHECKS = 8192


def _check_tensors(tensors: Sequence[torch.Tensor]) -> torch.device:
    """The device of ``tensors``, a PageLayout's byte views; raises naming the bad one."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError("tensors must be a list of (num_blocks, page_bytes) tensors")
    if not tensors:
        raise ValueError("tensors is empty: at least one KV tensor is needed")
    device: torch.device | None = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if t.dim() != 2:
            raise ValueError(
                f"tensors[{i}] has shape {tuple(t.shape)}: want (num_blocks, page_bytes)"
            )
        if t.element_size() != 1 or t.is_floating_point() or t.dtype == torch.bool:
            raise TypeError(f"tensors[{i}] is {t.dtype}: want a byte view (int8 or uint8)")
        if t.shape[0] <= 0:
            raise ValueError(f"tensors[{i}] holds no blocks (shape {tuple(t.shape)})")
        if t.stride(1) != 1:
            raise ValueError(f"tensors[{i}] rows are not contiguous (strides {t.stride()})")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(
                f"tensors[{i}] is on {t.device}, tensors[0] on {device}: all KV tensors "
                "must be on one device"
            )
    assert device is not None
    return device


def _check_pages(tensors: Sequence[torch.Tensor], page_bytes: Sequence[int]) -> list[int]:
    """``page_bytes`` as ints, each within its tensor's rows; raises naming the bad one."""
    pages = _int_list(page_bytes, "page_bytes")
    if len(pages) != len(tensors):
        raise ValueError(f"page_bytes has {len(pages)} entries for {len(tensors)} tensors")
    for i, (t, p) in enumerate(zip(tensors, pages)):
        if not 0 < p <= t.shape[1]:
            raise ValueError(
                f"page_bytes[{i}] = {p}: want 0 < page_bytes <= {t.shape[1]} (the row "
                f"length of tensors[{i}])"
            )
        if t.shape[0] > 1 and t.stride(0) < p:
            raise ValueError(
                f"tensors[{i}] rows are {t.stride(0)} bytes apart, less than its "
                f"page_bytes {p}: pages would overlap"
            )
    return pages


def _check_group_refs(
    group_refs: Sequence[Sequence[tuple[int, int]]], pages: Sequence[int]
) -> list[list[tuple[int, int]]]:
    """``group_refs`` as lists of ``(tensor_idx, nbytes)``, each within its tensor's page;
    raises naming the bad one."""
    if isinstance(group_refs, (str, bytes)) or not isinstance(group_refs, Sequence):
        raise TypeError("group_refs must be a list (per group) of (tensor_idx, nbytes) lists")
    if not group_refs:
        raise ValueError("group_refs is empty: at least one KV-cache group is needed")
    refs: list[list[tuple[int, int]]] = []
    for g, group in enumerate(group_refs):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
            raise TypeError(f"group_refs[{g}] must be a list of (tensor_idx, nbytes) pairs")
        out: list[tuple[int, int]] = []
        for r, ref in enumerate(group):
            where = f"group_refs[{g}][{r}]"
            if isinstance(ref, (str, bytes)) or not isinstance(ref, Sequence) or len(ref) != 2:
                raise TypeError(f"{where} = {ref!r}: want a (tensor_idx, nbytes) pair")
            t_idx, nbytes = _int(ref[0], f"{where}[0]"), _int(ref[1], f"{where}[1]")
            if not 0 <= t_idx < len(pages):
                raise IndexError(f"{where} names tensor {t_idx}: there are {len(pages)} tensors")
            if not 0 < nbytes <= pages[t_idx]:
                raise ValueError(
                    f"{where} moves {nbytes} bytes per block: want 0 < nbytes <= "
                    f"page_bytes[{t_idx}] = {pages[t_idx]}"
                )
            out.append((t_idx, nbytes))
        refs.append(out)
    return refs


class PageLayout:
    """The KV tensors, their groups, and the host slot layout (see the module docstring).

    ``tensors``: ``(num_blocks, >= page_bytes[t])`` tensors of 1-byte elements (int8 or
    uint8; vLLM's canonical views), rows contiguous (``stride(1) == 1``), all on one
    device. ``page_bytes[t]``: bytes of tensor ``t`` per block, the host page size.
    ``group_refs[g]``: ``(tensor_idx, nbytes)`` pairs, ``0 < nbytes <= page_bytes[t]``; a
    group may have none (it then moves nothing). ``blocks_per_chunk``: an int >= 1.

    The layout keeps the tensors (copies read and write them through raw addresses).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        page_bytes: Sequence[int],
        group_refs: Sequence[Sequence[tuple[int, int]]],
        blocks_per_chunk: int,
    ) -> None:
        device = _check_tensors(tensors)
        pages = _check_pages(tensors, page_bytes)
        if isinstance(blocks_per_chunk, bool) or not isinstance(blocks_per_chunk, int):
            raise TypeError(f"blocks_per_chunk must be an int, got {blocks_per_chunk!r}")
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        refs = _check_group_refs(group_refs, pages)

        bpc = blocks_per_chunk
        self.tensors: list[torch.Tensor] = list(tensors)
        #: uint8 views of the tensors (the same memory): torch copies use these.
        self.byte_views: list[torch.Tensor] = [
            t if t.dtype == torch.uint8 else t.view(torch.uint8) for t in tensors
        ]
        self.device: torch.device = device
        self.page_bytes: tuple[int, ...] = tuple(pages)
        self.group_refs: tuple[tuple[tuple[int, int], ...], ...] = tuple(map(tuple, refs))
        self.blocks_per_chunk = bpc
        self.num_blocks: tuple[int, ...] = tuple(int(t.shape[0]) for t in tensors)
        offsets = [0]
        for p in pages[:-1]:
            offsets.append(offsets[-1] + bpc * p)
        #: Where tensor ``t``'s sub-pages start in a slot.
        self.tensor_offset: tuple[int, ...] = tuple(offsets)
        #: Bytes of one host slot: ``bpc * sum(page_bytes)``.
        self.slot_bytes: int = bpc * sum(pages)
        # Per group, per ref: the address arithmetic as int64 column vectors.
        self._ref_cols: list[tuple[torch.Tensor, ...]] = []
        for group in refs:
            idx = [t for t, _ in group]
            col = [
                [self.tensors[t].data_ptr() for t in idx],
                [self.tensors[t].stride(0) for t in idx],
                [self.tensor_offset[t] for t in idx],
                [pages[t] for t in idx],
                [n for _, n in group],
            ]
            self._ref_cols.append(
                tuple(torch.tensor(c, dtype=torch.int64).view(-1, 1) for c in col)
            )
        #: The number of blocks a group's ids must stay under: the fewest rows of its
        #: tensors (of all tensors for a group without refs).
        self.group_rows: tuple[int, ...] = tuple(
            min(self.num_blocks[t] for t, _ in group) if group else min(self.num_blocks)
            for group in refs
        )
        #: Bytes one block of each group moves.
        self.group_block_bytes: tuple[int, ...] = tuple(sum(n for _, n in g) for g in refs)
        # Groups that share a tensor (transitively): a load must not write one (tensor,
        # block) twice, so their gpu ids are checked for repeats together.
        self._components = _shared_tensor_components(refs)
        self._arange = torch.arange(1024, dtype=torch.int64)
        #: ``(ids address, count, limit, unique) -> int``: a native id check (see
        #: ``ao_ids_check`` in ``cuda_helpers.c``) an engine may set; -1 means fine.
        self.native_check: Callable[[int, int, int, bool], int] | None = None

    @property
    def num_groups(self) -> int:
        return len(self.group_refs)

    def __repr__(self) -> str:
        return (
            f"<PageLayout {len(self.tensors)} tensors on {self.device}, "
            f"{self.num_groups} groups, {self.blocks_per_chunk} blocks per chunk, "
            f"slot {self.slot_bytes} B>"
        )

    def _range(self, n: int) -> torch.Tensor:
        if n > self._arange.numel():
            self._arange = torch.arange(max(n, 2 * self._arange.numel()), dtype=torch.int64)
        return self._arange[:n]

    # --- plans --------------------------------------------------------------------------

    def plan(
        self,
        gpu_ids: IdsLike,
        group_sizes: IdsLike,
        block_indices: IdsLike,
        slot_ids: IdsLike,
        *,
        num_slots: int,
        store: bool,
    ) -> CopyPlan:
        """Check a transfer and return its plan; ``store`` says which side is written
        (the host slots for a store, the KV blocks for a load), for the repeat checks.

        Raises, naming the argument: ``TypeError`` (not integers, not 1-D),
        ``ValueError`` (lengths that disagree with ``group_sizes`` / ``block_indices`` /
        ``blocks_per_chunk``, negative sizes, a destination written twice), ``IndexError``
        (a block id or slot id out of range).
        """
        gpu = _ids(gpu_ids, "gpu_ids")
        slots = _ids(slot_ids, "slot_ids")
        sizes = _int_list(group_sizes, "group_sizes")
        starts = _int_list(block_indices, "block_indices")
        groups = self.num_groups
        if len(sizes) != groups:
            raise ValueError(f"group_sizes has {len(sizes)} entries for {groups} KV-cache groups")
        if len(starts) != groups:
            raise ValueError(
                f"block_indices has {len(starts)} entries for {groups} KV-cache groups"
            )
        for g in range(groups):
            if sizes[g] < 0:
                raise ValueError(f"group_sizes[{g}] = {sizes[g]} is negative")
            if starts[g] < 0:
                raise ValueError(f"block_indices[{g}] = {starts[g]} is negative")
        if sum(sizes) != gpu.numel():
            raise ValueError(
                f"gpu_ids has {gpu.numel()} entries but group_sizes {sizes} add up to {sum(sizes)}"
            )
        bpc = self.blocks_per_chunk
        skips = [s % bpc for s in starts]
        chunks = [-(-(n + k) // bpc) if n else 0 for n, k in zip(sizes, skips)]
        if sum(chunks) != slots.numel():
            raise ValueError(
                f"slot_ids has {slots.numel()} entries; group_sizes {sizes} with "
                f"block_indices {starts} and blocks_per_chunk {bpc} need {chunks} "
                f"= {sum(chunks)}"
            )
        if not (groups == 1 and self._checked_natively(gpu, slots, num_slots, store)):
            self._check_ids(gpu, slots, sizes, num_slots, store)

        spans: list[GroupSpan] = []
        glo = slo = 0
        for g in range(groups):
            n, nchunks = sizes[g], chunks[g]
            if n and self.group_refs[g]:
                spans.append(GroupSpan(g, glo, n, slo, nchunks, skips[g]))
            glo += n
            slo += nchunks
        return CopyPlan(self, gpu, slots, tuple(spans))

    def ids_from_pointers(
        self,
        ptrs: Any,
        sizes: Any,
        group_block_counts: Sequence[int],
        group_ref_counts: Sequence[int],
    ) -> torch.Tensor:
        """The KV block ids that a transfer given as device pointers names.

        vLLM 0.34 hands a worker flat arrays in canonical order: per group, per ref, per
        block, the address of the block's row in the ref's tensor (``ptrs``) and the
        ref's bytes (``sizes``); ``group_block_counts`` and ``group_ref_counts`` give
        the shape. Every pointer must be the start of a row of the tensor its ref names
        (the same row for every ref of a block) and every size the ref's bytes, so a
        pointer outside the registered KV tensors is refused before anything is copied.
        Raises ``TypeError`` / ``ValueError`` / ``IndexError`` naming the group, the ref
        and the first bad position; returns the ids (int64, ordered by group) that
        :meth:`plan` takes with ``group_sizes = group_block_counts``. Needs numpy (which
        vLLM has), imported here only.
        """
        import numpy as np

        p = _pointer_array(ptrs, "ptrs")
        s = _pointer_array(sizes, "sizes")
        counts = _int_list(group_block_counts, "group_block_counts")
        ref_counts = _int_list(group_ref_counts, "group_data_ref_counts")
        groups = self.num_groups
        if len(counts) != groups or len(ref_counts) != groups:
            raise ValueError(
                f"device pointers describe {len(counts)} groups ({len(ref_counts)} ref "
                f"counts); this KV cache has {groups} KV-cache groups"
            )
        for g, (n, r) in enumerate(zip(counts, ref_counts)):
            if n < 0:
                raise ValueError(f"group_block_counts[{g}] = {n} is negative")
            if r != len(self.group_refs[g]):
                raise ValueError(
                    f"group_data_ref_counts[{g}] = {r}: group {g} has "
                    f"{len(self.group_refs[g])} refs"
                )
        want = sum(n * len(self.group_refs[g]) for g, n in enumerate(counts))
        if p.size != want or s.size != want:
            raise ValueError(
                f"device pointers hold {p.size} pointers and {s.size} sizes; group sizes "
                f"{counts} with {ref_counts} refs need {want}"
            )
        parts: list[np.ndarray] = []
        off = 0
        for g, n in enumerate(counts):
            refs = self.group_refs[g]
            if not n:
                continue
            if not refs:  # a group that moves nothing: any row will do
                parts.append(np.zeros(n, dtype=np.int64))
                continue
            ids: np.ndarray | None = None
            for r, (t, nbytes) in enumerate(refs):
                where = f"group {g}, ref {r} (tensor {t})"
                tensor = self.tensors[t]
                base, stride = tensor.data_ptr(), tensor.stride(0)
                seg = p[off : off + n]
                bad = np.flatnonzero(s[off : off + n] != nbytes)
                if bad.size:
                    raise ValueError(
                        f"device pointers of {where}: size {int(s[off + bad[0]])} at block "
                        f"{int(bad[0])}; the ref moves {nbytes} bytes a block"
                    )
                if ids is None:
                    delta = seg.astype(np.int64) - np.int64(base)  # two's complement: exact
                    ids = delta // max(stride, 1)
                    bad = np.flatnonzero(
                        (delta < 0) | (delta % max(stride, 1) != 0) | (ids >= tensor.shape[0])
                    )
                    if bad.size:
                        raise IndexError(
                            f"device pointers of {where}: {int(seg[bad[0]]):#x} at block "
                            f"{int(bad[0])} is not the start of a row of that tensor "
                            f"({tensor.shape[0]} rows of {stride} B from {base:#x})"
                        )
                else:
                    expected = np.uint64(base) + ids.astype(np.uint64) * np.uint64(stride)
                    bad = np.flatnonzero(seg != expected)
                    if bad.size:
                        raise ValueError(
                            f"device pointers of {where}: {int(seg[bad[0]]):#x} at block "
                            f"{int(bad[0])} is not the row ref 0 names ({int(ids[bad[0]])}: "
                            f"{int(expected[bad[0]]):#x})"
                        )
                off += n
            assert ids is not None
            parts.append(ids)
        if not parts:
            return _EMPTY
        return torch.from_numpy(np.concatenate(parts) if len(parts) > 1 else parts[0])

    def _checked_natively(
        self, gpu: torch.Tensor, slots: torch.Tensor, num_slots: int, store: bool
    ) -> bool:
        """One group's ids checked by :attr:`native_check` (where an engine set it): True
        if they are fine, False if they need (or it could not give) the full checks."""
        check = self.native_check
        if check is None:
            return False
        rows = self.group_rows[0]
        return (
            check(slots.data_ptr(), slots.numel(), num_slots, store) == -1
            and check(gpu.data_ptr(), gpu.numel(), rows, not store) == -1
        )

    def _check_ids(
        self, gpu: torch.Tensor, slots: torch.Tensor, sizes: list[int], num_slots: int, store: bool
    ) -> None:
        """Ranges, and repeats of what the transfer writes (slots of a store, KV blocks of
        a load, within groups that share tensors); raises naming the argument."""
        groups = self.num_groups
        # Small transfers are checked on Python lists: a few list operations cost less
        # than the torch calls (each several microseconds) the large ones use.
        small = gpu.numel() + slots.numel() <= _LIST_CHECKS
        slot_list: list[int] = slots.tolist() if small else []
        if not small or (slot_list and (min(slot_list) < 0 or max(slot_list) >= num_slots)):
            _check_range(slots, 0, num_slots, "slot_ids", "host slots")
        gpu_list: list[int] = gpu.tolist() if small else []
        lo = 0
        for g in range(groups):
            n = sizes[g]
            if n:
                rows = self.group_rows[g]
                part = gpu_list[lo : lo + n]
                if not small or min(part) < 0 or max(part) >= rows:
                    _check_range(gpu[lo : lo + n], lo, rows, "gpu_ids", f"group {g}'s KV blocks")
            lo += n
        if store:
            repeated = (
                len(set(slot_list)) != len(slot_list)
                if small
                else slots.numel() > 1 and torch.unique(slots).numel() != slots.numel()
            )
            if repeated:
                raise ValueError(f"slot_ids repeat a slot: {_repeats(slots)}")
        else:
            self._check_load_targets(gpu, sizes, gpu_list if small else None)

    def _descriptors(self, plan: CopyPlan) -> tuple[tuple[torch.Tensor, ...], tuple[Segment, ...]]:
        """A plan's descriptor columns (kv_addr, kv_block, host_slot, host_offset, size)
        and segments: vectorised per group."""
        bpc = self.blocks_per_chunk
        parts: list[list[torch.Tensor]] = [[], [], [], [], []]
        segments: list[Segment] = []
        pos = 0
        for g, glo, n, slo, nchunks, skip in plan.spans:
            refs = self.group_refs[g]
            gid = plan.gpu_ids[glo : glo + n]
            sl = plan.slot_ids[slo : slo + nchunks]
            base, stride, toff, page, size = self._ref_cols[g]
            if bpc == 1:
                slot_of = sl.view(1, -1)
                sub_off = toff
            else:
                p = self._range(skip + n)[skip:]
                slot_of = sl[p // bpc].view(1, -1)
                sub_off = toff + (p % bpc).view(1, -1) * page
            r = len(refs)
            parts[0].append((base + gid.view(1, -1) * stride).view(-1))
            parts[1].append(gid.view(1, -1).expand(r, n).reshape(-1))
            parts[2].append(slot_of.expand(r, n).reshape(-1))
            parts[3].append(sub_off.expand(r, n).reshape(-1))
            parts[4].append(size.expand(r, n).reshape(-1))
            for t_idx, nb in refs:
                segments.append(Segment(t_idx, nb, pos, pos + n, g))
                pos += n
        return tuple(_cat(p) for p in parts), tuple(segments)

    def _check_load_targets(
        self, gpu: torch.Tensor, sizes: list[int], gpu_list: list[int] | None = None
    ) -> None:
        """A load writes (tensor, block) pairs: ids must not repeat within groups that
        share a tensor. ``gpu_list``: ``gpu`` as a list, to check on (small loads)."""
        if gpu.numel() < 2:
            return
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        for component in self._components:
            if gpu_list is not None:
                listed = [i for g in component for i in gpu_list[starts[g] : starts[g + 1]]]
                if len(set(listed)) == len(listed):
                    continue
            ids = _cat([gpu[starts[g] : starts[g + 1]] for g in component])
            if ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
                names = ", ".join(map(str, component))
                raise ValueError(
                    f"gpu_ids of a load repeat a block within groups {names}, which share "
                    f"KV tensors: {_repeats(ids)}"
                )


# --- input normalisation -------------------------------------------------------------------


def _int(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def _int_list(values: object, name: str) -> list[int]:
    """Small per-group or per-tensor int lists: lists, tuples, numpy arrays, tensors."""
    if isinstance(values, torch.Tensor) or hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    return [_int(v, f"{name}[{i}]") for i, v in enumerate(values)]


def _pointer_array(values: object, name: str) -> np.ndarray:
    """A 1-D uint64 numpy view of device addresses or sizes (vLLM's ``DevicePointers``)."""
    import numpy as np

    if isinstance(values, np.ndarray):
        array = values
    elif isinstance(values, (list, tuple)):
        array = np.asarray(values, dtype=np.uint64)
    else:
        raise TypeError(f"{name} must be a numpy array of uint64, got {type(values).__name__}")
    if array.ndim != 1:
        raise TypeError(f"{name} must be 1-D, got shape {array.shape}")
    if array.dtype != np.uint64:
        if array.dtype.kind not in "iu" or (array.size and int(array.min()) < 0):
            raise TypeError(f"{name} must hold unsigned 64-bit ints, got {array.dtype}")
        array = array.astype(np.uint64)
    return array


def _ids(values: IdsLike, name: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor of ``values`` (list, numpy array or tensor of integers)."""
    if isinstance(values, torch.Tensor):
        t = values.detach()
        if t.device.type != "cpu":
            t = t.cpu()
    else:
        try:
            t = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name} must be a 1-D sequence of ints: {exc}") from None
    if t.dim() != 1:
        raise TypeError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        return _EMPTY
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    return t.to(torch.int64).contiguous()


def _check_range(ids: torch.Tensor, first: int, limit: int, name: str, what: str) -> None:
    if not ids.numel():
        return
    low, high = torch.aminmax(ids)
    if int(low) >= 0 and int(high) < limit:
        return
    bad = int(torch.nonzero((ids < 0) | (ids >= limit))[0, 0])
    raise IndexError(
        f"{name}[{first + bad}] = {int(ids[bad])} is out of range: {what} are numbered "
        f"0 to {limit - 1}"
    )


def _repeats(ids: torch.Tensor) -> list[int]:
    values, counts = torch.unique(ids, return_counts=True)
    return [int(v) for v in values[counts > 1][:8]]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    if not parts:
        return _EMPTY
    if len(parts) == 1:
        return parts[0].contiguous()
    return torch.cat(parts)


def _shared_tensor_components(refs: list[list[tuple[int, int]]]) -> list[list[int]]:
    """Groups linked by shared tensors (transitively), each list in group order."""
    parent = list(range(len(refs)))

    def find(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    owner: dict[int, int] = {}
    for g, group in enumerate(refs):
        for t, _ in group:
            if t in owner:
                parent[find(g)] = find(owner[t])
            else:
                owner[t] = g
    out: dict[int, list[int]] = {}
    for g in range(len(refs)):
        out.setdefault(find(g), []).append(g)
    return list(out.values())
