"""Host memory is checked before a large allocation, with a message naming the setting."""

from __future__ import annotations

import pytest

import asyncoffload as ao
from asyncoffload import hostmem
from asyncoffload.cli import main


def test_this_machine_reports_its_available_memory() -> None:
    available = hostmem.available_host_bytes()
    assert available is not None and 0 < available < 1 << 50


def test_a_request_beyond_what_is_available_names_the_setting_and_both_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hostmem, "available_host_bytes", lambda: 3 << 30)
    hostmem.check_host_bytes(2 << 30, "cpu_blocks=8")
    with pytest.raises(ao.HostMemoryError, match=r"cpu_blocks=8 needs 4\.0 GiB .* 3\.0 GiB"):
        hostmem.check_host_bytes(4 << 30, "cpu_blocks=8")


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1536, "1.5 KiB"), (5 << 40, "5.0 TiB")])
def test_bytes_are_formatted_in_binary_units(n: int, text: str) -> None:
    assert hostmem.format_bytes(n) == text


def test_a_demo_too_large_for_the_machine_fails_at_once_naming_layers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--layers", "100000", "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--layers 100000" in err and "of host memory" in err
    assert "Traceback" not in err


def test_a_tier_too_large_for_the_machine_fails_before_allocating() -> None:
    import torch

    kv = [torch.zeros((2, 8, 4, 2, 8), dtype=torch.bfloat16)]
    with pytest.raises(ao.HostMemoryError, match=r"cpu_blocks\) needs .* TiB of host memory"):
        ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=10**12))
