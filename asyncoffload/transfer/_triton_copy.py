"""A Triton kernel that copies whole KV blocks between the KV tensors and pinned host slots.

Through UVA a kernel reads and writes pinned host memory directly, so one launch moves
every (block, layer, K/V) fragment of a transfer: the SMs do the gather and scatter that
would otherwise cost one DMA descriptor per fragment. Addresses are computed on the
device from the block ids and per-fragment tables, so a transfer sends only its ids.
Fragments must be whole int64 words and 8-byte aligned.

Each program copies ``DESC`` fragments at a time, ``WORDS`` words of each per step, so
that small fragments still keep many PCIe transactions in flight per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncoffload.transfer.settings import TransferSettings

__all__ = ["launch_copy_blocks"]

# Words moved per program per step (DESC * WORDS), and warps per program; the
# environment overrides (``TransferSettings``) are for tuning runs.
_SETTINGS = TransferSettings.from_env()
_TILE_WORDS = _SETTINGS.kernel_tile_words
_NUM_WARPS: int = _SETTINGS.kernel_warps


@triton.jit
def _copy_blocks(  # type: ignore[no-untyped-def]
    ids,  # int64 [2 * n_blocks]: KV block ids, then host block ids
    n_blocks,
    nfrag,
    kv_base,  # int64 [nfrag]: address of fragment column f's block 0
    kv_stride,  # int64 [nfrag]: bytes between consecutive blocks of column f
    host_addr,  # int64 [host blocks]: address of each host slot
    words,  # int64 words per fragment
    STORE: tl.constexpr,
    DESC: tl.constexpr,
    WORDS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, DESC)
    offs = tl.arange(0, WORDS)
    n_desc = n_blocks * nfrag
    base = pid * DESC
    while base < n_desc:
        d = base + lanes
        live = d < n_desc
        blk = d // nfrag
        f = d % nfrag
        kv_id = tl.load(ids + blk, mask=live, other=0)
        host_id = tl.load(ids + n_blocks + blk, mask=live, other=0)
        kv = tl.load(kv_base + f, mask=live, other=0) + kv_id * tl.load(
            kv_stride + f, mask=live, other=0
        )
        host = tl.load(host_addr + host_id, mask=live, other=0) + f * (words * 8)
        if STORE:
            src = kv.to(tl.pointer_type(tl.int64))
            dst = host.to(tl.pointer_type(tl.int64))
        else:
            src = host.to(tl.pointer_type(tl.int64))
            dst = kv.to(tl.pointer_type(tl.int64))
        for start in range(0, words, WORDS):
            idx = start + offs
            mask = live[:, None] & (idx < words)[None, :]
            vals = tl.load(src[:, None] + idx[None, :], mask=mask)
            tl.store(dst[:, None] + idx[None, :], vals, mask=mask)
        base += nprog * DESC


def launch_copy_blocks(
    ids: torch.Tensor,
    n_blocks: int,
    kv_base: torch.Tensor,
    kv_stride: torch.Tensor,
    host_addr: torch.Tensor,
    fragment_bytes: int,
    store: bool,
    programs: int,
) -> None:
    """Copy ``n_blocks`` blocks (ids on the device: KV ids then host ids) on the current
    stream, KV -> host if ``store`` else host -> KV, with at most ``programs`` programs."""
    if n_blocks == 0:
        return
    nfrag = kv_base.numel()
    words = fragment_bytes // 8
    per_step = min(_TILE_WORDS, 1 << (words - 1).bit_length())
    desc = max(1, _TILE_WORDS // per_step)
    grid = (max(1, min(programs, triton.cdiv(n_blocks * nfrag, desc))),)
    _copy_blocks[grid](
        ids,
        n_blocks,
        nfrag,
        kv_base,
        kv_stride,
        host_addr,
        words,
        STORE=store,
        DESC=desc,
        WORDS=per_step,
        num_warps=_NUM_WARPS,
    )
