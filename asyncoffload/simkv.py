"""A simulated GPU KV cache on the CPU, whose blocks are written and checked by key.

The demo (:mod:`asyncoffload.demo`) serves its requests against one, and the engine
replay (:func:`asyncoffload.replay.replay_engine`) loads its hits into one: both move
real bytes through the engine and check every loaded block bit for bit.

Every block's content is a function of its key, so a load is checked exactly: block
``b`` of layer ``l``, half ``h`` (K or V) holds the int64 words
``(w(key) XOR salt[l, h]) + j``
for ``j`` in the fragment.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncoffload.keys import OffloadKey

__all__ = ["SimulatedKVCache"]

_WORD_MASK = (1 << 62) - 1


class SimulatedKVCache:
    """Per-layer K/V tensors ``[2, num_blocks, block_size, kv_heads, head_dim]`` bf16,
    views of one tensor, whose blocks are written and checked by key."""

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        seed: int = 0,
    ) -> None:
        shape = (layers, 2, num_blocks, block_size, kv_heads, head_dim)
        self.storage = torch.zeros(shape, dtype=torch.bfloat16)
        #: What the engine sees: one contiguous tensor per layer.
        self.kv_caches: list[torch.Tensor] = list(self.storage.unbind(0))
        self.num_blocks = num_blocks
        self._words = self.storage.view(layers, 2, num_blocks, -1).view(torch.int64)
        n_words = self._words.shape[-1]
        # torch takes 64-bit seeds and reduces negative ones modulo 2**64: so for any int.
        gen = torch.Generator().manual_seed(seed % (1 << 64))
        self._salt = torch.randint(0, 1 << 61, (layers, 2, 1, 1), generator=gen)
        self._ramp = torch.arange(n_words, dtype=torch.int64)

    def _expected(self, keys: Sequence[OffloadKey]) -> torch.Tensor:
        words = [int.from_bytes(key[:8], "little") & _WORD_MASK for key in keys]
        base = torch.tensor(words, dtype=torch.int64).view(1, 1, -1, 1) ^ self._salt
        return base + self._ramp

    def write(self, keys: Sequence[OffloadKey], blocks: Sequence[int]) -> None:
        """Fill ``blocks`` with the content of ``keys`` (as a forward pass would)."""
        if keys:
            idx = torch.tensor(blocks, dtype=torch.int64)
            self._words.index_copy_(2, idx, self._expected(keys))

    def check(self, keys: Sequence[OffloadKey], blocks: Sequence[int]) -> int:
        """How many of ``blocks`` do not hold exactly the content of ``keys``."""
        if not keys:
            return 0
        idx = torch.tensor(blocks, dtype=torch.int64)
        equal = self._words.index_select(2, idx) == self._expected(keys)
        if bool(equal.all()):
            return 0
        per_block = equal.all(dim=3).all(dim=1).all(dim=0)
        return int((~per_block).sum())
