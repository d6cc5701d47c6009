"""A Triton kernel that copies equal-size fragments between arbitrary addresses.

Through UVA a kernel can read and write pinned host memory directly, so one launch
gathers the (block, layer, K/V) fragments of a whole transfer: the SMs do the scatter and
gather that would otherwise cost one DMA descriptor per fragment. Fragments must be whole
int64 words and 8-byte aligned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["launch_copy_fragments"]


@triton.jit
def _copy_fragments(src_addr, dst_addr, n_desc, words, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    # Program p copies descriptors p, p + nprog, ...; each is `words` int64 words, moved
    # BLOCK words per step.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    d = pid
    while d < n_desc:
        src = tl.load(src_addr + d).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_addr + d).to(tl.pointer_type(tl.int64))
        for start in range(0, words, BLOCK):
            idx = start + offs
            mask = idx < words
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)
        d += nprog


def launch_copy_fragments(src: torch.Tensor, dst: torch.Tensor, words: int, programs: int) -> None:
    """Copy ``words`` int64 words from each address in ``src`` to the matching address in
    ``dst`` (int64 device tensors), on the current stream, with at most ``programs``
    programs."""
    n = src.numel()
    if n == 0:
        return
    block = 1024 if words >= 1024 else max(16, 1 << (words - 1).bit_length())
    _copy_fragments[(max(1, min(programs, n)),)](src, dst, n, words, BLOCK=block)
