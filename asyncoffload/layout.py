"""KVLayout: how the serving engine's KV tensors are split into blocks, and the host layout.

Two GPU layouts are understood, per layer and all alike:

- K/V split, ``[2, num_blocks, ...]`` (vLLM's flash-attention layout): block ``b`` of a layer
  is two fragments, ``t[0, b]`` and ``t[1, b]``;
- unsplit, ``[num_blocks, ...]`` (MLA and friends): block ``b`` is one fragment ``t[b]``.

On the host a block is **block-major**: every fragment of every layer, contiguous, in the
order (layer 0 K, layer 0 V, layer 1 K, ...). One host block moves to a lower tier as one
buffer, and a GPU<->host copy is at most one descriptor per fragment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["KVLayout"]


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV tensors of one engine.

    ``fragment_bytes`` is the size of one block of one layer (of K or of V when split).
    """

    num_layers: int
    num_blocks: int
    kv_split: bool
    fragment_bytes: int
    dtype: torch.dtype
    device: torch.device

    @property
    def block_dim(self) -> int:
        """The tensor dimension that indexes blocks."""
        return 1 if self.kv_split else 0

    @property
    def fragments_per_block(self) -> int:
        return self.num_layers * (2 if self.kv_split else 1)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: the size of one host slot."""
        return self.fragments_per_block * self.fragment_bytes

    @classmethod
    def infer(cls, kv_caches: Sequence[torch.Tensor], kv_split: bool | None = None) -> KVLayout:
        """Describe ``kv_caches``; ``ValueError`` saying what is wrong when it can't.

        ``kv_split=None`` infers the layout: a leading dimension other than 2 means
        unsplit; a 5-dimensional tensor with leading 2 is vLLM's split layout
        ``[2, num_blocks, block_size, heads, head_dim]``. Anything else with a leading 2
        is ambiguous (two unsplit blocks, or K/V?) and must be stated.
        """
        if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence):
            raise TypeError("kv_caches must be a list of per-layer tensors")
        if not kv_caches:
            raise ValueError("kv_caches is empty: at least one layer is needed")
        first = kv_caches[0]
        for i, t in enumerate(kv_caches):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv_caches[{i}] is a {type(t).__name__}, not a torch.Tensor")
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"kv_caches[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}, layer 0 is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}: layers must match"
                )
            if not t.is_contiguous():
                raise ValueError(f"kv_caches[{i}] is not contiguous")
        shape = tuple(first.shape)
        if kv_split is None:
            if len(shape) >= 1 and shape[0] != 2:
                kv_split = False
            elif len(shape) == 5:
                kv_split = True
            else:
                raise ValueError(
                    f"cannot tell whether KV tensors of shape {shape} are K/V split "
                    "[2, num_blocks, ...] or unsplit [num_blocks, ...]: pass kv_split="
                )
        min_dims = 2 if kv_split else 1
        if len(shape) < min_dims or (kv_split and shape[0] != 2):
            want = "[2, num_blocks, ...]" if kv_split else "[num_blocks, ...]"
            raise ValueError(f"KV tensor shape {shape} does not match the layout {want}")
        num_blocks = shape[1] if kv_split else shape[0]
        if num_blocks <= 0:
            raise ValueError(f"KV tensors of shape {shape} hold no blocks")
        per_block = math.prod(shape[min_dims:]) * first.element_size()
        if per_block <= 0:
            raise ValueError(f"KV tensors of shape {shape} have empty blocks")
        return cls(
            num_layers=len(kv_caches),
            num_blocks=num_blocks,
            kv_split=kv_split,
            fragment_bytes=per_block,
            dtype=first.dtype,
            device=first.device,
        )

    def fragment_views(self, kv_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``[num_blocks, fragment_bytes]`` uint8 views of every fragment column, in host
        order; writing into a view writes the KV tensor."""
        views: list[torch.Tensor] = []
        for t in kv_caches:
            raw = t.view(-1).view(torch.uint8)
            if self.kv_split:
                raw = raw.view(2, self.num_blocks, self.fragment_bytes)
                views.extend((raw[0], raw[1]))
            else:
                views.append(raw.view(self.num_blocks, self.fragment_bytes))
        return views
