"""The copy paths' settings (``TransferSettings``): every ``ASYNCOFFLOAD_*`` knob the CUDA
stack and the Triton kernels read is validated, and ``EngineConfig.from_env`` accepts
(and checks) them."""

from __future__ import annotations

import pytest

import asyncoffload as ao
from asyncoffload.transfer.settings import TransferSettings


def test_defaults_without_variables() -> None:
    s = TransferSettings.from_env({})
    assert (s.native_copy, s.native_programs, s.native_small, s.native_kernel) == (
        True,
        4,
        "kernel",
        "plain",
    )


def test_values_from_the_environment() -> None:
    s = TransferSettings.from_env(
        {
            "ASYNCOFFLOAD_NATIVE_COPY": "0",
            "ASYNCOFFLOAD_NATIVE_PROGRAMS": "8",
            "ASYNCOFFLOAD_NATIVE_SMALL": "staged",
            "ASYNCOFFLOAD_KERNEL_WARPS": "4",
            "ASYNCOFFLOAD_PAGED_TILE": "8192",
        }
    )
    assert not s.native_copy
    assert (s.native_programs, s.native_small, s.kernel_warps, s.paged_tile) == (
        8,
        "staged",
        4,
        8192,
    )


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("ASYNCOFFLOAD_NATIVE_COPY", "maybe"),
        ("ASYNCOFFLOAD_NATIVE_PROGRAMS", "0"),
        ("ASYNCOFFLOAD_NATIVE_PROGRAMS", "four"),
        ("ASYNCOFFLOAD_NATIVE_SMALL", "dma"),
        ("ASYNCOFFLOAD_NATIVE_KERNEL", "fast"),
        ("ASYNCOFFLOAD_KERNEL_TILE_WORDS", "1000"),
        ("ASYNCOFFLOAD_KERNEL_WARPS", "3"),
        ("ASYNCOFFLOAD_PAGED_TILE", "128"),
    ],
)
def test_a_bad_value_is_named(var: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{var}={value!r}"):
        TransferSettings.from_env({var: value})


def test_engine_config_from_env_accepts_the_documented_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCOFFLOAD_NATIVE_COPY", "0")
    monkeypatch.setenv("ASYNCOFFLOAD_NATIVE_PROGRAMS", "2")
    monkeypatch.setenv("ASYNCOFFLOAD_NATIVE_SMALL", "staged")
    monkeypatch.setenv("ASYNCOFFLOAD_CPU_BLOCKS", "8")
    assert ao.EngineConfig.from_env().cpu_blocks == 8


def test_engine_config_from_env_checks_the_copy_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCOFFLOAD_NATIVE_PROGRAMS", "x")
    with pytest.raises(ValueError, match="ASYNCOFFLOAD_NATIVE_PROGRAMS='x'"):
        ao.EngineConfig.from_env()
