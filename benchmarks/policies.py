"""Cost of the cache policies on a replay: manager time per block, against LRU.

Replays a workload (the Mooncake conversation trace when it is at
``../shared/traces/conversation_trace.jsonl``, else the synthetic session generator)
through :func:`asyncoffload.replay.replay` for every policy, several times, interleaved,
and reports the best time per prompt block of the manager calls (lookup, touch, load,
store: what a scheduler pays), next to the hit rate and the blocks written, and the
ratio to LRU measured in the same run.

    python benchmarks/policies.py [--trace PATH] [--capacity 5% 20%] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from asyncoffload.cli import capacity_shares
from asyncoffload.replay import capacity_blocks, parse_spec, replay
from asyncoffload.workloads import Request, load_mooncake, summarize, synthetic_sessions

#: ``$ASYNCOFFLOAD_TRACE_DIR`` (where the Mooncake traces are), else ``../shared/traces``.
DEFAULT_TRACE = (
    Path(
        os.environ.get("ASYNCOFFLOAD_TRACE_DIR")
        or Path(__file__).resolve().parents[2] / "shared" / "traces"
    )
    / "conversation_trace.jsonl"
)


def load(trace: str | None) -> tuple[str, list[Request]]:
    if trace == "synthetic":
        return "synthetic_sessions(20000)", synthetic_sessions(20_000)
    path = Path(trace) if trace else DEFAULT_TRACE
    if not path.exists():
        if trace:
            sys.exit(f"no trace at {path}")
        return "synthetic_sessions(20000)", synthetic_sessions(20_000)
    return path.name, load_mooncake(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="Mooncake JSONL trace, or 'synthetic'")
    ap.add_argument("--capacity", nargs="+", default=["5%", "20%"])
    ap.add_argument(
        "--policies", default="lru,arc,s3fifo,sieve,kv,lru+ghost,lru+adaptive,kv+adaptive"
    )
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    name, requests = load(args.trace)
    unique = summarize(requests).unique_blocks
    specs = [s for s in args.policies.split(",") if s]
    parsed = [parse_spec(s) for s in specs]
    shares = capacity_shares(",".join(args.capacity))
    print(f"{name}: {len(requests):,} requests, {unique:,} unique blocks")
    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor()}")
    rows = []
    for share in shares:
        cap = capacity_blocks(share, unique)
        best: dict[str, float] = {}
        info: dict[str, tuple[float, int]] = {}
        for rep in range(args.repeat):
            order = parsed[rep % len(parsed) :] + parsed[: rep % len(parsed)]
            for policy, adm in order:
                res = replay(requests, cap, policy=policy, admission=adm, unique_blocks=unique)
                label = res.label
                best[label] = min(best.get(label, float("inf")), res.us_per_block)
                info[label] = (res.block_hit_rate, res.stored)
        base = best["lru"]
        print(f"\ncapacity {share:.0%} ({cap:,} blocks), best of {args.repeat}:")
        print(f"  {'policy':<14} {'us/block':>9} {'x lru':>6} {'hit':>6} {'written':>9}")
        for spec in specs:
            label = spec
            us = best[label]
            hit, stored = info[label]
            print(f"  {label:<14} {us:9.2f} {us / base:6.2f} {hit:6.3f} {stored:9,}")
            rows.append(
                {
                    "share": share,
                    "policy": label,
                    "us_per_block": us,
                    "x_lru": us / base,
                    "block_hit_rate": hit,
                    "stored": stored,
                }
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"trace": name, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
