"""EngineConfig: the CPU tier given in bytes, configuration from the environment and a
file, and the engine's periodic summary line."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

import asyncoffload as ao
from asyncoffload.config import parse_bytes

from .helpers import random_kv

# --- cpu_bytes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("16 GB", 16 * 10**9),
        ("512MiB", 512 * 2**20),
        ("512mib", 512 * 2**20),
        ("1.5 KiB", 1536),
        ("4096", 4096),
        ("4096 B", 4096),
        (" 2 TB ", 2 * 10**12),
        (1 << 30, 1 << 30),
    ],
)
def test_byte_sizes_parse_with_explicit_units(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected
    assert ao.EngineConfig(cpu_bytes=text).cpu_bytes == expected


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("16G", r"cpu_bytes: unknown unit 'G' in '16G' \('GB' for powers of 1000 or 'GiB'"),
        ("16 gigs", "cpu_bytes: unknown unit 'gigs'"),
        ("lots", "cpu_bytes: 'lots' is not a byte size"),
        ("-1GiB", "cpu_bytes: '-1GiB' is not a byte size"),
        (0, "cpu_bytes: must be more than 0 bytes"),
        ("0 MiB", "cpu_bytes: must be more than 0 bytes"),
        (True, "cpu_bytes: expected a byte count"),
        (1.5, "cpu_bytes: expected a byte count"),
    ],
)
def test_bad_byte_sizes_name_the_field(value: object, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        ao.EngineConfig(cpu_bytes=value)


def test_cpu_bytes_and_an_explicit_cpu_blocks_conflict() -> None:
    with pytest.raises(ValidationError, match=r"either cpu_blocks .* or cpu_bytes"):
        ao.EngineConfig(cpu_blocks=8, cpu_bytes="1MiB")
    assert ao.EngineConfig(cpu_bytes="1MiB").cpu_blocks == 1024  # the default, unused


async def test_engine_resolves_cpu_bytes_to_blocks(caplog: pytest.LogCaptureFixture) -> None:
    kv = random_kv(2, 32)
    layout = ao.KVLayout.infer(kv)
    assert layout.block_bytes == 512
    cfg = ao.EngineConfig(cpu_bytes="10KiB", copy_engine="threads")
    with caplog.at_level(logging.INFO, logger="asyncoffload"):
        engine = ao.AsyncOffloadEngine(kv, cfg)
    async with engine:
        assert engine.config.cpu_blocks == 20  # 10240 // 512
        assert engine.config.cpu_bytes == 10240
        assert engine.manager.num_blocks == 20
        assert engine.stats().manager.num_blocks == 20
        assert engine.backend.num_host_blocks == 20
    assert "cpu_bytes=10240 (10.0 KiB) resolved to cpu_blocks=20 of 512 bytes each" in caplog.text
    assert cfg.cpu_blocks == 1024  # the caller's config is left as it was


def test_engine_rejects_cpu_bytes_smaller_than_a_block() -> None:
    kv = random_kv(2, 32)
    with pytest.raises(ValueError, match="cpu_bytes=100 holds no KV block: one block takes 512"):
        ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_bytes=100, copy_engine="threads"))
