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
import operator
import struct
from collections.abc import Sequence
from typing import Any, NewType, Protocol, SupportsIndex, TypeAlias

__all__ = [
    "GROUP_IDX_BYTES",
    "BlockTokens",
    "OffloadKey",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "hash_token_blocks",
    "keys_for_tokens",
    "make_offload_key",
    "tenant_key",
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


def tenant_key(key: OffloadKey, tenant: str) -> OffloadKey:
    """``key`` as filed for ``tenant``: its block hash mixed with the tenant (BLAKE2b,
    as long as the hash, 16 to 64 bytes), the group index kept. Equal keys of different
    tenants never meet in any tier."""
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str, got {type(tenant).__name__}")
    block_hash = key[:-GROUP_IDX_BYTES]
    size = min(max(len(block_hash), 16), 64)
    mixed = hashlib.blake2b(
        tenant.encode() + b"\0" + block_hash, digest_size=size, person=b"ao-tenant"
    ).digest()
    return OffloadKey(mixed + key[-GROUP_IDX_BYTES:])


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block-hash part of ``key``."""
    return key[:-GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index of ``key``."""
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big", signed=False)


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class IntArray(Protocol):
    """A one-dimensional integer numpy array or torch tensor (anything with ``dtype``,
    ``ndim`` and ``tolist``)."""

    @property
    def dtype(self) -> Any: ...
    @property
    def ndim(self) -> int: ...
    def tolist(self) -> Any: ...


#: Token ids: a sequence of ints (numpy integer scalars too) or an :class:`IntArray`.
TokenIds: TypeAlias = "Sequence[SupportsIndex] | IntArray"


def token_list(token_ids: object, what: str = "token_ids") -> list[int]:
    """``token_ids`` as a list of Python ints: a sequence of ints (anything
    ``operator.index`` takes, numpy integer scalars included), or a one-dimensional integer
    numpy array or torch tensor. Each must fit int64, as token ids are hashed as int64.
    ``TypeError`` / ``ValueError`` name ``what`` and the index of the first bad value."""
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise TypeError(f"{what} must be a sequence of ints, not {type(token_ids).__name__}")
    dtype = getattr(token_ids, "dtype", None)
    if dtype is not None and hasattr(token_ids, "tolist"):  # a numpy array or torch tensor
        kind = getattr(dtype, "kind", None)  # numpy
        is_int = kind in ("i", "u") if kind is not None else _torch_int_dtype(dtype)
        if not is_int:
            raise TypeError(f"{what} has dtype {dtype}, not an integer dtype")
        ndim = getattr(token_ids, "ndim", 1)
        if ndim != 1:
            raise ValueError(f"{what} must be one-dimensional, got {ndim} dimensions")
        values = token_ids.tolist()
    else:
        try:
            values = list(token_ids)  # type: ignore[call-overload]
        except TypeError:
            raise TypeError(
                f"{what} must be a sequence of ints, not {type(token_ids).__name__}"
            ) from None
    out: list[int] = []
    for i, t in enumerate(values):
        if isinstance(t, bool):
            raise TypeError(f"{what}[{i}] is a bool, not an int")
        try:
            v = operator.index(t)
        except TypeError:
            raise TypeError(f"{what}[{i}] is a {type(t).__name__} ({t!r}), not an int") from None
        if not _INT64_MIN <= v <= _INT64_MAX:
            raise ValueError(f"{what}[{i}] = {v} does not fit a 64-bit signed integer")
        out.append(v)
    return out


def _torch_int_dtype(dtype: object) -> bool:
    is_floating = getattr(dtype, "is_floating_point", True)
    is_complex = getattr(dtype, "is_complex", True)
    return not is_floating and not is_complex and str(dtype) != "torch.bool"


def _optional_bytes(value: object, what: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    raise TypeError(f"{what} must be bytes or None, got {type(value).__name__}")


def hash_token_blocks(
    token_ids: TokenIds,
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
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    token_ids = token_list(token_ids)
    parent = _optional_bytes(parent, "parent")
    salt = _optional_bytes(salt, "salt")
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
    token_ids: TokenIds,
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


class BlockTokens:
    """What a chain of blocks holds, so that stored events can describe it.

    ``keys[i]`` holds ``token_ids[i * block_size:(i + 1) * block_size]``; the parent of
    ``keys[0]`` is ``parent_block_hash`` (``None``: it starts the sequence) and the parent
    of ``keys[i]`` is ``keys[i - 1]``. ``token_ids`` may run on into a trailing partial
    block, which has no key and is ignored, so a request's whole prompt will do.

    Put one on :class:`~asyncoffload.ReqContext` (``ctx.tokens``) for a request, or pass it
    to ``AsyncOffloadEngine.prepare_store(..., tokens=)``: the stored events of those
    keys then carry their token ids, parent hash, block size and LoRA (vLLM's
    self-describing ``BlockStored``). Raises ``TypeError`` / ``ValueError`` naming what
    does not fit.
    """

    __slots__ = (
        "_index",
        "block_size",
        "keys",
        "lora_id",
        "lora_name",
        "parent_block_hash",
        "token_ids",
    )

    def __init__(
        self,
        keys: Sequence[OffloadKey],
        token_ids: TokenIds,
        block_size: int,
        parent_block_hash: bytes | None = None,
        *,
        lora_name: str | None = None,
        lora_id: int | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(keys, (bytes, str)):
            raise TypeError("keys must be a sequence of OffloadKey, not one key")
        key_list = tuple(keys)
        for i, key in enumerate(key_list):
            if not isinstance(key, bytes) or len(key) <= GROUP_IDX_BYTES:
                raise TypeError(f"keys[{i}] is not an OffloadKey (hash bytes + 4-byte group)")
        index = {key: i for i, key in enumerate(key_list)}
        if len(index) != len(key_list):
            raise ValueError("keys holds the same key more than once")
        tokens = tuple(token_list(token_ids))
        need = block_size * len(key_list)
        if not need <= len(tokens) < need + block_size:
            raise ValueError(
                f"{len(key_list)} keys of {block_size} tokens need {need} token ids "
                f"(up to {need + block_size - 1} with a trailing partial block), "
                f"got {len(tokens)}"
            )
        if parent_block_hash is not None and not isinstance(parent_block_hash, bytes):
            raise TypeError(
                f"parent_block_hash must be bytes or None, got {type(parent_block_hash).__name__}"
            )
        if lora_name is not None and not isinstance(lora_name, str):
            raise TypeError(f"lora_name must be a str or None, got {type(lora_name).__name__}")
        if lora_id is not None and (isinstance(lora_id, bool) or not isinstance(lora_id, int)):
            raise TypeError(f"lora_id must be an int or None, got {type(lora_id).__name__}")
        self.keys = key_list
        self.token_ids = tokens[:need]
        self.block_size = block_size
        self.parent_block_hash = parent_block_hash
        self.lora_name = lora_name
        self.lora_id = lora_id
        self._index = index

    @classmethod
    def from_tokens(
        cls,
        token_ids: TokenIds,
        block_size: int,
        group_idx: int = 0,
        *,
        parent: bytes | None = None,
        salt: bytes | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
    ) -> BlockTokens:
        """Hash ``token_ids`` (:func:`keys_for_tokens`) and describe the keys made.
        ``token_ids`` may be a list, a numpy array or a torch tensor of integers."""
        token_ids = token_list(token_ids)
        keys = keys_for_tokens(token_ids, block_size, group_idx, parent=parent, salt=salt)
        return cls(keys, token_ids, block_size, parent, lora_name=lora_name, lora_id=lora_id)

    def index(self, key: OffloadKey) -> int | None:
        """The position of ``key`` in :attr:`keys`, or ``None``."""
        return self._index.get(key)

    def parent_of(self, i: int) -> bytes | None:
        """The block hash of the parent of ``keys[i]``."""
        return self.parent_block_hash if i == 0 else get_offload_block_hash(self.keys[i - 1])

    def tokens_of(self, start: int, stop: int) -> tuple[int, ...]:
        """The token ids of ``keys[start:stop]``."""
        return self.token_ids[start * self.block_size : stop * self.block_size]

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"<BlockTokens {len(self.keys)} blocks of {self.block_size} tokens>"
