"""The namespace identity of stored blocks, and the on-disk block header.

A block written below the CPU tier outlives the engine that wrote it (files mode keeps
it across restarts, and engines may share a directory), so every block says what it is.
Three peers served the wrong KV because a field was missing from their keys: the KV
dtype (vLLM #45767), the model weights (SGLang #24758), the tenant (lmdeploy #4930).
:class:`Namespace` holds every field that changes the meaning of a block's bytes; its
:meth:`~Namespace.identity` (16 bytes) goes into each block's header and names the
directory of files mode. Engines with different identities never read each other's
blocks: their directories differ, and a block that strays (a renamed or copied file)
fails the header check.

The header (``HEADER_BYTES``, little-endian) precedes the payload, which is padded with
zeros to a multiple of 4096 bytes so that the block can be read and written with
``O_DIRECT``::

    [0, 8)       magic b"AOKVBLK\\0"
    [8, 12)      format version (u32)
    [12, 16)     header length (u32) = 4096
    [16, 32)     identity (16 bytes)
    [32, 40)     payload length (u64)
    [40, 44)     CRC32C of the payload (u32)
    [44, 48)     key length (u32), 1..256
    [48, 304)    key, zero padded
    [304, 4092)  zeros
    [4092, 4096) CRC32C of bytes [0, 4092)

The native I/O lanes build and check it (the CRCs are computed in C, in the lane);
:func:`pack_header` / :func:`parse_header` are the same format in Python, for tests and
tools.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import asdict, dataclass, replace

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_KEY_BYTES",
    "BlockHeader",
    "Namespace",
    "block_file_bytes",
    "pack_header",
    "pack_header_into",
    "parse_header",
]

MAGIC = b"AOKVBLK\0"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
MAX_KEY_BYTES = 256
_ALIGN = 4096
_FIXED = struct.Struct("<8sII16sQII")  # magic .. key length: 48 bytes
_KEY_END = _FIXED.size + MAX_KEY_BYTES


def block_file_bytes(payload_bytes: int) -> int:
    """Bytes one block takes on disk: the header and the payload padded to 4096."""
    return HEADER_BYTES + -(-payload_bytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for a stored block to be usable.

    ``model`` names the weights (a path or a hub id, with a revision if it may change);
    ``kv_dtype``, ``layout`` and ``block_bytes`` describe the bytes; ``tokens_per_block``
    how many tokens a block holds; ``rank`` / ``world_size`` which shard of a
    tensor-parallel KV cache; ``tenant`` isolates tenants (a ``cache_salt``) that must not
    share KV; ``extra`` any further field of the deployment (a LoRA, a quantization
    recipe). The engine id is deliberately absent: engines with equal namespaces share.
    """

    model: str
    kv_dtype: str
    layout: str
    block_bytes: int
    tokens_per_block: int = 0
    rank: int = 0
    world_size: int = 1
    tenant: str = ""
    extra: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("model", "kv_dtype", "layout", "tenant", "extra"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"Namespace.{name} must be a str, got {type(value).__name__}")
        for name in ("block_bytes", "tokens_per_block", "rank", "world_size", "format_version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Namespace.{name} must be an int >= 0, got {value!r}")
        if self.block_bytes <= 0:
            raise ValueError(f"Namespace.block_bytes must be positive, got {self.block_bytes}")
        if self.world_size <= 0 or self.rank >= self.world_size:
            raise ValueError(f"Namespace rank {self.rank} is outside world_size {self.world_size}")

    def identity(self) -> bytes:
        """16 bytes naming this namespace: a BLAKE2b of its canonical JSON."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=16, person=b"asyncoffload-ns").digest()

    def with_tenant(self, tenant: str | None) -> Namespace:
        """This namespace for ``tenant`` (itself for ``None`` or its own tenant)."""
        if tenant is None or tenant == self.tenant:
            return self
        return replace(self, tenant=tenant)

    def dirname(self) -> str:
        """The directory of this namespace under a files-mode root: a readable model
        name, the rank, then the identity."""
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model).strip("._") or "model"
        return f"{safe[:64]}_r{self.rank}_{self.identity().hex()}"

    def describe(self) -> dict[str, object]:
        """The fields, for the ``namespace.json`` written beside files-mode blocks."""
        out: dict[str, object] = asdict(self)
        out["identity"] = self.identity().hex()
        return out


@dataclass(frozen=True)
class BlockHeader:
    identity: bytes
    key: bytes
    payload_len: int
    payload_crc: int
    version: int = FORMAT_VERSION


def _crc32c(data: bytes | memoryview) -> int:
    from asyncoffload.tiers._io import crc32c

    return crc32c(data)


def pack_header(identity: bytes, key: bytes, payload: bytes) -> bytes:
    """The header of a block holding ``payload`` (CRCs through the native lanes' C)."""
    if len(identity) != 16:
        raise ValueError(f"identity must be 16 bytes, got {len(identity)}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a key must have 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    head = _FIXED.pack(
        MAGIC, FORMAT_VERSION, HEADER_BYTES, identity, len(payload), _crc32c(payload), len(key)
    )
    body = head + key.ljust(MAX_KEY_BYTES, b"\0")
    body = body.ljust(HEADER_BYTES - 4, b"\0")
    return body + struct.pack("<I", _crc32c(body))


def pack_header_into(block: bytearray, identity: bytes, key: bytes) -> None:
    """Write the header of the block in ``block`` (``HEADER_BYTES`` of room, then the
    payload) in place: one buffer, no copy of the payload."""
    if len(identity) != 16:
        raise ValueError(f"identity must be 16 bytes, got {len(identity)}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a key must have 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    view = memoryview(block)
    payload = view[HEADER_BYTES:]
    view[:HEADER_BYTES] = bytes(HEADER_BYTES)
    _FIXED.pack_into(
        view,
        0,
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        identity,
        len(payload),
        _crc32c(payload),
        len(key),
    )
    view[_FIXED.size : _FIXED.size + len(key)] = key
    struct.pack_into("<I", view, HEADER_BYTES - 4, _crc32c(view[: HEADER_BYTES - 4]))


def parse_header(raw: bytes) -> BlockHeader:
    """Check and decode a header; ``ValueError`` saying what does not match."""
    if len(raw) < HEADER_BYTES:
        raise ValueError(f"short header: {len(raw)} of {HEADER_BYTES} bytes")
    magic, version, length, identity, payload_len, crc, key_len = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION or length != HEADER_BYTES:
        raise ValueError(f"unknown format version {version} / header length {length}")
    (stored,) = struct.unpack_from("<I", raw, HEADER_BYTES - 4)
    if stored != _crc32c(bytes(raw[: HEADER_BYTES - 4])):
        raise ValueError("header CRC mismatch")
    if not 1 <= key_len <= MAX_KEY_BYTES:
        raise ValueError(f"bad key length {key_len}")
    key = bytes(raw[_FIXED.size : _FIXED.size + key_len])
    return BlockHeader(identity, key, payload_len, crc, version)
