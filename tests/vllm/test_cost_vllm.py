"""Load or recompute in real vLLM on CPU: a lower tier never makes TTFT worse than no
offloading (issue 41's invariant), in one vLLM run against no offloading.

One LLM serves three cases with a disk tier and a Valkey tier below a CPU tier. Every
prompt of a case was stored (written through to both tiers) in round 0; each case
starts with vLLM's prefix cache and our CPU tier reset (the lower tiers keep their
blocks) and alternates a prompt never seen (no offloading: every block is computed)
with a stored one (ours), each request alone:

- **fast disk**: the stored prompts load from the disk tier (``kv_load_tiers``);
- **slow disk**: the same tier, each read delayed by ``SLOW_READ_S`` (a fault hook),
  far longer than prefilling the prompt: the first promotion falls back to recompute
  at its deadline, the next ones are declined at lookup (counted);
- **Valkey paused**: the stored prompts load from Valkey, stopped with SIGSTOP for the
  case (SIGCONT after): no request waits past its deadline, and outputs are identical.

TTFT on 2 shared vCPUs is noisy: the comparisons are of medians over ``N`` requests,
with a tolerance of ``TOL`` plus ``FLOOR_S`` (one promotion that falls back costs up to
its deadline, 50 ms at least, once per case). Precise figures: benchmarks/vllm_cost.py.
"""

from __future__ import annotations

import random
import signal
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import RunVLLM
from tests.vllm.harness import (
    BLOCK_SIZE,
    LOGPROB_ATOL,
    generation_diff,
    offloading_kv_transfer_config,
)
from tests.vllm.test_e2e import BLOCK_BYTES

VLLM_TIMEOUT = 900
PROMPT_BLOCKS = 16
#: Requests per case, ours and no offloading each.
N = 5
SLOW_READ_S = 1.5
TOL = 0.05
FLOOR_S = 0.06
DISK = [{"medium": "storage", "locality": "local"}]
REMOTE = [{"medium": "storage", "locality": "remote"}]
CASES = ("fast_disk", "slow_disk", "valkey_paused")


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE)]


def plan(
    delay_file: Path, valkey_pid: int, n: int = N, seed: int = 41
) -> tuple[list[list[Any]], dict[str, Any], dict[str, list[tuple[int, str]]]]:
    """The rounds, their actions, and each case's rounds as (index, "ours" | "base")."""
    rng = random.Random(seed)
    stored = {case: [_prompt(rng) for _ in range(n)] for case in CASES}
    rounds: list[list[Any]] = [[p for case in CASES for p in stored[case]]]
    actions: dict[str, Any] = {"0": {"after": [{"metrics": True}]}}
    where: dict[str, list[tuple[int, str]]] = {}
    for case in CASES:
        tiers = REMOTE if case == "valkey_paused" else DISK
        first = len(rounds)
        before: list[dict[str, Any]] = [{"reset_prefix_cache": True}]
        after: list[dict[str, Any]] = [{"metrics": True}]
        if case == "slow_disk":
            before.append({"write": str(delay_file), "text": SLOW_READ_S})
            after.insert(0, {"write": str(delay_file), "text": 0})
        if case == "valkey_paused":
            before.append({"signal": valkey_pid, "name": "SIGSTOP"})
            after.insert(0, {"signal": valkey_pid, "name": "SIGCONT"})
        where[case] = []
        for i in range(n):
            where[case].append((len(rounds), "base"))
            rounds.append([_prompt(rng)])
            where[case].append((len(rounds), "ours"))
            rounds.append(
                [
                    {
                        "prompt_token_ids": stored[case][i],
                        "kv_transfer_params": {"kv_load_tiers": tiers},
                    }
                ]
            )
        actions[str(first)] = {"before": before}
        actions[str(len(rounds) - 1)] = {"after": after}
    return rounds, actions, where


def kv_config(
    tmp_path: Path,
    valkey_url: str,
    delay_file: Path,
    n: int = N,
    block_bytes: int = BLOCK_BYTES,
    **extra: Any,
) -> dict[str, Any]:
    """Our spec with the per-read delay hook, a CPU tier of 4 x the workload's blocks
    over a disk tier and a Valkey tier (both written every block)."""
    return offloading_kv_transfer_config(
        "FaultyAsyncOffloadSpec",
        "tests.vllm.fault_spec",
        policy="lru",
        cpu_bytes_to_use=4 * len(CASES) * n * PROMPT_BLOCKS * block_bytes,
        tiers=[
            {
                "kind": "disk",
                "path": str(tmp_path / "disk"),
                # Every prompt's blocks, twice over (the stored ones are never evicted).
                "capacity": 4 * len(CASES) * n * PROMPT_BLOCKS * (block_bytes + 4096),
                "admission": None,
            },
            {"url": valkey_url, "admission": None},
        ],
        tier_read_delay_file=str(delay_file),
        **extra,
    )


def ttfts(result: dict[str, Any], rounds: list[tuple[int, str]], who: str) -> list[float]:
    by_round = {r["round"]: r for r in result["requests"]}
    return [by_round[i]["metrics"]["ttft_s"] for i, w in rounds if w == who]


def decisions(result: dict[str, Any], last_round: int, first_round: int) -> dict[str, float]:
    """The decision counters' increase over a case (metrics after its last round, and
    after the round before its first)."""
    after = result["rounds"][last_round]["metrics"]
    before = result["rounds"][first_round - 1]["metrics"]
    names = (
        "tier_loaded",
        "tier_recomputed_by_choice",
        "tier_recomputed_after_deadline",
        "tier_read_failures",
    )
    key = "vllm:asyncoffload_"
    return {n: after.get(key + n, 0.0) - before.get(key + n, 0.0) for n in names}


@pytest.fixture
def cost_run(run_vllm: RunVLLM, tmp_path: Path, valkey_server: Any) -> dict[str, Any]:
    delay_file = tmp_path / "read-delay"
    pid = valkey_server.pid
    assert pid is not None
    rounds, actions, where = plan(delay_file, pid)
    shm_before = set(Path("/dev/shm").glob("asyncoffload-*.pool"))
    try:
        result = run_vllm(
            rounds,
            name="cost",
            kv_transfer_config=kv_config(tmp_path, valkey_server.url, delay_file),
            num_gpu_blocks=4 * PROMPT_BLOCKS,
            round_actions=actions,
            settle_s=20,
            kv_events=False,
        )
    finally:
        valkey_server.proc.send_signal(signal.SIGCONT)  # whatever happened in the run
    # The workers' host pool files (in /dev/shm, mapped by the scheduler to read and
    # write the tiers) were unlinked: once mapped by both sides, and at shutdown.
    left = set(Path("/dev/shm").glob("asyncoffload-*.pool")) - shm_before
    return {"result": result, "where": where, "pools_left": left}


@pytest.mark.timeout(VLLM_TIMEOUT)
def test_a_tier_never_makes_ttft_worse_than_no_offloading(cost_run: dict[str, Any]) -> None:
    result, where = cost_run["result"], cost_run["where"]
    assert cost_run["pools_left"] == set()
    assert result["rounds"][0]["settled"]  # every stored prompt is written through
    for case, rounds in where.items():
        ours, base = ttfts(result, rounds, "ours"), ttfts(result, rounds, "base")
        counts = decisions(result, rounds[-1][0], rounds[0][0])
        bound = (1 + TOL) * statistics.median(base) + FLOOR_S
        assert statistics.median(ours) <= bound, (case, ours, base, counts)
        by_round = {r["round"]: r for r in result["requests"]}
        refs = [r for r in result["requests"] if r["round"] == 0]
        served = [by_round[i] for i, w in rounds if w == "ours"]
        for i, r in enumerate(served):  # identical outputs, from the tier or recomputed
            ref = refs[CASES.index(case) * N + i]
            same, lp_diff = generation_diff(r, ref)
            assert same and lp_diff < LOGPROB_ATOL, (case, r["round"], lp_diff)
        if case == "fast_disk":  # read (a read on a busy machine may overrun, and fall back)
            assert counts["tier_loaded"] >= PROMPT_BLOCKS
        elif case == "slow_disk":
            assert counts["tier_loaded"] == 0
            assert counts["tier_recomputed_by_choice"] > 0
        else:  # paused: no request waits past its deadline (the tier's own is 5 s + 1 s)
            assert max(ours + base) < 1.0, (ours, base)
            assert counts["tier_loaded"] == 0
            # Each stored block is recomputed: its read overran its deadline, was declined,
            # or failed at once (a question about a new prompt's keys overran its deadline
            # first: the server is then taken as down for a while).
            recomputed = (
                counts["tier_recomputed_after_deadline"]
                + counts["tier_recomputed_by_choice"]
                + counts["tier_read_failures"]
            )
            assert recomputed >= N * PROMPT_BLOCKS
