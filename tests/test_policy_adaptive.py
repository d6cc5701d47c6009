"""The adaptive policy (``auto``): switches between candidates keep every block and every
guarantee, its decisions are reproducible, and it follows the best candidate.

The brute-force / invariant harnesses (tests/test_policies.py, tests/test_manager.py)
run every registered policy, ``auto`` included.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import asyncoffload as ao
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import BlockStatus
from asyncoffload.manager.native import native_manager_available
from asyncoffload.manager.policies import AdaptivePolicy, available_policies
from asyncoffload.manager.policies.adaptive import Ghost, _recency_order
from asyncoffload.manager.policies.arc import ARCPolicy
from asyncoffload.manager.policies.kv import KVPolicy, adoption
from asyncoffload.replay import FamilySource, capacity_blocks, replay
from asyncoffload.replay.manager import serve_request
from asyncoffload.workloads import Request, families, summarize, synthetic_sessions

KEYS = [ao.make_offload_key(bytes([i]) * 8) for i in range(24)]
A, B, C, D, E, F = KEYS[:6]
CANDIDATES = ("lru", "arc", "kv")


def manager(capacity: int, **options: object) -> tuple[ao.CPUOffloadingManager, AdaptivePolicy]:
    policy = AdaptivePolicy(capacity, **options)  # type: ignore[arg-type]
    return ao.CPUOffloadingManager(capacity, policy=policy), policy


def store(m: ao.CPUOffloadingManager, keys: Sequence[OffloadKey]) -> None:
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(out.keys_to_store)


def check_view(m: ao.CPUOffloadingManager, blocks: dict[OffloadKey, BlockStatus]) -> None:
    """The policy tracks exactly ``blocks`` (the same records), once each, as the manager
    counts them."""
    items = list(m.policy.items())
    keys = [key for key, _ in items]
    assert len(keys) == len(set(keys))
    assert dict(items) == blocks
    assert all(block is blocks[key] for key, block in items)
    assert all(m.policy.get(key) is block for key, block in blocks.items())
    stats = m.stats()
    assert len(m.policy) == len(blocks) == stats.ready + stats.write_pending
    assert stats.free + stats.ready + stats.write_pending == m.num_blocks


# --- registration ----------------------------------------------------------------------


def test_auto_is_registered_so_the_harnesses_run_it() -> None:
    # tests/test_policies.py and tests/test_manager.py parametrize over these.
    assert "auto" in available_policies()
    assert isinstance(ao.CPUOffloadingManager(4, policy="auto").policy, AdaptivePolicy)


def test_auto_is_the_engines_default_and_vllms_stays_lru() -> None:
    assert ao.EngineConfig().policy == "auto"
    # The vLLM spec keeps lru (vLLM's own decisions): through vLLM's calls auto falls
    # more than 0.005 below lru on 4-5 of 59 tuning rows (docs/vllm.md, "auto through
    # vLLM's calls", benchmarks/vllm_policies.py).
    from asyncoffload.integrations.vllm.settings import VllmOffloadSettings

    assert VllmOffloadSettings.model_fields["policy"].default == "lru"


@pytest.mark.parametrize(
    "options",
    [
        {"candidates": ()},
        {"candidates": ("lru", "auto")},
        {"candidates": ("lru", "nope")},
        {"initial": "sieve"},
        {"epoch": 0.0},
        {"margin": -0.1},
        {"patience": 0},
    ],
)
def test_bad_options_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        AdaptivePolicy(100, **options)  # type: ignore[arg-type]


@pytest.mark.skipif(not native_manager_available(), reason="the C manager core does not build")
def test_every_candidate_runs_at_full_size_on_the_c_core() -> None:
    policy = AdaptivePolicy(100_000)
    assert [(g.name, g.capacity, g.native) for g in policy.ghosts] == [
        (name, 100_000, True) for name in CANDIDATES
    ]
    assert not any(g.native for g in AdaptivePolicy(100, native=False).ghosts)


@pytest.mark.parametrize("name", ["lru", "arc", "kv", "s3fifo", "sieve"])
def test_a_ghost_decides_the_same_in_c_and_in_python(name: str) -> None:
    if not native_manager_available():
        pytest.skip("the C manager core does not build")
    requests = scan_workload(600, seed=5) + chat_workload(600)
    for capacity in (7, 90, 700):
        c, py = Ghost(name, capacity, native=True), Ghost(name, capacity, native=False)
        hits_c = [c.request(req.keys) for req in requests]
        hits_py = [py.request(req.keys) for req in requests]
        assert hits_c == hits_py, (name, capacity)
        assert sum(hits_c) > 0
        assert c.resident() == py.resident() <= capacity


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("name", CANDIDATES)
def test_a_ghost_is_the_real_tier_at_full_size(name: str, native: bool) -> None:
    # The leader is judged by its ghost: the ghost of a candidate hits exactly where
    # the real tier running that candidate does, request by request (the replay drives
    # the manager as the engine does).
    if native and not native_manager_available():
        pytest.skip("the C manager core does not build")
    requests = chat_workload(800)
    cap = capacity_blocks(0.05, summarize(requests).unique_blocks)
    ghost = Ghost(name, cap, native=native)
    m = ao.CPUOffloadingManager(cap, policy=name)
    assert [ghost.request(req.keys) for req in requests] == drive_each(m, requests)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("name", ["lru", "kv"])
def test_a_ghost_restarted_from_the_real_tier_hits_as_it_does(name: str, native: bool) -> None:
    # When auto leaves a leader, that leader's ghost (paused while the real tier ran its
    # policy) starts again from the real tier: kv with what it learned. From then on it
    # is that tier, request by request.
    if native and not native_manager_available():
        pytest.skip("the C manager core does not build")
    requests = chat_workload(1600)
    cap = capacity_blocks(0.05, summarize(requests).unique_blocks)
    m = ao.CPUOffloadingManager(cap, policy=name)
    drive_each(m, requests[:800])
    ghost = Ghost(name, cap, native=native)
    for req in requests[::7]:
        ghost.request(req.keys)  # something to forget
    ghost.restart(m.policy, [key for key, _ in _recency_order(m.policy)])
    assert ghost.resident() == len(m.policy)
    assert [ghost.request(req.keys) for req in requests[800:]] == drive_each(m, requests[800:])


@pytest.mark.skipif(not native_manager_available(), reason="the C manager core does not build")
def test_a_kv_ghost_restore_refuses_a_bad_state_and_changes_nothing() -> None:
    real = KVPolicy(40)
    m = ao.CPUOffloadingManager(40, real)
    drive_each(m, chat_workload(300))
    state = real.snapshot()
    keys = [key for key, _ in _recency_order(real)]
    held, gone = adoption(state, keys, 160)
    args = [state["tick"], state["inserts"], state["last_victim"], state["entered"]]
    args += [state["reused"], state["table"]]
    fade = [state["rebuilds"], state["rebuild_ticks"], state["traffic"]]
    assert 1 < len(fade[1]) == min(state["rebuilds"], 160)
    ghost = Ghost("kv", 40, native=True)
    ghost.request(keys[:5])
    with pytest.raises(ValueError, match="empty kv manager"):
        ghost.core.kv_restore(*args, held, gone, *fade)
    ghost.clear()
    late = (held[0][0], held[0][1], state["tick"] + 1, held[0][3])
    for bad, match in [
        ([*held[:-1], held[0]], "listed twice"),
        ([*held, (b"x" * 20, 1, 0, 0)], "more resident rows than slots"),
        ([late, *held[1:]], "out of range"),
        ([("key", 1, 0, 0)], "bytes"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            ghost.core.kv_restore(*args, bad, gone, *fade)
        assert ghost.resident() == 0
    with pytest.raises(ValueError, match="entered"):
        ghost.core.kv_restore(
            state["tick"], 0, 0.0, [0.0], state["reused"], state["table"], [], [], *fade
        )
    ticks = fade[1]
    for rebuilds, bad_ticks, match in [
        (-1, [], "rebuild_ticks must hold"),
        (fade[0], ticks[:-1], "rebuild_ticks must hold"),
        (fade[0], [*ticks[:-1], state["tick"] + 1], "in order, each in"),
        (fade[0], ticks[::-1], "in order, each in"),
    ]:
        with pytest.raises(ValueError, match=match):
            ghost.core.kv_restore(*args, held, gone, rebuilds, bad_ticks, state["traffic"])
        assert ghost.resident() == 0
    with pytest.raises(ValueError, match="traffic must be >= 0"):
        ghost.core.kv_restore(*args, held, gone, fade[0], ticks, -1)
    ghost.core.kv_restore(*args, held, gone, *fade)
    state_after = ghost.kv_state()
    assert state_after["rebuild_ticks"] == ticks and state_after["traffic"] == state["traffic"]
    assert ghost.resident() == len(held)


@pytest.mark.parametrize("native", [True, False])
def test_an_arc_ghost_restarts_with_the_real_tiers_t2(native: bool) -> None:
    if native and not native_manager_available():
        pytest.skip("the C manager core does not build")
    requests = scan_workload(900, seed=2)
    m = ao.CPUOffloadingManager(120, policy="arc")
    drive_each(m, requests)
    real = m.policy
    assert isinstance(real, ARCPolicy) and real.t1 and real.t2
    ghost = Ghost("arc", 120, native=native)
    ghost.restart(real, [key for key, _ in _recency_order(real)])
    if native:
        lists = ghost.state()["lists"]  # type: ignore[index]
        t1, t2 = [row[0] for row in lists[0]], [row[0] for row in lists[1]]
    else:
        assert isinstance(ghost.policy, ARCPolicy)
        t1, t2 = list(ghost.policy.t1), list(ghost.policy.t2)
    assert (t1, t2) == (list(real.t1), list(real.t2))


def test_repr_names_the_leader_and_the_scores() -> None:
    m, policy = manager(8)
    store(m, [A, B])
    assert repr(policy).startswith("<AdaptivePolicy leader=kv [2 of 8, full-size ghosts in ")


# --- switching -------------------------------------------------------------------------


def test_a_switch_keeps_recency_order() -> None:
    m, policy = manager(8, initial="lru")
    for key in (A, B, C, D, E):
        store(m, [key])
    m.touch([B])  # LRU order now A C D E B
    policy.switch_to("arc")
    assert [key for key, _ in policy.items()] == [A, C, D, E, B]
    policy.switch_to("kv")
    m.touch([C])  # kv: C used last
    policy.switch_to("lru")
    assert [key for key, _ in policy.items()] == [A, D, E, B, C]
    assert policy.switches == 3
    out = m.prepare_store(KEYS[10:15])
    assert out is not None and out.evicted_keys == [A, D]


def test_pinned_and_in_flight_blocks_survive_switches() -> None:
    m, policy = manager(4, initial="lru")
    store(m, [A, B])
    m.prepare_load([A])  # pinned
    assert m.prepare_store([C]) is not None  # in flight
    blocks = {key: block for key, block in policy.items()}
    refs = {key: block.ref_cnt for key, block in blocks.items()}
    for name in ("arc", "kv", "lru", "kv", "arc"):
        policy.switch_to(name)
        check_view(m, blocks)
        assert {key: block.ref_cnt for key, block in policy.items()} == refs
        # Two free slots and one idle block (B): a store of four cannot be made.
        assert m.prepare_store([D, E, F, KEYS[7]]) is None
        check_view(m, blocks)
    out = m.prepare_store([D, E, F])  # 1 free slot + B: still one short
    assert out is None
    out = m.prepare_store([D, E])
    assert out is not None and out.evicted_keys == [B]
    m.complete_store([C, D, E])
    m.complete_load([A])
    assert set(m.resident_keys()) == {A, C, D, E}


def test_switching_to_the_leader_changes_nothing() -> None:
    m, policy = manager(8)
    store(m, [A, B])
    before = policy.snapshot()
    policy.switch_to("kv")
    assert policy.snapshot() == before
    assert policy.switches == 0
    with pytest.raises(ValueError):
        policy.switch_to("sieve")


def test_clear_forgets_everything_and_restores_the_initial_leader() -> None:
    m, policy = manager(8)
    store(m, [A, B])
    policy.switch_to("arc")
    m.reset_cache()
    assert policy.leader == "kv" and policy.switches == 0 and len(policy) == 0
    assert policy.snapshot() == AdaptivePolicy(8).snapshot()


OPS = ["store"] * 3 + ["complete"] * 2 + ["fail", "load", "unload", "touch", "lookup"]
OPS += ["switch", "switch"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), capacity=st.integers(1, 8))
def test_switches_never_lose_duplicate_or_break_a_guarantee(
    data: st.DataObject, capacity: int
) -> None:
    m, policy = manager(capacity, epoch=0.5, margin=0.0, patience=1)
    blocks: dict[OffloadKey, BlockStatus] = {}
    pins: dict[OffloadKey, int] = {}
    pool = KEYS[:12]
    for step in range(data.draw(st.integers(1, 60), label="n_ops")):
        kind = data.draw(st.sampled_from(OPS))
        pending = [k for k, b in blocks.items() if b.ref_cnt < 0]
        ready = [k for k, b in blocks.items() if b.ref_cnt >= 0]
        note(f"{step}: {kind} (leader {policy.leader})")
        if kind == "store":
            keys = data.draw(st.lists(st.sampled_from(pool), max_size=5, unique=True))
            protected, idle = set(keys), {k for k in ready if not pins.get(k)}
            out = m.prepare_store(keys)
            if out is not None:
                evicted = set(out.evicted_keys)
                assert not evicted & protected  # never the store's own keys
                assert evicted <= idle  # never pinned or in flight
                for key in evicted:
                    del blocks[key]
                for key in out.keys_to_store:
                    block = m.block_of(key)
                    assert block is not None
                    blocks[key] = block
        elif kind in ("complete", "fail") and pending:
            keys = data.draw(st.lists(st.sampled_from(pending), min_size=1, unique=True))
            m.complete_store(keys, success=kind == "complete")
            if kind == "fail":
                for key in keys:
                    del blocks[key]
        elif kind == "load" and ready:
            key = data.draw(st.sampled_from(ready))
            m.prepare_load([key])
            pins[key] = pins.get(key, 0) + 1
        elif kind == "unload" and pins:
            key = data.draw(st.sampled_from(sorted(pins)))
            m.complete_load([key])
            pins[key] -= 1
            if not pins[key]:
                del pins[key]
        elif kind == "touch":
            m.touch(data.draw(st.lists(st.sampled_from(pool), max_size=6, unique=True)))
        elif kind == "lookup":
            # The ghosts hear of a request here, and an epoch's end may switch.
            m.lookup_prefix(data.draw(st.lists(st.sampled_from(pool), max_size=6, unique=True)))
        elif kind == "switch":
            policy.switch_to(data.draw(st.sampled_from(CANDIDATES)))
        check_view(m, blocks)
        assert {k: b.ref_cnt for k, b in blocks.items() if b.ref_cnt > 0} == pins


def drive_each(
    m: ao.CPUOffloadingManager,
    requests: Sequence[Request],
    check: Callable[[], None] | None = None,
) -> list[int]:
    """The engine's calls per request (as the replay makes them), with ``check`` after
    each; each request's prefix hits."""
    out = []
    for req in requests:
        out.append(serve_request(m, req.keys))
        if check is not None:
            check()
    return out


def drive(
    m: ao.CPUOffloadingManager,
    requests: Sequence[Request],
    check: Callable[[], None] | None = None,
) -> int:
    return sum(drive_each(m, requests, check))


def test_its_own_switches_keep_the_manager_consistent() -> None:
    # Tiny epochs, no margin, no patience, no warm-up: it switches at its epoch ends
    # (inside lookup_prefix) as well as when told to, every 15 requests, mid-run.
    requests = synthetic_sessions(300, block_size=16, blocks_per_turn=3.0, think_time_s=5.0)
    m, policy = manager(60, epoch=0.2, margin=0.0, patience=1, warmup=0.0, initial="arc")
    told = 0

    def check() -> None:
        nonlocal told
        blocks = {key: block for key, block in policy.items()}
        check_view(m, blocks)
        assert set(m.resident_keys()) == set(blocks)
        told += 1
        if told % 15 == 0:
            policy.switch_to(CANDIDATES[(told // 15) % len(CANDIDATES)])
            check_view(m, blocks)

    own = policy.switch_to
    switched_itself = []

    def counted(name: str) -> None:
        switched_itself.append(name)
        own(name)

    policy.switch_to = counted  # type: ignore[method-assign]
    drive(m, requests, check)
    assert policy.switches >= 10
    assert len(switched_itself) > told // 15  # some switches were its own


def test_under_request_scoped_calls_every_candidate_gets_its_touch() -> None:
    m = ao.CPUOffloadingManager(8, policy="auto", request_scoped=True)
    policy = m.policy
    assert isinstance(policy, AdaptivePolicy)
    for i, keys in enumerate([[A, B, C], [A, B, C, D], [A, B, C, D, E]]):
        ctx = ao.ReqContext(req_id=f"r{i}")
        m.on_new_request(ctx)
        n = m.lookup_prefix(keys)
        if n:
            m.prepare_load(keys[:n], ctx)
            m.complete_load(keys[:n], ctx)
        out = m.prepare_store(keys, ctx)
        assert out is not None
        m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
    # The ghosts saw every request, once: 0 + 3 + 4 prefix hits of 12.
    assert policy.scores() == pytest.approx({name: 7 / 12 for name in CANDIDATES})
    assert set(m.resident_keys()) == {A, B, C, D, E}


# --- determinism -----------------------------------------------------------------------


def test_its_scores_are_the_candidates_full_size_hit_rates() -> None:
    # What fooled the sampled shadows (issue 24) cannot happen: with no decay, each
    # ghost's score is exactly the hit rate of a full-size replay of its candidate, on
    # the family built to make the old sample rank kv first where ARC wins.
    requests = families()["mixed"].generate(1200, seed=0)
    cap = capacity_blocks(0.1, summarize(requests).unique_blocks)
    policy = AdaptivePolicy(cap, epoch=1e9)  # one window: no halving, no switch
    replay(requests, cap, policy=policy)
    rates = {name: replay(requests, cap, policy=name).block_hit_rate for name in CANDIDATES}
    assert policy.scores() == pytest.approx(rates, abs=1e-12)
    assert len(set(rates.values())) == len(rates)  # they differ: the ranking means something


@pytest.mark.parametrize("native", [True, False])
def test_the_same_trace_gives_the_same_decisions(native: bool) -> None:
    if native and not native_manager_available():
        pytest.skip("the C manager core does not build")
    requests = scan_workload(1500, seed=3)
    cap = capacity_blocks(0.05, summarize(requests).unique_blocks)
    runs = []
    for _ in range(2):
        policy = AdaptivePolicy(cap, native=native, epoch=1.0, initial="lru")
        res = replay(requests, cap, policy=policy)
        runs.append((res.hit_blocks, res.stored, res.evicted, policy.switches, policy.snapshot()))
    assert runs[0] == runs[1]
    assert policy.switches >= 1


# --- following the best candidate ------------------------------------------------------


def _fresh_keys(seed: int) -> Callable[[int], list[OffloadKey]]:
    rng = random.Random(seed)
    namespace, counter = rng.randbytes(8), itertools.count()

    def fresh(n: int) -> list[OffloadKey]:
        return [
            ao.make_offload_key(namespace + i.to_bytes(8, "big"))
            for i in itertools.islice(counter, n)
        ]

    return fresh


def _request(i: int, keys: Sequence[OffloadKey]) -> Request:
    return Request(
        req_id=str(i),
        arrival_s=float(i),
        keys=tuple(keys),
        input_tokens=16 * len(keys),
        output_tokens=1,
        block_size=16,
    )


def scan_workload(n: int, seed: int = 0) -> list[Request]:
    """A Zipf-popular hot set of short prompts, and one-off scans of 40 fresh blocks mixed
    in: LRU lets the scans flush the hot set, ARC and kv keep it."""
    rng, fresh = random.Random(seed), _fresh_keys(seed)
    hot = [fresh(rng.randint(2, 8)) for _ in range(300)]
    weights = list(itertools.accumulate(1 / (i + 1) ** 0.8 for i in range(len(hot))))
    out = []
    for i in range(n):
        scan = rng.random() < 0.3
        out.append(_request(i, fresh(40) if scan else rng.choices(hot, cum_weights=weights)[0]))
    return out


def shifting_workload(n: int, seed: int = 0, phase: int = 500) -> list[Request]:
    """Conversations whose hot set is replaced every ``phase`` requests: what was used
    often is dead once the phase ends, and recency (LRU) beats frequency (ARC)."""
    rng, fresh = random.Random(seed), _fresh_keys(seed)
    docs: list[list[OffloadKey]] = []
    out = []
    for i in range(n):
        if i % phase == 0:
            docs = [fresh(rng.randint(3, 10)) for _ in range(150)]
        if rng.random() < 0.7:
            d = rng.randrange(len(docs))
            docs[d] = docs[d] + fresh(rng.randint(0, 2))
            keys = docs[d]
        else:
            keys = fresh(rng.randint(3, 12))
        out.append(_request(i, keys))
    return out


def chat_workload(n: int) -> list[Request]:
    return synthetic_sessions(n, block_size=16, blocks_per_turn=6.0, think_time_s=30.0)


# Each starts on a candidate the workload does not favour, so it has to find the best.
# Epochs of one capacity and no patience let it switch early in a run this short; the
# chat workload, where the candidates are close, runs with the defaults. There a switch
# into kv starts kv's learning over (it cost 0.007 of 0.507 on this run), so the bar is
# the issue's: 0.005 below the best of LRU and ARC; elsewhere 0.01 below the best.
FAST = {"epoch": 1.0, "patience": 1}


@pytest.mark.parametrize(
    ("build", "share", "candidates", "options", "bar"),
    [
        (scan_workload, 0.02, ("lru", "arc"), {"initial": "lru", **FAST}, "best"),
        (scan_workload, 0.02, CANDIDATES, {"initial": "lru", **FAST}, "best"),
        (shifting_workload, 0.05, ("lru", "arc"), {"initial": "arc", **FAST}, "best"),
        (shifting_workload, 0.05, CANDIDATES, {"initial": "arc", **FAST}, "best"),
        (chat_workload, 0.05, CANDIDATES, {"initial": "arc"}, "lru/arc"),
    ],
)
def test_auto_ends_close_to_the_best_candidate(
    build: Callable[[int], list[Request]],
    share: float,
    candidates: tuple[str, ...],
    options: dict[str, object],
    bar: str,
) -> None:
    requests = build(4000)
    cap = capacity_blocks(share, summarize(requests).unique_blocks)
    rates = {name: replay(requests, cap, policy=name).block_hit_rate for name in candidates}
    best = max(rates.values())
    start = rates[str(options["initial"])]
    assert start < best - 0.01  # the workload favours another
    policy = AdaptivePolicy(cap, candidates=candidates, **options)  # type: ignore[arg-type]
    auto = replay(requests, cap, policy=policy).block_hit_rate
    if bar == "best":
        assert auto >= best - 0.01, (rates, auto, repr(policy))
    else:
        assert auto >= max(rates["lru"], rates["arc"]) - 0.005, (rates, auto, repr(policy))
        assert auto >= start + 0.01, (rates, auto, repr(policy))
    assert policy.switches >= 1


@pytest.mark.parametrize("share", [0.2, 0.5])
def test_auto_holds_the_bar_on_a_short_trace_while_kv_still_learns(share: float) -> None:
    """Issue 40's short-trace cells: 2,000 requests of ``mixed`` (seed 0) are 9.3 and
    3.7 capacities of traffic at 20% and 50%, inside kv's learning, where ARC led kv
    (auto stayed on kv: -0.0078 and -0.0068). kv's estimate counted blocks too young to
    have been reused as never reused; discounted (the fade, kv.py) kv is within 0.005."""
    requests = FamilySource("mixed", 2000, 0).requests()
    cap = capacity_blocks(share, summarize(requests).unique_blocks)
    rates = {name: replay(requests, cap, policy=name).block_hit_rate for name in ("lru", "arc")}
    auto = replay(requests, cap, policy=AdaptivePolicy(cap)).block_hit_rate
    assert auto >= max(rates.values()) - 0.005, (rates, auto)


# --- reacting to a change, and not flapping (issue 40) ----------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from policy_families import regime_change, stationary  # noqa: E402


def rates_of(requests: Sequence[Request], cap: int) -> dict[str, float]:
    return {name: replay(requests, cap, policy=name).block_hit_rate for name in CANDIDATES}


def test_auto_leaves_a_leader_within_two_capacities_of_a_sustained_change() -> None:
    # kv leads for 16 capacities of traffic, then falls 0.1-0.3 behind LRU and ARC for
    # about 6 (documents it learned are never read again are now read twice), then
    # leads again once it has learned that (benchmarks/policy_families.py,
    # regime_change). The rule of before issue 40 never switched: its score since the
    # start still had kv ahead (so on the hidden Mooncake trace: 0 switches, 0.022
    # below ARC).
    requests = regime_change(2000, 1500)
    cap = 1000
    change = sum(len(r.keys) for r in requests[:2000])
    assert change > 15 * cap
    policy = AdaptivePolicy(cap)
    auto = replay(requests, cap, policy=policy).block_hit_rate
    assert policy.timeline, repr(policy)
    at, old, new = policy.timeline[0]
    assert old == "kv" and new in ("lru", "arc"), policy.timeline
    assert change < at <= change + 2 * cap, (at - change) / cap
    # Back to kv once it leads again, and no more: following the leader beats every
    # candidate alone.
    assert policy.switches <= 3 and policy.leader == "kv", policy.timeline
    assert auto > max(rates_of(requests, cap).values()) + 0.01


@pytest.mark.parametrize(("n", "seed", "share"), [(4000, 1, 0.02), (2000, 0, 0.01)])
def test_auto_does_not_flap_where_one_candidate_leads_throughout(
    n: int, seed: int, share: float
) -> None:
    # The mixed family is stationary, and kv leads it at these points by 0.02-0.04.
    # The rule of before issue 40 left kv and came back (2 switches each), each switch
    # into kv starting its learning over: 0.022 and 0.025 below kv alone.
    requests = families()["mixed"].generate(n, seed=seed)
    cap = capacity_blocks(share, summarize(requests).unique_blocks)
    assert sum(len(r.keys) for r in requests) > 100 * cap
    rates = rates_of(requests, cap)
    assert rates["kv"] > max(rates["lru"], rates["arc"]) + 0.015
    policy = AdaptivePolicy(cap)
    auto = replay(requests, cap, policy=policy).block_hit_rate
    assert policy.switches == 0, policy.timeline
    assert auto == rates["kv"]


def test_auto_settles_once_between_candidates_that_take_turns() -> None:
    # The traffic after regime_change's change, from the start: kv ahead by 0.02-0.04,
    # ARC and LRU a little behind and ahead of each other in turn. Started on ARC, auto
    # goes to kv once and stays; on chat, where kv leads LRU by 0.002-0.01, it never
    # leaves kv.
    requests = stationary(3000)
    policy = AdaptivePolicy(1000, initial="arc")
    replay(requests, 1000, policy=policy)
    assert [(old, new) for _, old, new in policy.timeline] == [("arc", "kv")]
    for seed in (0, 1):
        chat = families()["chat"].generate(4000, seed=seed, block_size=16)
        cap = capacity_blocks(0.02, summarize(chat).unique_blocks)
        policy = AdaptivePolicy(cap)
        replay(chat, cap, policy=policy)
        assert policy.switches == 0, (seed, policy.timeline)
