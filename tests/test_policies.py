"""Cache policies against brute-force reference models, and manager invariants, over random
operation sequences.

The references below are written plainly (lists scanned front to back, LRU first) so that
they are easy to check by eye against the documented semantics; the real policies use
ordered dicts and incremental scans.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import asyncoffload as ao
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import BlockStatus
from asyncoffload.manager.policies import ARCPolicy

POLICIES = ao.available_policies()
UNIVERSE = 12
KEYS = [ao.make_offload_key(bytes([i]) * 8) for i in range(UNIVERSE)]
NAMES = {key: i for i, key in enumerate(KEYS)}

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# Operation kinds, repeated to weight how often each is drawn: mostly completed stores and
# touches, so that sequences evict, build ghost lists and move ARC's target.
OP_KINDS = (
    ["store"] * 2
    + ["store_done"] * 6
    + ["complete_ok"] * 2
    + ["complete_fail"]
    + ["load"] * 2
    + ["complete_load"] * 2
    + ["touch"] * 5
    + ["lookup"]
    + ["store_dup"]
    + ["reset"]
)


# --- reference policies ----------------------------------------------------------------


class RefLRU:
    """LRU as one list, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.order: list[OffloadKey] = []

    def insert(self, key: OffloadKey) -> None:
        self.order.append(key)

    def remove(self, key: OffloadKey) -> None:
        self.order.remove(key)

    def touch(self, keys: Sequence[OffloadKey], is_ready: Callable[[OffloadKey], bool]) -> None:
        for key in reversed(keys):
            if key in self.order:
                self.order.remove(key)
                self.order.append(key)

    def evict(self, n: int, evictable: Callable[[OffloadKey], bool]) -> list[OffloadKey] | None:
        victims = [key for key in self.order if evictable(key)][:n]
        if len(victims) < n:
            return None
        for key in victims:
            self.order.remove(key)
        return victims

    def blocks_order(self) -> list[OffloadKey]:
        return list(self.order)

    def clear(self) -> None:
        self.order = []


class RefARC:
    """ARC as four lists (LRU first) and a float target for |T1|, vLLM's touch-driven variant.

    Eviction prefers T1 while |T1| >= int(target), else T2, and falls back to the other list
    when the preferred one has no evictable block (unlike vLLM, which gives up when T2 has
    none).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target = 0.0
        self.t1: list[OffloadKey] = []
        self.t2: list[OffloadKey] = []
        self.b1: list[OffloadKey] = []
        self.b2: list[OffloadKey] = []

    def insert(self, key: OffloadKey) -> None:
        self.t1.append(key)
        if key in self.b1:
            self.b1.remove(key)
        if key in self.b2:
            self.b2.remove(key)

    def remove(self, key: OffloadKey) -> None:
        if key in self.t1:
            self.t1.remove(key)
        else:
            self.t2.remove(key)

    def touch(self, keys: Sequence[OffloadKey], is_ready: Callable[[OffloadKey], bool]) -> None:
        for key in reversed(keys):
            if key in self.t1:
                self.t1.remove(key)
                if is_ready(key):
                    self.t2.append(key)
                else:
                    self.t1.append(key)
            elif key in self.t2:
                self.t2.remove(key)
                self.t2.append(key)
            elif key in self.b1:
                step = max(1.0, len(self.b2) / len(self.b1))
                self.target = min(self.target + step, float(self.capacity))
                self.b1.remove(key)
                self.b1.append(key)
            elif key in self.b2:
                step = max(1.0, len(self.b1) / len(self.b2))
                self.target = max(self.target - step, 0.0)
                self.b2.remove(key)
                self.b2.append(key)

    def evict(self, n: int, evictable: Callable[[OffloadKey], bool]) -> list[OffloadKey] | None:
        # Work on copies; commit only if all n victims were found.
        t1, t2, b1, b2 = list(self.t1), list(self.t2), list(self.b1), list(self.b2)
        victims: list[OffloadKey] = []
        for _ in range(n):
            from_t1 = [key for key in t1 if evictable(key)]
            from_t2 = [key for key in t2 if evictable(key)]
            if len(t1) >= int(self.target):
                choices = [(from_t1, t1, b1), (from_t2, t2, b2)]
            else:
                choices = [(from_t2, t2, b2), (from_t1, t1, b1)]
            for candidates, lst, ghosts in choices:
                if candidates:
                    victim = candidates[0]
                    lst.remove(victim)
                    ghosts.append(victim)
                    victims.append(victim)
                    break
            else:
                return None
        while len(b1) > self.capacity:
            b1.pop(0)
        while len(b2) > self.capacity:
            b2.pop(0)
        self.t1, self.t2, self.b1, self.b2 = t1, t2, b1, b2
        return victims

    def blocks_order(self) -> list[OffloadKey]:
        return self.t1 + self.t2

    def clear(self) -> None:
        self.target = 0.0
        self.t1, self.t2, self.b1, self.b2 = [], [], [], []


RefPolicy = RefLRU | RefARC


# --- reference manager -----------------------------------------------------------------


class RefManager:
    """The manager's contract, brute force: slots, ref counts, offers, events."""

    def __init__(self, num_blocks: int, policy: RefPolicy, store_threshold: int) -> None:
        self.num_blocks = num_blocks
        self.policy = policy
        self.threshold = store_threshold
        self.slot: dict[OffloadKey, int] = {}
        self.ref: dict[OffloadKey, int] = {}  # -1 writing, 0 idle, n > 0 pinned n times
        self.next_fresh = 0
        self.freed: list[int] = []  # a stack: the last freed is reused first
        self.offers: dict[OffloadKey, int] = {}
        self.events: list[tuple[bool, tuple[OffloadKey, ...]]] = []

    def lookup(self, key: OffloadKey) -> ao.LookupResult:
        if key not in self.ref:
            return ao.LookupResult.MISS
        return ao.LookupResult.HIT if self.ref[key] >= 0 else ao.LookupResult.HIT_PENDING

    def prepare_load(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        if len(set(keys)) < len(keys):
            raise ao.DuplicateKeyError("duplicate")
        for key in keys:
            if key not in self.ref:
                raise ao.UnknownKeyError("unknown")
            if self.ref[key] < 0:
                raise ao.KeyNotReadyError("not ready")
        for key in keys:
            self.ref[key] += 1
        return tuple(self.slot[key] for key in keys)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        for key, count in Counter(keys).items():
            if self.ref.get(key, -1) < count:
                raise ValueError("not pinned")
        for key in keys:
            self.ref[key] -= 1

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.policy.touch(keys, lambda key: self.ref[key] >= 0)

    def prepare_store(
        self, keys: Sequence[OffloadKey]
    ) -> tuple[list[OffloadKey], tuple[int, ...], list[OffloadKey]] | None:
        if len(set(keys)) < len(keys):
            raise ao.DuplicateKeyError("duplicate")
        offered = [key for key in keys if key not in self.ref]
        counts = {key: self.offers.get(key, 0) + 1 for key in offered}
        if self.threshold >= 2:
            to_store = [key for key in offered if counts[key] >= self.threshold]
        else:
            to_store = offered
        victims: list[OffloadKey] = []
        free = self.num_blocks - self.next_fresh + len(self.freed)
        if to_store and len(to_store) > free:
            found = self.policy.evict(
                len(to_store) - free, lambda key: self.ref[key] == 0 and key not in keys
            )
            if found is None:
                return None  # nothing changed, offers included
            victims = found
            for key in victims:
                del self.ref[key]
                self.freed.append(self.slot.pop(key))
            self.events.append((True, tuple(victims)))
        if self.threshold >= 2:
            for key in offered:
                self.offers.pop(key, None)
                if key not in to_store:
                    self.offers[key] = counts[key]
        ids: list[int] = []
        for key in to_store:
            if self.next_fresh < self.num_blocks:
                ids.append(self.next_fresh)
                self.next_fresh += 1
            else:
                ids.append(self.freed.pop())
            self.slot[key] = ids[-1]
            self.ref[key] = -1
            self.policy.insert(key)
        return to_store, tuple(ids), victims

    def complete_store(self, keys: Sequence[OffloadKey], success: bool) -> None:
        done: list[OffloadKey] = []
        for key in keys:
            if self.ref.get(key, 0) >= 0:
                continue  # unknown, ready, or already handled in this call
            if success:
                self.ref[key] = 0
            else:
                del self.ref[key]
                self.freed.append(self.slot.pop(key))
                self.policy.remove(key)
            done.append(key)
        if success and done:
            self.events.append((False, tuple(done)))

    def reset_cache(self) -> None:
        ready = [key for key in self.policy.blocks_order() if self.ref[key] >= 0]
        if ready:
            self.events.append((True, tuple(ready)))
        self.slot.clear()
        self.ref.clear()
        self.next_fresh = 0
        self.freed.clear()
        self.offers.clear()
        self.policy.clear()

    def take_events(self) -> list[tuple[bool, tuple[OffloadKey, ...]]]:
        events, self.events = self.events, []
        return events

    def blocks(self) -> list[tuple[OffloadKey, int, int]]:
        return [(key, self.slot[key], self.ref[key]) for key in self.policy.blocks_order()]


# --- drawing operations ----------------------------------------------------------------


@dataclass
class KeyStates:
    """What a caller knows about each key, from the manager's answers (policy-agnostic)."""

    pending: set[OffloadKey] = field(default_factory=set)
    ready: set[OffloadKey] = field(default_factory=set)
    pins: Counter[OffloadKey] = field(default_factory=Counter)
    evicted: list[OffloadKey] = field(default_factory=list)  # most recent last

    def idle(self) -> set[OffloadKey]:
        return {key for key in self.ready if self.pins[key] == 0}


@dataclass
class Op:
    kind: str
    keys: list[OffloadKey]
    success: bool = True
    then_complete: bool = False  # a store whose copy completes at once (the next op)

    def __repr__(self) -> str:
        names = [NAMES[key] for key in self.keys]
        return f"{self.kind}({names}{'' if self.success else ', success=False'})"


# Draws go through strategies over index ranges, which hypothesis caches by their
# arguments; building a fresh ``sampled_from(list)`` per draw is several times slower.
def _index(data: st.DataObject, n: int) -> int:
    return data.draw(st.integers(0, n - 1))


def _keys(data: st.DataObject, pool: Sequence[OffloadKey], max_size: int) -> list[OffloadKey]:
    if not pool:
        return []
    picks = data.draw(st.lists(st.integers(0, len(pool) - 1), unique=True, max_size=max_size))
    return [pool[i] for i in picks]


def _some_key(data: st.DataObject) -> OffloadKey:
    return KEYS[_index(data, UNIVERSE)]


def draw_op(data: st.DataObject, states: KeyStates) -> Op:
    kind = OP_KINDS[_index(data, len(OP_KINDS))]
    if kind in ("store", "store_done", "store_dup"):
        keys = _keys(data, KEYS, 4)
        if kind == "store_dup" and keys:
            keys.append(keys[_index(data, len(keys))])
        return Op("store", keys, then_complete=kind == "store_done")
    if kind in ("complete_ok", "complete_fail"):
        keys = _keys(data, sorted(states.pending), 4)
        if data.draw(st.integers(0, 4)) == 0:
            keys.append(_some_key(data))  # unknown, ready or repeated: ignored
        return Op("complete_store", keys, success=kind == "complete_ok")
    if kind == "load":
        keys = _keys(data, sorted(states.ready), 3)
        if data.draw(st.integers(0, 3)) == 0:
            keys.append(_some_key(data))  # may be missing, pending or a duplicate
        return Op("prepare_load", keys)
    if kind == "complete_load":
        pinned = sorted(states.pins.elements())
        keys = []
        if pinned:
            picks = data.draw(st.lists(st.integers(0, len(pinned) - 1), unique=True, max_size=3))
            keys = [pinned[i] for i in picks]  # a key pinned twice may be released twice
        if data.draw(st.integers(0, 4)) == 0:
            keys.append(_some_key(data))  # may be over-released: ValueError
        return Op("complete_load", keys)
    if kind == "touch":
        # Half the time, re-request recently evicted blocks (ARC's ghost hits).
        recent = states.evicted[-6:] if data.draw(st.booleans()) else KEYS
        return Op("touch", _keys(data, recent, 4))
    if (
        kind == "reset"
        and not states.pins
        and not states.pending
        and data.draw(st.integers(0, 3)) == 0
    ):
        return Op("reset_cache", [])  # rare, and only with no transfer in flight
    return Op("lookup", [_some_key(data)])


# --- running operations ----------------------------------------------------------------

Outcome = tuple[object, ...]


def run_real(m: ao.CPUOffloadingManager, op: Op) -> Outcome:
    """Apply ``op``; what it returned or raised, and the events it published."""
    result: object = None
    try:
        if op.kind == "store":
            out = m.prepare_store(op.keys)
            if out is not None:
                result = (out.keys_to_store, out.store_spec.block_ids, out.evicted_keys)
        elif op.kind == "complete_store":
            m.complete_store(op.keys, success=op.success)
        elif op.kind == "prepare_load":
            result = m.prepare_load(op.keys).block_ids
        elif op.kind == "complete_load":
            m.complete_load(op.keys)
        elif op.kind == "touch":
            m.touch(op.keys)
        elif op.kind == "lookup":
            result = m.lookup(op.keys[0])
        else:
            m.reset_cache()
    except (KeyError, ValueError) as exc:
        result = type(exc)
    events = m.take_events()
    # seq grows by one per event: this call's events end at last_seq, with no gap.
    assert [e.seq for e in events] == list(range(m.last_seq - len(events) + 1, m.last_seq + 1))
    assert all(e.medium is ao.Medium.CPU and not e.snapshot for e in events)
    return result, [(e.removed, e.keys) for e in events]


def run_ref(ref: RefManager, op: Op) -> Outcome:
    result: object = None
    try:
        if op.kind == "store":
            result = ref.prepare_store(op.keys)
        elif op.kind == "complete_store":
            ref.complete_store(op.keys, op.success)
        elif op.kind == "prepare_load":
            result = ref.prepare_load(op.keys)
        elif op.kind == "complete_load":
            ref.complete_load(op.keys)
        elif op.kind == "touch":
            ref.touch(op.keys)
        elif op.kind == "lookup":
            result = ref.lookup(op.keys[0])
        else:
            ref.reset_cache()
    except (KeyError, ValueError) as exc:
        result = type(exc)
    return result, ref.take_events()


def follow_up(op: Op, outcome: Outcome) -> Op | None:
    """The completion of a ``then_complete`` store, if it reserved anything."""
    result = outcome[0]
    if op.then_complete and isinstance(result, tuple) and result[0]:
        assert isinstance(result[0], list)
        return Op("complete_store", result[0])
    return None


def update_states(states: KeyStates, op: Op, outcome: Outcome) -> None:
    """Follow the manager's answers: what is pending, ready and pinned now."""
    result, events = outcome
    if isinstance(result, type):
        return  # rejected: nothing changed
    if op.kind == "store" and result is not None:
        assert isinstance(result, tuple)
        states.pending.update(result[0])
    elif op.kind == "complete_store":
        done = states.pending.intersection(op.keys)
        states.pending -= done
        if op.success:
            states.ready |= done
    elif op.kind == "prepare_load":
        states.pins.update(op.keys)
    elif op.kind == "complete_load":
        states.pins.subtract(op.keys)
        states.pins = +states.pins
    elif op.kind == "reset_cache":
        states.pending.clear()
        states.ready.clear()
    assert isinstance(events, list)
    for removed, keys in events:
        if removed:
            states.ready.difference_update(keys)
            states.evicted = [k for k in states.evicted if k not in keys] + list(keys)


def real_blocks(m: ao.CPUOffloadingManager) -> list[tuple[OffloadKey, int, int]]:
    return [(key, block.block_id, block.ref_cnt) for key, block in m.policy.items()]


def _norm(value: object) -> object:
    if isinstance(value, BlockStatus):
        return (value.block_id, value.ref_cnt)
    if isinstance(value, dict):
        return [(k, _norm(v)) for k, v in value.items()]
    return value


class Snapshot(NamedTuple):
    stats: ao.ManagerStats  # lookup counters zeroed
    blocks: list[tuple[OffloadKey, int, int]]
    resident: list[OffloadKey]
    last_seq: int
    policy_state: list[tuple[str, str]]  # every attribute: ghosts, targets, ...


def fingerprint(m: ao.CPUOffloadingManager) -> Snapshot:
    return Snapshot(
        m.stats()._replace(lookups=0, hits=0),
        real_blocks(m),
        list(m.resident_keys()),
        m.last_seq,
        sorted((name, repr(_norm(v))) for name, v in vars(m.policy).items()),
    )


# --- (1), (2): policies against their references ---------------------------------------


def _lockstep(data: st.DataObject, policy: str, ref_policy: RefPolicy, num_blocks: int) -> None:
    threshold = data.draw(st.sampled_from([0, 0, 2]), label="store_threshold")
    m = ao.CPUOffloadingManager(num_blocks, policy=policy, store_threshold=threshold)
    ref = RefManager(num_blocks, ref_policy, threshold)
    states = KeyStates()
    n_ops = data.draw(st.integers(1, 80), label="n_ops")
    queued: Op | None = None
    for step in range(n_ops):
        op = queued or draw_op(data, states)
        note(f"{step}: {op!r}")
        got, want = run_real(m, op), run_ref(ref, op)
        assert got == want, f"step {step} {op!r}: manager {got} != reference {want}"
        update_states(states, op, got)
        queued = follow_up(op, got)
        assert real_blocks(m) == ref.blocks()
        if isinstance(ref_policy, RefARC):
            arc = m.policy
            assert isinstance(arc, ARCPolicy)
            assert (list(arc.t1), list(arc.t2)) == (ref_policy.t1, ref_policy.t2)
            assert (list(arc.b1), list(arc.b2)) == (ref_policy.b1, ref_policy.b2)
            assert arc.target_t1 == ref_policy.target
        else:
            assert list(m.resident_keys()) == [k for k in ref_policy.order if ref.ref[k] >= 0]


@SETTINGS
@given(data=st.data(), num_blocks=st.integers(1, 6))
def test_lru_matches_reference_model(data: st.DataObject, num_blocks: int) -> None:
    _lockstep(data, "lru", RefLRU(num_blocks), num_blocks)


@SETTINGS
@given(data=st.data(), num_blocks=st.integers(1, 6))
def test_arc_matches_reference_model(data: st.DataObject, num_blocks: int) -> None:
    _lockstep(data, "arc", RefARC(num_blocks), num_blocks)


# --- (3): invariants of the manager, for every registered policy -----------------------


def check_invariants(
    m: ao.CPUOffloadingManager, states: KeyStates, replayed: set[OffloadKey]
) -> None:
    stats = m.stats()
    blocks = real_blocks(m)
    assert stats.free + stats.ready + stats.write_pending == m.num_blocks
    assert stats.free == m.num_free >= 0
    assert len(blocks) == stats.ready + stats.write_pending == len(m.policy)
    slots = [slot for _, slot, _ in blocks]
    assert len(set(slots)) == len(slots)
    assert all(0 <= slot < m.num_blocks for slot in slots)
    assert {k for k, _, ref in blocks if ref < 0} == states.pending
    assert {k for k, _, ref in blocks if ref >= 0} == states.ready
    assert {k: ref for k, _, ref in blocks if ref > 0} == dict(states.pins)
    assert stats.pinned == len(states.pins)
    assert set(m.resident_keys()) == states.ready == replayed
    for key in KEYS:
        block = m.block_of(key)
        assert (block is not None) == (key in m.policy)


@pytest.mark.parametrize("policy", POLICIES)
@SETTINGS
@given(data=st.data(), num_blocks=st.integers(1, 6))
def test_manager_invariants_hold(policy: str, data: st.DataObject, num_blocks: int) -> None:
    m = ao.CPUOffloadingManager(num_blocks, policy=policy)
    states = KeyStates()
    replayed: set[OffloadKey] = set()
    last_seq = 0
    n_ops = data.draw(st.integers(1, 80), label="n_ops")
    queued: Op | None = None
    for step in range(n_ops):
        op = queued or draw_op(data, states)
        note(f"{step}: {op!r}")
        before = fingerprint(m)
        free_before = m.num_free
        idle_before = states.idle()
        pinned_before, pending_before = set(states.pins), set(states.pending)

        result, events = run_real(m, op)
        assert isinstance(events, list)

        # Events: with run_real's check, seqs continue from the last op's without a gap.
        assert m.last_seq == last_seq + len(events)
        last_seq = m.last_seq
        # Replaying them tracks the resident set (checked in check_invariants).
        for removed, keys in events:
            if removed:
                replayed.difference_update(keys)
            else:
                replayed.update(keys)

        if isinstance(result, type):  # rejected: nothing changed
            assert fingerprint(m) == before
            assert events == []
        elif op.kind == "store":
            absent = [k for k in op.keys if k not in pending_before | states.ready]
            shortfall = len(absent) - free_before
            evictable = idle_before - set(op.keys)
            if result is None:
                # Refused only when too few idle, unprotected, ready blocks exist, and then
                # all or nothing.
                assert shortfall > 0
                assert len(evictable) < shortfall
                assert fingerprint(m) == before
                assert events == []
            else:
                assert isinstance(result, tuple)
                to_store, ids, evicted = result
                assert to_store == absent
                assert len(ids) == len(to_store) == len(set(ids))
                assert len(evicted) == max(0, shortfall)
                assert set(evicted) <= evictable
                assert not set(evicted) & (pinned_before | pending_before | set(op.keys))
                assert events == ([(True, tuple(evicted))] if evicted else [])
        elif op.kind == "lookup":
            assert fingerprint(m) == before  # lookups never change recency
        elif op.kind == "touch":
            # Only the order changes: same blocks, slots and ref counts, no event.
            after = fingerprint(m)
            assert sorted(after.blocks) == sorted(before.blocks)
            assert (after.stats, after.last_seq) == (before.stats, before.last_seq)
            assert events == []

        update_states(states, op, (result, events))
        check_invariants(m, states, replayed)
        queued = follow_up(op, (result, events))


# --- ARC examples ----------------------------------------------------------------------


def _arc(num_blocks: int) -> tuple[ao.CPUOffloadingManager, ARCPolicy]:
    m = ao.CPUOffloadingManager(num_blocks, policy="arc")
    arc = m.policy
    assert isinstance(arc, ARCPolicy)
    return m, arc


def _store(m: ao.CPUOffloadingManager, keys: Sequence[OffloadKey]) -> None:
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(out.keys_to_store)


def test_arc_touch_promotes_ready_block_to_t2() -> None:
    m, arc = _arc(4)
    a, b = KEYS[:2]
    _store(m, [a, b])
    m.touch([a])
    assert (list(arc.t1), list(arc.t2)) == ([b], [a])


def test_arc_touch_keeps_pending_block_in_t1() -> None:
    m, arc = _arc(4)
    a, b = KEYS[:2]
    assert m.prepare_store([a, b]) is not None
    m.touch([a])
    assert (list(arc.t1), list(arc.t2)) == ([b, a], [])


def test_arc_ghost_hits_move_the_target() -> None:
    m, arc = _arc(2)
    a, b, c, d = KEYS[:4]
    _store(m, [a, b])
    m.touch([b])  # T1 = [a], T2 = [b]
    _store(m, [c])  # evicts a from T1 -> B1
    assert list(arc.b1) == [a]
    m.touch([a])  # B1 hit: target + max(1, 0/1)
    assert arc.target_t1 == 1.0
    m.touch([c])  # T1 = [], T2 = [b, c]
    _store(m, [d])  # |T1| = 0 < 1: evict from T2 -> B2
    assert list(arc.b2) == [b]
    m.touch([b])  # B2 hit: target - max(1, |B1|/|B2|) = 1 - 1
    assert arc.target_t1 == 0.0
    m.touch([b])  # floored at 0
    assert arc.target_t1 == 0.0


def test_arc_target_capped_at_capacity() -> None:
    m, arc = _arc(1)
    a, b = KEYS[:2]
    _store(m, [a])
    _store(m, [b])  # a -> B1
    for _ in range(3):
        m.touch([a])
    assert arc.target_t1 == 1.0


def test_arc_falls_back_to_t1_when_t2_has_no_idle_block() -> None:
    m, arc = _arc(3)
    a, b, c, d, e = KEYS[:5]
    _store(m, [a, b, c])
    m.touch([a])  # T1 = [b, c], T2 = [a]
    _store(m, [d])  # evicts b -> B1; T1 = [c, d]
    for _ in range(3):
        m.touch([b])  # B1 hits: target 1, 2, 3
    assert arc.target_t1 == 3.0
    m.prepare_load([a])  # T2's only block is pinned
    out = m.prepare_store([e])  # |T1| = 2 < 3 prefers T2, which has no idle block
    assert out is not None
    assert out.evicted_keys == [c]  # vLLM's manager would return None here
    assert list(arc.b1) == [b, c]
    assert list(arc.t2) == [a]


def test_arc_ghost_lists_bounded_by_capacity() -> None:
    m, arc = _arc(2)
    for key in KEYS:
        _store(m, [key])
    assert len(arc.b1) == 2
    assert list(arc.b1) == KEYS[-4:-2]


def test_arc_insert_removes_ghost_entry() -> None:
    m, arc = _arc(1)
    a, b = KEYS[:2]
    _store(m, [a])
    _store(m, [b])
    assert list(arc.b1) == [a]
    _store(m, [a])
    assert list(arc.b1) == [b]
    assert list(arc.t1) == [a]


def test_arc_failed_store_leaves_no_ghost() -> None:
    m, arc = _arc(2)
    a = KEYS[0]
    assert m.prepare_store([a]) is not None
    m.complete_store([a], success=False)
    assert (list(arc.t1), list(arc.b1), list(arc.b2)) == ([], [], [])


def test_arc_ghost_step_is_the_true_list_ratio() -> None:
    m, arc = _arc(3)
    a, b, c, d, e, f, g, h = KEYS[:8]
    _store(m, [a, b, c])
    m.touch([a, b, c])  # T2 = [c, b, a]
    _store(m, [d, e, f])  # T1 is empty, so T2 gives: B2 = [c, b, a]
    _store(m, [g, h])  # |T1| = 3 >= 0: B1 = [d, e]
    assert (list(arc.b1), list(arc.b2)) == ([d, e], [c, b, a])
    m.touch([d])  # B1 hit: step max(1, 3 / 2)
    assert arc.target_t1 == 1.5
    m.touch([c])  # B2 hit: step max(1, 2 / 3) = 1
    assert arc.target_t1 == 0.5


def test_arc_ghost_hit_refreshes_its_ghost_position() -> None:
    m, arc = _arc(2)
    a, b, c, d, e = KEYS[:5]
    for key in (a, b, c, d):
        _store(m, [key])  # B1 = [a, b]
    m.touch([a])  # B1 = [b, a]
    _store(m, [e])  # evicts c; trimming B1 drops b, the oldest ghost
    assert list(arc.b1) == [a, c]


def test_arc_evicts_from_t1_when_t1_is_at_its_target() -> None:
    m, arc = _arc(3)
    a, b, c, d, e = KEYS[:5]
    _store(m, [a, b, c])
    m.touch([a])  # T1 = [b, c], T2 = [a]
    _store(m, [d])  # evicts b -> B1; T1 = [c, d]
    m.touch([b])  # target 1
    m.touch([c])  # T1 = [d], T2 = [a, c]
    assert len(arc.t1) == int(arc.target_t1) == 1
    out = m.prepare_store([e])
    assert out is not None
    assert out.evicted_keys == [d]


def test_arc_evicts_from_t2_when_t1_is_below_its_target() -> None:
    m, arc = _arc(3)
    a, b, c, d, e = KEYS[:5]
    _store(m, [a, b, c])
    m.touch([a])  # T1 = [b, c], T2 = [a]
    _store(m, [d])  # evicts b -> B1; T1 = [c, d]
    m.touch([b])
    m.touch([b])  # target 2
    m.touch([c])  # T1 = [d], T2 = [a, c]
    out = m.prepare_store([e])
    assert out is not None
    assert out.evicted_keys == [a]
    assert list(arc.b2) == [a]
