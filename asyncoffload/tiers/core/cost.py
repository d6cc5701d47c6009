"""Load or recompute, by measured cost: the tier core's rule, once, for every driver.

A lower tier is worth reading only when reading beats recomputing. Each tier keeps a
model of its read time (:class:`ReadModel`: a per-read latency and a bandwidth, fitted
to every read's measured duration and bytes), and the hierarchy keeps one of recompute
time (:class:`RecomputeModel`: prefill tokens per second, configured or measured from
the serving framework's own steps). Then, per request (:class:`CostModel`):

- a promotion from lower tiers is taken only when its expected time (the slowest of its
  tiers' reads, each tier read once) beats recomputing its blocks; otherwise the lookup
  stops before them (misses) and they count ``recomputed_by_choice``;
- a promotion taken is given a deadline of ``deadline_factor`` times the recompute time
  of the blocks its read brings (the settings ``load_deadline_factor`` and
  ``load_deadline_floor_s``; at least ``min_deadline_s``, at most the tier's own
  deadline plus the grace): a read that overruns it fails the promotion (its keys are
  misses, recomputed; nothing fails the request) and counts
  ``recomputed_after_deadline``; promotions that end well count ``loaded``;
- a question to a shared tier (``Exists``, handed out by ``take_io``) gets the same
  deadline for its keys: unanswered by then, it fails as on the tier's own deadline
  (its keys are misses, the tier is not asked again for a while).

Early in a run nothing was measured: a tier with no read measured is expected to read
in ``floor_s`` (an optimistic start: promotions are taken, and measured), and with no
recompute rate known every promotion is taken under the tier's own deadline only. A
tier judged slow is not read again, so it is *probed*: at most once every
``probe_every_s`` a promotion it would refuse is taken, and measured (a tier that
recovered is used again). A read that overruns its deadline replaces the tier's model:
the tier is at least that slow now (one such read is enough to decline the next ones).

:class:`CostedHierarchy` hooks the rule into :class:`TierHierarchy` (its lookup,
``take_io``, ``read_done`` and ``check``) for both drivers; sans-I/O like it: every time
is the driver's ``now``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from asyncoffload.keys import OffloadKey
from asyncoffload.tiers.core.hierarchy import TierHierarchy
from asyncoffload.tiers.core.readtime import ALPHA, ReadModel
from asyncoffload.tiers.core.requests import Exists, Promotion, Request, TierIo, TierState
from asyncoffload.tiers.core.types import CpuIndex, Outcome, TierStats

__all__ = ["CostModel", "CostedHierarchy", "ReadModel", "RecomputeModel"]

#: A tier that refuses promotions takes one at most this often, to measure it again.
PROBE_EVERY_S = 5.0
#: A promotion's deadline: this many times the recompute time of its read's blocks...
DEADLINE_FACTOR = 1.0
#: ...and never less than this (a driver's polling granularity, a tier's jitter).
MIN_DEADLINE_S = 0.05


@dataclass
class RecomputeModel:
    """Prefill throughput: ``tokens_per_s`` configured, or an EMA of the framework's
    steps (:meth:`observe`); ``None``: not known yet. ``tokens_per_block``: the tokens
    one block of the tiers holds."""

    tokens_per_block: int = 0
    tokens_per_s: float | None = None
    configured: bool = False
    alpha: float = ALPHA
    samples: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """The framework computed ``tokens`` in ``seconds`` (ignored when configured)."""
        if self.configured or tokens <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        rate = tokens / seconds
        old = self.tokens_per_s
        self.tokens_per_s = rate if old is None else old + self.alpha * (rate - old)
        self.samples += 1

    def seconds(self, blocks: int) -> float | None:
        """Seconds to recompute ``blocks`` blocks, or None while unknown."""
        rate = self.tokens_per_s
        if rate is None or rate <= 0 or self.tokens_per_block <= 0:
            return None
        return blocks * self.tokens_per_block / rate


@dataclass
class CostModel:
    """The decisions (see the module docstring); ``enabled=False`` takes every promotion
    under the tiers' own deadlines (as before this rule), still measuring."""

    enabled: bool = True
    recompute: RecomputeModel = field(default_factory=RecomputeModel)
    probe_every_s: float = PROBE_EVERY_S
    deadline_factor: float = DEADLINE_FACTOR
    min_deadline_s: float = MIN_DEADLINE_S
    reads: dict[TierState, ReadModel] = field(default_factory=dict)
    #: When each tier was last read (a promotion handed out, or a probe decided).
    read_at: dict[TierState, float] = field(default_factory=dict)

    def read_model(self, tier: TierState) -> ReadModel:
        model = self.reads.get(tier)
        if model is None:
            model = self.reads[tier] = ReadModel()
        return model

    def expected_s(self, by_tier: Mapping[TierState, int]) -> float:
        """Seconds to read ``by_tier`` (blocks per tier): the slowest tier's one read."""
        return max(
            (self.read_model(t).expect(n * t.block_bytes) for t, n in by_tier.items() if n),
            default=0.0,
        )

    def worth(self, by_tier: Mapping[TierState, int], now: float, count: bool = True) -> bool:
        """Whether to promote ``by_tier`` (blocks per tier) rather than recompute them.
        A refusal counts ``recomputed_by_choice`` per tier (``count=False``: not, a
        refusal the caller counted already), unless a tier is due a probe (then the
        promotion is taken)."""
        blocks = sum(by_tier.values())
        if not (self.enabled and blocks):
            return True
        recompute = self.recompute.seconds(blocks)
        if recompute is None or self.expected_s(by_tier) < recompute:
            return True
        slow = [t for t, n in by_tier.items() if n]
        if any(now - self.read_at.get(t, now) >= self.probe_every_s for t in slow):
            for tier in slow:
                self.read_at[tier] = now
            return True
        for tier, n in by_tier.items() if count else ():
            tier.counters.recomputed_by_choice += n
        return False

    def deadline(self, blocks: int, now: float) -> float | None:
        """When a read of ``blocks`` handed out at ``now`` has lost to recomputing them
        (None: no rate known, or the rule is off)."""
        seconds = self.recompute.seconds(blocks) if self.enabled else None
        if seconds is None:
            return None
        return now + max(self.min_deadline_s, self.deadline_factor * seconds)


def run_by_tier(
    core: TierHierarchy,
    keys: Sequence[OffloadKey],
    allow: Callable[[TierState], bool] | None = None,
) -> dict[TierState, int]:
    """Blocks per tier of the run of ``keys`` a promotion would bring up: each key ready
    in the CPU tier is passed over, each absent there counts for the highest tier (of
    those ``allow`` accepts) that has it ready; the run ends at a key in neither."""
    return _walk(core, keys, allow)[0]


def _walk(
    core: TierHierarchy,
    keys: Sequence[OffloadKey],
    allow: Callable[[TierState], bool] | None = None,
) -> tuple[dict[TierState, int], int, int]:
    """:func:`run_by_tier`'s blocks per tier, with the number of keys the run spans and
    the index of its first key absent from the CPU tier (that number if none is)."""
    get = core.cpu.block_of
    out: dict[TierState, int] = {}
    first = -1
    end = len(keys)
    for i, key in enumerate(keys):
        block = get(key)
        if block is not None:
            if block.ref_cnt < 0:
                end = i
                break
            continue
        tier = core.source(key, allow)
        if tier is None:
            end = i
            break
        out[tier] = out.get(tier, 0) + 1
        if first < 0:
            first = i
    return out, end, end if first < 0 else first


class CostedHierarchy(TierHierarchy):
    """:class:`TierHierarchy` with the load-or-recompute rule (``cost``): lookups that
    decline a promotion, reads measured, promotions' deadlines from the recompute
    time, and the decisions counted in each tier's counters."""

    def __init__(self, cpu: CpuIndex, tiers: Sequence[TierState]) -> None:
        super().__init__(cpu, tiers)
        self.cost = CostModel()
        #: Reads handed out and not ended, with when.
        self._submitted: dict[TierIo, float] = {}
        #: Promotions handed out and not finished, with their blocks per tier.
        self._blocks: dict[Promotion, dict[TierState, int]] = {}

    def worth(
        self,
        keys: Sequence[OffloadKey],
        now: float,
        allow: Callable[[TierState], bool] | None = None,
        count: bool = True,
    ) -> bool:
        """Whether the run of ``keys`` (a request's keys from the first one absent from
        the CPU tier, in order) is worth promoting: see :meth:`CostModel.worth`."""
        return self.cost.worth(run_by_tier(self, keys, allow), now, count)

    def lookup(
        self, keys: Sequence[OffloadKey], n: int, *, count: bool = True, now: float | None = None
    ) -> int:
        """:meth:`TierHierarchy.lookup`, with ``now``: the prefix stops at its first key
        from a lower tier when recomputing the run beats reading it."""
        if now is None or not count:
            return super().lookup(keys, n, count=count)
        # One walk: the run's blocks per tier decide; taken, each counts as its tier's
        # lookup hit, as the plain lookup counts them.
        run, end, first = _walk(self, keys[n:])
        if run and not self.cost.worth(run, now):
            return n + first
        for tier, blocks in run.items():
            tier.counters.lookup_hits += blocks
        return n + end

    def ask(self, keys: Sequence[OffloadKey], now: float) -> list[Exists]:
        """:meth:`TierHierarchy.ask` (the engine's ``alookup``), each question due by the
        recompute time of its keys, as those :meth:`take_io` hands out."""
        out = super().ask(keys, now)
        for q in out:
            self._question_due(q, now)
        return out

    def _question_due(self, q: Exists, now: float) -> None:
        """A key asked about waits no longer than a read of it would."""
        at = self.cost.deadline(len(q.keys), now)
        q.deadline = q.deadline if at is None else min(q.deadline, at)

    def take_io(self, now: float, *, batched: bool = True) -> list[Request]:
        out = super().take_io(now, batched=batched)
        due: dict[Promotion, float] = {}
        for req in out:
            if isinstance(req, Exists):
                self._question_due(req, now)
            if not isinstance(req, TierIo) or req.write:
                continue
            self._submitted[req] = now
            at = self.cost.deadline(len(req.keys), now)
            self.cost.read_at[req.tier] = now
            for promotion in req.promotions:
                blocks = self._blocks.setdefault(promotion, {})
                blocks[req.tier] = blocks.get(req.tier, 0) + 1
                if at is not None:
                    due[promotion] = max(due.get(promotion, at), at)
        for promotion, at in due.items():
            if at < promotion.deadline:
                promotion.deadline = at
                heapq.heappush(self._stalls, (at, id(promotion), promotion))
        return out

    def read_done(self, io: TierIo, outcome: Outcome, now: float) -> list[Promotion]:
        fresh = not io.settled
        finished = super().read_done(io, outcome, now)
        if not fresh:
            return finished
        at = self._submitted.pop(io, None)
        if at is not None and outcome.ok:
            self.cost.read_model(io.tier).observe(now - at, len(io.keys) * io.tier.block_bytes)
        for promotion in finished:
            blocks = self._blocks.pop(promotion, {})
            if not promotion.failed:
                for tier, n in blocks.items():
                    tier.counters.loaded += n
        return finished

    def check(self, now: float) -> list[Promotion]:
        stalled = super().check(now)
        for promotion in stalled:
            for tier, n in self._blocks.get(promotion, {}).items():
                tier.counters.recomputed_after_deadline += n
        if stalled:  # a read still running: at least this slow
            for io, at in self._submitted.items():
                if any(p.stalled for p in io.promotions):
                    self.cost.read_model(io.tier).observe(
                        now - at, len(io.keys) * io.tier.block_bytes, alone=True
                    )
        return stalled

    def stats(
        self, info: Callable[[TierState], dict[str, object]] | None = None
    ) -> tuple[TierStats, ...]:
        """:meth:`TierHierarchy.stats`, with each tier's read model as measured."""
        out = []
        for stats, tier in zip(super().stats(info), self.tiers):
            model = self.cost.reads.get(tier)
            if model is not None and model.samples:
                stats = dataclasses.replace(
                    stats, read_latency_s=model.latency_s, read_bytes_per_s=model.bytes_per_s
                )
            out.append(stats)
        return tuple(out)
