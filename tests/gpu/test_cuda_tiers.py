"""The disk tier under CUDA KV caches: blocks go GPU -> pinned host slot -> disk and come
back disk -> pinned slot -> GPU byte-exact; a corrupt block never reaches the GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import asyncoffload as ao
from asyncoffload.tiers import _io
from asyncoffload.tiers.disk import DiskStore
from asyncoffload.tiers.format import HEADER_BYTES, block_file_bytes
from tests.gpu.conftest import GPU
from tests.helpers import tier_index

pytestmark = [*GPU, pytest.mark.skipif(not _io.available(), reason="no native I/O lanes")]

NUM = 64
FRAG = 16384  # a block: 4 layers x 16 KiB = 64 KiB


def kv() -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(3)
    return [
        torch.randint(0, 256, (NUM, FRAG), dtype=torch.uint8, device="cuda", generator=gen)
        for _ in range(4)
    ]


async def store(engine: ao.AsyncOffloadEngine, ks: list[ao.OffloadKey], ids: list[int]) -> None:
    handle = await engine.prepare_store(ks, ids)
    assert handle is not None
    await handle
    await engine.flush()  # CPU slots stay pinned until their disk write ends


def keys(n: int, start: int = 0) -> list[ao.OffloadKey]:
    return [ao.make_offload_key(i.to_bytes(4, "big") * 8) for i in range(start, start + n)]


@pytest.mark.parametrize("mode", ["slab", "files"])
async def test_cuda_blocks_round_trip_through_disk(tmp_path: Path, mode: str) -> None:
    caches = kv()
    want = [torch.cat([t[i] for t in caches]).cpu() for i in range(16)]
    slot = block_file_bytes(4 * FRAG)
    cfg = ao.EngineConfig(
        cpu_blocks=8,
        tiers=[ao.DiskTier(tmp_path, 64 * slot, mode, admission=None)],
        model="gpu-test",
        # The steps below count on recency alone deciding what leaves the CPU tier (the
        # default policy, auto, may keep the corrupt block's key there).
        policy="lru",
    )
    async with ao.AsyncOffloadEngine(caches, cfg) as engine:
        ks = keys(16)
        for i in range(0, 16, 4):
            await store(engine, ks[i : i + 4], list(range(i, i + 4)))
        await engine.flush()
        assert engine.stats().tiers[0].blocks_written == 16
        assert engine.manager.block_of(ks[0]) is None  # only on disk now
        for t in caches:
            t[32:48].zero_()
        # The first 8 live only on disk; a load takes at most the CPU tier's 8 slots.
        await (await engine.prepare_load(ks[:8], list(range(32, 40))))
        await (await engine.prepare_load(ks[8:], list(range(40, 48))))
        torch.cuda.synchronize()
        for i in range(16):
            assert torch.equal(torch.cat([t[32 + i] for t in caches]).cpu(), want[i]), i
        assert engine.tiers[0].describe()["direct_io"] in (True, False)

        # A corrupt block: a miss, and the GPU blocks stay as they were.
        ks2 = keys(2, start=100)
        await store(engine, ks2, [0, 1])
        for j in range(0, 8, 4):
            await store(engine, keys(4, start=200 + j), [2, 3, 4, 5])
        await engine.flush()
        tier = engine.tiers[0]
        assert isinstance(tier, DiskStore)
        assert engine.manager.block_of(ks2[0]) is None
        if mode == "files":
            path = tier.path_of(ks2[0])
            raw = bytearray(path.read_bytes())
            raw[HEADER_BYTES + 7] ^= 1
            path.write_bytes(bytes(raw))
        else:
            block = tier_index(engine).block_of(ks2[0])
            assert block is not None
            fd = os.open(f"/proc/self/fd/{tier._fd}", os.O_RDWR)
            off = block.block_id * tier.slot_bytes + HEADER_BYTES + 7
            os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 1]), off)
            os.close(fd)
        before = [t[60:62].clone() for t in caches]
        with pytest.raises(ao.TransferError, match="could not be read"):
            await (await engine.prepare_load(ks2, [60, 61]))
        torch.cuda.synchronize()
        assert all(torch.equal(t[60:62], b) for t, b in zip(caches, before))
        assert engine.lookup(ks2) == 0
