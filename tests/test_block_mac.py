"""Authenticated blocks: a keyed BLAKE2b MAC in the block header (``DiskTier.mac_key``,
``RemoteTier.mac_key``). The native BLAKE2b against :mod:`hashlib`, native and Python
blocks byte for byte (the Python path with and without the native library), every way a
block can fail the MAC, the disk tier on real files in slab and files mode, and the key
kept out of everything printed."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import subprocess
import sys
import traceback
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncoffload as ao
from asyncoffload.keys import make_offload_key
from asyncoffload.manager.base import Medium
from asyncoffload.tiers import _io
from asyncoffload.tiers.base import TierManager
from asyncoffload.tiers.disk import DiskStore, DiskTier
from asyncoffload.tiers.format import (
    HEADER_BYTES,
    BlockError,
    Namespace,
    block_file_bytes,
    block_mac,
    mac_key_id,
    pack_block,
    parse_header,
    unpack_block,
)
from asyncoffload.tiers.remote import RemoteTier
from tests.helpers import tier_index

pytestmark = pytest.mark.skipif(not _io.available(), reason="native I/O lanes not built")

KEY = b"k" * 16 + os.urandom(16)  # 32 bytes
OTHER_KEY = os.urandom(32)
IDENTITY = Namespace("m", "uint8", "x", 8192).identity()
NUM_KV = 32
FRAG = 4096
BLOCK = 2 * FRAG
SLOT = block_file_bytes(BLOCK)


def lib() -> ctypes.CDLL:
    return _io._library()


def native_pack(
    payload: bytes, key: bytes, mac_key: bytes | None, identity: bytes = IDENTITY
) -> bytes:
    value = ctypes.create_string_buffer(HEADER_BYTES + len(payload))
    n = len(mac_key or b"")
    rc = lib().ao_pack_block(
        value, payload, len(payload), identity, key, len(key), 1, None, mac_key, n
    )
    assert rc == 0
    return value.raw


def native_unpack(raw: bytes, key: bytes, payload_len: int, mac_key: bytes | None) -> int:
    """0, or the -errno of the check that failed."""
    out = ctypes.create_string_buffer(max(1, payload_len))
    n = len(mac_key or b"")
    return int(
        lib().ao_unpack_block(
            raw, len(raw), out, payload_len, IDENTITY, key, len(key), 1, None, mac_key, n
        )
    )


def reseal(raw: bytes | bytearray) -> bytes:
    """``raw`` with its header CRC made right again (an attacker's edit)."""
    out = bytearray(raw)
    from asyncoffload.tiers._io import crc32c

    out[HEADER_BYTES - 4 : HEADER_BYTES] = crc32c(bytes(out[: HEADER_BYTES - 4])).to_bytes(
        4, "little"
    )
    return bytes(out)


# --- the MAC itself ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 127, 128, 129, 256, 1000, 65536, 65537, 300_001])
def test_native_blake2b_matches_hashlib(size: int) -> None:
    """The C BLAKE2b (written from RFC 7693) is Python's, keyed and not, for every length
    around its 128-byte blocks, key lengths 0..64 and digest sizes 1..64."""
    data = os.urandom(size)
    for key_len in (0, 1, 16, 32, 63, 64):
        key = os.urandom(key_len)
        for digest in (1, 16, 32, 64):
            out = ctypes.create_string_buffer(digest)
            assert lib().ao_blake2b(out, digest, key, key_len, data, size) == 0
            want = hashlib.blake2b(data, key=key, digest_size=digest).digest()
            assert out.raw == want, (size, key_len, digest)
    out = ctypes.create_string_buffer(64)
    assert lib().ao_blake2b(out, 65, None, 0, data, size) == -1  # digest too long
    assert lib().ao_blake2b(out, 32, bytes(65), 65, data, size) == -1  # key too long


def test_the_mac_covers_the_payload_then_the_header_fields() -> None:
    payload = os.urandom(10_000)
    raw = pack_block(IDENTITY, b"key-1", payload, KEY)
    header = parse_header(raw[:HEADER_BYTES])
    assert header.mac_type == 1 and len(header.mac) == 32
    want = hashlib.blake2b(payload + raw[:312], key=KEY, digest_size=32).digest()
    assert header.mac == want == raw[312:344] == block_mac(KEY, raw[:HEADER_BYTES], payload)
    assert raw[344 : HEADER_BYTES - 4] == bytes(HEADER_BYTES - 4 - 344)
    plain = pack_block(IDENTITY, b"key-1", payload)
    assert parse_header(plain[:HEADER_BYTES]).mac_type == 0
    assert plain[304 : HEADER_BYTES - 4] == bytes(HEADER_BYTES - 4 - 304)  # as before


# --- native and Python blocks agree -----------------------------------------------------


@pytest.mark.parametrize("size", [4096, 8192, 200_000])
@pytest.mark.parametrize("keyed", [False, True])
def test_native_and_python_blocks_are_the_same_bytes(size: int, keyed: bool) -> None:
    payload = os.urandom(size)
    mac_key = KEY if keyed else None
    raw = native_pack(payload, b"block-7", mac_key)
    assert raw == pack_block(IDENTITY, b"block-7", payload, mac_key)
    assert unpack_block(raw, IDENTITY, b"block-7", size, mac_key) == payload
    assert native_unpack(raw, b"block-7", size, mac_key) == 0
    # A payload in slices (tensor-parallel ranks) packs to the same value.
    half = size // 2
    src = ctypes.create_string_buffer(payload[:half] + bytes(1000) + payload[half:])
    deltas = (ctypes.c_int64 * 2)(0, half + 1000)
    value = ctypes.create_string_buffer(HEADER_BYTES + size)
    n = len(mac_key or b"")
    rc = lib().ao_pack_block(
        value, src, size, IDENTITY, b"block-7", 7, 2, deltas, mac_key, n
    )  # fmt: skip
    assert rc == 0 and value.raw == raw


#: What every bad block is, by the Python path's cause and the native -errno.
CASES = {
    "other key": ("unauthenticated", errno.ENOKEY),
    "unkeyed block, keyed reader": ("unauthenticated", errno.ENOKEY),
    "keyed block, unkeyed reader": ("unauthenticated", errno.ENOKEY),
    "forged MAC": ("unauthenticated", errno.ENOKEY),
    "payload, MAC kept": ("corrupt", errno.EBADMSG),
    "payload and CRC, MAC kept": ("unauthenticated", errno.ENOKEY),
    "MAC type cleared": ("unauthenticated", errno.ENOKEY),
    "another identity": ("stale", errno.ESTALE),
    "short": ("short", errno.ENODATA),
}


def bad_block(case: str, payload: bytes) -> tuple[bytes, bytes | None]:
    """A block that must fail, and the reader's MAC key."""
    good = pack_block(IDENTITY, b"blk", payload, KEY)
    if case == "other key":
        return pack_block(IDENTITY, b"blk", payload, OTHER_KEY), KEY
    if case == "unkeyed block, keyed reader":
        return pack_block(IDENTITY, b"blk", payload), KEY
    if case == "keyed block, unkeyed reader":
        return good, None
    raw = bytearray(good)
    if case == "forged MAC":
        raw[320] ^= 1
        return reseal(raw), KEY
    if case == "payload, MAC kept":
        raw[HEADER_BYTES + 5] ^= 1
        return bytes(raw), KEY
    if case == "payload and CRC, MAC kept":
        raw[HEADER_BYTES + 5] ^= 1
        from asyncoffload.tiers._io import crc32c

        raw[40:44] = crc32c(bytes(raw[HEADER_BYTES:])).to_bytes(4, "little")
        return reseal(raw), KEY
    if case == "MAC type cleared":
        raw[304:308] = bytes(4)
        return reseal(raw), KEY
    if case == "another identity":
        other = Namespace("m", "uint8", "x", 8192).with_mac_key(KEY).identity()
        return pack_block(other, b"blk", payload, KEY), KEY
    assert case == "short"
    return good[:-1], KEY


@pytest.mark.parametrize("case", list(CASES))
def test_a_block_without_this_keys_mac_fails_natively_and_in_python(case: str) -> None:
    payload = os.urandom(8192)
    raw, reader_key = bad_block(case, payload)
    cause, code = CASES[case]
    with pytest.raises(BlockError) as info:
        unpack_block(raw, IDENTITY, b"blk", len(payload), reader_key)
    assert info.value.cause == cause
    assert native_unpack(raw, b"blk", len(payload), reader_key) == -code


_FALLBACK = """
import json, os, sys
assert os.environ["ASYNCOFFLOAD_NO_NATIVE"] == "1"
from asyncoffload._native import load_disk_io
from asyncoffload.tiers.format import BlockError, pack_block, unpack_block
assert load_disk_io() is None
case = json.loads(sys.stdin.read())
identity, payload = bytes.fromhex(case["identity"]), bytes.fromhex(case["payload"])
key = bytes.fromhex(case["key"])
out = {"packed": pack_block(identity, b"blk", payload, key).hex(), "causes": {}}
for name, (raw, reader) in case["bad"].items():
    try:
        unpack_block(bytes.fromhex(raw), identity, b"blk", len(payload),
                     bytes.fromhex(reader) if reader else None)
        out["causes"][name] = "accepted"
    except BlockError as exc:
        out["causes"][name] = exc.cause
good = bytes.fromhex(case["native"])
out["native_ok"] = unpack_block(good, identity, b"blk", len(payload), key) == payload
print(json.dumps(out))
"""


def test_the_python_path_without_the_native_library_agrees() -> None:
    """With ``ASYNCOFFLOAD_NO_NATIVE=1`` (no C at all: CRC32C in Python, the MAC with
    hashlib), blocks are the native lanes' bytes and fail the same checks."""
    payload = os.urandom(8192)
    bad = {}
    for name in CASES:
        raw, reader = bad_block(name, payload)
        bad[name] = (raw.hex(), reader.hex() if reader else None)
    case = {
        "identity": IDENTITY.hex(),
        "payload": payload.hex(),
        "key": KEY.hex(),
        "bad": bad,
        "native": native_pack(payload, b"blk", KEY).hex(),
    }
    env = dict(os.environ, ASYNCOFFLOAD_NO_NATIVE="1")
    done = subprocess.run(
        [sys.executable, "-c", _FALLBACK],
        input=json.dumps(case).encode(),
        capture_output=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    out = json.loads(done.stdout)
    assert bytes.fromhex(out["packed"]) == native_pack(payload, b"blk", KEY)
    assert out["causes"] == {name: cause for name, (cause, _) in CASES.items()}
    assert out["native_ok"]


# --- the namespace ----------------------------------------------------------------------


def test_the_key_fingerprint_is_part_of_the_identity_and_reveals_nothing() -> None:
    ns = Namespace("m", "uint8", "x", 8192)
    # Unkeyed identities are what they always were (files-mode blocks stay found).
    fields = {
        "model": "m",
        "kv_dtype": "uint8",
        "layout": "x",
        "block_bytes": 8192,
        "tokens_per_block": 0,
        "rank": 0,
        "world_size": 1,
        "tenant": "",
        "extra": "",
        "format_version": 1,
    }
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    old = hashlib.blake2b(text.encode(), digest_size=16, person=b"asyncoffload-ns").digest()
    assert ns.identity() == old and ns.with_mac_key(None) is ns
    keyed, other = ns.with_mac_key(KEY), ns.with_mac_key(OTHER_KEY)
    assert len({ns.identity(), keyed.identity(), other.identity()}) == 3
    assert keyed.mac_key_id == mac_key_id(KEY) and len(keyed.mac_key_id) == 32
    assert KEY.hex() not in json.dumps(keyed.describe()) and KEY.hex() not in keyed.dirname()
    with pytest.raises(ValueError, match="16 to 64 bytes, got 15"):
        mac_key_id(b"x" * 15)


# --- the disk tier ----------------------------------------------------------------------


def kv_caches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [
        torch.randint(0, 256, (NUM_KV, FRAG), dtype=torch.uint8, generator=gen) for _ in range(2)
    ]


def keys(n: int, start: int = 0) -> list[ao.OffloadKey]:
    return [make_offload_key(i.to_bytes(4, "big") * 8) for i in range(start, start + n)]


def block(kv: list[torch.Tensor], i: int) -> bytes:
    return b"".join(bytes(t[i].numpy().tobytes()) for t in kv)


def config(path: Path, mode: str, mac_key: bytes | None, cpu_blocks: int = 4) -> ao.EngineConfig:
    tier = DiskTier(path, 16 * SLOT, mode, admission=None, mac_key=mac_key)
    # LRU: the tests count on which block the CPU tier evicts.
    return ao.EngineConfig(cpu_blocks=cpu_blocks, tiers=[tier], model="test-model", policy="lru")


@contextlib.asynccontextmanager
async def engine(
    cfg: ao.EngineConfig, kv: list[torch.Tensor] | None = None
) -> AsyncIterator[ao.AsyncOffloadEngine]:
    eng = ao.AsyncOffloadEngine(kv if kv is not None else kv_caches(), cfg)
    try:
        yield eng
    finally:
        await eng.aclose()


async def store(eng: ao.AsyncOffloadEngine, ks: list[ao.OffloadKey], ids: list[int]) -> None:
    handle = await eng.prepare_store(ks, ids)
    assert handle is not None
    await handle
    await eng.flush()


async def push_out_of_cpu(eng: ao.AsyncOffloadEngine, ks: list[ao.OffloadKey]) -> None:
    """Store other keys until ``ks`` live only on disk."""
    cpu = eng.config.cpu_blocks
    filler = keys(cpu, start=1000)
    for i in range(0, cpu, 2):
        await store(eng, filler[i : i + 2], [NUM_KV - 1, NUM_KV - 2])
    assert all(eng.manager.block_of(k) is None for k in ks)


@contextlib.contextmanager
def reopened(fd: int) -> Iterator[int]:
    """The (unlinked, O_DIRECT) slab opened again for plain byte-sized I/O."""
    fd2 = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        yield fd2
    finally:
        os.close(fd2)


def plant(tier: DiskStore, index: TierManager, key: bytes, raw: bytes) -> None:
    """Put ``raw`` where the tier keeps block ``key``, as someone who can write there."""
    raw = raw.ljust(tier.slot_bytes, b"\0")
    if tier.config.mode == "slab":
        slot = index.block_of(ao.OffloadKey(key))
        assert slot is not None
        with reopened(tier._fd) as fd:
            os.pwrite(fd, raw, slot.block_id * tier.slot_bytes)
    else:
        tier.path_of(ao.OffloadKey(key)).write_bytes(raw)


@pytest.mark.parametrize("mode", ["slab", "files"])
async def test_a_keyed_disk_tier_round_trips_byte_exact(tmp_path: Path, mode: str) -> None:
    kv = kv_caches()
    want = [block(kv, i) for i in range(4)]
    ks = keys(4)
    async with engine(config(tmp_path, mode, KEY), kv) as eng:
        await store(eng, ks, [0, 1, 2, 3])
        await push_out_of_cpu(eng, ks)
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        assert tier.identity == eng.namespace.with_mac_key(KEY).identity() != IDENTITY
        if mode == "files":
            raw = tier.path_of(ks[0]).read_bytes()
            header = parse_header(raw[:HEADER_BYTES])
            assert header.mac_type == 1
            assert unpack_block(raw, tier.identity, ks[0], BLOCK, KEY) == want[0]
        for t in kv:
            t[8:12].zero_()
        await (await eng.prepare_load(ks, [8, 9, 10, 11]))
        assert [block(kv, 8 + i) for i in range(4)] == want
        st = eng.stats().tiers[0]
        assert st.blocks_read == 4 and st.read_failures == 0
        assert st.info["authenticated"] is True
    if mode == "files":  # a restart with the key finds and reads them
        fresh = [torch.zeros_like(t) for t in kv]
        async with engine(config(tmp_path, mode, KEY), fresh) as eng:
            assert eng.lookup(ks) == 4
            await (await eng.prepare_load(ks, [8, 9, 10, 11]))
            assert [block(fresh, 8 + i) for i in range(4)] == want


@pytest.mark.parametrize("mode", ["slab", "files"])
@pytest.mark.parametrize("planted", ["unkeyed", "other key", "forged MAC"])
async def test_a_block_without_the_tiers_mac_is_a_miss(
    tmp_path: Path, mode: str, planted: str
) -> None:
    """Someone who can write the tier's files (or slab) but has not the key: a block of
    theirs, checksums right, is a miss with a removed event; no byte reaches the KV."""
    kv = kv_caches()
    ks = keys(2)
    async with engine(config(tmp_path, mode, KEY), kv) as eng:
        await store(eng, ks, [0, 1])
        await push_out_of_cpu(eng, ks)
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        evil = os.urandom(BLOCK)
        if planted == "unkeyed":
            raw = pack_block(tier.identity, ks[0], evil)
        elif planted == "other key":
            raw = pack_block(tier.identity, ks[0], evil, OTHER_KEY)
        else:  # the genuine header, the payload swapped, CRC fixed: the MAC is wrong
            good = bytearray(pack_block(tier.identity, ks[0], block(kv, 0), KEY))
            from asyncoffload.tiers._io import crc32c

            good[HEADER_BYTES:] = evil
            good[40:44] = crc32c(evil).to_bytes(4, "little")
            raw = reseal(good)
        plant(tier, tier_index(eng), ks[0], raw)
        sub = eng.events()
        before = [t[20:22].clone() for t in kv]
        with pytest.raises(ao.TransferError, match="could not be read"):
            await (await eng.prepare_load(ks, [20, 21]))
        assert all(torch.equal(t[20:22], x) for t, x in zip(kv, before))
        assert eng.lookup(ks) == 0
        st = eng.stats().tiers[0]
        assert st.failures == {"unauthenticated": 1} and st.dropped == 1
        if mode == "files":
            await eng.flush()  # the removal runs on the lanes
            assert not tier.path_of(ks[0]).exists()  # deleted
        events = [e async for e in _drain(eng, sub)]
    assert ks[0] in {k for e in events if e.removed and e.medium is Medium.DISK for k in e.keys}


async def _drain(eng: ao.AsyncOffloadEngine, sub: ao.EventSubscription) -> AsyncIterator[Any]:
    await eng.aclose()
    async for e in sub:
        if isinstance(e, ao.OffloadingEvent):
            yield e


async def test_keyed_and_unkeyed_tiers_never_read_each_others_blocks(tmp_path: Path) -> None:
    """Decision: a keyed tier's blocks are another namespace for an unkeyed tier (and
    for a tier with another key): not found, not indexed at restart, and one copied
    into its place is ``stale``; an unkeyed block copied into a keyed tier's place is
    ``unauthenticated``."""
    kv = kv_caches()
    ks = keys(2)
    async with engine(config(tmp_path, "files", KEY), kv) as eng:
        await store(eng, ks, [0, 1])
        keyed_dir = eng.tiers[0].dir  # type: ignore[attr-defined]
        keyed_file = eng.tiers[0].path_of(ks[0])  # type: ignore[attr-defined]
    for other in (None, OTHER_KEY):
        async with engine(config(tmp_path, "files", other), kv) as eng:
            tier = eng.tiers[0]
            assert isinstance(tier, DiskStore)
            assert tier.dir != keyed_dir and tier.recovered == 0
            assert eng.lookup(ks) == 0
            # Copied into this tier's place by hand, and indexed as if found there:
            await store(eng, ks[1:], [1])  # a good block of this tier's own
            await push_out_of_cpu(eng, ks[1:])
            tier.path_of(ks[1]).write_bytes(keyed_file.read_bytes())
            with pytest.raises(ao.TransferError):
                await (await eng.prepare_load(ks[1:], [20]))
            assert eng.stats().tiers[0].failures == {"stale": 1}
    # An unkeyed tier's block in the keyed tier's place (same name, identity rewritten
    # to the keyed one's: all a writer without the key can do).
    async with engine(config(tmp_path, "files", KEY), kv) as eng:
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore) and tier.recovered == 2
        await push_out_of_cpu(eng, ks)
        plant(tier, tier_index(eng), ks[0], pack_block(tier.identity, ks[0], block(kv, 0)))
        with pytest.raises(ao.TransferError):
            await (await eng.prepare_load(ks[:1], [20]))
        assert eng.stats().tiers[0].failures == {"unauthenticated": 1}


# --- the key is a secret --------------------------------------------------------------


SECRET = "hunter2-hunter2-hunter2-xyzzy"  # 29 bytes


def shown(*objects: object) -> str:
    return "\n".join(str(o) + repr(o) for o in objects)


async def test_the_key_is_never_shown(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 16 * SLOT, "files", mac_key=SECRET, admission=None)
    remote_tier = RemoteTier("redis://127.0.0.1:1/0", mac_key=SECRET.encode())
    assert disk.mac_key is not None and disk.mac_key.get_secret_value() == SECRET.encode()
    cfg = ao.EngineConfig(cpu_blocks=4, tiers=[disk, remote_tier], model="m", policy="lru")
    texts = [
        shown(disk, remote_tier, cfg),
        disk.model_dump_json(),
        remote_tier.model_dump_json(),
        cfg.model_dump_json(),
        str(cfg.model_dump()),
    ]
    async with engine(ao.EngineConfig(cpu_blocks=4, tiers=[disk], model="m", policy="lru")) as eng:
        texts.append(shown(eng, eng.stats(), eng.tiers[0], eng.tiers[0].pool))  # type: ignore[attr-defined]
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        texts.append(json.dumps(tier.namespace.describe()))
    ns = Namespace("m", "uint8", "x", 8192)
    store_ = remote_tier.open(ns)
    texts.append(shown(store_.describe(), store_._io))
    store_.close()
    for text in texts:
        assert SECRET not in text and SECRET.encode().hex() not in text, text


@pytest.mark.parametrize("bad", ["short-secret", b"x" * 65])
def test_a_bad_key_is_refused_without_showing_it(bad: str | bytes) -> None:
    secret = bad if isinstance(bad, str) else bad.decode()
    for make in (
        lambda: DiskTier("/tmp/x", "1GiB", mac_key=bad),
        lambda: RemoteTier(mac_key=bad),
        lambda: ao.EngineConfig(
            tiers=[{"kind": "disk", "path": "/x", "capacity": 1 << 30, "mac_key": bad}]
        ),
    ):
        with pytest.raises(ValueError) as info:
            make()
        text = "".join(traceback.format_exception(info.value))
        assert "mac_key" in text and "16 to 64 bytes" in text
        assert secret not in text


def test_from_env_and_vllm_settings_take_the_key_and_never_show_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from asyncoffload.integrations.vllm.settings import VllmOffloadSettings

    tier = {"kind": "disk", "path": str(tmp_path), "capacity": "1GiB", "mac_key": SECRET}
    monkeypatch.setenv("ASYNCOFFLOAD_TIERS", json.dumps([tier]))
    cfg = ao.EngineConfig.from_env()
    key = cfg.tiers[0].mac_key
    assert key is not None and key.get_secret_value() == SECRET.encode()
    # An error elsewhere in the tier names where, never the key.
    monkeypatch.setenv("ASYNCOFFLOAD_TIERS", json.dumps([dict(tier, deadline_s=-1)]))
    with pytest.raises(ValueError) as info:
        ao.EngineConfig.from_env()
    assert SECRET not in "".join(traceback.format_exception(info.value))
    monkeypatch.delenv("ASYNCOFFLOAD_TIERS")
    extra = {"cpu_bytes_to_use": 1 << 30}
    settings = VllmOffloadSettings.from_extra_config({**extra, "tiers": [tier]})
    vkey = settings.tiers[0].mac_key
    assert vkey is not None and vkey.get_secret_value() == SECRET.encode()
    assert SECRET not in repr(settings) and SECRET not in settings.model_dump_json()
    with pytest.raises(ValueError) as info:
        VllmOffloadSettings.from_extra_config({**extra, "tiers": [dict(tier, mac_key=SECRET[:8])]})
    assert SECRET[:8] not in str(info.value) and "16 to 64 bytes" in str(info.value)


def test_a_pool_keeps_its_key_out_of_sight() -> None:
    pool = _io.IoPool(threads=1, payload_len=4096, identity=IDENTITY, direct_files=False,
                      mac_key=KEY)  # fmt: skip
    try:
        assert KEY.hex() not in repr(pool) and repr(KEY) not in repr(pool)
    finally:
        pool.close()
    with pytest.raises(ValueError, match="1 to 64 bytes, got 65"):
        _io.IoPool(threads=1, payload_len=4096, identity=IDENTITY, direct_files=False,
                   mac_key=bytes(65))  # fmt: skip
