"""Retention hints on the Claude Code family (issue 40): what pins buy hinted sessions,
and what they cost everyone.

The trace (``claude_code_sessions.jsonl.gz``: 60 Claude Code sessions, 64-token blocks,
read by :func:`asyncoffload.workloads.load_block_trace`) names no session; sessions share
no block, so a session is a connected component of requests sharing blocks. Each is
replayed through the CPU tier's manager in arrival order, as the engine calls it (look
up, load and touch the hits, touch and store the rest), at 1, 2 and 5% of the trace's
unique blocks, its clock following the trace's timestamps (a fake clock: a replay takes
seconds, the trace hours).

A hinted session's requests carry ``Retention(ttl_s=...)``, the TTL that session's own
median gap between turns. Three runs per capacity and policy, side by side:

- ``none``: no hints (the baseline);
- ``half``: every other session (by first arrival) hinted;
- ``all``: every session with two turns or more hinted.

Per run: the block hit rate (prefix blocks found over blocks asked for) overall, of the
sessions ``half`` hints (``A``) and of the others (``B``), with the pins' counters (pins,
refused by the budget, expired). The same sessions are measured in every run, so ``A``
under ``half`` against ``A`` under ``none`` is what the hint bought them, and ``B`` under
``half`` against ``none`` what it cost the others.

    python benchmarks/retention.py [--trace PATH] [--shares 1%,2%,5%] [--policy lru,auto]
        [--budget 0.5] [--limit N] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncoffload.manager import CPUOffloadingManager, ReqContext
from asyncoffload.manager.retention import MAX_TTL_S, Retention
from asyncoffload.workloads import Request, load_block_trace

DEFAULT_TRACE = (
    Path(
        os.environ.get("ASYNCOFFLOAD_TRACE_DIR")
        or Path(__file__).resolve().parents[2] / "shared" / "traces"
    )
    / "claude_code_sessions.jsonl.gz"
)
MODES = ("none", "half", "all")


def sessions(requests: Sequence[Request]) -> list[int]:
    """Each request's session: connected components of requests sharing a block,
    numbered by first arrival."""
    parent = list(range(len(requests)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[bytes, int] = {}
    for i, req in enumerate(requests):
        for key in req.keys:
            j = owner.setdefault(key, i)
            if j != i:
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    roots: dict[int, int] = {}
    out = []
    for i in range(len(requests)):
        out.append(roots.setdefault(find(i), len(roots)))
    return out


def session_ttls(requests: Sequence[Request], of: Sequence[int]) -> dict[int, float]:
    """Each session's median gap between turns (seconds), for sessions of two turns or
    more, clamped into a hint's range."""
    arrivals: dict[int, list[float]] = {}
    for req, s in zip(requests, of):
        arrivals.setdefault(s, []).append(req.arrival_s)
    ttls = {}
    for s, times in arrivals.items():
        times.sort()
        gaps = [b - a for a, b in itertools.pairwise(times)]
        if gaps:
            ttls[s] = min(max(statistics.median(gaps), 0.001), MAX_TTL_S)
    return ttls


def run(
    requests: Sequence[Request],
    of: Sequence[int],
    hints: dict[int, Retention],
    capacity: int,
    policy: str,
    budget: float,
) -> dict[str, Any]:
    """One replay; hit rates overall and of the even (A) and odd (B) sessions."""
    now = [0.0]
    manager = CPUOffloadingManager(
        capacity, policy, enable_events=False, pin_budget=budget, clock=lambda: now[0]
    )
    asked = [0, 0]
    found = [0, 0]
    start = time.perf_counter()
    for req, s in zip(requests, of):
        now[0] = req.arrival_s
        hint = hints.get(s)
        ctx = ReqContext(req.req_id, retention=hint) if hint is not None else None
        keys = list(req.keys)
        n = manager.lookup_prefix(keys, ctx)
        if n:
            hits = keys[:n]
            manager.prepare_load(hits, ctx)
            manager.touch(hits, ctx)
            manager.complete_load(hits)
        if n < len(keys):
            manager.touch(keys[n:], ctx)
        out = manager.prepare_store(keys[n:], ctx)
        if out is not None and out.keys_to_store:
            manager.complete_store(out.keys_to_store, ctx)
        asked[s % 2] += len(keys)
        found[s % 2] += n
    pins = manager.pins.stats()
    return {
        "hit_rate": sum(found) / max(sum(asked), 1),
        "hit_rate_a": found[0] / max(asked[0], 1),
        "hit_rate_b": found[1] / max(asked[1], 1),
        "pins": pins.pins,
        "refused": pins.refused,
        "expired": pins.expired,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--shares", default="1%,2%,5%")
    parser.add_argument("--policy", default="lru,auto")
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    requests = load_block_trace(args.trace, limit=args.limit)
    of = sessions(requests)
    ttls = session_ttls(requests, of)
    unique = len({key for req in requests for key in req.keys})
    refs = sum(len(req.keys) for req in requests)
    n_sessions = max(of) + 1
    print(
        f"{args.trace.name}: {len(requests)} requests, {n_sessions} sessions "
        f"({len(ttls)} of two turns or more), {refs} block references, {unique} unique; "
        f"median session TTL {statistics.median(ttls.values()):.1f} s; "
        f"pin budget {args.budget:g}; {platform.machine()}, {os.cpu_count()} CPUs"
    )
    hinted = {
        "none": {},
        "half": {s: Retention(t) for s, t in ttls.items() if s % 2 == 0},
        "all": {s: Retention(t) for s, t in ttls.items()},
    }
    rows: list[dict[str, Any]] = []
    header = (
        f"{'policy':7} {'share':>5} {'hints':5} {'overall':>8} {'A':>7} {'B':>7} "
        f"{'pins':>8} {'refused':>8} {'expired':>8} {'s':>6}"
    )
    print(header)
    for policy in args.policy.split(","):
        for share_text in args.shares.split(","):
            share = float(share_text.rstrip("%")) / 100
            capacity = max(1, round(unique * share))
            for mode in MODES:
                r = run(requests, of, hinted[mode], capacity, policy, args.budget)
                r.update(policy=policy, share=share, capacity=capacity, hints=mode)
                rows.append(r)
                print(
                    f"{policy:7} {share:>5.0%} {mode:5} {r['hit_rate']:>8.4f} "
                    f"{r['hit_rate_a']:>7.4f} {r['hit_rate_b']:>7.4f} {r['pins']:>8} "
                    f"{r['refused']:>8} {r['expired']:>8} {r['seconds']:>6.1f}",
                    flush=True,
                )
    if args.json is not None:
        meta = {"trace": args.trace.name, "budget": args.budget, "machine": platform.node()}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
