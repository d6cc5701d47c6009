"""Hit rates of ``auto`` through vLLM's manager path, against ``lru`` and ``arc`` there.

Issue 40: the vLLM spec's default becomes ``auto`` if it holds there. Each workload is
replayed through :class:`~asyncoffload.integrations.vllm.AsyncOffloadManager` the way
vLLM's OffloadingConnector calls it (:func:`~asyncoffload.integrations.vllm.
connector_replay.replay_like_connector`: per-key lookups up to the first miss, loads,
stores a step or two later, request ends, no ``touch``), once per policy, on the
installed vLLM (0.32, or an overlay: ``PYTHONPATH=.vllm-0.34/site``). Only full blocks
have keys, as in vLLM. It prints, per workload and capacity, each policy's block hit
rate and ``auto`` less the best of ``lru`` and ``arc`` (issue 15's bar: never below by
more than 0.005), and the worst cell.

The workloads are benchmarks/policy_families.py's tuning set (``chat``, ``rag``,
``scan``, ``mixed`` at seeds 0 and 1, sized as there times ``--scale``; the conversation
trace; the Claude Code sessions, their first ``--claude-limit`` requests, at their own
capacity points). Needs the vLLM venv.

    .venv-vllm/bin/python benchmarks/vllm_policies.py [--scale 0.5] [--claude-limit 1000]
        [--set tuning|held-out|all] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from policy_families import BASELINES, TOLERANCE, Workload, _pct, plan
from vllm.v1.kv_offload.base import OffloadKey

from asyncoffload.cli import capacity_shares
from asyncoffload.integrations.vllm import AsyncOffloadManager
from asyncoffload.integrations.vllm.connector_replay import replay_like_connector
from asyncoffload.integrations.vllm.versions import installed_api
from asyncoffload.manager import CPUOffloadingManager
from asyncoffload.manager.policies import AdaptivePolicy
from asyncoffload.replay import capacity_blocks
from asyncoffload.workloads import Request

POLICIES = ("lru", "arc", "auto")


def full_chunks(requests: Sequence[Request]) -> list[list[OffloadKey]]:
    """Each request's keys of full blocks: vLLM offloads no partial block."""
    return [
        cast(list[OffloadKey], list(r.keys[: r.input_tokens // r.block_size])) for r in requests
    ]


def measure(
    workload: Workload, shares: Sequence[float], policies: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per share: each policy's block hit rate through the vLLM manager, and
    ``auto``'s switches."""
    prompts = full_chunks(workload.requests())
    unique = len({key for p in prompts for key in p})
    rows = []
    for share in workload.shares or shares:
        cap = capacity_blocks(share, unique)
        row: dict[str, Any] = {"workload": workload.name, "set": workload.group, "share": share}
        for policy in policies:
            manager = AsyncOffloadManager(cap, policy)
            stats = replay_like_connector(prompts, [manager], check=False)
            row[policy] = stats.hit_rate
            inner = manager.manager
            if isinstance(inner, CPUOffloadingManager) and isinstance(inner.policy, AdaptivePolicy):
                row["switches"] = inner.policy.switches
            row[f"{policy} impl"] = "C" if manager.native else "python"
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--capacity", default="1%,2%,5%,10%,20%,50%", help="shares")
    ap.add_argument("--set", choices=("all", "tuning", "held-out"), default="tuning")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--scale", type=float, default=1.0, help="family requests x this")
    ap.add_argument("--trace", help="the conversation trace (default: found, else none)")
    ap.add_argument("--claude-trace", help="the Claude Code sessions (default: found)")
    ap.add_argument("--claude-limit", type=int, metavar="N", default=1000)
    ap.add_argument("--no-trace", action="store_true", help="families only")
    ap.add_argument("--json", metavar="PATH", help="write every row as JSON")
    args = ap.parse_args()
    args.holdout = ["agent", "diurnal"]
    if not args.scale > 0:
        ap.error("--scale must be positive")
    if args.claude_limit < 1:
        ap.error("--claude-limit must be positive")
    shares = capacity_shares(args.capacity)
    print(f"vLLM {installed_api().version}; block hit rates through AsyncOffloadManager\n")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    head = ["workload", "capacity", *POLICIES, "auto - best of lru/arc"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for workload in plan(args):
        for row in measure(workload, shares, POLICIES):
            rows.append(row)
            d = row["auto"] - max(row[p] for p in BASELINES)
            cell = f"{d:+.4f}" if d >= -TOLERANCE else f"**{d:+.4f}**"
            rates = " | ".join(f"{row[p]:.4f}" for p in POLICIES)
            print(
                f"| {row['workload']} | {_pct(row['share'])} | {rates} | {cell} "
                f"({row['switches']} switches) |",
                flush=True,
            )
    diffs = [(r["auto"] - max(r[p] for p in BASELINES), r["workload"], r["share"]) for r in rows]
    worst, where, at = min(diffs)
    losses = sum(d < -TOLERANCE for d, _, _ in diffs)
    mean = sum(d for d, _, _ in diffs) / len(diffs)
    print(
        f"\nauto - best of lru/arc: worst {worst:+.4f} ({where}, {_pct(at)}), mean "
        f"{mean:+.4f}, below by more than {TOLERANCE}: {losses} of {len(diffs)} rows "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
