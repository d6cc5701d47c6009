"""How far admission by request features can go: an in-sample bound.

An online policy decides at a request's arrival whether its new blocks are worth a slot.
The only things a trace tells about a request are its prompt (length, which blocks are
already known, when they were last used) and its output length. This script fits, on the
*whole* trace (so with knowledge of the future no online policy has), the share of new
blocks that are ever reused for every class of those features, then replays the trace
with an admission filter that writes a request's new blocks only when its class's rate is
at least a threshold. The best threshold is an optimistic bound on what admission by
these features can add in front of a policy.

    python benchmarks/admission_bound.py [--trace PATH] [--capacity 5%] [--policies lru,kv]
"""

from __future__ import annotations

import argparse
import math
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from asyncoffload.cli import capacity_shares
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.admission import AdmissionFilter
from asyncoffload.replay import capacity_blocks, replay
from asyncoffload.workloads import Request, load_mooncake, summarize

#: ``$ASYNCOFFLOAD_TRACE_DIR`` (where the Mooncake traces are), else ``../shared/traces``.
DEFAULT_TRACE = (
    Path(
        os.environ.get("ASYNCOFFLOAD_TRACE_DIR")
        or Path(__file__).resolve().parents[2] / "shared" / "traces"
    )
    / "conversation_trace.jsonl"
)
THRESHOLDS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4)

Features = tuple[int, int, int, int]


def _log2(x: float, cap: int) -> int:
    return min(int(math.log2(x + 1)), cap)


def request_classes(requests: Sequence[Request]) -> tuple[list[Features], dict[Features, float]]:
    """Each request's feature class (from what was visible at its arrival) and, per class,
    the share of the new blocks it brought that any later request used again."""
    uses: Counter[OffloadKey] = Counter()
    last_seen: dict[OffloadKey, float] = {}
    classes: list[Features] = []
    brought: list[list[OffloadKey]] = []
    for r in requests:
        known = [k for k in r.keys if k in uses]
        gap = r.arrival_s - max((last_seen[k] for k in known), default=r.arrival_s)
        classes.append(
            (
                _log2(len(r.keys), 8),
                _log2(r.output_tokens, 10),
                _log2(len(known), 7),
                _log2(gap, 10) if known else -1,
            )
        )
        brought.append([k for k in r.keys if k not in uses])
        for k in r.keys:
            uses[k] += 1
            last_seen[k] = r.arrival_s
    new: Counter[Features] = Counter()
    reused: Counter[Features] = Counter()
    for c, keys in zip(classes, brought, strict=True):
        new[c] += len(keys)
        reused[c] += sum(uses[k] > 1 for k in keys)
    return classes, {c: reused[c] / n for c, n in new.items() if n}


class ClassRateAdmission(AdmissionFilter):
    """Writes the blocks of requests whose class rate is at least ``threshold``, when a
    store would evict; the replay sets ``rate`` before each request."""

    name = "class-rate"

    def __init__(self, capacity: int, threshold: float) -> None:
        super().__init__(capacity)
        self.threshold = threshold
        self.rate = 1.0

    def admissible(self, keys: Sequence[OffloadKey], full: bool) -> list[OffloadKey]:
        return list(keys) if not full or self.rate >= self.threshold else []

    def clear(self) -> None:
        self.rate = 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake JSONL trace")
    ap.add_argument("--capacity", nargs="+", default=["5%"])
    ap.add_argument("--policies", default="lru,kv")
    args = ap.parse_args()

    requests = load_mooncake(args.trace)
    unique = summarize(requests).unique_blocks
    classes, rates = request_classes(requests)
    print(f"{Path(args.trace).name}: {len(requests):,} requests, {unique:,} unique blocks")
    print(f"{len(rates)} request classes (prompt length x output length x known blocks x gap)")
    for share in capacity_shares(",".join(args.capacity)):
        capacity = capacity_blocks(share, unique)
        for policy in [p for p in args.policies.split(",") if p]:
            for threshold in THRESHOLDS:
                admission = ClassRateAdmission(capacity, threshold)

                def before(i: int, a: ClassRateAdmission = admission) -> None:
                    a.rate = rates[classes[i]]

                res = replay(
                    requests, capacity, policy=policy, admission=admission, before_request=before
                )
                print(
                    f"{share:6.1%} {policy:4} rate >= {threshold:.2f}: "
                    f"block hit {res.block_hit_rate:.3f}, written {res.stored:,}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
