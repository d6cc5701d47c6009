"""A Triton kernel that copies the pages of one KV-cache group between the paged KV tensors
and host slot images: pinned host slots through UVA (the ``kernel`` method) or rows of
device staging memory that the copy engines then move whole (the ``staged`` method).

A launch covers blocks ``j0 .. j0 + n_blocks - 1`` of one group and a set of its refs; it
reads only the group's block ids and slot ids (device memory, uploaded per transfer) and a
per-ref table made once per layout, and computes every address on the device::

    kv   = kv_base[r] + gpu_ids[g_off + j] * kv_stride[r]
    p    = skip + j;  pos = p // bpc;  sub = p % bpc
    row  = row_table[slot_ids[s_off + pos]]          (USE_TABLE: host slots)
         | row_base + (pos - row_lo) * row_stride    (else: staging rows)
    host = row + host_off[r] + sub * page[r]         (nbytes[r] bytes)

so a transfer sends two id arrays, not one descriptor per (block, ref). ``WIDE`` launches
move int64 words and need every address and size of the launch to be 8-byte aligned (the
caller checks it once per layout); others move bytes. Each program copies ``DESC``
descriptors at a time, ``WORDS`` elements of each per step, grid-striding over the
launch's ``n_blocks * nref`` descriptors (block-major).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncoffload.transfer.settings import TransferSettings

__all__ = ["launch_copy_pages", "tile_shape"]

_SETTINGS = TransferSettings.from_env()  # the environment's overrides, for tuning runs
_TILE = _SETTINGS.paged_tile
_NUM_WARPS: int = _SETTINGS.paged_warps

_INTS = [
    "n_blocks",
    "nref",
    "j0",
    "g_off",
    "s_off",
    "skip",
    "bpc",
    "max_elems",
    "row_base",
    "row_stride",
    "row_lo",
]


@triton.jit(do_not_specialize=_INTS)  # type: ignore[untyped-decorator]
def _copy_pages(  # type: ignore[no-untyped-def]
    ids,  # int64 device: the transfer's gpu ids then slot ids
    refs,  # int64 [5, nref]: kv_base, kv_stride, host_off, page, nbytes
    row_table,  # int64 [slots]: address of each host slot (USE_TABLE only)
    n_blocks,
    nref,
    j0,
    g_off,
    s_off,
    skip,
    bpc,
    max_elems,
    row_base,
    row_stride,
    row_lo,
    STORE: tl.constexpr,
    USE_TABLE: tl.constexpr,
    WIDE: tl.constexpr,
    DESC: tl.constexpr,
    WORDS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, DESC).to(tl.int64)
    offs = tl.arange(0, WORDS).to(tl.int64)
    n_desc = n_blocks.to(tl.int64) * nref
    base = pid.to(tl.int64) * DESC
    while base < n_desc:
        d = base + lanes
        live = d < n_desc
        b = d // nref
        r = d % nref
        j = j0 + b
        gid = tl.load(ids + g_off + j, mask=live, other=0)
        p = skip + j
        pos = p // bpc
        sub = p % bpc
        if USE_TABLE:
            slot = tl.load(ids + s_off + pos, mask=live, other=0)
            row = tl.load(row_table + slot, mask=live, other=0)
        else:
            row = row_base + (pos - row_lo) * row_stride
        kv = tl.load(refs + r, mask=live, other=0) + gid * tl.load(
            refs + nref + r, mask=live, other=0
        )
        host = (
            row
            + tl.load(refs + 2 * nref + r, mask=live, other=0)
            + sub * tl.load(refs + 3 * nref + r, mask=live, other=0)
        )
        size = tl.load(refs + 4 * nref + r, mask=live, other=0)
        if WIDE:
            elems = size // 8
            if STORE:
                src = kv.to(tl.pointer_type(tl.int64))
                dst = host.to(tl.pointer_type(tl.int64))
            else:
                src = host.to(tl.pointer_type(tl.int64))
                dst = kv.to(tl.pointer_type(tl.int64))
        else:
            elems = size
            if STORE:
                src = kv.to(tl.pointer_type(tl.uint8))
                dst = host.to(tl.pointer_type(tl.uint8))
            else:
                src = host.to(tl.pointer_type(tl.uint8))
                dst = kv.to(tl.pointer_type(tl.uint8))
        for start in range(0, max_elems, WORDS):
            idx = start + offs
            mask = live[:, None] & (idx[None, :] < elems[:, None])
            vals = tl.load(src[:, None] + idx[None, :], mask=mask)
            tl.store(dst[:, None] + idx[None, :], vals, mask=mask)
        base += nprog * DESC


def tile_shape(max_elems: int) -> tuple[int, int]:
    """(DESC, WORDS) for a launch whose largest descriptor has ``max_elems`` elements."""
    words = min(_TILE, 1 << max(0, (max_elems - 1).bit_length()))
    return max(1, _TILE // words), words


def launch_copy_pages(
    ids: torch.Tensor,
    refs: torch.Tensor,
    row_table: torch.Tensor,
    *,
    n_blocks: int,
    j0: int,
    g_off: int,
    s_off: int,
    skip: int,
    bpc: int,
    max_elems: int,
    row_base: int,
    row_stride: int,
    row_lo: int,
    store: bool,
    use_table: bool,
    wide: bool,
    programs: int,
) -> None:
    """Copy ``n_blocks`` blocks of one group (see the module docstring) on the current
    stream, KV -> host rows if ``store`` else host rows -> KV."""
    nref = refs.shape[1]
    desc, words = tile_shape(max_elems)
    grid = (max(1, min(programs, triton.cdiv(max(1, n_blocks * nref), desc))),)
    _copy_pages[grid](
        ids,
        refs,
        row_table,
        n_blocks,
        nref,
        j0,
        g_off,
        s_off,
        skip,
        bpc,
        max_elems,
        row_base,
        row_stride,
        row_lo,
        STORE=store,
        USE_TABLE=use_table,
        WIDE=wide,
        DESC=desc,
        WORDS=words,
        num_warps=_NUM_WARPS,
    )
