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
    [304, 308)   MAC type (u32): 0 none, 1 keyed BLAKE2b-256 (an authenticated block)
    [308, 312)   zeros
    [312, 344)   with MAC type 1: the MAC, keyed BLAKE2b-256 of the payload, then of
                 bytes [0, 312)
    [344, 4092)  zeros
    [4092, 4096) CRC32C of bytes [0, 4092)

**Authenticated blocks.** A tier given a MAC key (``DiskTier.mac_key``,
``RemoteTier.mac_key``) writes MAC type 1 and the MAC, and takes a block as its own only
when the MAC matches; a tier without one writes MAC type 0 and refuses blocks with a MAC
(it cannot check them). The key's fingerprint (:func:`mac_key_id`, a keyed BLAKE2b of
nothing: it does not reveal the key) is part of the namespace identity, so tiers with
another key, or none, file their blocks under another identity and never find these.

The native I/O lanes build and check it (the CRCs and the MAC are computed in C, in the
lane); :func:`pack_header`, :func:`parse_header`, :func:`pack_block` and
:func:`unpack_block` are the same format in Python (CRC32C in C where the native library
loads, else in Python; the MAC with :mod:`hashlib`), for tests and tools.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from dataclasses import asdict, dataclass, replace

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAC_BYTES",
    "MAC_KEY_MAX",
    "MAC_KEY_MIN",
    "MAGIC",
    "MAX_KEY_BYTES",
    "BlockError",
    "BlockHeader",
    "Namespace",
    "block_file_bytes",
    "block_mac",
    "check_mac_key",
    "mac_key_id",
    "pack_block",
    "pack_header",
    "pack_header_into",
    "parse_header",
    "unpack_block",
]

MAGIC = b"AOKVBLK\0"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
MAX_KEY_BYTES = 256
_ALIGN = 4096
_FIXED = struct.Struct("<8sII16sQII")  # magic .. key length: 48 bytes
_KEY_END = _FIXED.size + MAX_KEY_BYTES
#: Where the MAC type (u32) and the MAC sit; the MAC covers the payload, then the
#: header's bytes before it.
_MAC_TYPE_AT = 304
_MAC_AT = 312
#: The MAC: keyed BLAKE2b of 32 bytes.
MAC_BYTES = 32
_MAC_BLAKE2B = 1
#: A MAC key's length, in bytes: BLAKE2b takes keys of up to 64; fewer than 16 are refused.
MAC_KEY_MIN = 16
MAC_KEY_MAX = 64


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
    #: The fingerprint of the MAC key of a tier with authenticated blocks
    #: (:func:`mac_key_id`), "" for none: set by the tier (:meth:`with_mac_key`).
    mac_key_id: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "kv_dtype", "layout", "tenant", "extra", "mac_key_id"):
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
        """16 bytes naming this namespace: a BLAKE2b of its canonical JSON (without
        ``mac_key_id`` when it is empty: unauthenticated blocks keep their identity)."""
        fields = asdict(self)
        if not fields["mac_key_id"]:
            del fields["mac_key_id"]
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=16, person=b"asyncoffload-ns").digest()

    def with_mac_key(self, mac_key: bytes | None) -> Namespace:
        """This namespace for a tier whose blocks carry a MAC with ``mac_key`` (itself for
        ``None``): its identity then names the key's fingerprint."""
        if mac_key is None:
            return self
        return replace(self, mac_key_id=mac_key_id(mac_key))

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


def mac_key_id(mac_key: bytes) -> str:
    """The fingerprint of a MAC key (32 hex digits): a keyed BLAKE2b of nothing, under a
    personalization of its own, so it names the key without revealing it or any MAC."""
    check_mac_key(mac_key)
    return hashlib.blake2b(b"", key=mac_key, digest_size=16, person=b"ao-mac-key-id").hexdigest()


def check_mac_key(mac_key: bytes) -> bytes:
    """``mac_key`` if it has ``MAC_KEY_MIN`` to ``MAC_KEY_MAX`` bytes; else
    ``ValueError`` saying its length (never its bytes)."""
    if not isinstance(mac_key, bytes):
        raise TypeError(f"a MAC key must be bytes, got {type(mac_key).__name__}")
    if not MAC_KEY_MIN <= len(mac_key) <= MAC_KEY_MAX:
        raise ValueError(
            f"a MAC key must have {MAC_KEY_MIN} to {MAC_KEY_MAX} bytes, got {len(mac_key)}"
        )
    return mac_key


@dataclass(frozen=True)
class BlockHeader:
    identity: bytes
    key: bytes
    payload_len: int
    payload_crc: int
    version: int = FORMAT_VERSION
    #: 0: no MAC; 1: ``mac`` is the keyed BLAKE2b-256 of the payload and header.
    mac_type: int = 0
    mac: bytes = b""


class BlockError(ValueError):
    """A stored block that is not the block asked for. ``cause`` names why, as a tier's
    ``TierStats.failures`` does: ``short``, ``corrupt``, ``stale`` (another namespace),
    ``wrong_key`` or ``unauthenticated`` (no MAC, another key's, or a MAC where none is
    expected)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(f"{cause}: {message}")
        self.cause = cause


#: CRC32C (Castagnoli, reflected) by byte, for the pure-Python path.
_CRC_TABLE: list[int] = []


def _crc32c_py(data: bytes | memoryview, crc: int = 0) -> int:
    """CRC32C in Python: where the native library is unavailable (slow: tools, tests)."""
    table = _CRC_TABLE
    if not table:
        for n in range(256):
            c = n
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            table.append(c)
    crc ^= 0xFFFFFFFF
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _crc32c(data: bytes | memoryview) -> int:
    from asyncoffload._native import load_disk_io

    if load_disk_io() is None:
        return _crc32c_py(data)
    from asyncoffload.tiers._io import crc32c

    return crc32c(data)


def block_mac(
    mac_key: bytes, header: bytes | bytearray | memoryview, payload: bytes | memoryview
) -> bytes:
    """The MAC of a block (:mod:`hashlib`): keyed BLAKE2b-256 of ``payload``, then of the
    header's bytes before the MAC (fields, key and MAC type)."""
    mac = hashlib.blake2b(payload, key=mac_key, digest_size=MAC_BYTES)
    mac.update(bytes(header[:_MAC_AT]))
    return mac.digest()


def _seal(body: bytearray, payload: bytes | memoryview, mac_key: bytes | None) -> None:
    """Finish a header in ``body`` (its fields and key written): the MAC type and MAC
    with a key, then the header CRC."""
    if mac_key is not None:
        struct.pack_into("<I", body, _MAC_TYPE_AT, _MAC_BLAKE2B)
        body[_MAC_AT : _MAC_AT + MAC_BYTES] = block_mac(mac_key, body, payload)
    struct.pack_into("<I", body, HEADER_BYTES - 4, _crc32c(memoryview(body)[: HEADER_BYTES - 4]))


def pack_header(
    identity: bytes, key: bytes, payload: bytes | memoryview, mac_key: bytes | None = None
) -> bytes:
    """The header of a block holding ``payload``; with ``mac_key``, an authenticated one."""
    if len(identity) != 16:
        raise ValueError(f"identity must be 16 bytes, got {len(identity)}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a key must have 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    if mac_key is not None:
        check_mac_key(mac_key)
    body = bytearray(HEADER_BYTES)
    _FIXED.pack_into(
        body,
        0,
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        identity,
        len(payload),
        _crc32c(payload),
        len(key),
    )
    body[_FIXED.size : _FIXED.size + len(key)] = key
    _seal(body, payload, mac_key)
    return bytes(body)


def pack_block(identity: bytes, key: bytes, payload: bytes, mac_key: bytes | None = None) -> bytes:
    """A whole block as the shared tier stores it: the header, then ``payload`` (the
    disk tier pads it with zeros to a multiple of 4096)."""
    return pack_header(identity, key, payload, mac_key) + payload


def pack_header_into(
    block: bytearray, identity: bytes, key: bytes, mac_key: bytes | None = None
) -> None:
    """Write the header of the block in ``block`` (``HEADER_BYTES`` of room, then the
    payload) in place: one buffer, no copy of the payload."""
    block[:HEADER_BYTES] = pack_header(identity, key, memoryview(block)[HEADER_BYTES:], mac_key)


def parse_header(raw: bytes | bytearray | memoryview) -> BlockHeader:
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
    (mac_type,) = struct.unpack_from("<I", raw, _MAC_TYPE_AT)
    mac = bytes(raw[_MAC_AT : _MAC_AT + MAC_BYTES]) if mac_type == _MAC_BLAKE2B else b""
    return BlockHeader(identity, key, payload_len, crc, version, mac_type, mac)


def unpack_block(
    raw: bytes | memoryview,
    identity: bytes,
    key: bytes,
    payload_len: int,
    mac_key: bytes | None = None,
) -> bytes:
    """The payload of ``raw`` (a header, then at least ``payload_len`` bytes) if it is
    block ``key`` of namespace ``identity``, whole, and (with ``mac_key``) carries that
    key's MAC; else :class:`BlockError`. The checks and their order are the native
    lanes': length (``short``); magic, version, header CRC, payload length
    (``corrupt``); identity (``stale``); key (``wrong_key``); MAC type
    (``unauthenticated``); payload CRC (``corrupt``); MAC (``unauthenticated``)."""
    view = memoryview(raw).cast("B")
    if len(view) < HEADER_BYTES + payload_len:
        raise BlockError("short", f"{len(view)} bytes, a block has {HEADER_BYTES + payload_len}")
    try:
        header = parse_header(view[:HEADER_BYTES])
    except ValueError as exc:
        raise BlockError("corrupt", str(exc)) from None
    if header.payload_len != payload_len:
        raise BlockError("corrupt", f"payload of {header.payload_len} bytes, not {payload_len}")
    if header.identity != identity:
        raise BlockError("stale", "another namespace's block")
    if header.key != key:
        raise BlockError("wrong_key", "another key's block")
    want_type = _MAC_BLAKE2B if mac_key is not None else 0
    if header.mac_type != want_type:
        raise BlockError(
            "unauthenticated",
            "a block without a MAC" if mac_key is not None else "a block with a MAC",
        )
    payload = view[HEADER_BYTES : HEADER_BYTES + payload_len]
    if _crc32c(payload) != header.payload_crc:
        raise BlockError("corrupt", "payload CRC mismatch")
    if mac_key is not None and not hmac.compare_digest(
        block_mac(mac_key, view[:HEADER_BYTES], payload), header.mac
    ):
        raise BlockError("unauthenticated", "the MAC does not match (another key's block?)")
    return bytes(payload)
