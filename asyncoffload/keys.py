"""Offload keys: a block's prefix-chain hash plus its KV-cache group index.

An :data:`OffloadKey` is raw ``bytes`` (hash bytes followed by the group index as a
4-byte big-endian unsigned integer), the same convention vLLM's ``kv_offload`` uses, so
keys produced here and there interoperate. Raw bytes keep hot paths free of tuples and
per-key objects.

:func:`hash_token_blocks` turns token ids into chained block hashes: block ``i``'s hash
covers the hash of block ``i - 1`` and its own tokens, so equal hashes mean equal
prefixes. Only full blocks are hashed; a trailing partial block has no key.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

__all__ = [
    "GROUP_IDX_BYTES",
    "OffloadKey",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "hash_token_blocks",
    "keys_for_tokens",
    "make_offload_key",
]

OffloadKey = NewType("OffloadKey", bytes)

GROUP_IDX_BYTES = 4
_MAX_GROUP_IDX = (1 << (8 * GROUP_IDX_BYTES)) - 1


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """Pack ``block_hash`` and ``group_idx`` into an :data:`OffloadKey`.

    Raises ``TypeError`` for a non-bytes hash or non-int group, ``ValueError`` for an
    empty hash or a group index outside ``[0, 2**32)``.
    """
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        raise TypeError(f"block_hash must be bytes, got {type(block_hash).__name__}")
    if isinstance(group_idx, bool) or not isinstance(group_idx, int):
        raise TypeError(f"group_idx must be an int, got {type(group_idx).__name__}")
    if not 0 <= group_idx <= _MAX_GROUP_IDX:
        raise ValueError(f"group_idx {group_idx} is outside [0, 2**32)")
    raw = bytes(block_hash)
    if not raw:
        raise ValueError("block_hash is empty")
    return OffloadKey(raw + group_idx.to_bytes(GROUP_IDX_BYTES, "big", signed=False))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block-hash part of ``key``."""
    return key[:-GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index of ``key``."""
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big", signed=False)


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: bytes | None = None,
    salt: bytes | None = None,
) -> list[bytes]:
    """Chained SHA-256 hashes of the full ``block_size``-token blocks of ``token_ids``.

    ``parent`` continues a chain (the hash of the block before ``token_ids[0]``);
    ``salt`` separates namespaces (a LoRA, a tenant, a cache-salt), mixed into the first
    block only, so it changes every hash of the chain.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[bytes] = []
    prev = parent if parent is not None else b""
    n_full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, n_full, block_size):
        h = hashlib.sha256()
        h.update(prev)
        if start == 0 and parent is None and salt:
            h.update(b"salt:")
            h.update(salt)
        h.update(struct.pack(f"<{block_size}q", *token_ids[start : start + block_size]))
        prev = h.digest()
        hashes.append(prev)
    return hashes


def keys_for_tokens(
    token_ids: Sequence[int],
    block_size: int,
    group_idx: int = 0,
    *,
    parent: bytes | None = None,
    salt: bytes | None = None,
) -> list[OffloadKey]:
    """:func:`hash_token_blocks` packed into offload keys of ``group_idx``."""
    return [
        make_offload_key(h, group_idx)
        for h in hash_token_blocks(token_ids, block_size, parent=parent, salt=salt)
    ]
