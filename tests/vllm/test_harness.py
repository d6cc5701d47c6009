"""The end-to-end harness itself: real vLLM (CPU) runs, deterministic and KV-sensitive.

These tests prove the harness can tell a working offloading spec from a broken one before
``asyncoffload.integrations.vllm`` exists, using the throwaway ``tests/vllm/toy_spec.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vllm.conftest import SENSITIVITY_POSITIONS, SENSITIVITY_ROUND, RunVLLM
from tests.vllm.harness import (
    LOGPROB_ATOL,
    LLMRunError,
    generation_diff,
    offloading_kv_transfer_config,
    requests_of,
    reuse_rounds,
    summarize_events,
    toy_kv_transfer_config,
)
from tests.vllm.tiny_model import write_tiny_llama

# One vLLM start is 20-30 s here, a whole run 35-45 s; the first test also builds fixtures.
VLLM_TIMEOUT = 900


def test_tiny_model_has_large_random_weights(tiny_model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    weights = load_file(str(tiny_model / "model.safetensors"))
    v = weights["model.layers.0.self_attn.v_proj.weight"]
    assert v.dtype == torch.float32
    # Not vLLM's dummy init (uniform ±1e-3), which would make outputs blind to the KV.
    assert 0.25 < v.std().item() < 0.35
    # Fixed seed: the same checkpoint every time.
    again = write_tiny_llama(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (
        tiny_model / "model.safetensors"
    ).read_bytes()


@pytest.mark.timeout(VLLM_TIMEOUT)
def test_baseline_runs_without_cached_tokens(reuse_baseline: dict[str, Any]) -> None:
    result = reuse_baseline
    assert len(result["requests"]) == 1 + 2 + 1 + len(SENSITIVITY_POSITIONS) + 3 + 1
    for req in result["requests"]:
        assert req["num_cached_tokens"] == 0  # prefix caching is off and no connector
        assert len(req["token_ids"]) == 8
        assert len(req["logprobs"]) == 8
        assert req["metrics"] is not None and req["metrics"]["ttft_s"] > 0
    # No connector and no prefix cache: nothing publishes KV events.
    assert summarize_events(result)["counts"] == {}
    # The repeated prompt, recomputed, gives the same output within the run.
    (a0,), (a2,) = requests_of(result, 0), requests_of(result, 2)
    assert generation_diff(a0, a2) == (True, 0.0)


@pytest.mark.long  # the harness checking itself: `make test-long`
@pytest.mark.timeout(VLLM_TIMEOUT)
def test_baseline_is_deterministic_across_runs(
    run_vllm: RunVLLM, reuse_baseline: dict[str, Any]
) -> None:
    from tests.vllm.conftest import baseline_rounds

    again = run_vllm(baseline_rounds(), name="baseline-again")
    for a, b in zip(reuse_baseline["requests"], again["requests"], strict=True):
        assert a["token_ids"] == b["token_ids"]
        assert a["logprobs"] == b["logprobs"]  # bit-identical in float32


@pytest.mark.timeout(VLLM_TIMEOUT)
def test_outputs_depend_on_early_prompt_tokens(reuse_baseline: dict[str, Any]) -> None:
    """Changing one token at position 0 or 100 of a 200-token prompt changes the output:
    the generated tokens read the KV of the whole prompt, not only of its last tokens."""
    (a,) = requests_of(reuse_baseline, 0)
    sensitivity = requests_of(reuse_baseline, SENSITIVITY_ROUND)
    for pos, req in zip(SENSITIVITY_POSITIONS, sensitivity, strict=True):
        same_tokens, lp_diff = generation_diff(a, req)
        assert not same_tokens or lp_diff > 100 * LOGPROB_ATOL, pos


@pytest.mark.long  # the harness checking itself: `make test-long`
@pytest.mark.timeout(VLLM_TIMEOUT)
def test_toy_spec_serves_repeated_prompt_from_connector(
    run_vllm: RunVLLM, reuse_baseline: dict[str, Any]
) -> None:
    result = run_vllm(reuse_rounds(), name="toy-copy", kv_transfer_config=toy_kv_transfer_config())
    for r in (0, 1):
        assert all(req["num_cached_tokens"] == 0 for req in requests_of(result, r))
    (a2,) = requests_of(result, 2)
    (base_a2,) = requests_of(reuse_baseline, 2)
    assert a2["num_cached_tokens"] == 6 * 32  # every full block of A, from the connector
    same_tokens, lp_diff = generation_diff(a2, base_a2)
    assert same_tokens
    assert lp_diff < LOGPROB_ATOL
    assert result["metrics"]["vllm:external_prefix_cache_hits"] == 6 * 32
    # The connector publishes a BlockStored (medium CPU) per offloaded block: A's 6 and
    # the fillers' 2 x 6 (the warm-up request adds one); nothing is evicted from 64 MiB.
    events = summarize_events(result)
    assert events["counts"].get("BlockStored:CPU", 0) >= 18
    assert set(events["counts"]) == {"BlockStored:CPU"}
    assert result["kv_events_missing_seqs"] == []


@pytest.mark.long  # the harness checking itself: `make test-long`
@pytest.mark.timeout(VLLM_TIMEOUT)
def test_workload_catches_a_spec_that_copies_nothing(
    run_vllm: RunVLLM, reuse_baseline: dict[str, Any]
) -> None:
    """A spec that reports loads done without writing the KV blocks gets the cache hit but
    not the baseline's output: the fillers overwrote A's GPU blocks."""
    result = run_vllm(
        reuse_rounds(), name="toy-skip", kv_transfer_config=toy_kv_transfer_config("skip_load")
    )
    (a2,) = requests_of(result, 2)
    (base_a2,) = requests_of(reuse_baseline, 2)
    assert a2["num_cached_tokens"] == 6 * 32
    same_tokens, lp_diff = generation_diff(a2, base_a2)
    assert not same_tokens or lp_diff > 100 * LOGPROB_ATOL


@pytest.mark.long  # the harness checking itself: `make test-long`
@pytest.mark.timeout(VLLM_TIMEOUT)
def test_runner_fails_clearly_when_vllm_cannot_start(run_vllm: RunVLLM) -> None:
    bad = offloading_kv_transfer_config("NoSuchSpec", "tests.vllm.no_such_module")
    with pytest.raises(LLMRunError, match="exited 1") as info:
        run_vllm([[[5] * 40]], name="bad-spec", kv_transfer_config=bad, timeout=240)
    # The message names the root cause, which vLLM logs in the worker process.
    message = str(info.value)
    assert "root cause (vLLM log): ModuleNotFoundError" in message
    assert "tests.vllm.no_such_module" in message
