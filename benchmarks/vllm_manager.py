"""Scheduler-side cost per block: asyncoffload's vLLM manager against vLLM's own.

Replays a workload (the Mooncake conversation trace when it is at
``../shared/traces/conversation_trace.jsonl``, else the synthetic session generator)
through :func:`~asyncoffload.integrations.vllm.connector_replay.record_calls`, the way
vLLM 0.32's OffloadingConnector calls a manager (lookups up to the first miss, loads,
stores, completions, request ends, events), once per manager; then replays each
manager's own calls on a fresh manager with nothing in between, several times,
interleaved, and reports the best CPU time per prompt block and the ratio to vLLM's
``CPUOffloadingManager`` measured in the same run: ARC against vLLM's ARC, every other
policy against vLLM's LRU (its default). Ours runs on the C core where it has the policy
(``impl`` C), else on the Python manager; ``--python`` adds the Python manager for every
policy (``lru:py``, ...), side by side. Needs the vLLM venv (``make test-vllm`` builds
it).

    .venv-vllm/bin/python benchmarks/vllm_manager.py [--trace PATH] [--capacity 5%] [--python]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from policies import load  # benchmarks/policies.py: the trace, or synthetic sessions
from vllm.v1.kv_offload.base import OffloadingManager, OffloadKey
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from asyncoffload.cli import capacity_shares
from asyncoffload.integrations.vllm import AsyncOffloadManager
from asyncoffload.integrations.vllm.connector_replay import record_calls, time_calls
from asyncoffload.replay import capacity_blocks
from asyncoffload.workloads import Request

POLICIES = ("lru", "arc", "kv", "s3fifo", "sieve")


def full_chunks(requests: list[Request]) -> list[list[OffloadKey]]:
    """Each request's keys of full blocks: vLLM offloads no partial block."""
    return [
        cast(list[OffloadKey], list(r.keys[: r.input_tokens // r.block_size])) for r in requests
    ]


def _makers(
    capacity: int, policies: list[str], python: bool
) -> dict[str, Callable[[], OffloadingManager]]:
    def vllm(policy: str) -> Callable[[], OffloadingManager]:
        return lambda: CPUOffloadingManager(capacity, policy, enable_events=True)

    def ours(policy: str, native: bool | None) -> Callable[[], OffloadingManager]:
        return lambda: AsyncOffloadManager(capacity, policy, enable_events=True, native=native)

    makers = {"vllm:lru": vllm("lru"), "vllm:arc": vllm("arc")}
    makers.update((policy, ours(policy, None)) for policy in policies)
    if python:
        makers.update((f"{policy}:py", ours(policy, False)) for policy in policies)
    return makers


def _impl(manager: OffloadingManager) -> str:
    if isinstance(manager, AsyncOffloadManager):
        return "C" if manager.native else "python"
    return "vllm"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="Mooncake JSONL trace, or 'synthetic'")
    ap.add_argument("--capacity", nargs="+", default=["5%"])
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--limit", type=int, help="only the first LIMIT requests")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--python", action="store_true", help="also time the Python manager for every policy"
    )
    args = ap.parse_args()

    name, requests = load(args.trace)
    if args.limit:
        requests = requests[: args.limit]
    prompts = full_chunks(requests)
    blocks = sum(len(p) for p in prompts)
    unique = len({key for p in prompts for key in p})
    policies = [p for p in args.policies.split(",") if p]
    print(f"{name}: {len(prompts):,} requests, {blocks:,} full blocks, {unique:,} unique")
    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor()}")
    rows: list[dict[str, Any]] = []
    for share in capacity_shares(",".join(args.capacity)):
        capacity = capacity_blocks(share, unique)
        makers = _makers(capacity, policies, args.python)
        recorded = {}
        impls = {}
        for label, make in makers.items():
            manager = make()
            impls[label] = _impl(manager)
            calls, stats = record_calls(prompts, manager)
            recorded[label] = (calls, stats)
        best = {label: float("inf") for label in makers}
        for _ in range(args.repeat):
            for label, make in makers.items():
                calls = recorded[label][0]
                seconds = time_calls(calls, make, clock=time.process_time)
                best[label] = min(best[label], seconds)
        print(f"\ncapacity {share:.0%} ({capacity:,} blocks): CPU time per prompt block")
        print(
            f"{'manager':10} {'impl':>6} {'us/block':>9} {'ratio':>6} {'hit rate':>9} {'calls':>9}"
        )
        for label in makers:
            us = best[label] * 1e6 / blocks
            base = "vllm:arc" if label.split(":")[0] == "arc" else "vllm:lru"
            ratio = best[label] / best[base] if not label.startswith("vllm:") else 1.0
            stats = recorded[label][1]
            calls = recorded[label][0]
            print(
                f"{label:10} {impls[label]:>6} {us:9.3f} {ratio:6.2f} {stats.hit_rate:9.3f} "
                f"{len(calls):9,}"
            )
            rows.append(
                {
                    "capacity": share,
                    "manager": label,
                    "impl": impls[label],
                    "us_per_block": us,
                    "ratio_to_vllm": ratio,
                    "baseline": base if not label.startswith("vllm:") else label,
                    "hit_rate": stats.hit_rate,
                    "calls": len(calls),
                }
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
