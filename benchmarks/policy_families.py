"""Hit rates of the cache policies on the trace families (issue 15), against the best of
LRU and ARC.

Every trace family of :func:`asyncoffload.workloads.families` (``chat``, ``agent``,
``rag``, ``scan``, ``diurnal``, ``mixed``; two seeds each), the Mooncake conversation
trace and the Claude Code sessions of kv-cache-tester (issue 40; when they are at
``$ASYNCOFFLOAD_TRACE_DIR`` or ``../shared/traces``, read from there) are replayed through
the CPU tier's manager (:func:`asyncoffload.replay.replay_matrix`) for policies lru, arc,
kv and s3fifo (``--policy`` adds more: ``auto``) at 1, 2, 5, 10, 20 and 50% of each
workload's unique blocks (the Claude Code sessions, whose working set is small next to
their traffic: 1, 2, 5, 10 and 20%). It prints, per workload and capacity, the block hit
rate of every policy and the best of LRU and ARC, then each other policy's margin over
that best (issue 15's bar: never below it by more than 0.005), and for ``auto`` its
switches.

``--short`` replays short workloads instead (2,000-4,000 requests of every family at
each seed, the first 300 and 1,000 requests of the Claude Code sessions): ``auto``
against the best of LRU and ARC, and its switches. ``--timeline`` prints the switch
timeline of ``auto`` on a trace built to change regime (:func:`regime_change`) and on a
stationary one (:func:`stationary`).

The workloads are split in two, reported in separate tables:

- **tuning**: ``chat``, ``rag``, ``scan``, ``mixed`` and the conversation trace: choose a
  policy's parameters on these (``--set tuning`` runs only them);
- **held-out**: ``agent`` and ``diurnal`` (``--holdout`` changes the split): look at them
  only to report how the choice carries over to shapes it was not tuned on.

Hit rates are counts (machine-independent); sizes are chosen for a few minutes on two
cores (``--scale`` multiplies them, ``--jobs`` replays workloads in parallel).

    python benchmarks/policy_families.py [--policy auto] [--set all|tuning|held-out]
        [--holdout agent diurnal] [--seeds 0 1] [--scale 1.0] [--jobs 2]
        [--trace PATH] [--claude-trace PATH] [--claude-limit N] [--no-trace]
        [--json PATH] [--short | --timeline]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncoffload.cli import capacity_shares
from asyncoffload.keys import OffloadKey, make_offload_key
from asyncoffload.manager import CPUOffloadingManager
from asyncoffload.manager.policies import AdaptivePolicy
from asyncoffload.manager.policies.adaptive import CANDIDATES, Ghost
from asyncoffload.replay import (
    FamilySource,
    ReplayResult,
    capacity_blocks,
    infinite_tier_hit_rate,
    parse_spec,
    replay,
    replay_matrix,
)
from asyncoffload.replay.manager import serve_request
from asyncoffload.workloads import Request, families, load_block_trace, load_mooncake, summarize

#: ``$ASYNCOFFLOAD_TRACE_DIR`` (where the Mooncake traces are), else ``../shared/traces``.
TRACE_DIR = Path(
    os.environ.get("ASYNCOFFLOAD_TRACE_DIR")
    or Path(__file__).resolve().parents[2] / "shared" / "traces"
)
DEFAULT_TRACE = TRACE_DIR / "conversation_trace.jsonl"
#: The Claude Code sessions of kv-cache-tester (../shared/traces/PROVENANCE.md): read
#: where they are, never copied.
DEFAULT_CLAUDE_TRACE = TRACE_DIR / "claude_code_sessions.jsonl.gz"
CONVERSATION = "conversation"
CLAUDE = "claude-code"
BASELINES = ("lru", "arc")
DEFAULT_POLICIES = ("lru", "arc", "kv", "s3fifo")
DEFAULT_SHARES = "1%,2%,5%,10%,20%,50%"
#: The Claude Code sessions' own capacity points: 96% of their block references repeat,
#: so 20% of their unique blocks already holds nearly every session.
CLAUDE_SHARES = (0.01, 0.02, 0.05, 0.10, 0.20)
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
    """One workload to replay: a family at a seed, or a trace file."""

    name: str
    #: ``"tuning"`` or ``"held-out"``.
    group: str
    #: The family source (``None``: the trace at ``trace``).
    source: FamilySource | None = None
    trace: str | None = None
    #: The trace holds block ids only (:func:`load_block_trace`), not Mooncake records.
    blocks_only: bool = False
    #: The first requests of the trace only.
    limit: int | None = None
    #: Its own capacity shares (``None``: the run's).
    shares: tuple[float, ...] | None = None

    def requests(self) -> list[Request]:
        if self.source is not None:
            return self.source.requests()
        assert self.trace is not None
        if self.blocks_only:
            return load_block_trace(self.trace, limit=self.limit)
        return load_mooncake(self.trace, limit=self.limit)


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
    shares: tuple[float, ...]

    def result(self, policy: str, share: float) -> ReplayResult:
        for r in self.results:
            if r.label == policy and r.capacity_share == share:
                return r
        raise KeyError((policy, share))

    def rate(self, policy: str, share: float) -> float:
        return self.result(policy, share).block_hit_rate


def measure(workload: Workload, shares: Sequence[float], specs: Sequence[str]) -> Measured:
    """Replay ``workload`` for every spec at every share (its own shares if it has
    them; one process's work). ``auto`` runs on a policy of its own, so that its
    switches can be counted (``extra["switches"]``)."""
    t0 = time.perf_counter()
    shares = list(workload.shares or shares)
    requests = workload.requests()
    summary = summarize(requests)
    results = replay_matrix(requests, shares, [spec for spec in specs if spec != "auto"])
    if "auto" in specs:
        for share in shares:
            cap = capacity_blocks(share, summary.unique_blocks)
            policy = AdaptivePolicy(cap)
            res = replay(
                requests, cap, policy=policy, unique_blocks=summary.unique_blocks, share=share
            )
            res.extra["switches"] = float(policy.switches)
            results.append(res)
    return Measured(
        workload,
        summary.requests,
        summary.total_blocks,
        summary.unique_blocks,
        infinite_tier_hit_rate(requests),
        results,
        time.perf_counter() - t0,
        tuple(shares),
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
            print(f"(no conversation trace at {trace})", file=sys.stderr)
        claude = Path(args.claude_trace) if args.claude_trace else DEFAULT_CLAUDE_TRACE
        if claude.exists():
            name = CLAUDE if args.claude_limit is None else f"{CLAUDE} {args.claude_limit}"
            workloads.append(
                Workload(
                    name,
                    "tuning",
                    trace=str(claude),
                    blocks_only=True,
                    limit=args.claude_limit,
                    shares=CLAUDE_SHARES,
                )
            )
        elif args.claude_trace:
            sys.exit(f"no trace at {claude}")
        else:
            print(f"(no Claude Code sessions at {claude})", file=sys.stderr)
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


def hit_table(measured: Sequence[Measured], specs: Sequence[str]) -> str:
    """Markdown: a row per workload x capacity, block hit rates per policy, the best of
    LRU and ARC last (a policy below it by more than :data:`TOLERANCE` in italics;
    ``auto``'s switches after a slash)."""
    head = ["workload", "capacity", *specs, "best of lru/arc"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in measured:
        for share in m.shares:
            best = max(m.rate(p, share) for p in BASELINES)
            cells = [m.workload.name, _pct(share)]
            for spec in specs:
                res = m.result(spec, share)
                rate = res.block_hit_rate
                cell = f"_{rate:.3f}_" if rate < best - TOLERANCE else f"{rate:.3f}"
                if "switches" in res.extra:
                    cell += f" / {res.extra['switches']:.0f}"
                cells.append(cell)
            cells.append(f"{best:.3f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def margins(measured: Sequence[Measured], specs: Sequence[str]) -> str:
    """Per policy beyond the baselines: its margin over the best of LRU and ARC."""
    lines = []
    for spec in specs:
        if spec in BASELINES:
            continue
        diffs = [
            (m.rate(spec, s) - max(m.rate(p, s) for p in BASELINES), m.workload.name, s)
            for m in measured
            for s in m.shares
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
                        **r.extra,
                    }
                    for r in m.results
                ],
            }
            for m in measured
        ],
    }


#: ``--short``: every family's first 4,000 requests (``agent``'s 3,000: about 75k prompt
#: blocks, as the others) and ``mixed``'s 2,000 too, at each seed; and the first requests
#: of the Claude Code sessions.
SHORT = {"agent": (3000,), "mixed": (4000, 2000)}
SHORT_REQUESTS = (4000,)
SHORT_CLAUDE = (300, 1000)


def plan_short(args: argparse.Namespace) -> list[Workload]:
    """The ``--short`` workloads, tuning ones first."""
    holdout = set(args.holdout)
    workloads = [
        Workload(
            f"{name} {n:,} s{seed}",
            "held-out" if name in holdout else "tuning",
            FamilySource(name, n, seed),
        )
        for name in families()
        for n in SHORT.get(name, SHORT_REQUESTS)
        for seed in args.seeds
    ]
    claude = Path(args.claude_trace) if args.claude_trace else DEFAULT_CLAUDE_TRACE
    if not args.no_trace and claude.exists():
        workloads += [
            Workload(
                f"{CLAUDE} {n:,}",
                "tuning",
                trace=str(claude),
                blocks_only=True,
                limit=n,
                shares=CLAUDE_SHARES,
            )
            for n in SHORT_CLAUDE
        ]
    workloads.sort(key=lambda w: w.group != "tuning")
    return workloads


def short_table(measured: Sequence[Measured], shares: Sequence[float]) -> str:
    """Markdown: per short workload and share, ``auto`` less the best of LRU and ARC
    (in bold when below by more than :data:`TOLERANCE`) and its switches."""
    head = ["workload", *(_pct(s) for s in shares)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in measured:
        cells = [m.workload.name]
        for share in shares:
            if share not in m.shares:
                cells.append("-")
                continue
            res = m.result("auto", share)
            d = res.block_hit_rate - max(m.rate(p, share) for p in BASELINES)
            text = f"{d:+.3f}/{res.extra['switches']:.0f}"
            cells.append(f"**{text}**" if d < -TOLERANCE else text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- switch timelines ---------------------------------------------------------------

#: The timelines' traces: a hot set of short prompts read 70% of the time (Zipf 0.8 over
#: 300 prompts of 2-8 blocks), and documents of 10-20 new blocks the rest of the time.
HOT_PROMPTS, HOT_ZIPF, DOCUMENTS = 300, 0.8, 0.3


def _traffic(
    n: int,
    rng: random.Random,
    fresh: Callable[[int], list[OffloadKey]],
    *,
    reread: bool,
    hot: list[list[OffloadKey]],
    weights: list[float],
    into: list[list[OffloadKey]],
) -> None:
    """``n`` prompts into ``into``: hot prompts, and documents read once (``reread``
    False: one-off scans that flush an LRU tier, which kv and ARC keep out of the hot
    set) or twice, the second read 1-8 requests after the first (which LRU and ARC keep
    and a kv that learned that documents never come back does not)."""
    again: dict[int, list[OffloadKey]] = {}
    start = len(into)
    for i in range(start, start + n):
        if i in again:
            into.append(again.pop(i))
        elif rng.random() < DOCUMENTS:
            doc = fresh(rng.randint(10, 20))
            into.append(doc)
            if reread:
                j = i + rng.randint(1, 8)
                while j in again:
                    j += 1
                again[j] = doc
        else:
            into.append(rng.choices(hot, cum_weights=weights)[0])


def _trace(phases: Sequence[tuple[int, bool]], seed: int) -> list[Request]:
    rng = random.Random(seed)
    namespace = rng.randbytes(8)
    counter = itertools.count()

    def fresh(n: int) -> list[OffloadKey]:
        return [
            make_offload_key(namespace + i.to_bytes(8, "big")) for i in itertools.islice(counter, n)
        ]

    hot = [fresh(rng.randint(2, 8)) for _ in range(HOT_PROMPTS)]
    weights = list(itertools.accumulate(1 / (r + 1) ** HOT_ZIPF for r in range(HOT_PROMPTS)))
    prompts: list[list[OffloadKey]] = []
    for n, reread in phases:
        _traffic(n, rng, fresh, reread=reread, hot=hot, weights=weights, into=prompts)
    return [
        Request(str(i), float(i), tuple(keys), 16 * len(keys), 1, block_size=16)
        for i, keys in enumerate(prompts)
    ]


def regime_change(before: int = 2500, after: int = 2500, seed: int = 0) -> list[Request]:
    """A trace built to change its leader: ``before`` requests of a hot set and one-off
    documents (kv leads, then ARC, LRU last), then ``after`` requests of the same hot
    set with documents read twice (LRU and ARC lead, kv far behind, for the 6-7
    capacities kv takes to learn that documents come back; then kv leads again)."""
    return _trace([(before, False), (after, True)], seed)


def stationary(n: int = 5000, seed: int = 0) -> list[Request]:
    """The second half of :func:`regime_change` throughout: kv, which learns from the
    start that documents come back, ahead by 0.02-0.05; ARC and LRU behind it, ahead of
    each other in turn."""
    return _trace([(n, True)], seed)


def timelines() -> list[tuple[str, float, list[Request]]]:
    """``--timeline``'s traces: titles (where the change is), capacity shares, requests."""
    changed = regime_change()
    unique = summarize(changed).unique_blocks
    before = sum(len(r.keys) for r in changed[:2500])
    out: list[tuple[str, float, list[Request]]] = []
    for share in (0.02, 0.05):
        at = before / capacity_blocks(share, unique)
        title = f"regime change (2,500 + 2,500 requests) at {share:.0%}: the change at {at:.2f}"
        out.append((title, share, changed))
    out += [(f"stationary (5,000 requests) at {s:.0%}", s, stationary()) for s in (0.02, 0.05)]
    return out


def switch_timeline(requests: Sequence[Request], share: float, width: float = 1.0) -> str:
    """Markdown: ``auto`` on ``requests`` at ``share``, a row per ``width`` capacities of
    traffic: each candidate's hit rate at full size over the row (a tier of its own),
    the real tier's under ``auto``, the leader at the row's end and the switches made
    in it (at how many capacities of traffic)."""
    cap = capacity_blocks(share, summarize(requests).unique_blocks)
    names = list(CANDIDATES)
    ghosts = [Ghost(name, cap) for name in names]
    policy = AdaptivePolicy(cap)
    m = CPUOffloadingManager(cap, policy=policy, enable_events=False)
    head = ["capacities of traffic", *names, "auto", "leader", "switches"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    window = [0] * (len(names) + 2)  # blocks, the candidates' hits, auto's
    seen = start = 0
    told = 0

    def row() -> None:
        nonlocal told, start
        blocks = window[0]
        rates = [f"{h / blocks:.3f}" for h in window[1:]]
        new = list(policy.timeline)[told:] if policy.switches > told else []
        told = policy.switches
        moves = ", ".join(f"{a} -> {b} at {t / cap:.2f}" for t, a, b in new)
        lines.append(
            f"| {start / cap:.1f}-{seen / cap:.1f} | "
            + " | ".join(rates)
            + f" | {policy.leader} | {moves} |"
        )
        window[:] = [0] * len(window)
        start = seen

    whole = [0] * len(window)
    for req in requests:
        keys = req.keys
        for i, ghost in enumerate(ghosts):
            window[1 + i] += ghost.request(keys)
        window[-1] += serve_request(m, keys)
        window[0] += len(keys)
        seen += len(keys)
        if window[0] >= width * cap:
            whole = [a + b for a, b in zip(whole, window, strict=True)]
            row()
    if window[0]:
        whole = [a + b for a, b in zip(whole, window, strict=True)]
        row()
    rates = ", ".join(
        f"{name} {h / whole[0]:.4f}" for name, h in zip([*names, "auto"], whole[1:], strict=True)
    )
    lines.append(
        f"\nWhole trace ({seen / cap:.1f} capacities): {rates}; {policy.switches} switches."
    )
    return "\n".join(lines)


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
    ap.add_argument("--claude-trace", help="the Claude Code sessions (default: found, else none)")
    ap.add_argument(
        "--claude-limit",
        type=int,
        metavar="N",
        help="the first N requests of the Claude Code sessions only",
    )
    ap.add_argument("--no-trace", action="store_true", help="families only")
    ap.add_argument("--json", metavar="PATH", help="write every result as JSON")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--short", action="store_true", help="auto on short workloads against lru/arc"
    )
    mode.add_argument(
        "--timeline",
        action="store_true",
        help="auto's switch timeline on a trace built to change regime, and on a stationary one",
    )
    args = ap.parse_args()
    if args.claude_limit is not None and args.claude_limit < 1:
        ap.error("--claude-limit must be positive")
    if args.timeline:
        for title, share, requests in timelines():
            print(f"\n### {title}\n")
            print(switch_timeline(requests, share))
        return
    if args.short:
        args.policy = ["auto", *args.policy]

    specs = list(dict.fromkeys([*DEFAULT_POLICIES, *args.policy]))
    try:
        for spec in specs:
            parse_spec(spec)
        shares = sorted(set(capacity_shares(args.capacity)))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        ap.error(str(exc))
    if not args.scale > 0:
        ap.error("--scale must be positive")
    workloads = plan_short(args) if args.short else plan(args)
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

    if args.json:
        Path(args.json).write_text(json.dumps(as_json(measured, args), indent=1))
    if args.short:
        print("auto - best of lru/arc / auto's switches, block hit rates\n")
        print(short_table(measured, shares))
        print(f"\n({time.perf_counter() - t0:.0f} s, {args.jobs} job(s))")
        return
    print(f"Policies {', '.join(specs)}; block hit rates at {args.capacity} of each ")
    print(f"workload's unique blocks; italics: below the best of lru/arc by > {TOLERANCE}.\n")
    print(workload_table(measured))
    for group in ("tuning", "held-out"):
        mine = [m for m in measured if m.workload.group == group]
        if not mine:
            continue
        names = sorted({m.workload.name.split(" ")[0] for m in mine})
        print(f"\n### {group}: {', '.join(names)}\n")
        print(hit_table(mine, specs))
        print()
        print(margins(mine, specs))
    print(f"\n({time.perf_counter() - t0:.0f} s, {args.jobs} job(s))")


if __name__ == "__main__":
    main()
