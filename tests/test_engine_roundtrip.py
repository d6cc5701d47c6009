"""Bytes survive a store and a load exactly, for both layouts and several dtypes."""

from __future__ import annotations

import pytest
import torch

import asyncoffload as ao
from tests.helpers import block_bytes, make_keys, random_kv

DTYPES = [torch.bfloat16, torch.float16, torch.int8, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


@pytest.mark.parametrize("kv_split", [True, False], ids=["kv_split", "unsplit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_bytes_round_trip_exactly(kv_split: bool, dtype: torch.dtype) -> None:
    kv = random_kv(3, 32, kv_split=kv_split, dtype=dtype, seed=7)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=16))
    assert engine.layout.kv_split is kv_split
    src_blocks = [3, 17, 0, 29, 8, 12]
    original = {b: block_bytes(kv, b, kv_split) for b in src_blocks}
    keys = make_keys(len(src_blocks))
    async with engine:
        store = await engine.prepare_store(keys, src_blocks)
        assert store is not None
        result = await store
        assert result.num_blocks == len(src_blocks)
        assert result.nbytes == len(src_blocks) * engine.layout.block_bytes

        # Overwrite every KV tensor, then load into other blocks, in another order.
        fresh = random_kv(3, 32, kv_split=kv_split, dtype=dtype, seed=99)
        for t, f in zip(kv, fresh):
            t.copy_(f)
        dst_blocks = [30, 1, 22, 5, 14, 9]
        order = [5, 0, 3, 1, 4, 2]
        assert engine.lookup(keys) == len(keys)
        load = await engine.prepare_load([keys[i] for i in order], dst_blocks)
        await load
        for dst, i in zip(dst_blocks, order):
            assert block_bytes(kv, dst, kv_split) == original[src_blocks[i]]
        # Blocks outside the load were not touched.
        assert block_bytes(kv, 2, kv_split) == block_bytes(fresh, 2, kv_split)


async def test_host_slot_is_block_major() -> None:
    kv = random_kv(2, 8, kv_split=True, seed=3)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=4))
    async with engine:
        handle = await engine.prepare_store(make_keys(1), [5])
        assert handle is not None
        await handle
        slot = engine.manager.prepare_load(make_keys(1)).block_ids[0]
        engine.manager.complete_load(make_keys(1))
        assert engine.backend.read_host_block(slot) == block_bytes(kv, 5)


async def test_tensor_block_ids_are_accepted() -> None:
    kv = random_kv(1, 8, seed=4)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=4))
    async with engine:
        handle = await engine.prepare_store(make_keys(2), torch.tensor([1, 2]))
        assert handle is not None
        await handle
        load = await engine.prepare_load(make_keys(2), torch.tensor([6, 7]))
        await load
        assert block_bytes(kv, 6) == block_bytes(kv, 1)
        assert block_bytes(kv, 7) == block_bytes(kv, 2)
