"""Hit rates of the cache policies on the trace families (issue 15), against the best of
LRU and ARC.

Every trace family of :func:`asyncoffload.workloads.families` (``chat``, ``agent``,
``rag``, ``scan``, ``diurnal``; two seeds each) and the Mooncake conversation trace (when
it is at ``$ASYNCOFFLOAD_TRACE_DIR`` or ``../shared/traces``) are replayed through the CPU
tier's manager (:func:`asyncoffload.replay.replay_matrix`) for policies lru, arc, kv and
s3fifo (``--policy`` adds more: a future ``auto``) at 1, 2, 5, 10, 20 and 50% of each
workload's unique blocks. It prints, per workload and capacity, the block hit rate of
every policy and the best of LRU and ARC, then each other policy's margin over that best
(issue 15's bar: never below it by more than 0.005).

The workloads are split in two, reported in separate tables:

- **tuning**: ``chat``, ``rag``, ``scan``, ``mixed`` and the conversation trace: choose a
  policy's parameters on these (``--set tuning`` runs only them);
- **held-out**: ``agent`` and ``diurnal`` (``--holdout`` changes the split): look at them
  only to report how the choice carries over to shapes it was not tuned on.

Hit rates are counts (machine-independent); sizes are chosen for a few minutes on two
cores (``--scale`` multiplies them, ``--jobs`` replays workloads in parallel).

    python benchmarks/policy_families.py [--policy auto] [--set all|tuning|held-out]
        [--holdout agent diurnal] [--seeds 0 1] [--scale 1.0] [--jobs 2]
        [--trace PATH | --no-trace] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncoffload.cli import capacity_shares
from asyncoffload.replay import (
    FamilySource,
    ReplayResult,
    infinite_tier_hit_rate,
    parse_spec,
    replay_matrix,
)
from asyncoffload.workloads import Request, families, load_mooncake, summarize

#: ``$ASYNCOFFLOAD_TRACE_DIR`` (where the Mooncake traces are), else ``../shared/traces``.
DEFAULT_TRACE = (
    Path(
        os.environ.get("ASYNCOFFLOAD_TRACE_DIR")
        or Path(__file__).resolve().parents[2] / "shared" / "traces"
    )
    / "conversation_trace.jsonl"
)
CONVERSATION = "conversation"
BASELINES = ("lru", "arc")
DEFAULT_POLICIES = ("lru", "arc", "kv", "s3fifo")
DEFAULT_SHARES = "1%,2%,5%,10%,20%,50%"
#: Families held out of tuning by default.
HOLDOUT = ("agent", "diurnal")
#: Requests per family workload at ``--scale 1``: each about 150-300k prompt blocks, so
#: that every workload replays in about the same time.
REQUESTS = {
    "chat": 10_000,
    "agent": 8_000,
    "rag": 30_000,
    "scan": 12_000,
    "diurnal": 25_000,
    "mixed": 20_000,
}
#: A margin below the best of LRU and ARC that counts as a loss (issue 15).
TOLERANCE = 0.005


@dataclass(frozen=True)
class Workload:
    """One workload to replay: a family at a seed, or the conversation trace."""

    name: str
    #: ``"tuning"`` or ``"held-out"``.
    group: str
    #: The family source (``None``: the trace at ``trace``).
    source: FamilySource | None = None
    trace: str | None = None

    def requests(self) -> list[Request]:
        if self.source is not None:
            return self.source.requests()
        assert self.trace is not None
        return load_mooncake(self.trace)


@dataclass(frozen=True)
class Measured:
    """What one workload's replays gave."""

    workload: Workload
    requests: int
    blocks: int
    unique_blocks: int
    infinite_hit_rate: float
    results: list[ReplayResult]
    seconds: float

    def rate(self, policy: str, share: float) -> float:
        for r in self.results:
            if r.label == policy and r.capacity_share == share:
                return r.block_hit_rate
        raise KeyError((policy, share))


def measure(workload: Workload, shares: Sequence[float], specs: Sequence[str]) -> Measured:
    """Replay ``workload`` for every spec at every share (one process's work)."""
    t0 = time.perf_counter()
    requests = workload.requests()
    summary = summarize(requests)
    results = replay_matrix(requests, shares, specs)
    return Measured(
        workload,
        summary.requests,
        summary.total_blocks,
        summary.unique_blocks,
        infinite_tier_hit_rate(requests),
        results,
        time.perf_counter() - t0,
    )


def plan(args: argparse.Namespace) -> list[Workload]:
    """The workloads the options ask for, tuning ones first."""
    holdout = set(args.holdout)
    workloads: list[Workload] = []
    if not args.no_trace:
        trace = Path(args.trace) if args.trace else DEFAULT_TRACE
        if trace.exists():
            workloads.append(Workload(CONVERSATION, "tuning", trace=str(trace)))
        elif args.trace:
            sys.exit(f"no trace at {trace}")
        else:
            print(f"(no conversation trace at {trace}: families only)", file=sys.stderr)
    for name in families():
        n = max(1, round(REQUESTS[name] * args.scale))
        for seed in args.seeds:
            group = "held-out" if name in holdout else "tuning"
            workloads.append(Workload(f"{name} s{seed}", group, FamilySource(name, n, seed)))
    workloads.sort(key=lambda w: w.group != "tuning")
    if args.set != "all":
        workloads = [w for w in workloads if w.group == args.set]
    return workloads


def _pct(share: float) -> str:
    pct = share * 100
    return f"{pct:.0f}%" if abs(pct - round(pct)) < 0.05 else f"{pct:.1f}%"


def hit_table(measured: Sequence[Measured], shares: Sequence[float], specs: Sequence[str]) -> str:
    """Markdown: a row per workload x capacity, block hit rates per policy, the best of
    LRU and ARC last (a policy below it by more than :data:`TOLERANCE` in italics)."""
    head = ["workload", "capacity", *specs, "best of lru/arc"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in measured:
        for share in shares:
            best = max(m.rate(p, share) for p in BASELINES)
            cells = [m.workload.name, _pct(share)]
            for spec in specs:
                rate = m.rate(spec, share)
                cells.append(f"_{rate:.3f}_" if rate < best - TOLERANCE else f"{rate:.3f}")
            cells.append(f"{best:.3f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def margins(measured: Sequence[Measured], shares: Sequence[float], specs: Sequence[str]) -> str:
    """Per policy beyond the baselines: its margin over the best of LRU and ARC."""
    lines = []
    for spec in specs:
        if spec in BASELINES:
            continue
        diffs = [
            (m.rate(spec, s) - max(m.rate(p, s) for p in BASELINES), m.workload.name, s)
            for m in measured
            for s in shares
        ]
        worst, where, at = min(diffs)
        losses = sum(d < -TOLERANCE for d, _, _ in diffs)
        mean = sum(d for d, _, _ in diffs) / len(diffs)
        lines.append(
            f"- {spec} - best of lru/arc: worst {worst:+.3f} ({where}, {_pct(at)}), mean "
            f"{mean:+.3f}, below by more than {TOLERANCE}: {losses} of {len(diffs)} rows"
        )
    return "\n".join(lines)


def workload_table(measured: Sequence[Measured]) -> str:
    head = "| workload | set | source | requests | blocks | unique | infinite tier |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for m in measured:
        w = m.workload
        source = str(w.source) if w.source is not None else Path(w.trace or "").name
        lines.append(
            f"| {w.name} | {w.group} | `{source}` | {m.requests:,} | {m.blocks:,} | "
            f"{m.unique_blocks:,} | {m.infinite_hit_rate:.3f} |"
        )
    return "\n".join(lines)


def as_json(measured: Sequence[Measured], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "holdout": list(args.holdout),
        "tolerance": TOLERANCE,
        "workloads": [
            {
                "name": m.workload.name,
                "set": m.workload.group,
                "source": str(m.workload.source) if m.workload.source else m.workload.trace,
                "requests": m.requests,
                "blocks": m.blocks,
                "unique_blocks": m.unique_blocks,
                "infinite_hit_rate": m.infinite_hit_rate,
                "seconds": m.seconds,
                "results": [
                    {
                        "policy": r.label,
                        "capacity_share": r.capacity_share,
                        "capacity": r.capacity,
                        "block_hit_rate": r.block_hit_rate,
                        "token_hit_rate": r.token_hit_rate,
                        "stored": r.stored,
                        "evicted": r.evicted,
                        "us_per_block": r.us_per_block,
                    }
                    for r in m.results
                ],
            }
            for m in measured
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--policy",
        nargs="+",
        action="extend",
        default=[],
        metavar="SPEC",
        help=f"policies beside {', '.join(DEFAULT_POLICIES)} (e.g. auto, lru+ghost)",
    )
    ap.add_argument(
        "--capacity", default=DEFAULT_SHARES, help=f"shares ({DEFAULT_SHARES.replace('%', '%%')})"
    )
    ap.add_argument(
        "--set",
        choices=("all", "tuning", "held-out"),
        default="all",
        help="which workloads to replay (all)",
    )
    ap.add_argument(
        "--holdout",
        nargs="*",
        default=list(HOLDOUT),
        choices=list(families()),
        metavar="FAMILY",
        help=f"families held out of tuning ({' '.join(HOLDOUT)}); the rest and the "
        "conversation trace are the tuning set",
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="seeds (0 1)")
    ap.add_argument("--scale", type=float, default=1.0, help="requests x this (1.0)")
    ap.add_argument("--jobs", type=int, default=1, help="workloads replayed at once (1)")
    ap.add_argument("--trace", help="the conversation trace (default: found, else none)")
    ap.add_argument("--no-trace", action="store_true", help="families only")
    ap.add_argument("--json", metavar="PATH", help="write every result as JSON")
    args = ap.parse_args()

    specs = list(dict.fromkeys([*DEFAULT_POLICIES, *args.policy]))
    try:
        for spec in specs:
            parse_spec(spec)
        shares = sorted(set(capacity_shares(args.capacity)))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        ap.error(str(exc))
    if not args.scale > 0:
        ap.error("--scale must be positive")
    workloads = plan(args)
    t0 = time.perf_counter()
    measured: list[Measured] = []
    if args.jobs <= 1:
        for w in workloads:
            measured.append(measure(w, shares, specs))
            print(f"{w.name}: {measured[-1].seconds:.0f} s", file=sys.stderr)
    else:
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(measure, w, shares, specs) for w in workloads]
            for future in futures:
                measured.append(future.result())
                print(
                    f"{measured[-1].workload.name}: {measured[-1].seconds:.0f} s", file=sys.stderr
                )

    print(f"Policies {', '.join(specs)}; block hit rates at {args.capacity} of each ")
    print(f"workload's unique blocks; italics: below the best of lru/arc by > {TOLERANCE}.\n")
    print(workload_table(measured))
    for group in ("tuning", "held-out"):
        mine = [m for m in measured if m.workload.group == group]
        if not mine:
            continue
        names = sorted({m.workload.name.split(" ")[0] for m in mine})
        print(f"\n### {group}: {', '.join(names)}\n")
        print(hit_table(mine, shares, specs))
        print()
        print(margins(mine, shares, specs))
    print(f"\n({time.perf_counter() - t0:.0f} s, {args.jobs} job(s))")
    if args.json:
        Path(args.json).write_text(json.dumps(as_json(measured, args), indent=1))


if __name__ == "__main__":
    main()
