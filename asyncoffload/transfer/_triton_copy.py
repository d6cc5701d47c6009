"""A Triton kernel that copies equal-size fragments between arbitrary addresses.

Through UVA a kernel can read and write pinned host memory directly, so one launch
gathers the (block, layer, K/V) fragments of a whole transfer: the SMs do the scatter and
gather that would otherwise cost one DMA descriptor per fragment. Fragments must be whole
int64 words and 8-byte aligned.

Each program copies ``DESC`` fragments at a time, ``WORDS`` words of each per step, so
that small fragments still keep many PCIe reads in flight per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["launch_copy_fragments"]

# Words moved per program per step (DESC * WORDS): 32 KiB.
_TILE_WORDS = 4096


@triton.jit
def _copy_fragments(src_addr, dst_addr, n_desc, words, DESC: tl.constexpr, WORDS: tl.constexpr):  # type: ignore[no-untyped-def]
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, DESC)
    offs = tl.arange(0, WORDS)
    base = pid * DESC
    while base < n_desc:
        d = base + lanes
        live = d < n_desc
        src = tl.load(src_addr + d, mask=live, other=0).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_addr + d, mask=live, other=0).to(tl.pointer_type(tl.int64))
        for start in range(0, words, WORDS):
            idx = start + offs
            mask = live[:, None] & (idx < words)[None, :]
            vals = tl.load(src[:, None] + idx[None, :], mask=mask)
            tl.store(dst[:, None] + idx[None, :], vals, mask=mask)
        base += nprog * DESC


def launch_copy_fragments(src: torch.Tensor, dst: torch.Tensor, words: int, programs: int) -> None:
    """Copy ``words`` int64 words from each address in ``src`` to the matching address in
    ``dst`` (int64 device tensors), on the current stream, with at most ``programs``
    programs."""
    n = src.numel()
    if n == 0:
        return
    per_step = min(_TILE_WORDS, 1 << (words - 1).bit_length())
    desc = max(1, _TILE_WORDS // per_step)
    grid = (max(1, min(programs, triton.cdiv(n, desc))),)
    _copy_fragments[grid](src, dst, n, words, DESC=desc, WORDS=per_step, num_warps=8)
