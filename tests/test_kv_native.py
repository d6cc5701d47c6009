"""The KV policy's C core against its pure-Python path: same decisions, same state.

The C core (asyncoffload/_native/kvcore.c) is a port of policies/kv.py. Both are driven
with the same calls through real managers, and their full snapshots (every queue, ghost
and fresh list with each key's uses, tick and class, the learning counters and the
value table) must stay equal after every call.
"""

from __future__ import annotations

import gc
import random
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncoffload.manager.policies.kv as kv_module
from asyncoffload._native import load_kvcore
from asyncoffload.keys import OffloadKey, make_offload_key
from asyncoffload.manager import BlockStatus, CPUOffloadingManager
from asyncoffload.manager.policies import KVPolicy
from asyncoffload.replay import replay
from asyncoffload.workloads import synthetic_sessions

pytestmark = pytest.mark.skipif(
    load_kvcore() is None, reason="the native KV core cannot be built here (no compiler?)"
)


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


def pair(capacity: int, **kw: object) -> tuple[CPUOffloadingManager, CPUOffloadingManager]:
    c = CPUOffloadingManager(capacity, KVPolicy(capacity, native=True, **kw))  # type: ignore[arg-type]
    p = CPUOffloadingManager(capacity, KVPolicy(capacity, native=False, **kw))  # type: ignore[arg-type]
    assert isinstance(c.policy, KVPolicy) and c.policy.native
    assert isinstance(p.policy, KVPolicy) and not p.policy.native
    return c, p


def same(c: CPUOffloadingManager, p: CPUOffloadingManager) -> None:
    assert isinstance(c.policy, KVPolicy) and isinstance(p.policy, KVPolicy)
    assert c.policy.snapshot() == p.policy.snapshot()
    assert [(k, b.block_id, b.ref_cnt) for k, b in c.policy.items()] == [
        (k, b.block_id, b.ref_cnt) for k, b in p.policy.items()
    ]
    assert c.stats() == p.stats()
    assert len(c.policy) == len(p.policy)


def run_random(seed: int, capacity: int, steps: int, universe: int) -> None:
    rng = random.Random(seed)
    c, p = pair(capacity)
    chains: list[list[int]] = [[0]]
    next_id = 1
    loading: list[list[OffloadKey]] = []
    storing: list[list[OffloadKey]] = []
    for _ in range(steps):
        op = rng.random()
        if op < 0.45:
            # a request: extend a known chain (or start one) and run the serving sequence
            base = rng.choice(chains)[: rng.randint(1, 6)]
            ids = base + list(range(next_id, next_id + rng.randint(0, 5)))
            next_id += len(ids) - len(base)
            if rng.random() < 0.3:
                ids = [rng.randrange(universe) for _ in range(rng.randint(1, 6))]
            ids = list(dict.fromkeys(ids))
            chains.append(ids)
            keys = [key(i) for i in ids]
            n = c.lookup_prefix(keys)
            assert n == p.lookup_prefix(keys)
            c.touch(keys)
            p.touch(keys)
            oc, op_ = c.prepare_store(keys[n:]), p.prepare_store(keys[n:])
            assert (oc is None) == (op_ is None)
            if oc is not None and op_ is not None:
                assert oc.keys_to_store == op_.keys_to_store
                assert oc.evicted_keys == op_.evicted_keys
                assert oc.store_spec == op_.store_spec
                if oc.keys_to_store:
                    storing.append(list(oc.keys_to_store))
        elif op < 0.6 and storing:
            keys = storing.pop(rng.randrange(len(storing)))
            ok = rng.random() < 0.85
            c.complete_store(keys, success=ok)
            p.complete_store(keys, success=ok)
        elif op < 0.75:
            ready = [k for k in c.resident_keys()]
            if ready:
                keys = rng.sample(ready, rng.randint(1, min(4, len(ready))))
                assert c.prepare_load(keys) == p.prepare_load(keys)
                loading.append(keys)
        elif op < 0.85 and loading:
            keys = loading.pop(rng.randrange(len(loading)))
            c.complete_load(keys)
            p.complete_load(keys)
        else:
            keys = [key(rng.randrange(max(universe, next_id))) for _ in range(rng.randint(1, 5))]
            keys = list(dict.fromkeys(keys))
            c.touch(keys)
            p.touch(keys)
        same(c, p)


@pytest.mark.parametrize("seed", range(8))
def test_random_serving_sequences_match(seed: int) -> None:
    # Small tiers, long enough to rebuild the table many times and to forget ghosts.
    run_random(seed, capacity=3 + seed * 5, steps=1500, universe=60)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), capacity=st.integers(1, 24))
def test_match_under_hypothesis(seed: int, capacity: int) -> None:
    run_random(seed, capacity, steps=300, universe=30)


@pytest.mark.parametrize("share", [0.01, 0.05, 0.3])
def test_replays_are_identical(share: float) -> None:
    reqs = synthetic_sessions(3000, seed=11)
    unique = len({k for r in reqs for k in r.keys})
    cap = max(1, round(share * unique))
    a = replay(reqs, cap, policy=KVPolicy(cap, native=True))
    b = replay(reqs, cap, policy=KVPolicy(cap, native=False))
    assert (a.hit_blocks, a.stored, a.evicted, a.skipped) == (
        b.hit_blocks,
        b.stored,
        b.evicted,
        b.skipped,
    )


@pytest.mark.parametrize(
    "switches",
    [dict(size_classes=False), dict(tail_classes=False), dict(admission=False)],
)
def test_switches_are_honoured_alike(switches: dict[str, bool]) -> None:
    reqs = synthetic_sessions(1500, seed=3)
    a = replay(reqs, 300, policy=KVPolicy(300, native=True, **switches))
    b = replay(reqs, 300, policy=KVPolicy(300, native=False, **switches))
    assert (a.hit_blocks, a.stored, a.evicted) == (b.hit_blocks, b.stored, b.evicted)


def test_bad_input_changes_nothing() -> None:
    for native in (True, False):
        policy = KVPolicy(4, native=native)
        policy.touch([key(1), key(2)])
        blocks = [(key(1), BlockStatus(0)), (key(2), BlockStatus(1))]
        for _, b in blocks:
            b.ref_cnt = 0
        policy.insert_many(blocks)
        before = policy.snapshot()
        with pytest.raises(TypeError, match="bytes"):
            policy.touch([key(3), 7])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="bytes"):
            policy.insert_many([(key(4), BlockStatus(2)), ("x", BlockStatus(3))])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="already resident"):
            policy.insert_many([(key(5), BlockStatus(2)), (key(1), BlockStatus(3))])
        assert policy.snapshot() == before, native


def test_no_references_leak() -> None:
    keys = [key(10_000 + i) for i in range(50)]
    blocks = [BlockStatus(i) for i in range(50)]
    base_k = [sys.getrefcount(k) for k in keys]
    base_b = [sys.getrefcount(b) for b in blocks]
    m = CPUOffloadingManager(8, KVPolicy(8, native=True))
    for i in range(0, 50, 5):
        chunk = keys[i : i + 5]
        m.touch(chunk)
        out = m.prepare_store(chunk)
        assert out is not None
        m.complete_store(out.keys_to_store)
    policy = m.policy
    assert isinstance(policy, KVPolicy)
    policy.insert_many([])
    m.reset_cache()
    del m, policy, out, chunk
    gc.collect()
    assert [sys.getrefcount(k) for k in keys] == base_k
    assert [sys.getrefcount(b) for b in blocks] == base_b


def test_falls_back_to_python_when_the_core_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_module, "load_kvcore", lambda: None)
    assert not KVPolicy(4).native
    with pytest.raises(RuntimeError, match="native KV policy core is unavailable"):
        KVPolicy(4, native=True)


def _serve(policy: KVPolicy, keys: list[OffloadKey]) -> list[OffloadKey]:
    """One request on the policy alone, as the manager makes its calls (every block
    idle, stores complete at once); the keys it evicted."""
    n = 0
    while n < len(keys) and policy.get(keys[n]) is not None:
        n += 1
    if n:
        policy.touch(keys[:n])
    rest = keys[n:]
    if not rest:
        return []
    policy.touch(rest)
    offered = [k for k in rest if policy.get(k) is None]
    free = policy.capacity - len(policy)
    chosen = policy.admissible(offered, len(offered) > free)
    evicted: list[OffloadKey] = []
    if len(chosen) > free:
        out = policy.evict(len(chosen) - free, set(rest))
        if out is None:
            return []
        evicted = [k for k, _ in out]
    blocks = [(k, BlockStatus(i)) for i, k in enumerate(chosen)]
    for _, b in blocks:
        b.ref_cnt = 0
    policy.insert_many(blocks)
    return evicted


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("split", [100, 800])
def test_a_kv_adopted_from_anothers_state_decides_as_it_does(native: bool, split: int) -> None:
    # What auto's switch to kv relies on: a kv started on another's blocks and learned
    # state (its table, counts, clock and per-key uses) is that kv from then on; early
    # (its ghost list not full) or late.
    reqs = synthetic_sessions(1600, block_size=16, blocks_per_turn=3.0, seed=5)
    cap = 120
    source = KVPolicy(cap, native=native)
    for req in reqs[:split]:
        _serve(source, list(req.keys))
    assert (2 * cap < len(source.snapshot()["ghost"]) < 4 * cap) == (split == 100)
    heir = KVPolicy(cap, native=native)
    heir.adopt(source.snapshot(), list(source.items()))
    state, again = source.snapshot(), heir.snapshot()
    for part in ("queues", "tick", "inserts", "last_victim", "entered", "reused", "table"):
        assert again[part] == state[part], part
    # Just seen and never stored, or remembered: remembered alike (as its next touch
    # will remember them), up to the ghost list's size (4 capacities).
    assert again["ghost"] == (state["ghost"] + state["fresh"])[-4 * cap :]
    evicted = 0
    for req in reqs[split:]:
        out = _serve(source, list(req.keys))
        assert _serve(heir, list(req.keys)) == out
        evicted += len(out)
    assert evicted > 100
    assert heir.snapshot() == source.snapshot()


def test_adoption_is_the_same_in_c_and_python() -> None:
    # Blocks the state does not know (taken as used once, long ago), and known keys the
    # blocks lack (remembered), the ghost list kept to its size.
    reqs = synthetic_sessions(900, block_size=16, blocks_per_turn=3.0, seed=7)
    teacher = KVPolicy(40, native=True)
    for req in reqs:
        _serve(teacher, list(req.keys))
    state = teacher.snapshot()
    held = list(teacher.items())
    mine = held[::2] + [(key(900_000 + i), BlockStatus(90 + i)) for i in range(5)]
    for _, b in mine:
        b.ref_cnt = 0
    c, p = KVPolicy(40, native=True), KVPolicy(40, native=False)
    c.adopt(state, mine)
    p.adopt(state, mine)
    assert c.snapshot() == p.snapshot()
    assert [k for k, _ in c.items()] == [k for k, _ in p.items()]
    assert sorted(k for k, _ in c.items()) == sorted(k for k, _ in mine)
    snap = c.snapshot()
    rows = [row for part in (*state["queues"], state["fresh"], state["ghost"]) for row in part]
    oldest = min(row[2] for row in rows)
    assert {row[0]: row[1:] for row in snap["queues"][0]}[key(900_000)] == (1, oldest, 0)
    dropped = len(held) - len(held[::2])
    assert dropped > 0
    assert len(snap["ghost"]) == min(160, len(state["ghost"]) + len(state["fresh"]) + dropped)
    # A bad state leaves the C core empty, not half restored.
    with pytest.raises(ValueError, match="entered"):
        c.adopt({**state, "entered": [0.0]}, mine)
    assert len(c) == 0
