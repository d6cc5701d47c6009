"""Hit rates of the ``session`` policy (issue 40) against lru, arc, kv and auto.

The Claude Code sessions of kv-cache-tester (``claude_code_sessions.jsonl.gz`` at
``$ASYNCOFFLOAD_TRACE_DIR`` or ``../shared/traces``, 64-token blocks) at 1, 2, 5, 10 and
20% of its unique blocks, then the tuning families of ``benchmarks/policy_families.py``
(``chat``, ``rag``, ``scan``, ``mixed``, and the Mooncake conversation trace when it is
there) and the held-out ones (``agent``, ``diurnal``; reported only) at 1-50%. Every
workload is replayed through the CPU tier's manager as the engine drives it
(:func:`asyncoffload.replay.replay`); ``session`` runs on the trace's clock (each
request's arrival time), and ``session-noadm`` (Claude Code only) without its admission,
to show what that part is worth. Block hit rates; counts, not times.

    python benchmarks/session_policy.py [--scale 0.5] [--seeds 0] [--no-families]
        [--no-claude] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncoffload.manager.policies import CachePolicy, SessionPolicy
from asyncoffload.replay import FamilySource, ReplayResult, replay
from asyncoffload.replay.result import capacity_blocks
from asyncoffload.workloads import Request, load_block_trace, load_mooncake, summarize

TRACES = Path(
    os.environ.get("ASYNCOFFLOAD_TRACE_DIR")
    or Path(__file__).resolve().parents[2] / "shared" / "traces"
)
CLAUDE = TRACES / "claude_code_sessions.jsonl.gz"
CONVERSATION = TRACES / "conversation_trace.jsonl"
CLAUDE_SHARES = (0.01, 0.02, 0.05, 0.10, 0.20)
FAMILY_SHARES = (0.01, 0.02, 0.05, 0.10, 0.20, 0.50)
NAMED = ("lru", "arc", "kv", "auto")
#: Requests per family at ``--scale 1`` (benchmarks/policy_families.py's sizes).
REQUESTS = {"chat": 10_000, "rag": 30_000, "scan": 12_000, "mixed": 20_000}
HELD_OUT = {"agent": 8_000, "diurnal": 25_000}


def session_run(
    requests: Sequence[Request], cap: int, unique: int, share: float, admission: bool = True
) -> ReplayResult:
    """``session`` replayed on the trace's clock."""
    now = [0.0]
    policy: CachePolicy = SessionPolicy(cap, clock=lambda: now[0], admission=admission)

    def before(i: int) -> None:
        now[0] = requests[i].arrival_s

    return replay(
        requests, cap, policy=policy, unique_blocks=unique, share=share, before_request=before
    )


def measure(
    name: str, requests: Sequence[Request], shares: Sequence[float], ablation: bool
) -> dict[str, Any]:
    unique = summarize(requests).unique_blocks
    rows: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for share in shares:
        cap = capacity_blocks(share, unique)
        runs = {
            spec: replay(requests, cap, policy=spec, unique_blocks=unique, share=share)
            for spec in NAMED
        }
        runs["session"] = session_run(requests, cap, unique, share)
        if ablation:
            runs["session-noadm"] = session_run(requests, cap, unique, share, admission=False)
        row = {spec: res.block_hit_rate for spec, res in runs.items()}
        # Manager time per block against LRU's (same process, one run each).
        row["session cost"] = runs["session"].us_per_block / runs["lru"].us_per_block
        rows[f"{share:g}"] = row
        print(name, f"{share:.0%}", " ".join(f"{k}={v:.4f}" for k, v in row.items()), flush=True)
    return {
        "requests": len(requests),
        "unique": unique,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
    }


def table(name: str, measured: dict[str, Any]) -> str:
    rows = measured["rows"]
    specs = [s for s in next(iter(rows.values())) if not s.endswith("cost")]
    lines = [
        f"{name}: {measured['requests']:,} requests, {measured['unique']:,} unique blocks",
        "| capacity | " + " | ".join(specs) + " | session - best(lru, arc) | cost / lru |",
        "|---|" + "---|" * (len(specs) + 2),
    ]
    for share, row in rows.items():
        best = max(row["lru"], row["arc"])
        cells = " | ".join(f"{row[s]:.3f}" for s in specs)
        margin = row["session"] - best
        lines.append(
            f"| {float(share):.0%} | {cells} | {margin:+.3f} | {row['session cost']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.5, help="family requests x this (0.5)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--no-families", action="store_true")
    ap.add_argument("--no-claude", action="store_true", help="skip the Claude Code trace")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if not args.scale > 0:
        ap.error("--scale must be positive")
    out: dict[str, Any] = {}
    if args.no_claude:
        pass
    elif CLAUDE.exists():
        out["claude-code"] = measure(
            "claude-code", load_block_trace(CLAUDE), CLAUDE_SHARES, ablation=True
        )
    else:
        print(f"(no Claude Code trace at {CLAUDE})", file=sys.stderr)
    if not args.no_families:
        if CONVERSATION.exists():
            out["conversation"] = measure(
                "conversation", load_mooncake(CONVERSATION), FAMILY_SHARES, False
            )
        for group in (REQUESTS, HELD_OUT):
            for fam, n in group.items():
                for seed in args.seeds:
                    source = FamilySource(fam, max(1, round(n * args.scale)), seed)
                    key = f"{fam} s{seed}" + (" (held out)" if group is HELD_OUT else "")
                    out[key] = measure(key, source.requests(), FAMILY_SHARES, False)
    for name, measured in out.items():
        print()
        print(table(name, measured))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
