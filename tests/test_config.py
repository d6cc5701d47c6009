"""EngineConfig: the CPU tier given in bytes, configuration from the environment and a
file, and the engine's periodic summary line."""

from __future__ import annotations

import json
import logging
import re
import traceback
from pathlib import Path

import pytest
from pydantic import ValidationError

import asyncoffload as ao
from asyncoffload.config import parse_bytes

from .helpers import make_keys, random_kv

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


@pytest.mark.parametrize("period", [0.0005, 0.0, -1.0])
def test_a_poll_period_under_a_millisecond_is_refused_naming_it(period: float) -> None:
    # uvloop truncates timers to whole milliseconds: a 0.5 ms period fired at once and
    # the loop spun (a benchmark's writer did, at 100 % of a CPU).
    with pytest.raises(ValidationError, match=r"poll_interval_s\n.*greater than or equal to 0.001"):
        ao.EngineConfig(poll_interval_s=period)
    assert ao.EngineConfig(poll_interval_s=0.001).poll_interval_s == 0.001


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


# --- from_env: pydantic-settings, a config file, unknown variables ------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ASYNCOFFLOAD_* variable from the surrounding environment."""
    import os

    for var in list(os.environ):
        if var.upper().startswith("ASYNCOFFLOAD_"):
            monkeypatch.delenv(var)
    return monkeypatch


def test_from_env_reads_fields_and_overrides_win(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("ASYNCOFFLOAD_CPU_BYTES", "1 MiB")
    clean_env.setenv("ASYNCOFFLOAD_PIN_MEMORY", "false")
    clean_env.setenv("ASYNCOFFLOAD_POLICY", "arc")
    clean_env.setenv("ASYNCOFFLOAD_NO_NATIVE", "1")  # the package's own, not a field
    clean_env.setenv("ASYNCOFFLOAD_LOG_LEVEL", "INFO")
    cfg = ao.EngineConfig.from_env(policy="lru")
    assert (cfg.cpu_bytes, cfg.pin_memory, cfg.policy) == (1 << 20, False, "lru")


def test_a_mistyped_variable_is_reported_with_a_suggestion(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("ASYNCOFFLOAD_CPU_BLOCK", "64")
    with pytest.raises(
        ValueError,
        match=r"unknown environment variable ASYNCOFFLOAD_CPU_BLOCK "
        r"\(did you mean ASYNCOFFLOAD_CPU_BLOCKS\?\)",
    ):
        ao.EngineConfig.from_env()


def test_errors_name_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("ASYNCOFFLOAD_CPU_BLOCKS", "abc")
    with pytest.raises(ValueError, match=r"ASYNCOFFLOAD_CPU_BLOCKS='abc': Input should be"):
        ao.EngineConfig.from_env()
    clean_env.setenv("ASYNCOFFLOAD_CPU_BLOCKS", "8")
    clean_env.setenv("ASYNCOFFLOAD_CPU_BYTES", "1GiB")
    with pytest.raises(ValueError, match=r"either cpu_blocks \(8\) or cpu_bytes"):
        ao.EngineConfig.from_env()


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_config_file_then_environment(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, suffix: str
) -> None:
    path = tmp_path / f"offload{suffix}"
    if suffix == ".toml":
        path.write_text('cpu_bytes = "2 MiB"\npolicy = "arc"\nevent_buffer = 16\n')
    else:
        path.write_text('{"cpu_bytes": "2 MiB", "policy": "arc", "event_buffer": 16}')
    clean_env.setenv("ASYNCOFFLOAD_POLICY", "sieve")  # the environment wins over the file
    cfg = ao.EngineConfig.from_env(config_file=path)
    assert (cfg.cpu_bytes, cfg.policy, cfg.event_buffer) == (2 << 20, "sieve", 16)
    clean_env.setenv("ASYNCOFFLOAD_CONFIG", str(path))  # the file named by the environment
    assert ao.EngineConfig.from_env().event_buffer == 16


def test_config_file_errors_name_the_file_and_key(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "offload.toml"
    path.write_text("event_buffer = -3\n")
    with pytest.raises(ValueError, match=r"offload.toml: event_buffer=-3: Input should be"):
        ao.EngineConfig.from_env(config_file=path)
    path.write_text("cpu_block = 3\n")
    with pytest.raises(
        ValueError, match=r"offload.toml: unknown key 'cpu_block' \(did you mean cpu_blocks\?\)"
    ):
        ao.EngineConfig.from_env(config_file=path)
    with pytest.raises(ValueError, match="no such file"):
        ao.EngineConfig.from_env(config_file=tmp_path / "missing.toml")
    bad = tmp_path / "offload.yaml"
    bad.write_text("x: 1\n")
    with pytest.raises(ValueError, match=r"use a \.toml or a \.json file"):
        ao.EngineConfig.from_env(config_file=bad)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("offload.toml", b"cpu_blocks = \n", r"Invalid value \(at line 1, column 14\)"),
        ("offload.toml", b'model = "m"\ncpu_blocks = [1,\n]]\n', r"at line 3, column 2"),
        ("offload.json", b'{"cpu_blocks": }', r"Expecting value \(at line 1, column 16\)"),
        ("offload.json", b'{\n"cpu_blocks": 4,\n}', r"\(at line 3, column 1\)"),
        ("offload.toml", b'model = "m"\ntenant = "\xff"\n', "not UTF-8 text: byte 0xff at line 2"),
        ("offload.json", b'{"model": "\xfe"}', "not UTF-8 text: byte 0xfe at line 1, column 12"),
        # Past Python's int-string conversion limit: a ValueError from inside the parser.
        ("offload.toml", b"cpu_blocks = " + b"9" * 5000, "Exceeds the limit"),
        ("offload.json", b'{"cpu_blocks": ' + b"9" * 5000 + b"}", "Exceeds the limit"),
        ("offload.json", b'"cpu_blocks"', "expected a table of settings .* found a string"),
        ("offload.json", b"[1, 2]", "expected a table of settings .* found an array"),
        ("offload.json", b"null", "expected a table of settings .* found null"),
        ("offload.json", b"[" * 100_000, "nested too deeply to read"),
        ("offload.toml", b"x = " + b"[" * 100_000, "nested too deeply to read"),
    ],
)
def test_a_config_file_that_cannot_be_read_is_named(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    """Each was a parser's own error (JSONDecodeError, TOMLDecodeError, a bare ValueError
    or UnicodeDecodeError) that named no file."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
        ao.EngineConfig.from_env(config_file=path)
    assert str(error.value).startswith(f"config file {path}: "), error.value
    assert type(error.value) is ValueError


def test_a_config_file_error_never_shows_the_file(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A syntax error next to a tier's password: the error, its traceback and whatever it
    is chained to hold no part of the file (JSONDecodeError.doc is the whole text)."""
    secret = "s3cret-pw"
    for name, content in (
        ("offload.json", f'{{"tiers": [{{"url": "redis://u:{secret}@h/0"}}], }}'),
        ("offload.toml", f'tiers = [{{url = "redis://u:{secret}@h/0"}}]\ncpu_blocks = \n'),
        ("offload.json", f'{{"tiers": [{{"password": "{secret}\udcff"}}]}}'),
    ):
        path = tmp_path / name
        path.write_bytes(content.encode("utf-8", "surrogateescape"))
        with pytest.raises(ValueError, match=f"config file {path}: ") as error:
            ao.EngineConfig.from_env(config_file=path)
        assert error.value.__cause__ is None and error.value.__suppress_context__
        assert secret not in "".join(traceback.format_exception(error.value))


def test_deeply_nested_tiers_in_the_environment_are_a_value_error(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """json.loads recursed out of Python's stack: a RecursionError that named nothing."""
    clean_env.setenv("ASYNCOFFLOAD_TIERS", "[" * 100_000)
    with pytest.raises(ValueError, match=r"ASYNCOFFLOAD_TIERS: .*nested too deeply to read"):
        ao.EngineConfig.from_env()
    with pytest.raises(ValueError, match=r"^invalid EngineConfig: tiers: .*nested too deeply"):
        ao.EngineConfig.from_env(prefix="", tiers="[" * 100_000 + "]" * 100_000)


def test_a_tier_error_never_shows_the_tiers_value_and_its_secrets(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A shared tier's password (in its url or on its own) must not reach an error,
    whichever source the tiers came from; the error still says where and what."""
    secret = "s3cret-pw"
    tiers = [
        {"url": f"redis://user:{secret}@127.0.0.1:6379/0", "ttl_s": -1},
        {"kind": "remote", "url": "redis://127.0.0.1/0", "password": secret, "ttl_s": -1},
    ]
    for tier in tiers:
        raw = json.dumps([tier])
        clean_env.setenv("ASYNCOFFLOAD_TIERS", raw)
        with pytest.raises(ValueError) as env_error:
            ao.EngineConfig.from_env()
        clean_env.delenv("ASYNCOFFLOAD_TIERS")
        path = tmp_path / "offload.json"
        path.write_text(json.dumps({"tiers": [tier]}))
        with pytest.raises(ValueError) as file_error:
            ao.EngineConfig.from_env(config_file=path)
        with pytest.raises(ValueError) as override_error:
            ao.EngineConfig.from_env(tiers=[tier])
        for error, where in (
            (env_error, "ASYNCOFFLOAD_TIERS[0]"),
            (file_error, "offload.json: tiers[0]"),
            (override_error, "tiers[0]"),
        ):
            text = "".join(traceback.format_exception(error.value))
            assert secret not in text, text  # nor in a chained pydantic error
            assert where in str(error.value) and "ttl_s" in str(error.value)


# --- log_summary_s ----------------------------------------------------------------------


async def test_periodic_summary_line(caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    kv = random_kv(2, 32)
    cfg = ao.EngineConfig(
        cpu_blocks=4, log_summary_s=0.05, copy_engine="threads", policy="lru"
    )  # LRU: the first store is the one evicted
    engine = ao.AsyncOffloadEngine(kv, cfg)
    keys = make_keys(6)
    with caplog.at_level(logging.INFO, logger="asyncoffload"):
        async with engine:
            for i in range(0, 6, 2):  # 6 keys through 4 blocks: 2 evictions
                handle = await engine.prepare_store(keys[i : i + 2], [i, i + 1])
                assert handle is not None
                await handle
            assert engine.lookup(keys[4:]) == 2
            assert engine.lookup(keys[:2]) == 0
            await (await engine.prepare_load(keys[4:], [20, 21]))
            for _ in range(100):
                await asyncio.sleep(0.02)
                if "summary" in caplog.text:
                    break
        lines = [r.getMessage() for r in caplog.records if "summary" in r.getMessage()]
        assert lines, caplog.text
        # A busy machine may split the work over several lines: add them up.
        pattern = re.compile(
            r"lookups (\d+), hit rate \S+ \((\d+)/(\d+) keys\); stores (\d+) \([\d.]+ GB/s\); "
            r"loads (\d+) \([\d.]+ GB/s\); evictions (\d+); in flight \d+"
        )
        totals = [0] * 6
        for line in lines:
            match = pattern.search(line)
            assert match, line
            totals = [t + int(g) for t, g in zip(totals, match.groups())]
        assert totals == [2, 2, 4, 3, 1, 2]
        # The two lookups run back to back, never split over two lines.
        assert any("lookups 2, hit rate 50.0% (2/4 keys)" in line for line in lines)
        assert engine._summary is not None and engine._summary.timer is None  # cancelled
        count = len(lines)
        await asyncio.sleep(0.15)
    after = [r for r in caplog.records if "summary" in r.getMessage()]
    assert len(after) == count


def test_no_summary_timer_before_first_use_or_by_default() -> None:
    kv = random_kv(2, 32)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(log_summary_s=1.0, copy_engine="threads"))
    assert engine._summary is not None and engine._summary.timer is None
    engine.backend.close()
    engine._closed = True
    with pytest.raises(ValidationError, match="log_summary_s"):
        ao.EngineConfig(log_summary_s=0)
