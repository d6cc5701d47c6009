"""Tenant quotas in real vLLM on CPU (issue 40): two cache_salts, one flooding and one
steady, under AsyncOffloadConnector (which hands each request's salt to our manager).

Rounds alternate: the steady tenant's prompt S (6 full blocks), then 4 new prompts of the
flood (6 full blocks each: 24 chunks, the whole CPU tier). Without quotas the flood
pushes S out of the tier; with the flood capped at 8 chunks, S is served from the tier
each time it comes back, exactly as with no flood at all, and the flood's refusals are
counted (``vllm:asyncoffload_blocks_quota_refused``)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.vllm.conftest import RunVLLM
from tests.vllm.harness import BLOCK_SIZE, random_prompt, requests_of

VLLM_TIMEOUT = 900
#: The tiny model's KV per 32-token block (tests/vllm/test_e2e.py).
BLOCK_BYTES = 4 * 2 * 2 * 64 * BLOCK_SIZE * 4
TIER_CHUNKS = 24
S_BLOCKS = 6
FLOOD_PROMPTS = 4
STEADY_ROUNDS = 4


def _rounds(flood: bool) -> list[list[Any]]:
    rng = random.Random(40)
    length = S_BLOCKS * BLOCK_SIZE + 8
    steady = {"prompt_token_ids": random_prompt(rng, length), "cache_salt": "steady"}
    rounds: list[list[Any]] = []
    for r in range(STEADY_ROUNDS):
        rounds.append([steady])
        if flood and r < STEADY_ROUNDS - 1:
            rounds.append(
                [
                    {"prompt_token_ids": random_prompt(rng, length), "cache_salt": "flood"}
                    for _ in range(FLOOD_PROMPTS)
                ]
            )
    return rounds


def _config(quotas: bool) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "spec_name": "AsyncOffloadSpec",
        "spec_module_path": "asyncoffload.integrations.vllm",
        "cpu_bytes_to_use": TIER_CHUNKS * BLOCK_BYTES,
        "policy": "lru",
    }
    if quotas:
        extra |= {"tenants": ["flood", "steady"], "quotas": {"flood": 8, "steady": "50%"}}
    return {
        "kv_connector": "AsyncOffloadConnector",
        "kv_connector_module_path": "asyncoffload.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def _steady_hits(result: dict[str, Any], flood: bool) -> list[int]:
    step = 2 if flood else 1
    return [
        requests_of(result, r)[0]["num_cached_tokens"]
        for r in range(0, step * (STEADY_ROUNDS - 1) + 1, step)
    ]


def _check_flood(runs: dict[str, dict[str, Any]]) -> None:
    for result in runs.values():
        assert all(r.get("settled", True) for r in result["rounds"])
    served = S_BLOCKS * BLOCK_SIZE
    # With no competition, the steady prompt is served whole each time it comes back
    # (the calm run, in `make test-long`, measures it).
    calm = [0] + [served] * (STEADY_ROUNDS - 1)
    # The steady salt's hits are the same with the flood as without it.
    assert _steady_hits(runs["flood"], flood=True) == calm
    # Without quotas the same flood takes the steady salt's blocks (the test can fail;
    # that run is in `make test-long`).
    if "flood-no-quota" in runs:
        assert _steady_hits(runs["flood-no-quota"], flood=True) != calm
    # The flood's refusals are counted; nothing opted out.
    metrics = runs["flood"]["metrics"]
    assert metrics["vllm:asyncoffload_blocks_quota_refused"] > 0
    assert metrics.get("vllm:asyncoffload_blocks_opted_out", 0) == 0
    if "calm" in runs:
        assert _steady_hits(runs["calm"], flood=False) == calm
        assert runs["calm"]["metrics"].get("vllm:asyncoffload_blocks_quota_refused", 0) == 0


def _run(run_vllm: RunVLLM, name: str, flood: bool, quotas: bool) -> dict[str, Any]:
    return run_vllm(
        _rounds(flood),
        name=f"quotas-{name}",
        kv_transfer_config=_config(quotas),
        kv_events=False,
        settle_s=20,
    )


@pytest.mark.timeout(VLLM_TIMEOUT)
def test_two_cache_salts_a_flood_leaves_the_steady_salt_its_hits(run_vllm: RunVLLM) -> None:
    _check_flood({"flood": _run(run_vllm, "flood", flood=True, quotas=True)})


# `make test-long`: the same flood without quotas (it takes the steady salt's blocks:
# the check above can fail) and the calm baseline measured, two more vLLM runs (the
# budget of `make test-vllm`).
@pytest.mark.long
@pytest.mark.timeout(VLLM_TIMEOUT)
def test_the_steady_salt_alone_is_served_as_beside_the_capped_flood(run_vllm: RunVLLM) -> None:
    _check_flood(
        {
            "calm": _run(run_vllm, "calm", flood=False, quotas=True),
            "flood": _run(run_vllm, "flood", flood=True, quotas=True),
            "flood-no-quota": _run(run_vllm, "flood-no-quota", flood=True, quotas=False),
        }
    )


@pytest.mark.long  # also through vLLM's real ReqContext in test_quotas_vllm.py
@pytest.mark.timeout(VLLM_TIMEOUT)
def test_an_opted_out_request_stores_nothing_in_vllm(run_vllm: RunVLLM) -> None:
    rng = random.Random(41)
    prompt = random_prompt(rng, S_BLOCKS * BLOCK_SIZE + 8)
    config = _config(quotas=False)
    result = run_vllm(
        [[prompt], [prompt]],
        name="opt-out",
        kv_transfer_config=config,
        kv_events=False,
        settle_s=20,
        kv_transfer_params={"asyncoffload_no_store": True},
        warmup_prompt_len=0,  # the warm-up request would store its block
    )
    assert [requests_of(result, r)[0]["num_cached_tokens"] for r in (0, 1)] == [0, 0]
    metrics = result["metrics"]
    assert metrics["vllm:asyncoffload_blocks_opted_out"] >= S_BLOCKS
    assert metrics.get("vllm:asyncoffload_blocks_stored", 0) == 0


@pytest.mark.long  # `make test-long`: a fourth vLLM run
@pytest.mark.timeout(VLLM_TIMEOUT)
def test_one_prompt_under_two_cache_salts_shares_no_block(run_vllm: RunVLLM) -> None:
    """vLLM mixes the salt into the first block's hash, so our tier files the same
    prompt apart per salt: salt b never loads what salt a stored, and a finds its own."""
    rng = random.Random(42)
    tokens = random_prompt(rng, S_BLOCKS * BLOCK_SIZE + 8)
    a = {"prompt_token_ids": tokens, "cache_salt": "a"}
    b = {"prompt_token_ids": tokens, "cache_salt": "b"}
    result = run_vllm(
        [[a], [b], [a], [b]],
        name="two-salts",
        kv_transfer_config=_config(quotas=False),
        kv_events=False,
        settle_s=20,
    )
    hits = [requests_of(result, r)[0]["num_cached_tokens"] for r in range(4)]
    assert hits == [0, 0, S_BLOCKS * BLOCK_SIZE, S_BLOCKS * BLOCK_SIZE]
