"""The "kv" policy (``asyncoffload/manager/policies/kv.py``) against a brute-force reference
model, its guarantees as a :class:`CachePolicy`, and the behaviour it exists for.

The reference, :class:`RefKV`, is written plainly: per-key dicts, lists for the ghost and
fresh keys, and eviction as "sort every evictable resident block by (value now, tie rank
of its class, queue position) and take the first ``n``" (the documented rule). The real
policy uses one ordered dict per class and a heap of per-class cursors, which relies on
each class queue being in order of last use (a store counts as a use). Both the global
rule and the per-class-head rule are checked in lockstep over any sequence, with stores
directly after their touch or not. Every test runs on the Python path and the C core.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import asyncoffload as ao
from asyncoffload._native import load_kvcore
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import BlockStatus
from asyncoffload.manager.policies import KVPolicy, available_policies, get_policy_cls
from asyncoffload.manager.policies.kv import (
    AGE_BINS,
    NUM_CLASSES,
    RANK,
    SIZE_BUCKETS,
    TAIL,
    USE_BUCKETS,
    class_of,
    size_bucket,
)

# --- implementations and keys ----------------------------------------------------------

#: Classes of short requests: touched once, twice, and a first-seen last block.
ONCE, TWICE, LAST = class_of(1, 0), class_of(2, 0), class_of(1, 0, last=True)

#: KVPolicy runs on a C core where it builds, else in Python: every test that exercises
#: its behaviour runs on both.
IMPLS = [
    pytest.param(False, id="python"),
    pytest.param(
        True,
        id="native",
        marks=pytest.mark.skipif(load_kvcore() is None, reason="the C core does not build here"),
    ),
]


def _manager(capacity: int, native: bool) -> ao.CPUOffloadingManager:
    return ao.CPUOffloadingManager(capacity, KVPolicy(capacity, native=native))


def _key(i: int, sampled: bool) -> OffloadKey:
    """Key ``i``; ``key[-5]`` (the last hash byte) decides whether the policy learns from it."""
    return ao.make_offload_key(i.to_bytes(7, "big") + (b"\x00" if sampled else b"\x01"))


def _sampled(key: OffloadKey) -> bool:
    return key[-5] & 3 == 0


def _ready(block_id: int) -> BlockStatus:
    block = BlockStatus(block_id)
    block.ref_cnt = 0
    return block


def _names(keys: Sequence[OffloadKey]) -> list[int]:
    return [int.from_bytes(key[:7], "big") for key in keys]


# --- the reference ---------------------------------------------------------------------


def ref_size_bucket(n: int) -> int:
    if n < 16:
        return 0
    if n < 64:
        return 1
    return 2


class RefKV:
    """KVPolicy, brute force.

    Per known key (resident, fresh or ghost): ``uses`` (1 to 4, capped), ``last`` (the
    tick of its last touch, or of its insertion if never touched) and ``cls``. Resident
    keys also have ``pos``: a counter value taken whenever the key joins the end of its
    class queue (insertion, or a touch, which moves it to the end of its possibly new
    class), so a class queue is its keys sorted by ``pos``. With ``size_classes``,
    ``tail_classes`` or ``admission`` off: one length bucket, no last-block classes,
    every block admitted.
    """

    def __init__(
        self,
        capacity: int,
        ghost_factor: float = 4.0,
        half_life: float = 4.0,
        *,
        size_classes: bool = True,
        tail_classes: bool = True,
        admission: bool = True,
        candidates: str = "all",
    ) -> None:
        assert candidates in ("all", "queue_heads")
        self.candidates = candidates
        self.size_classes = size_classes
        self.tail_classes = tail_classes
        self.admission = admission
        self.capacity = capacity
        self.ghost_cap = int(capacity * ghost_factor)
        self.rebuild_every = max(64, capacity // 8)
        self.decay = 0.5 ** (self.rebuild_every / (half_life * capacity))
        self.clear()

    def clear(self) -> None:
        self.uses: dict[OffloadKey, int] = {}
        self.last: dict[OffloadKey, int] = {}
        self.cls: dict[OffloadKey, int] = {}
        self.pos: dict[OffloadKey, int] = {}  # resident keys only
        self.counter = 0
        self.fresh: list[OffloadKey] = []  # first seen by the latest touch, not inserted
        self.ghost: list[OffloadKey] = []  # oldest first
        self.tick = 0
        self.inserts = 0
        self.last_victim = 0.0
        self.entered = [0.0] * NUM_CLASSES
        self.reused = [[0.0] * AGE_BINS for _ in range(NUM_CLASSES)]
        self.table = [[1.0] * AGE_BINS for _ in range(NUM_CLASSES)]
        self.rebuilds = 0
        self.rebuild_ticks: list[int] = []  # the first 160 rebuilds'
        self.traffic = 0  # keys touched

    # --- helpers

    def _to_queue_end(self, key: OffloadKey) -> None:
        self.counter += 1
        self.pos[key] = self.counter

    def _forget(self, key: OffloadKey) -> None:
        del self.uses[key], self.last[key], self.cls[key]

    def _trim_ghosts(self) -> None:
        while len(self.ghost) > self.ghost_cap:
            self._forget(self.ghost.pop(0))

    def resident(self) -> list[OffloadKey]:
        """Class by class, queue order within a class."""
        return sorted(self.pos, key=lambda k: (self.cls[k], self.pos[k]))

    def age(self, key: OffloadKey) -> int:
        return self.tick - self.last[key]

    def now(self, key: OffloadKey) -> float:
        """The value now of a known key: its class's row at its age bin."""
        return self.table[self.cls[key]][self.age(key).bit_length()]

    def value(self, key: OffloadKey) -> float | None:
        return self.now(key) if key in self.pos else None

    def class_and_age(self, key: OffloadKey) -> tuple[int, int] | None:
        if key not in self.pos:
            return None
        return self.cls[key], self.age(key)

    # --- learning

    def censored(self) -> list[list[float]]:
        """Per class and age bin: the known sampled keys (none reused since it entered
        its class), each weighted as the decay weighted its entry, to 2**-24."""
        out = [[0] * AGE_BINS for _ in range(NUM_CLASSES)]
        for key in self.uses:
            if _sampled(key):
                decays = sum(1 for t in self.rebuild_ticks if t >= self.last[key])
                out[self.cls[key]][self.age(key).bit_length()] += int(self.decay**decays * 2**24)
        return [[x / 2**24 for x in row] for row in out]

    def rebuild(self) -> None:
        # The first 12 capacities of traffic discount the keys too young to have been
        # reused yet (their share fading from 1 to 0).
        fade = max(0.0, 1.0 - self.traffic / (12.0 * self.capacity))
        censored = self.censored() if fade else [[0.0] * AGE_BINS] * NUM_CLASSES
        if len(self.rebuild_ticks) < 160:
            self.rebuild_ticks.append(self.tick)
        self.rebuilds += 1
        for c in range(NUM_CLASSES):
            alive = self.entered[c]
            later = sum(self.reused[c])
            best = 1.0
            for b in range(AGE_BINS):
                p = later / alive if alive > 1e-9 else 0.0
                best = min(best, p)  # non-increasing in age
                self.table[c][b] = best
                alive -= self.reused[c][b] + fade * censored[c][b]
                later -= self.reused[c][b]
                self.reused[c][b] *= self.decay
            self.entered[c] *= self.decay
        # Non-decreasing in uses, per size bucket.
        for u in range(1, USE_BUCKETS):
            for s in range(SIZE_BUCKETS):
                c, lower = u * SIZE_BUCKETS + s, (u - 1) * SIZE_BUCKETS + s
                self.table[c] = [max(a, b) for a, b in zip(self.table[c], self.table[lower])]
        # A first-seen last block is worth at most a once-used block of its size.
        for s in range(SIZE_BUCKETS):
            self.table[TAIL + s] = [min(a, b) for a, b in zip(self.table[TAIL + s], self.table[s])]

    # --- the policy

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.tick += 1
        self.traffic += len(keys)
        self.ghost.extend(self.fresh)  # touched before, never stored
        self.fresh = []
        size = ref_size_bucket(len(keys)) if self.size_classes else 0
        seen: set[OffloadKey] = set()
        for i, key in enumerate(reversed(keys)):  # deepest first; keys[-1] is the last block
            if key in seen:
                continue
            seen.add(key)
            if key not in self.uses:
                cls = TAIL + size if i == 0 and self.tail_classes else size
                self.uses[key], self.last[key], self.cls[key] = 1, self.tick, cls
                self.fresh.append(key)
                if _sampled(key):
                    self.entered[cls] += 1
                continue
            uses = min(self.uses[key] + 1, USE_BUCKETS)
            cls = (uses - 1) * SIZE_BUCKETS + size
            if _sampled(key):
                self.reused[self.cls[key]][self.age(key).bit_length()] += 1
                self.entered[cls] += 1
            self.uses[key], self.last[key], self.cls[key] = uses, self.tick, cls
            if key in self.pos:
                self._to_queue_end(key)
            else:
                self.ghost.remove(key)
                self.ghost.append(key)
        self._trim_ghosts()

    def admissible(self, keys: Sequence[OffloadKey], full: bool) -> list[OffloadKey]:
        if not full or not self.pos or not self.admission:
            return list(keys)
        return [
            key
            for key in keys
            if key not in self.uses
            or self.uses[key] > 1
            or self.table[self.cls[key]][0] >= self.last_victim
        ]

    def insert_many(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):  # deepest first
            if key in self.fresh:
                self.fresh.remove(key)
            elif key not in self.uses:
                self.uses[key], self.last[key], self.cls[key] = 1, self.tick, 0
                if _sampled(key):
                    self.entered[0] += 1
            elif key in self.ghost:
                self.ghost.remove(key)
            self.last[key] = self.tick  # a store is a use
            self._to_queue_end(key)
        self.inserts += len(keys)
        if self.inserts >= self.rebuild_every:
            self.inserts = 0
            self.rebuild()

    def remove(self, key: OffloadKey) -> None:
        if key in self.pos:
            del self.pos[key]
            self._forget(key)

    def snapshot(self) -> dict[str, object]:
        """In the format of ``KVPolicy.snapshot()``."""

        def rows(keys: Sequence[OffloadKey]) -> list[tuple[OffloadKey, int, int, int]]:
            return [(k, self.uses[k], self.last[k], self.cls[k]) for k in keys]

        queues: list[list[OffloadKey]] = [[] for _ in range(NUM_CLASSES)]
        for key in self.resident():
            queues[self.cls[key]].append(key)
        return {
            "queues": [rows(queue) for queue in queues],
            "fresh": rows(self.fresh),
            "ghost": rows(self.ghost),
            "tick": self.tick,
            "inserts": self.inserts,
            "last_victim": self.last_victim,
            "entered": list(self.entered),
            "reused": [x for row in self.reused for x in row],
            "table": [row[:] for row in self.table],
            "rebuilds": self.rebuilds,
            "rebuild_ticks": list(self.rebuild_ticks),
            "traffic": self.traffic,
        }

    def _rank(self, key: OffloadKey) -> tuple[float, int, int]:
        # ties: last-block classes first, then fewer uses, then least recently used
        return self.now(key), RANK[self.cls[key]], self.pos[key]

    def evict(self, n: int, evictable: Callable[[OffloadKey], bool]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        candidates = [key for key in self.pos if evictable(key)]
        if len(candidates) < n:
            return None
        if self.candidates == "all":
            victims = sorted(candidates, key=self._rank)[:n]
        else:
            victims = []
            for _ in range(n):
                heads: dict[int, OffloadKey] = {}
                for key in sorted(candidates, key=lambda k: self.pos[k]):
                    heads.setdefault(self.cls[key], key)
                victim = min(heads.values(), key=self._rank)
                candidates.remove(victim)
                victims.append(victim)
        self.last_victim = self.now(victims[-1])
        for key in victims:
            del self.pos[key]
            self.ghost.append(key)
        self._trim_ghosts()
        return victims


class RefKVManager:
    """The manager around :class:`RefKV`: reference counts and the store protocol."""

    def __init__(self, num_blocks: int, policy: RefKV) -> None:
        self.num_blocks = num_blocks
        self.policy = policy
        self.ref: dict[OffloadKey, int] = {}  # -1 writing, 0 idle, n > 0 pinned n times

    def prepare_store(
        self, keys: Sequence[OffloadKey]
    ) -> tuple[list[OffloadKey], list[OffloadKey]] | None:
        offered = [key for key in keys if key not in self.ref]
        if not offered:
            return [], []
        free = self.num_blocks - len(self.ref)
        to_store = self.policy.admissible(offered, len(offered) > free)
        if not to_store:
            return [], []
        victims: list[OffloadKey] = []
        if len(to_store) > free:
            found = self.policy.evict(
                len(to_store) - free, lambda key: self.ref[key] == 0 and key not in keys
            )
            if found is None:
                return None
            victims = found
            for key in victims:
                del self.ref[key]
        for key in to_store:
            self.ref[key] = -1
        self.policy.insert_many(to_store)
        return to_store, victims

    def complete_store(self, keys: Sequence[OffloadKey], success: bool) -> None:
        for key in keys:
            if self.ref.get(key, 0) >= 0:
                continue
            if success:
                self.ref[key] = 0
            else:
                del self.ref[key]
                self.policy.remove(key)

    def reset_cache(self) -> None:
        self.ref.clear()
        self.policy.clear()


# --- lockstep: the manager with "kv" against the reference -----------------------------

#: 80 keys; one in two is sampled by the learning (``key[-5] & 3 == 0``): the last hash
#: bytes cycle through 0, 1, 2, 3, 4, 8, 12, 6.
HASH_BYTES = (0, 1, 2, 3, 4, 8, 12, 6)
UNIVERSE = [
    ao.make_offload_key(i.to_bytes(7, "big") + bytes([HASH_BYTES[i % 8]])) for i in range(80)
]
#: Where request chains start: four conversations sharing nothing, the first long enough
#: for requests of 64 blocks and more.
ROOTS = (0, 40, 52, 66)

# No shrinking: sequences are long, shrinking one takes minutes, past pytest's timeout (which
# would end the run without a report); the failing sequence is printed step by step.
LOCKSTEP = settings(
    max_examples=50,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Operation kinds, repeated to weight them (index 0, where draws shrink to, is a request).
OP_KINDS = ["request"] * 8 + ["touch"] * 2 + ["store"] * 2 + ["complete"] * 2
OP_KINDS += ["load"] * 2 + ["unload"] * 2 + ["lookup", "reset"]


@dataclass
class Step:
    kind: str  # touch, store, complete_ok, complete_fail, load, unload, lookup, reset
    keys: list[OffloadKey]

    def __repr__(self) -> str:
        return f"{self.kind}({_names(self.keys)})"


class Choices:
    """Choices decoded from one drawn integer: one draw per operation keeps hypothesis'
    overhead down on long sequences. The integer is scrambled first (hypothesis favours
    small ones); 0, where it shrinks to, still decodes to the simplest choices."""

    def __init__(self, value: int) -> None:
        self.value = value * 0x9E3779B97F4A7C15 % 2**64

    def below(self, n: int) -> int:
        self.value, r = divmod(self.value, n)
        return r

    def subset(self, pool: Sequence[OffloadKey], max_size: int) -> list[OffloadKey]:
        out: list[OffloadKey] = []
        for _ in range(max_size):
            i = self.below(len(pool) + 1)
            if i == 0:
                break
            if pool[i - 1] not in out:
                out.append(pool[i - 1])
        return out

    def chain(self) -> list[OffloadKey]:
        """A request's keys: a prefix of one conversation, mostly short, sometimes 16 to
        24 blocks, rarely 64 or more."""
        root = ROOTS[self.below(len(ROOTS))]
        span = len(UNIVERSE) - root
        shape = self.below(20)
        if shape == 19 and root == 0:
            length = 64 + self.below(span - 63)
        elif shape >= 16 and span >= 16:
            length = 16 + self.below(min(24, span) - 15)
        else:
            length = 1 + self.below(min(10, span))
        return UNIVERSE[root : root + length]


def _draw_steps(
    data: st.DataObject,
    m: ao.CPUOffloadingManager,
    capacity: int,
    evicted: list[OffloadKey],
    untouched_stores: bool,
) -> list[Step]:
    """The next operation, as manager calls; what the manager holds decides what is valid.

    Without ``untouched_stores`` every store follows a touch of its keys, as a serving
    engine's do."""
    blocks = list(m.policy.items())
    pending = [key for key, block in blocks if block.ref_cnt < 0]
    ready = [key for key, block in blocks if block.ref_cnt >= 0]
    pinned = sorted(key for key, block in blocks if block.ref_cnt > 0)
    c = Choices(data.draw(st.integers(0, 2**64 - 1)))
    kind = OP_KINDS[c.below(len(OP_KINDS))]
    if kind == "request" or (kind == "store" and not untouched_stores):
        # As a serving engine does: touch the whole prompt, store what follows its hits
        # (as much as fits), and usually complete the copy (or fail it, or leave it in
        # flight).
        chain = c.chain()
        hits = m.lookup_prefix(chain)
        if hits == len(chain):
            return [Step("touch", chain)]
        stored = chain[hits : hits + 1 + c.below(min(len(chain) - hits, capacity))]
        end = ["complete_ok"] * 6 + ["complete_fail", "none"]
        steps = [Step("touch", chain), Step("store", stored)]
        if (how := end[c.below(len(end))]) != "none":
            steps.append(Step(how, stored))  # keys the store skipped are ignored
        return steps
    if kind == "touch":
        return [Step("touch", c.chain() if c.below(2) else c.subset(UNIVERSE, 6))]
    if kind == "store":
        # Keys never touched, or remembered ones (recently evicted) stored again without
        # a touch in between.
        pool = evicted[-8:] if evicted and c.below(2) else UNIVERSE
        keys = c.subset(pool, min(4, capacity))
        return [Step("store", keys), Step("complete_ok", keys)]
    if kind == "complete":
        how = "complete_fail" if c.below(4) == 3 else "complete_ok"
        return [Step(how, c.subset(pending, 4))]
    if kind == "load":
        return [Step("load", c.subset(ready, 3))]
    if kind == "unload":
        return [Step("unload", c.subset(pinned, 3))]
    if kind == "reset" and not pending and not pinned and c.below(6) == 0:
        return [Step("reset", [])]
    return [Step("lookup", [UNIVERSE[c.below(len(UNIVERSE))]])]


def _kv(m: ao.CPUOffloadingManager) -> KVPolicy:
    policy = m.policy
    assert isinstance(policy, KVPolicy)
    return policy


def assert_same_state(m: ao.CPUOffloadingManager, ref: RefKVManager, inspect: bool) -> None:
    """The manager's policy holds what the reference does; with ``inspect``, also through
    the inspection methods (values, classes and ages, the table), after the calls that can
    change them."""
    real, model = _kv(m), ref.policy
    # The resident blocks, class by class in queue order, and their reference counts.
    assert [key for key, _ in real.items()] == model.resident()
    assert {key: block.ref_cnt for key, block in real.items()} == ref.ref
    assert len(real) == len(ref.ref)
    # Everything it holds: queues, fresh and ghost keys with their history, counters,
    # the table.
    assert real.snapshot() == model.snapshot()
    if inspect:
        for key in model.resident():
            assert real.class_and_age(key) == model.class_and_age(key)
            assert real.value(key) == model.value(key)
        assert real.reuse_table() == model.table


def run_step(m: ao.CPUOffloadingManager, ref: RefKVManager, step: Step) -> object:
    """Apply ``step`` to both; assert they answer the same; the manager's answer."""
    keys = step.keys
    if step.kind == "touch":
        m.touch(keys)
        ref.policy.touch(keys)
        return None
    if step.kind == "store":
        out = m.prepare_store(keys)
        want = ref.prepare_store(keys)
        got = None if out is None else (out.keys_to_store, out.evicted_keys)
        assert got == want
        if out is not None and out.evicted_keys:
            events = m.take_events()
            assert [(e.removed, e.keys) for e in events] == [(True, tuple(out.evicted_keys))]
        return got
    if step.kind in ("complete_ok", "complete_fail"):
        m.complete_store(keys, success=step.kind == "complete_ok")
        ref.complete_store(keys, step.kind == "complete_ok")
        return None
    if step.kind == "load":
        m.prepare_load(keys)
        for key in keys:
            ref.ref[key] += 1
        return None
    if step.kind == "unload":
        m.complete_load(keys)
        for key in keys:
            ref.ref[key] -= 1
        return None
    if step.kind == "reset":
        m.reset_cache()
        ref.reset_cache()
        return None
    return m.lookup(keys[0])


def _lockstep(
    data: st.DataObject,
    native: bool,
    capacity: int,
    n_ops: int,
    candidates: str,
    untouched_stores: bool,
) -> int:
    """Run ``n_ops`` operations; the number of rebuilds of the reuse table."""
    ghost_factor = data.draw(st.sampled_from([4.0, 4.0, 0.0, 0.5, 1.0]), label="ghost_factor")
    half_life = data.draw(st.sampled_from([4.0, 4.0, 0.25, 1.0]), label="half_life")
    # The switches that turn parts off (to measure them), mostly on.
    switches = data.draw(
        st.sampled_from(
            [(True, True, True)] * 5
            + [(False, True, True), (True, False, True), (True, True, False)]
        ),
        label="size, tail, admission",
    )
    size_classes, tail_classes, admission = switches
    policy = KVPolicy(
        capacity,
        ghost_factor=ghost_factor,
        half_life=half_life,
        size_classes=size_classes,
        tail_classes=tail_classes,
        admission=admission,
        native=native,
    )
    m = ao.CPUOffloadingManager(capacity, policy)
    model = RefKV(
        capacity,
        ghost_factor,
        half_life,
        size_classes=size_classes,
        tail_classes=tail_classes,
        admission=admission,
        candidates=candidates,
    )
    ref = RefKVManager(capacity, model)
    evicted: list[OffloadKey] = []
    rebuilds = 0
    n = 0
    for _ in range(n_ops):
        for step in _draw_steps(data, m, capacity, evicted, untouched_stores):
            note(f"{n}: {step!r}")
            n += 1
            inserts = ref.policy.inserts
            got = run_step(m, ref, step)
            if isinstance(got, tuple) and got[1]:
                evicted = [k for k in evicted if k not in got[1]] + got[1]
            if ref.policy.inserts < inserts and step.kind == "store":
                rebuilds += 1
            m.take_events()
            assert_same_state(m, ref, inspect=step.kind in ("touch", "store", "reset"))
    return rebuilds


@pytest.mark.parametrize("native", IMPLS)
@LOCKSTEP
@given(data=st.data(), capacity=st.integers(3, 12))
def test_kv_follows_the_documented_eviction_rule(
    native: bool, data: st.DataObject, capacity: int
) -> None:
    """Any sequence (stores of keys touched before the latest touch, or never, included):
    eviction takes the evictable blocks of lowest (value now, tie rank, queue position),
    globally."""
    n_ops = data.draw(st.integers(30, 200), label="n_ops")
    _lockstep(data, native, capacity, n_ops, candidates="all", untouched_stores=True)


@pytest.mark.parametrize("native", IMPLS)
@LOCKSTEP
@given(data=st.data(), capacity=st.integers(3, 12))
def test_kv_matches_reference_model(native: bool, data: st.DataObject, capacity: int) -> None:
    """Any sequence; each class's first evictable block in queue order is its candidate
    (how the code finds the global minimum)."""
    n_ops = data.draw(st.integers(30, 200), label="n_ops")
    _lockstep(data, native, capacity, n_ops, candidates="queue_heads", untouched_stores=True)


# --- where the code departs from its docstring -----------------------------------------


def _learned_policy(native: bool) -> KVPolicy:
    """A policy whose table says: a once-used block (class 0) used again one touch after
    its first use half the time, never later: worth 0.5 up to age 1, 0 from age 2."""
    policy = KVPolicy(64, native=native)
    block_id = 0
    for i in range(1000, 1128, 4):
        a, t, b, u = (_key(i + j, True) for j in range(4))
        policy.touch([a, t])
        policy.insert_many([(a, _ready(block_id)), (t, _ready(block_id + 1))])
        policy.touch([a])
        policy.touch([b, u])
        policy.insert_many([(b, _ready(block_id + 2)), (u, _ready(block_id + 3))])
        block_id += 4
    assert policy.reuse_table()[ONCE][:4] == [0.5, 0.5, 0.0, 0.0]
    for key, _ in list(policy.items()):
        policy.remove(key)
    return policy


@pytest.mark.parametrize("native", IMPLS)
def test_a_store_is_a_use_and_keeps_queues_in_order(native: bool) -> None:
    """Two requests touched, then both stored (as a scheduler does per step), and a key
    stored again from the ghost list: ages count from the store, so every class queue
    stays in order of last use and its head is its least valuable block."""
    policy = _learned_policy(native)
    a, x, b, y, z = (_key(i, True) for i in range(5))
    policy.touch([a, x])  # request 1: a seen first
    policy.touch([b, y])  # request 2: b seen first; a is remembered (a ghost) now
    policy.insert_many([(b, _ready(0))])  # request 2 stores
    policy.insert_many([(a, _ready(1))])  # request 1 stores, after a later touch
    policy.touch([z])
    assert policy.class_and_age(b) == (ONCE, 1)
    assert policy.class_and_age(a) == (ONCE, 1)
    assert (policy.value(b), policy.value(a)) == (0.5, 0.5)
    for queue in policy.snapshot()["queues"]:
        ticks = [tick for _, _, tick, _ in queue]
        assert ticks == sorted(ticks)
    victims = policy.evict(1, ())
    assert victims is not None
    assert [key for key, _ in victims] == [b]  # equal value: the least recently used


@pytest.mark.parametrize("native", IMPLS)
def test_a_touched_and_stored_prefix_is_cut_from_its_end(native: bool) -> None:
    m = _manager(4, native)
    chain = [_key(i, True) for i in range(4)]
    m.touch(chain)  # the engine touches a request's keys, then stores them
    out = m.prepare_store(chain)
    assert out is not None
    m.complete_store(out.keys_to_store)
    policy = _kv(m)
    assert [policy.class_and_age(key) for key in chain] == [(ONCE, 0)] * 3 + [(LAST, 0)]
    out = m.prepare_store([_key(9, True)])
    assert out is not None
    # Equal values: the last block goes first, so the prefix is cut from its end.
    assert out.evicted_keys == [chain[3]]


# --- guarantees: never pinned, in flight or protected; all or nothing -----------------


def _state(policy: KVPolicy) -> tuple[object, ...]:
    """Everything observable, and everything it holds (its snapshot)."""
    keys = [key for key, _ in policy.items()]
    return (
        [(key, block.block_id, block.ref_cnt) for key, block in policy.items()],
        len(policy),
        [(policy.value(key), policy.class_and_age(key)) for key in keys],
        policy.reuse_table(),
        policy.snapshot(),
    )


GUARD_OPS = ["insert"] * 4 + ["ready"] * 3 + ["pin", "unpin", "touch", "touch", "remove"]
GUARD_OPS += ["evict"] * 4


@pytest.mark.parametrize("native", IMPLS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), capacity=st.integers(1, 10))
def test_kv_never_evicts_busy_or_protected_blocks_and_is_all_or_nothing(
    native: bool, data: st.DataObject, capacity: int
) -> None:
    """Straight against the policy, with ref counts set freely and arbitrary protected
    sets, long enough for the table to be rebuilt."""
    policy = KVPolicy(capacity, native=native)
    blocks: dict[OffloadKey, BlockStatus] = {}
    for step in range(data.draw(st.integers(20, 150), label="n_ops")):
        c = Choices(data.draw(st.integers(0, 2**64 - 1)))
        kind = GUARD_OPS[c.below(len(GUARD_OPS))]
        tracked = list(blocks)
        if kind == "insert" and len(blocks) < capacity:
            keys = [k for k in c.subset(UNIVERSE, capacity - len(blocks)) if k not in blocks]
            for i, key in enumerate(keys):
                blocks[key] = BlockStatus(1000 * step + i)  # in flight
            policy.insert_many([(key, blocks[key]) for key in keys])
        elif kind == "ready":
            for key in c.subset([k for k in tracked if blocks[k].ref_cnt < 0], 3):
                blocks[key].ref_cnt = 0
        elif kind == "pin":
            for key in c.subset([k for k in tracked if blocks[k].ref_cnt >= 0], 2):
                blocks[key].ref_cnt += 1
        elif kind == "unpin":
            for key in c.subset([k for k in tracked if blocks[k].ref_cnt > 0], 2):
                blocks[key].ref_cnt -= 1
        elif kind == "remove":
            for key in c.subset([k for k in tracked if blocks[k].ref_cnt < 0], 2):
                del blocks[key]
                policy.remove(key)
        elif kind == "touch":
            policy.touch(c.chain() if c.below(2) else c.subset(UNIVERSE, 5))
        elif kind == "evict":
            n = c.below(len(blocks) + 2)
            protected = set(c.subset(tracked, len(tracked)))
            evictable = {
                key for key in tracked if blocks[key].ref_cnt == 0 and key not in protected
            }
            busy = {key: blocks[key].ref_cnt for key in tracked if key not in evictable}
            before = _state(policy)
            victims = policy.evict(n, protected)
            note(f"{step}: evict({n}, {len(evictable)} evictable) -> {victims is not None}")
            if n > len(evictable):
                assert victims is None
                assert _state(policy) == before
                continue
            assert victims is not None
            keys = [key for key, _ in victims]
            assert len(keys) == len(set(keys)) == n
            assert set(keys) <= evictable
            assert all(block is blocks[key] for key, block in victims)
            for key in keys:
                del blocks[key]
            # Busy and protected blocks are all still there, untouched.
            assert {key: blocks[key].ref_cnt for key in busy} == busy
        assert dict(policy.items()) == blocks
        assert len(policy) == len(blocks)


def _chain_manager(native: bool) -> tuple[ao.CPUOffloadingManager, list[OffloadKey]]:
    """A tier of 4 holding one request's 4 blocks, touched then stored."""
    m = _manager(4, native)
    chain = [_key(i, True) for i in range(4)]
    m.touch(chain)
    out = m.prepare_store(chain)
    assert out is not None
    m.complete_store(out.keys_to_store)
    return m, chain


def _evict_all(policy: KVPolicy, protected: set[OffloadKey] | None = None) -> list[OffloadKey]:
    """Evict every evictable block not in ``protected``; the order they went in."""
    protected = protected or set()
    n = sum(1 for key, block in policy.items() if block.ref_cnt == 0 and key not in protected)
    victims = policy.evict(n, protected)
    assert victims is not None
    return [key for key, _ in victims]


@pytest.mark.parametrize("native", IMPLS)
def test_pinned_block_is_never_evicted(native: bool) -> None:
    order = _evict_all(_kv(_chain_manager(native)[0]))  # on a twin
    m, _ = _chain_manager(native)
    first = order[0]
    m.prepare_load([first])  # being read: pinned
    new = [_key(10, True), _key(11, True), _key(12, True)]
    out = m.prepare_store(new)
    assert out is not None
    assert first not in out.evicted_keys
    assert out.evicted_keys == order[1:]
    # With the pinned block the only one left, there is no room.
    assert m.prepare_store([_key(13, True)]) is None
    m.complete_load([first])
    m.complete_store(new)
    out = m.prepare_store([_key(13, True)])
    assert out is not None
    assert out.evicted_keys == [first]  # unpinned, it goes first again


@pytest.mark.parametrize("native", IMPLS)
def test_in_flight_blocks_are_never_evicted(native: bool) -> None:
    m = _manager(3, native)
    keys = [_key(i, True) for i in range(3)]
    assert m.prepare_store(keys) is not None  # copies in flight
    before = _state(_kv(m))
    assert m.prepare_store([_key(5, True)]) is None
    assert _state(_kv(m)) == before
    m.complete_store(keys[:1])
    out = m.prepare_store([_key(5, True)])
    assert out is not None
    assert out.evicted_keys == keys[:1]  # the only ready one


@pytest.mark.parametrize("native", IMPLS)
def test_the_store_s_own_keys_are_protected(native: bool) -> None:
    order = _evict_all(_kv(_chain_manager(native)[0]))  # on a twin
    m, _ = _chain_manager(native)
    new = _key(20, True)
    # The store names the two blocks that would go first: they are kept, the next goes.
    out = m.prepare_store([order[0], order[1], new])
    assert out is not None
    assert out.keys_to_store == [new]
    assert out.evicted_keys == [order[2]]
    assert order[0] in m.policy and order[1] in m.policy


@pytest.mark.parametrize("native", IMPLS)
def test_infeasible_eviction_changes_nothing_and_behaves_as_if_never_called(
    native: bool,
) -> None:
    def build() -> ao.CPUOffloadingManager:
        m = _manager(8, native)
        reqs = Requests(m)
        _learn(reqs, rounds=40)
        chain = reqs.new(3)
        reqs.run(chain)
        m.prepare_load(chain[:1])
        return m

    m, twin = build(), build()
    policy, twin_policy = _kv(m), _kv(twin)
    assert _state(policy) == _state(twin_policy)
    assert policy.reuse_table() != [[1.0] * AGE_BINS for _ in range(NUM_CLASSES)]  # learned
    idle = [key for key, block in policy.items() if block.ref_cnt == 0]
    assert len(idle) == 7  # one of 8 pinned
    before = _state(policy)
    assert policy.evict(3, set(idle[2:])) is None  # two idle blocks left unprotected
    assert _state(policy) == before == _state(twin_policy)
    # Its later decisions are the twin's.
    outs = []
    for mgr in (m, twin):
        mgr.touch(idle[:3])
        out = mgr.prepare_store([_key(900, True), _key(901, True)])
        assert out is not None
        outs.append((out.keys_to_store, out.evicted_keys))
    assert outs[0] == outs[1]
    assert _state(policy) == _state(twin_policy)


# --- what the policy is for ------------------------------------------------------------


class Requests:
    """A serving engine's calls for a stream of requests: touch a request's keys, store
    the ones after its hits, complete the copy. New keys are numbered from 1000."""

    def __init__(self, m: ao.CPUOffloadingManager) -> None:
        self.m = m
        self.count = 1000
        #: The parent of each request's last block (the block before it).
        self.parent: dict[OffloadKey, OffloadKey] = {}

    def new(self, n: int) -> list[OffloadKey]:
        self.count += n
        return [_key(i, True) for i in range(self.count - n, self.count)]

    def run(self, keys: Sequence[OffloadKey]) -> ao.PrepareStoreOutput | None:
        m = self.m
        m.touch(keys)
        out = m.prepare_store(keys[m.lookup_prefix(keys) :])
        if out is not None and out.keys_to_store:
            m.complete_store(out.keys_to_store)
        if len(keys) > 1:
            self.parent[keys[-1]] = keys[-2]
        return out


def _learn(reqs: Requests, rounds: int = 120) -> None:
    """Requests of two blocks, ``[x, last]``. Last blocks are never used again; one ``x``
    in four is, by a request of the next round and by another 1 to 8 rounds later, the
    other ``x`` never. So a block used once is used again a quarter of the time, soon or
    never; a block used twice always is, within some 15 touches."""
    later: dict[int, list[OffloadKey]] = {}
    for i in range(rounds):
        x, last = reqs.new(2)
        reqs.run([x, last])
        if i % 4 == 0:
            later.setdefault(i + 1, []).append(x)
            later.setdefault(i + 1 + (i // 4) % 8, []).append(x)
        for y in later.pop(i, []):
            reqs.run([y, *reqs.new(1)])


def _learned(native: bool) -> tuple[ao.CPUOffloadingManager, Requests, KVPolicy]:
    m = _manager(16, native)
    reqs = Requests(m)
    _learn(reqs)
    return m, reqs, _kv(m)


@pytest.mark.parametrize("native", IMPLS)
def test_learned_table_reflects_the_workload(native: bool) -> None:
    _, _, policy = _learned(native)
    table = policy.reuse_table()
    assert all(v == 0.0 for v in table[LAST])  # never used again
    assert 0.0 < table[ONCE][0] < 0.5  # used again a quarter of the time
    assert all(table[TWICE][b] > 2 * table[ONCE][b] for b in range(5))
    assert table[TWICE][0] == 1.0
    # The monotone fixes: non-increasing in age, non-decreasing in uses, a last block
    # worth at most a once-used block of its size.
    for c in range(NUM_CLASSES):
        assert all(a >= b for a, b in zip(table[c], table[c][1:]))
    for c in range(SIZE_BUCKETS, TAIL):
        assert all(a >= b for a, b in zip(table[c], table[c - SIZE_BUCKETS]))
    for s in range(SIZE_BUCKETS):
        assert all(a <= b for a, b in zip(table[TAIL + s], table[s]))


@pytest.mark.parametrize("native", IMPLS)
def test_twice_used_old_block_outlives_once_used_younger_one(native: bool) -> None:
    results = {}
    for name in ("kv", "lru"):
        m = _manager(16, native) if name == "kv" else ao.CPUOffloadingManager(16, "lru")
        reqs = Requests(m)
        _learn(reqs)
        old, young = reqs.new(2)
        reqs.run([old, *reqs.new(1)])
        reqs.run([old, *reqs.new(1)])  # old: used twice
        for _ in range(3):
            reqs.run(reqs.new(2))
        reqs.run([young, *reqs.new(1)])  # young: used once, later
        assert old in m.policy and young in m.policy
        if name == "kv":
            policy = _kv(m)
            old_class, old_age = policy.class_and_age(old) or (-1, -1)
            young_class, young_age = policy.class_and_age(young) or (-1, -1)
            assert (old_class, young_class) == (TWICE, ONCE)
            assert old_age > young_age
            assert (policy.value(old) or 0.0) > (policy.value(young) or 0.0)
        others = {key for key, _ in m.policy.items()} - {old, young}
        victims = m.policy.evict(1, others)
        assert victims is not None
        results[name] = victims[0][0]
    assert results == {"kv": young, "lru": old}


@pytest.mark.parametrize("native", IMPLS)
def test_never_reused_last_blocks_go_first_and_a_request_is_cut_from_its_end(
    native: bool,
) -> None:
    def build() -> tuple[KVPolicy, list[OffloadKey]]:
        _, reqs, policy = _learned(native)
        chain = reqs.new(4)
        reqs.run(chain)
        return policy, chain

    policy, chain = build()
    assert [policy.class_and_age(key) for key in chain] == [(ONCE, 0)] * 3 + [(LAST, 0)]
    assert policy.value(chain[3]) == 0.0 < (policy.value(chain[2]) or 0.0)
    values = {key: policy.value(key) or 0.0 for key, _ in policy.items()}
    order = _evict_all(policy)
    assert order.index(chain[3]) < order.index(chain[2]) < order.index(chain[1])
    assert order.index(chain[1]) < order.index(chain[0])
    # Every block worth nothing goes before any block worth something.
    assert [values[key] for key in order] == sorted(values.values())
    # Among the request's own blocks: its last block, then from its end.
    policy, chain = build()
    others = {key for key, _ in policy.items()} - set(chain)
    assert _evict_all(policy, others) == chain[::-1]


@pytest.mark.parametrize("native", IMPLS)
def test_never_reused_last_blocks_are_declined_only_when_the_store_would_evict(
    native: bool,
) -> None:
    m, reqs, policy = _learned(native)
    y = reqs.new(2)
    reqs.run(y)
    # Pin every block worth nothing, so that the next eviction takes one worth something.
    zero = [key for key, _ in policy.items() if policy.value(key) == 0.0]
    assert y[1] in zero and y[0] not in zero
    m.prepare_load(zero)
    z = _key(1, True)  # never seen: always admitted
    out = m.prepare_store([z])
    assert out is not None and len(out.evicted_keys) == 1
    assert out.evicted_keys[0] not in zero
    m.complete_store([z])
    # A new request: its first block is worth at least what just went, its last block
    # (never reused here) is worth less.
    n0, n1 = reqs.new(2)
    m.touch([n0, n1])
    before = _state(policy)
    assert list(policy.admissible([n0, n1], True)) == [n0]
    assert list(policy.admissible([n0, n1], False)) == [n0, n1]
    assert _state(policy) == before  # deciding changes nothing
    out = m.prepare_store([n0, n1])
    assert out is not None
    assert out.keys_to_store == [n0]
    assert len(out.evicted_keys) == 1
    m.complete_store([n0])
    # Free one slot (a failed store), then offer a one-block request: its only block is
    # a last block worth nothing, declined when storing it would evict, stored when it fits.
    w = _key(2, True)
    out = m.prepare_store([w])
    assert out is not None
    m.complete_store([w], success=False)
    assert m.num_free == 1
    (q,) = reqs.new(1)
    m.touch([q])
    assert policy.class_and_age(q) is None
    assert list(policy.admissible([q], True)) == []
    out = m.prepare_store([q])
    assert out is not None
    assert (out.keys_to_store, out.evicted_keys) == ([q], [])
    assert policy.class_and_age(q) == (LAST, 0)


@pytest.mark.parametrize("native", IMPLS)
def test_no_last_block_outlives_its_parent(native: bool) -> None:
    _, reqs, policy = _learned(native)
    resident = {key for key, _ in policy.items()}
    orphans = [key for key in resident if key in reqs.parent and reqs.parent[key] not in resident]
    assert orphans == []


@pytest.mark.parametrize("native", IMPLS)
def test_a_store_goes_in_deepest_first(native: bool) -> None:
    m = _manager(6, native)
    chain = [_key(i, True) for i in range(4)]
    out = m.prepare_store(chain)  # never touched: all once-used blocks
    assert out is not None
    m.complete_store(chain)
    policy = _kv(m)
    assert [key for key, _ in policy.items()] == chain[::-1]
    assert _evict_all(policy) == chain[::-1]
    # The same through insert_many directly, given parent first.
    direct = KVPolicy(6, native=native)
    direct.insert_many([(key, _ready(i)) for i, key in enumerate(chain)])
    assert [key for key, _ in direct.items()] == chain[::-1]
    direct.insert(_key(9, True), _ready(9))
    assert [key for key, _ in direct.items()] == [*chain[::-1], _key(9, True)]


# --- classes, learning cadence, memory -------------------------------------------------


def test_kv_is_registered() -> None:
    assert "kv" in available_policies()
    assert get_policy_cls("kv") is KVPolicy
    assert ao.CPUOffloadingManager(4, "kv").policy_name == "kv"


@pytest.mark.parametrize(
    ("capacity", "ghost_factor", "half_life"),
    [
        (0, 4.0, 4.0),
        (4, -1.0, 4.0),
        (4, math.nan, 4.0),
        (4, 4.0, 0.0),
        (4, 4.0, -2.0),
        (4, 4.0, math.nan),
    ],
)
def test_invalid_construction_rejected(
    capacity: int, ghost_factor: float, half_life: float
) -> None:
    with pytest.raises(ValueError):
        KVPolicy(capacity, ghost_factor=ghost_factor, half_life=half_life)


def test_size_buckets_and_classes() -> None:
    assert [size_bucket(n) for n in (0, 1, 15, 16, 63, 64, 10_000)] == [0, 0, 0, 1, 1, 2, 2]
    assert [ref_size_bucket(n) for n in (0, 1, 15, 16, 63, 64, 10_000)] == [0, 0, 0, 1, 1, 2, 2]
    for s in range(SIZE_BUCKETS):
        assert class_of(1, s, last=True) == TAIL + s
        assert class_of(2, s, last=True) == class_of(2, s) == SIZE_BUCKETS + s
        assert class_of(4, s) == class_of(9, s) == (USE_BUCKETS - 1) * SIZE_BUCKETS + s


@pytest.mark.parametrize("native", IMPLS)
@pytest.mark.parametrize("length", [1, 15, 16, 63, 64])
def test_touch_classes_by_uses_length_and_last_block(native: bool, length: int) -> None:
    policy = KVPolicy(128, native=native)
    keys = [_key(i, True) for i in range(length)]
    size = size_bucket(length)
    policy.touch(keys)
    policy.insert_many([(key, _ready(i)) for i, key in enumerate(keys)])
    want = [class_of(1, size)] * (length - 1) + [class_of(1, size, last=True)]
    assert [(policy.class_and_age(key) or (-1,))[0] for key in keys] == want
    for uses in (2, 3, 4, 5):
        policy.touch(keys)
        assert {(policy.class_and_age(key) or (-1,))[0] for key in keys} == {class_of(uses, size)}
    # A short request touching one of them now moves it to its own length bucket.
    policy.touch(keys[:1])
    assert policy.class_and_age(keys[0]) == (class_of(4, 0), 0)


@pytest.mark.parametrize("native", IMPLS)
def test_a_key_listed_twice_in_one_touch_counts_once(native: bool) -> None:
    policy = KVPolicy(8, native=native)
    a, b = _key(0, True), _key(1, True)
    policy.touch([a, b, a])
    policy.insert_many([(a, _ready(0)), (b, _ready(1))])
    # a is the last block of that request (it is listed last), b is not.
    assert policy.class_and_age(a) == (LAST, 0)
    assert policy.class_and_age(b) == (ONCE, 0)
    policy.touch([a, a])
    assert policy.class_and_age(a) == (TWICE, 0)


@pytest.mark.parametrize("native", IMPLS)
@pytest.mark.parametrize(("capacity", "every"), [(8, 64), (1024, 128)])
def test_table_rebuilt_every_max_64_or_an_eighth_of_capacity_inserts(
    native: bool, capacity: int, every: int
) -> None:
    policy = KVPolicy(capacity, native=native)
    fresh = [[1.0] * AGE_BINS for _ in range(NUM_CLASSES)]
    keys = [_key(i, True) for i in range(every)]
    for i, key in enumerate(keys[:-1]):
        policy.insert(key, _ready(i))
    assert policy.reuse_table() == fresh
    policy.insert(keys[-1], _ready(every))
    # Blocks stored and never touched: nothing was reused.
    assert policy.reuse_table() == [[0.0] * AGE_BINS for _ in range(NUM_CLASSES)]


@pytest.mark.parametrize("native", IMPLS)
def test_only_sampled_keys_teach(native: bool) -> None:
    tables = []
    for sampled in (True, False):
        policy = KVPolicy(64, native=native)
        for i in range(0, 64, 2):
            a, b = _key(i, sampled), _key(i + 1, sampled)
            policy.touch([a, b])
            policy.insert_many([(a, _ready(i)), (b, _ready(i + 1))])
            policy.touch([a, b])
        tables.append(policy.reuse_table())
    # Every last block was used again, but the table was rebuilt at the 64th insert, before
    # the last pair's second touch: 31 of 32.
    assert tables[0][TAIL][0] == 31 / 32
    assert tables[1] == [[0.0] * AGE_BINS for _ in range(NUM_CLASSES)]  # nothing learned


def _ghosts(policy: KVPolicy) -> list[OffloadKey]:
    """The keys ``policy`` remembers without holding them, oldest first."""
    rows: list[tuple[OffloadKey, int, int, int]] = policy.snapshot()["ghost"]
    return [row[0] for row in rows]


def _fresh(policy: KVPolicy) -> list[OffloadKey]:
    rows: list[tuple[OffloadKey, int, int, int]] = policy.snapshot()["fresh"]
    return [row[0] for row in rows]


@pytest.mark.parametrize("native", IMPLS)
def test_kv_ghost_memory_is_bounded_and_forgets_the_oldest(native: bool) -> None:
    policy = KVPolicy(2, ghost_factor=1.5, native=native)  # remembers 3 keys
    g = [_key(i, True) for i in range(6)]
    for i in range(4):
        policy.insert(g[i], _ready(i))
        assert [key for key, _ in policy.evict(1, ()) or []] == [g[i]]
    assert _ghosts(policy) == g[1:4]  # g0 forgotten
    policy.touch([g[1]])  # touching a remembered key makes it the most recent
    assert _ghosts(policy) == [g[2], g[3], g[1]]
    policy.insert(g[4], _ready(4))
    assert [key for key, _ in policy.evict(1, ()) or []] == [g[4]]
    assert _ghosts(policy) == [g[3], g[1], g[4]]
    # A remembered key's next touch counts a second use; a forgotten one's, a first.
    policy.touch([g[3], g[0], _key(99, True)])
    policy.insert_many([(g[3], _ready(3)), (g[0], _ready(0))])
    assert (policy.class_and_age(g[3]), policy.class_and_age(g[0])) == ((TWICE, 0), (ONCE, 0))
    assert g[3] not in _ghosts(policy)  # stored again: not a ghost


@pytest.mark.parametrize("native", IMPLS)
def test_keys_touched_and_not_stored_are_remembered_from_the_next_touch(native: bool) -> None:
    f, last, other = _key(0, True), _key(1, True), _key(2, True)
    for ghost_factor, ghosts in ((4.0, [last, f]), (0.0, [])):
        policy = KVPolicy(4, ghost_factor=ghost_factor, native=native)
        policy.touch([f, last])  # first seen (deepest first), not stored
        assert (_fresh(policy), _ghosts(policy)) == ([last, f], [])
        policy.touch([other])  # ghosts now (forgotten at once without ghost memory)
        assert (_fresh(policy), _ghosts(policy)) == ([other], ghosts)
    # Stored right after its touch, a first-seen key keeps the class that touch gave it.
    policy = KVPolicy(4, native=native)
    policy.touch([f, last])
    policy.insert_many([(f, _ready(0)), (last, _ready(1))])
    assert [policy.class_and_age(f), policy.class_and_age(last)] == [(ONCE, 0), (LAST, 0)]
    assert _fresh(policy) == []


@pytest.mark.parametrize("native", IMPLS)
def test_failed_store_forgets_the_key_and_clear_forgets_everything(native: bool) -> None:
    policy = KVPolicy(4, native=native)
    a, b = _key(0, True), _key(1, True)
    policy.touch([a, b])
    policy.insert_many([(a, BlockStatus(0)), (b, BlockStatus(1))])
    policy.remove(a)  # its store failed: no ghost entry, no history
    assert a not in policy and policy.get(a) is None
    assert _ghosts(policy) == [] and a not in {
        row[0] for q in policy.snapshot()["queues"] for row in q
    }
    policy.touch([a])
    policy.insert(a, _ready(0))
    assert policy.class_and_age(a) == (LAST, 0)  # first seen again
    policy.remove(_key(7, True))  # unknown: ignored
    policy.clear()
    assert len(policy) == 0 and list(policy.items()) == []
    assert policy.reuse_table() == [[1.0] * AGE_BINS for _ in range(NUM_CLASSES)]
    assert (_fresh(policy), _ghosts(policy)) == ([], [])
    assert policy.snapshot()["tick"] == 0


@pytest.mark.parametrize("native", IMPLS)
def test_reset_cache_clears_what_kv_learned(native: bool) -> None:
    m, _, policy = _learned(native)
    assert policy.reuse_table() != [[1.0] * AGE_BINS for _ in range(NUM_CLASSES)]
    m.reset_cache()
    assert policy.reuse_table() == [[1.0] * AGE_BINS for _ in range(NUM_CLASSES)]
    assert len(policy) == 0 and _ghosts(policy) == []


def test_native_and_python_agree_on_a_learned_workload() -> None:
    if load_kvcore() is None:
        pytest.skip("the C core does not build here")
    states = []
    for native in (False, True):
        m, reqs, policy = _learned(native)
        assert policy.native is native
        reqs.run(reqs.new(70))  # a long request: the last length bucket
        states.append((_state(policy), m.stats()))
    assert states[0] == states[1]
