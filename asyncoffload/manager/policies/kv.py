"""KV-aware eviction and admission: keep the blocks most likely to be read again.

A block is worth its slot only if a later request reads it again, and in LLM serving that
chance is very uneven. On the Mooncake conversation trace three quarters of all blocks
are never read again; a prefix read once is read again far more often (0.26 -> 0.42 ->
0.50 -> 0.78 for its 1st, 2nd, 3rd, 4th+ use); long prompts are reused less per block
than short ones; and the last block of a prompt is almost never reused (it is partial,
and the next turn of the conversation rewrites it). Generic policies guess from recency
(LRU) or apply fixed frequency rules (ARC, S3-FIFO, SIEVE). This policy *measures* the
chance of reuse online and evicts the block least likely to be read again.

Classes. A block's class is what the policy can see when a request touches it:

- how many requests have touched it (1, 2, 3, 4 or more): every turn of a conversation
  touches all of its earlier blocks, so this counts the turns a prefix has served;
- the length of that request, in three buckets (< 16, < 64, >= 64 blocks);
- for a block touched once, whether it was the last block of its request.

Within a class blocks are kept least recently touched first, one ordered dict per class.

Learning. Time counts :meth:`touch` calls (one per request in the serving sequence); a
block's age counts from its last use, the last touch of its key or its store. Per class
the policy counts the blocks that entered it and, when a block is touched again, the
age at which that happened (power-of-two age bins). From those counts it estimates
``P(reuse | class, survived to age a)``: the share of the class's blocks still unused at
age ``a`` that were used again later. Evicted blocks are remembered for a while (a ghost
list of ``ghost_factor`` times the capacity), so reuses that come too late to hit still
teach it. One block in four (by a byte of its hash) feeds the counts, which decay with
a half-life of ``half_life`` capacities of inserted blocks, so the estimate follows the
workload; the table is rebuilt every eighth of a capacity of inserts. A block not
reused yet has not had the time to be reused at the ages it has not reached: early in a
run nearly every block is that young, and counting them as unused at every age
understates old blocks' value. So each rebuild takes them out of the counts for the ages
they have not reached (right-censoring), weighted as the decay weighted their entry:
fully at first, fading to nothing over the first ``FADE`` (12) capacities of traffic
(kept on, it cost ``chat`` 0.011-0.016 at 5%: later, the estimate's lean towards recent
blocks is worth having; docs/policies.md). The table is made
non-increasing in age and non-decreasing in uses, and a last block is never worth more
than a block of the same request that is not last: a parent block is touched whenever
its children are, so it keeps at least their value. Nothing in it is fitted to one
trace: the classes are what any scheduler sees, and the values are learned from the
workload at hand.

Eviction takes, among the evictable blocks, the one with the lowest value now. Ties go
to last blocks first, then to fewer uses (lower class), then to the least recently used
block; so a prefix is cut from its end even when its blocks are worth the same. Every
class queue is in order of last use, and value only falls with age, so only the first
evictable block of each class is a candidate. Blocks a store inserts together go in
deepest first, so a just-stored prefix is cut from its end and what remains still hits.

Admission. When a store would evict, a block that at most one request has used is
declined if its class is worth less, even at age 0, than the last evicted block was
when it went: it would be among the next victims anyway, and declining it saves the
copy.

A C core (``asyncoffload/_native/kvcore.c``, compiled on first use) runs the same
algorithm with the same state, decision for decision (tests/test_kv_native.py); this
module's Python code is the reference and the fallback where it cannot be built.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from itertools import pairwise
from typing import Any

from asyncoffload._native import load_kvcore
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies.base import CachePolicy, register_policy

__all__ = ["KVPolicy", "adoption", "class_of", "fade_state", "size_bucket"]

#: Use-count buckets: 1, 2, 3, 4+.
USE_BUCKETS = 4
#: Request-length buckets: < 16, < 64, >= 64 blocks.
SIZE_BUCKETS = 3
#: First-time blocks that were the last block of their request have a class of their
#: own per size bucket, after the use x size classes.
TAIL = USE_BUCKETS * SIZE_BUCKETS
NUM_CLASSES = TAIL + SIZE_BUCKETS
#: Eviction breaks value ties by rank: last blocks first, then by uses (fewer first), so
#: a prefix is cut from its end even when its blocks are worth the same.
RANK = [SIZE_BUCKETS + c for c in range(TAIL)] + list(range(SIZE_BUCKETS))
CLASS_AT_RANK = [RANK.index(r) for r in range(NUM_CLASSES)]
#: Age bins: 0, 1, 2-3, 4-7, ... touches (``age.bit_length()``; 64 bins cover any age).
AGE_BINS = 64
#: Learn from the blocks whose hash byte ``key[-5]`` has these bits clear (one in four):
#: the estimates need far fewer samples than a tier has blocks.
_SAMPLE_MASK = 3
#: The first FADE capacities of traffic (blocks touched, since the start or ``clear``)
#: correct the estimate for blocks too young to have been reused yet (right-censored),
#: fully at first, fading to nothing by then. See the module's "Learning".
FADE = 12.0
#: Rebuild ticks remembered for the correction's weights: more than a fade has rebuilds
#: (a rebuild every eighth of a capacity of inserts or more, and inserts <= traffic).
FADE_TICKS = 160
#: The censored counts are summed as integers of this scale (exact, in any order).
CENSOR_SCALE = 16777216.0

# What the policy knows of a block, resident or remembered: [uses, last use, class].
_Meta = list[int]


def size_bucket(num_blocks: int) -> int:
    """The length bucket of a request of ``num_blocks`` blocks."""
    return 0 if num_blocks < 16 else (1 if num_blocks < 64 else 2)


def class_of(uses: int, size: int, last: bool = False) -> int:
    """The class of a block touched ``uses`` times, last by a request of length bucket
    ``size``, in which it was the last block (``last``, only counted for one use)."""
    if uses <= 1 and last:
        return TAIL + size
    return (min(uses, USE_BUCKETS) - 1) * SIZE_BUCKETS + size


Row = tuple[OffloadKey, int, int, int]


def fade_state(state: Mapping[str, Any]) -> tuple[int, list[int], int]:
    """``(rebuilds, rebuild ticks, traffic)`` of a kv's :meth:`KVPolicy.snapshot`,
    checked: ``ValueError`` naming what is wrong."""
    rebuilds = int(state["rebuilds"])
    ticks = [int(t) for t in state["rebuild_ticks"]]
    traffic = int(state["traffic"])
    if rebuilds < 0 or traffic < 0:
        raise ValueError(f"rebuilds and traffic must be >= 0, got {rebuilds}, {traffic}")
    if len(ticks) != min(rebuilds, FADE_TICKS):
        raise ValueError(
            f"rebuild_ticks must hold the first min(rebuilds, {FADE_TICKS}) rebuilds' ticks,"
            f" got {len(ticks)} for {rebuilds} rebuilds"
        )
    if any(b < a for a, b in pairwise(ticks)) or any(
        not 0 <= t <= int(state["tick"]) for t in ticks
    ):
        raise ValueError("rebuild_ticks must be in order, each in [0, tick]")
    return rebuilds, ticks, traffic


def adoption(
    state: Mapping[str, Any], keys: Sequence[OffloadKey], ghost_cap: int
) -> tuple[list[Row], list[Row]]:
    """What a kv that holds ``keys`` (least recently used first) takes of another kv's
    ``state`` (its :meth:`KVPolicy.snapshot`): rows ``(key, uses, last use, class)`` of
    the keys held, in order of last use, then of recency, and of the keys to remember.

    A key the state knows keeps its uses, last use and class; one it does not know is
    taken as used once (short request, not last) at the time of its oldest memory.
    Remembered: the state's ghost list in its order, then what it held or had just seen
    and ``keys`` lack (more recent than any ghost), by last use; the most recent
    ``ghost_cap``. The table, counts and clock are taken as they are."""
    known: dict[OffloadKey, tuple[int, int, int]] = {}
    for rows in (*state["queues"], state["fresh"], state["ghost"]):
        for key, uses, tick, cls in rows:
            known[key] = (uses, tick, cls)
    oldest = min((row[1] for row in known.values()), default=int(state["tick"]))
    held: list[tuple[int, int, Row]] = []
    for order, key in enumerate(keys):
        uses, tick, cls = known.pop(key, (1, oldest, 0))
        held.append((tick, order, (key, uses, tick, cls)))
    held.sort(key=lambda item: (item[0], item[1]))
    remembered = [row[0] for row in state["ghost"] if row[0] in known]
    listed = set(remembered)
    rest = sorted((key for key in known if key not in listed), key=lambda key: known[key][1])
    gone = [(key, *known[key]) for key in remembered + rest]
    gone = gone[max(0, len(gone) - ghost_cap) :] if ghost_cap else []
    return [row for _, _, row in held], gone


@register_policy("kv")
class KVPolicy(CachePolicy):
    """Evicts the block least likely to be reused, by class and age, learned online."""

    touch_before_store = True
    learns_online = True

    def __init__(
        self,
        capacity: int,
        *,
        ghost_factor: float = 4.0,
        half_life: float = 4.0,
        size_classes: bool = True,
        tail_classes: bool = True,
        admission: bool = True,
        native: bool | None = None,
    ) -> None:
        """``size_classes``, ``tail_classes`` and ``admission`` switch those parts off
        (one request-length bucket; no last-block classes; admit every block): they
        exist to measure what each part is worth (docs/policies.md). ``native`` picks
        the C core (True: required, False: never, None: where it builds)."""
        super().__init__(capacity)
        self.size_classes = size_classes
        self.tail_classes = tail_classes
        self.admission = admission
        if not ghost_factor >= 0:
            raise ValueError(f"ghost_factor must be >= 0, got {ghost_factor}")
        if not half_life > 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self.ghost_factor = ghost_factor
        self.half_life = half_life
        self._ghost_cap = int(capacity * ghost_factor)
        self._rebuild_every = max(64, capacity // 8)
        self._decay = 0.5 ** (self._rebuild_every / (half_life * capacity))
        self._core: Any = None
        self.clear()
        kvcore = None if native is False else load_kvcore()
        if native and kvcore is None:
            raise RuntimeError("the native KV policy core is unavailable (see the log)")
        if kvcore is not None:
            core = kvcore.Core(
                capacity,
                self._ghost_cap,
                self._rebuild_every,
                self._decay,
                size_classes,
                tail_classes,
                admission,
            )
            self._core = core
            # The hot methods go straight to C.
            self.get = core.get  # type: ignore[method-assign]
            self.touch = core.touch  # type: ignore[method-assign]
            self.insert_many = core.insert_many  # type: ignore[method-assign]
            self.evict = core.evict  # type: ignore[method-assign]
            self.admissible = core.admissible  # type: ignore[method-assign]
            self.remove = core.remove  # type: ignore[method-assign]

    @property
    def native(self) -> bool:
        """Whether the C core runs this policy."""
        return self._core is not None

    # --- state ------------------------------------------------------------------------

    def clear(self) -> None:
        if self._core is not None:
            self._core.clear()
            return
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        self.get = self._blocks.get  # type: ignore[method-assign,assignment]
        #: Every block known: resident, fresh or ghost.
        self._meta: dict[OffloadKey, _Meta] = {}
        #: Resident blocks by class, least recently touched first.
        self._queues: list[OrderedDict[OffloadKey, _Meta]] = [
            OrderedDict() for _ in range(NUM_CLASSES)
        ]
        #: Keys first seen by the latest touch, not inserted yet.
        self._fresh: dict[OffloadKey, _Meta] = {}
        #: Keys known but not resident (evicted, or touched and never stored).
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self._tick = 0
        self._inserts = 0
        #: Value of the last block evicted, when it was (admission compares with it).
        self._last_victim = 0.0
        # Per class: blocks that entered it, and reuses seen per age bin (flat).
        self._entered = [0.0] * NUM_CLASSES
        self._reused = [0.0] * (NUM_CLASSES * AGE_BINS)
        self._table = [[1.0] * AGE_BINS for _ in range(NUM_CLASSES)]
        #: Rebuilds so far, and the ticks of the first FADE_TICKS (the fade's weights);
        #: blocks touched so far (the fade's clock).
        self._rebuilds = 0
        self._rebuild_ticks: list[int] = []
        self._traffic = 0

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """Every block, class by class, least recently touched first within a class."""
        if self._core is not None:
            return iter(self._core.items())
        blocks = self._blocks
        return ((key, blocks[key]) for queue in self._queues for key in queue)

    def __len__(self) -> int:
        if self._core is not None:
            return len(self._core)
        return len(self._blocks)

    def _now(self) -> int:
        return int(self._core.state()[0]) if self._core is not None else self._tick

    def _meta_of(self, key: OffloadKey) -> tuple[int, int, int] | None:
        """``(uses, last touch, class)`` of a resident block."""
        if self._core is not None:
            found = self._core.meta(key)
            if found is None or found[3] != 1:
                return None
            return found[0], found[1], found[2]
        if key not in self._blocks:
            return None
        uses, last, cls = self._meta[key]
        return uses, last, cls

    def value(self, key: OffloadKey) -> float | None:
        """The estimated reuse probability of a resident block now (for inspection)."""
        meta = self._meta_of(key)
        if meta is None:
            return None
        table = self._core.table() if self._core is not None else self._table
        value: float = table[meta[2]][(self._now() - meta[1]).bit_length()]
        return value

    def class_and_age(self, key: OffloadKey) -> tuple[int, int] | None:
        """``(class, age in touches)`` of a resident block (for inspection and tests)."""
        meta = self._meta_of(key)
        if meta is None:
            return None
        return meta[2], self._now() - meta[1]

    def snapshot(self) -> dict[str, Any]:
        """Everything the policy holds (for tests: the C core and the Python path give
        equal snapshots after equal calls). Lists of ``(key, uses, tick, class)``."""
        if self._core is not None:
            snap: dict[str, Any] = self._core.snapshot()
            return snap
        meta = self._meta

        def rows(keys: Iterable[OffloadKey]) -> list[tuple[OffloadKey, int, int, int]]:
            return [(k, meta[k][0], meta[k][1], meta[k][2]) for k in keys]

        return {
            "queues": [rows(q) for q in self._queues],
            "fresh": rows(self._fresh),
            "ghost": rows(self._ghost),
            "tick": self._tick,
            "inserts": self._inserts,
            "last_victim": self._last_victim,
            "entered": list(self._entered),
            "reused": list(self._reused),
            "table": self.reuse_table(),
            "rebuilds": self._rebuilds,
            "rebuild_ticks": list(self._rebuild_ticks),
            "traffic": self._traffic,
        }

    def reuse_table(self) -> list[list[float]]:
        """``P(reuse | class, age bin)`` as last rebuilt (a copy)."""
        if self._core is not None:
            table: list[list[float]] = self._core.table()
            return table
        return [row[:] for row in self._table]

    def adopt(
        self,
        state: Mapping[str, Any],
        blocks: Sequence[tuple[OffloadKey, BlockStatus]],
    ) -> None:
        """Start again on ``blocks`` (least recently used first) with what another kv of
        the same capacity and settings learned: ``state`` is its :meth:`snapshot` (an
        ``auto`` ghost's, when ``auto`` switches to kv). See :func:`adoption`. Tracked
        blocks before are forgotten."""
        held, gone = adoption(state, [key for key, _ in blocks], self._ghost_cap)
        block_of = dict(blocks)
        now = int(state["tick"])
        if self._core is not None:
            self._core.restore(
                now,
                int(state["inserts"]),
                float(state["last_victim"]),
                state["entered"],
                state["reused"],
                state["table"],
                [(key, block_of[key], uses, tick, cls) for key, uses, tick, cls in held],
                gone,
                int(state["rebuilds"]),
                state["rebuild_ticks"],
                int(state["traffic"]),
            )
            return
        self.clear()
        self._tick = now
        self._inserts = int(state["inserts"])
        self._last_victim = float(state["last_victim"])
        self._entered = [float(x) for x in state["entered"]]
        self._reused = [float(x) for x in state["reused"]]
        self._table = [[float(x) for x in row] for row in state["table"]]
        self._rebuilds, self._rebuild_ticks, self._traffic = fade_state(state)
        meta_of, queues = self._meta, self._queues
        for key, uses, tick, cls in held:
            meta = meta_of[key] = [uses, tick, cls]
            self._blocks[key] = block_of[key]
            queues[cls][key] = meta
        for key, uses, tick, cls in gone:
            meta_of[key] = [uses, tick, cls]
            self._ghost[key] = None

    # --- learning ---------------------------------------------------------------------

    def _forget_ghosts(self) -> None:
        ghost, meta = self._ghost, self._meta
        for _ in range(len(ghost) - self._ghost_cap):
            del meta[ghost.popitem(last=False)[0]]

    def _fade(self) -> float:
        """The share of the censoring correction the next rebuild applies."""
        return 1.0 - self._traffic / (FADE * self.capacity)

    def _censored(self) -> list[float]:
        """Per class and age bin, the blocks (sampled) not reused since they entered
        their class, by their age now, each weighted as the decay has weighted its entry
        (``decay ** rebuilds since``), summed as exact integers."""
        now, ticks = self._tick, self._rebuild_ticks
        n = len(ticks)
        weights = [int(self._decay**k * CENSOR_SCALE) for k in range(n + 1)]
        sums = [0] * (NUM_CLASSES * AGE_BINS)
        for key, meta in self._meta.items():
            if key[-5] & _SAMPLE_MASK:
                continue
            last = meta[1]
            sums[meta[2] * AGE_BINS + (now - last).bit_length()] += weights[
                n - bisect_left(ticks, last)
            ]
        return [x / CENSOR_SCALE for x in sums]

    def _rebuild(self) -> None:
        decay = self._decay
        table, reused, entered = self._table, self._reused, self._entered
        fade = self._fade()
        if fade > 0.0:
            censored = self._censored()
        else:
            fade, censored = 0.0, [0.0] * (NUM_CLASSES * AGE_BINS)
        if len(self._rebuild_ticks) < FADE_TICKS:
            self._rebuild_ticks.append(self._tick)
        self._rebuilds += 1
        for c in range(NUM_CLASSES):
            base = c * AGE_BINS
            alive = entered[c]
            later = 0.0  # summed in order, as the C core does
            for b in range(base, base + AGE_BINS):
                later += reused[b]
            row = table[c]
            prev = 1.0
            for b in range(base, base + AGE_BINS):
                p = later / alive if alive > 1e-9 else 0.0
                prev = p if p < prev else prev
                row[b - base] = prev
                alive -= reused[b] + fade * censored[b]
                later -= reused[b]
                reused[b] *= decay
            entered[c] *= decay
        for c in range(SIZE_BUCKETS, TAIL):
            lower = table[c - SIZE_BUCKETS]
            table[c] = [a if a > b else b for a, b in zip(table[c], lower)]
        for c in range(TAIL, NUM_CLASSES):
            parent = table[c - TAIL]
            table[c] = [a if a < b else b for a, b in zip(table[c], parent)]

    # --- CachePolicy ------------------------------------------------------------------

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            if not isinstance(key, bytes):
                raise TypeError(f"keys must be bytes, got {type(key).__name__}")
        self._tick += 1
        self._traffic += len(keys)
        tick = self._tick
        meta_of, ghost = self._meta, self._ghost
        fresh = self._fresh
        if fresh:
            # Touched before and never stored: remembered like evicted blocks.
            for key in fresh:
                ghost[key] = None
            fresh.clear()
        size = size_bucket(len(keys)) if self.size_classes else 0
        top = TAIL - SIZE_BUCKETS + size
        blocks, queues = self._blocks, self._queues
        entered, reused = self._entered, self._reused
        first = TAIL + size if self.tail_classes else size  # a first-seen last block
        for key in reversed(keys):
            meta = meta_of.get(key)
            if meta is None:
                meta_of[key] = fresh[key] = [1, tick, first]
                if not key[-5] & _SAMPLE_MASK:
                    entered[first] += 1
                first = size
                continue
            first = size
            uses, last, old = meta
            if last == tick:
                continue  # the same key twice in one touch counts once
            if uses < USE_BUCKETS:
                meta[0] = uses + 1
                cls = uses * SIZE_BUCKETS + size
            else:
                cls = top
            meta[1] = tick
            if not key[-5] & _SAMPLE_MASK:
                reused[old * AGE_BINS + (tick - last).bit_length()] += 1
                entered[cls] += 1
            if key in blocks:
                if cls == old:
                    queues[cls].move_to_end(key)
                else:
                    meta[2] = cls
                    del queues[old][key]
                    queues[cls][key] = meta
            else:
                meta[2] = cls
                ghost.move_to_end(key)
        if len(ghost) > self._ghost_cap:
            self._forget_ghosts()

    def admissible(self, keys: list[OffloadKey], full: bool) -> list[OffloadKey]:
        """When storing would evict, decline blocks seen for the first time whose class
        is worth less at age 0 than the last block evicted was when it went."""
        if not full or not self._blocks or not self.admission:
            return keys
        meta_of, table, floor = self._meta, self._table, self._last_victim
        out = []
        for key in keys:
            meta = meta_of.get(key)
            if meta is None or meta[0] > 1 or table[meta[2]][0] >= floor:
                out.append(key)
        return out

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.insert_many(((key, block),))

    def insert_many(self, items: Iterable[tuple[OffloadKey, BlockStatus]]) -> None:
        """Insert a store's blocks, deepest first, so the deepest is evicted first."""
        batch = items if isinstance(items, list) else list(items)
        meta_of, blocks, queues = self._meta, self._blocks, self._queues
        for key, _ in batch:
            if not isinstance(key, bytes):
                raise TypeError(f"keys must be bytes, got {type(key).__name__}")
            if key in blocks:
                raise ValueError("insert_many: key is already resident")
        fresh, ghost = self._fresh, self._ghost
        tick = self._tick
        for key, block in reversed(batch):
            meta = fresh.pop(key, None)
            if meta is None:
                meta = meta_of.get(key)
                if meta is None:
                    meta = meta_of[key] = [1, tick, 0]
                    if not key[-5] & _SAMPLE_MASK:
                        self._entered[0] += 1
                else:
                    ghost.pop(key, None)
            meta[1] = tick  # a store is a use: age counts from it (keeps queues in order)
            blocks[key] = block
            queues[meta[2]][key] = meta
        self._inserts += len(batch)
        if self._inserts >= self._rebuild_every:
            self._inserts = 0
            self._rebuild()

    def remove(self, key: OffloadKey) -> None:
        if self._blocks.pop(key, None) is None:
            return
        meta = self._meta.pop(key)
        del self._queues[meta[2]][key]

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        blocks, table, tick, queues = self._blocks, self._table, self._tick, self._queues
        # One cursor per class over its evictable blocks, oldest first; a heap of the
        # cursors by the value of the block they point at. Values rise along a queue,
        # so a class keeps giving victims while it stays the cheapest.
        heads: list[tuple[float, int]] = []
        cursors: dict[int, Iterator[tuple[OffloadKey, _Meta]]] = {}
        pointed: dict[int, OffloadKey] = {}
        for c, queue in enumerate(queues):
            if not queue:
                continue
            cursor = iter(queue.items())
            for key, meta in cursor:
                if blocks[key].ref_cnt == 0 and key not in protected:
                    heads.append((table[c][(tick - meta[1]).bit_length()], RANK[c]))
                    cursors[c] = cursor
                    pointed[c] = key
                    break
        heapq.heapify(heads)
        taken: list[tuple[int, list[OffloadKey]]] = []
        need = n
        value = 0.0
        while need:
            if not heads:
                return None
            value, rank = heapq.heappop(heads)
            c = CLASS_AT_RANK[rank]
            bar, bar_rank = heads[0] if heads else (3.0, NUM_CLASSES)
            row = table[c]
            keys = [pointed.pop(c)]
            need -= 1
            for key, meta in cursors[c]:
                if blocks[key].ref_cnt != 0 or key in protected:
                    continue
                v = row[(tick - meta[1]).bit_length()]
                if need and (v < bar or (v == bar and rank < bar_rank)):
                    keys.append(key)
                    value = v
                    need -= 1
                    continue
                pointed[c] = key
                heapq.heappush(heads, (v, rank))
                break
            taken.append((c, keys))
        self._last_victim = value
        out: list[tuple[OffloadKey, BlockStatus]] = []
        ghost = self._ghost
        for c, keys in taken:
            queue = queues[c]
            for key in keys:
                del queue[key]
                out.append((key, blocks.pop(key)))
                ghost[key] = None
        if len(ghost) > self._ghost_cap:
            self._forget_ghosts()
        return out
