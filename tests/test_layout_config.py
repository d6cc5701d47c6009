from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import asyncoffload as ao


def test_split_layout_inferred_from_vllm_flash_shape() -> None:
    kv = [torch.zeros(2, 10, 16, 8, 128, dtype=torch.bfloat16) for _ in range(4)]
    layout = ao.KVLayout.infer(kv)
    assert layout.kv_split and layout.block_dim == 1
    assert layout.num_blocks == 10 and layout.num_layers == 4
    assert layout.fragment_bytes == 16 * 8 * 128 * 2
    assert layout.block_bytes == 4 * 2 * layout.fragment_bytes


def test_unsplit_layout_inferred() -> None:
    layout = ao.KVLayout.infer([torch.zeros(7, 16, 576, dtype=torch.float16)])
    assert not layout.kv_split and layout.block_dim == 0
    assert (layout.num_blocks, layout.block_bytes) == (7, 16 * 576 * 2)


def test_ambiguous_layout_must_be_stated() -> None:
    kv = [torch.zeros(2, 16, 64)]
    with pytest.raises(ValueError, match="kv_split"):
        ao.KVLayout.infer(kv)
    assert ao.KVLayout.infer(kv, kv_split=False).num_blocks == 2
    assert ao.KVLayout.infer(kv, kv_split=True).num_blocks == 16


@pytest.mark.parametrize(
    ("kv", "match"),
    [
        ([], "empty"),
        ([torch.zeros(4, 8), torch.zeros(5, 8)], "layers must match"),
        ([torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float16)], "layers must match"),
        ([torch.zeros(8, 4).t()], "not contiguous"),
        ([torch.zeros(0, 8)], "no blocks"),
    ],
)
def test_bad_kv_caches_are_rejected(kv: list[torch.Tensor], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ao.KVLayout.infer(kv)


def test_kv_caches_must_be_a_list_of_tensors() -> None:
    with pytest.raises(TypeError):
        ao.KVLayout.infer(torch.zeros(4, 8))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"kv_caches\[1\]"):
        ao.KVLayout.infer([torch.zeros(4, 8), "x"])  # type: ignore[list-item]


def test_config_validates_once_with_clear_errors() -> None:
    with pytest.raises(ValidationError, match="unknown cache policy 'fifo'"):
        ao.EngineConfig(policy="fifo")
    with pytest.raises(ValidationError, match="cpu_blocks"):
        ao.EngineConfig(cpu_blocks=0)
    with pytest.raises(ValidationError, match="extra"):
        ao.EngineConfig(cpu_block=4)  # type: ignore[call-arg]


def test_config_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCOFFLOAD_CPU_BLOCKS", "77")
    monkeypatch.setenv("ASYNCOFFLOAD_POLICY", "arc")
    cfg = ao.EngineConfig.from_env(store_threshold=2)
    assert (cfg.cpu_blocks, cfg.policy, cfg.store_threshold) == (77, "arc", 2)


def test_engine_rejects_a_backend_smaller_than_the_tier() -> None:
    kv = [torch.zeros(2, 8, 1, 1, 8)]
    backend = ao.CpuCopyBackend(kv, ao.KVLayout.infer(kv), 4)
    try:
        with pytest.raises(ValueError, match="host blocks"):
            ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=8), backend=backend)
    finally:
        backend.close()


def test_engine_rejects_tensors_it_cannot_copy() -> None:
    kv = [torch.zeros(2, 8, 1, 1, 8, device="meta")]
    with pytest.raises(ValueError, match="no transfer backend"):
        ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=8))
