"""The ``session`` policy (``asyncoffload/manager/policies/session.py``): a session's blocks
go from its tail, a session due back soon is kept over one idle past its usual gap, a
session's deeper blocks never push out its own prefix, under every call pattern; and
clear errors for bad settings and bad session names. Its guarantees as a CachePolicy
(never a pinned, pending or protected block; all or nothing) are checked with every
registered policy's by tests/test_policies.py and tests/test_manager.py."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest

import asyncoffload as ao
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import ReqContext
from asyncoffload.manager.policies import SessionPolicy, get_policy_cls
from asyncoffload.manager.policies.session import WARM_GAPS
from asyncoffload.replay.manager import serve_request
from tests.helpers import FakeClock


def keys(prefix: str, n: int) -> list[OffloadKey]:
    """``n`` prefix-chained keys of one conversation (``prefix`` names it)."""
    return [ao.make_offload_key(f"{prefix}{i}".encode().ljust(8, b".")) for i in range(n)]


def manager(
    capacity: int, clock: FakeClock, request_scoped: bool = False, **kw: Any
) -> ao.CPUOffloadingManager:
    policy = SessionPolicy(capacity, clock=clock, **kw)
    return ao.CPUOffloadingManager(capacity, policy, request_scoped=request_scoped)


def by_prefix(m: ao.CPUOffloadingManager, ks: Sequence[OffloadKey], ctx: ReqContext) -> int:
    """The engine's calls for one request: lookup_prefix, load and touch the hits, touch
    and store the rest."""
    return serve_request(m, ks, ctx=ctx)


def key_by_key(m: ao.CPUOffloadingManager, ks: Sequence[OffloadKey], ctx: ReqContext) -> int:
    """Per-key lookups, then the load's and the store's touches (no lookup_prefix)."""
    n = 0
    while n < len(ks) and m.lookup(ks[n], ctx) is ao.LookupResult.HIT:
        n += 1
    return serve_request(m, ks, n, ctx)


def request_scoped(m: ao.CPUOffloadingManager, ks: Sequence[OffloadKey], ctx: ReqContext) -> int:
    """vLLM's connector: per-key lookups, load, store, then the request ends; no touch."""
    m.on_new_request(ctx)
    n = 0
    while n < len(ks) and m.lookup(ks[n], ctx) is ao.LookupResult.HIT:
        n += 1
    if n:
        m.prepare_load(ks[:n], ctx)
        m.complete_load(ks[:n], ctx)
    out = m.prepare_store(ks[n:], ctx)
    if out is not None and out.keys_to_store:
        m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    return n


Serve = Callable[[ao.CPUOffloadingManager, Sequence[OffloadKey], ReqContext], int]
PATTERNS = [
    pytest.param(by_prefix, False, id="lookup_prefix"),
    pytest.param(key_by_key, False, id="per-key"),
    pytest.param(request_scoped, True, id="request-scoped"),
]
_n = iter(range(1 << 30))


def ctx(session: str | None = None, params: dict[str, Any] | None = None) -> ReqContext:
    return ReqContext(req_id=f"r{next(_n)}", session=session, kv_transfer_params=params)


def present(m: ao.CPUOffloadingManager, ks: Sequence[OffloadKey]) -> list[bool]:
    return [m.block_of(k) is not None for k in ks]


# --- tail first --------------------------------------------------------------------------


@pytest.mark.parametrize(("serve", "scoped"), PATTERNS)
def test_a_session_loses_its_tail_first(serve: Serve, scoped: bool) -> None:
    clock = FakeClock()
    m = manager(8, clock, scoped)
    a = keys("a", 6)
    serve(m, a[:4], ctx())  # turn 1
    clock.now = 5.0
    assert serve(m, a, ctx()) == 4  # turn 2 continues it: 2 deeper blocks stored
    clock.now = 6.0
    b = keys("b", 4)
    serve(m, b, ctx())  # another session needs 2 of A's 6 slots
    # A's two deepest blocks went; its prefix still hits up to there.
    assert present(m, a) == [True] * 4 + [False] * 2
    assert m.lookup_prefix(a, observe=False) == 4
    clock.now = 7.0
    # A is due in 3 s (its gap, 5 s); B has no gap yet (the prior, 30 s): B's tail goes.
    serve(m, keys("c", 2), ctx())
    assert present(m, a) == [True] * 4 + [False] * 2
    assert present(m, b) == [True] * 2 + [False] * 2


def test_lru_would_cut_the_same_session_from_its_head() -> None:
    """The contrast: LRU evicts a just-stored prompt's first block first."""
    m = ao.CPUOffloadingManager(8, "lru")
    a = keys("a", 6)
    by_prefix(m, a, ctx())
    by_prefix(m, keys("b", 4), ctx())
    assert m.lookup_prefix(a, observe=False) == 0


# --- next turn soon ----------------------------------------------------------------------


@pytest.mark.parametrize(("serve", "scoped"), PATTERNS)
def test_a_session_due_soon_is_kept_over_one_idle_past_its_gap(serve: Serve, scoped: bool) -> None:
    clock = FakeClock()
    m = manager(10, clock, scoped)
    a, b = keys("a", 4), keys("b", 4)
    # A runs long tools: one turn a minute. B answers every 5 s.
    for t, n in ((0.0, 2), (60.0, 4)):
        clock.now = t
        serve(m, a[:n], ctx())
    for t, n in ((70.0, 2), (75.0, 3), (80.0, 4)):
        clock.now = t
        serve(m, b[:n], ctx())
    policy = m.policy
    assert isinstance(policy, SessionPolicy)
    clock.now = 115.0  # A is due in 5 s; B has been away 35 s, 7 of its gaps
    assert policy.expected_wait(a[0]) == pytest.approx(5.0)
    assert policy.expected_wait(b[0]) == pytest.approx(35.0)
    serve(m, keys("c", 4), ctx())  # 2 slots short
    assert present(m, a) == [True] * 4  # A was seen before B: LRU would take it
    assert present(m, b) == [True, True, False, False]


def test_lru_would_evict_the_session_due_soon() -> None:
    m = ao.CPUOffloadingManager(10, "lru")
    a, b = keys("a", 4), keys("b", 4)
    by_prefix(m, a[:2], ctx())
    by_prefix(m, a, ctx())
    for n in (2, 3, 4):
        by_prefix(m, b[:n], ctx())
    by_prefix(m, keys("c", 4), ctx())
    assert not all(present(m, a))


@pytest.mark.parametrize("via", ["field", "kv_transfer_params"])
def test_a_named_session_is_one_session_whatever_its_blocks(via: str) -> None:
    clock = FakeClock()
    m = manager(16, clock)

    def named() -> ReqContext:
        return ctx("s1") if via == "field" else ctx(params={"session_id": "s1"})

    x, y = keys("x", 2), keys("y", 2)  # no block in common
    by_prefix(m, x, named())
    clock.now = 10.0
    by_prefix(m, y, named())
    policy = m.policy
    assert isinstance(policy, SessionPolicy)
    assert policy.session_of(x[0]) == policy.session_of(y[0]) == "s1"
    clock.now = 12.0  # its gap is 10 s: due in 8 s
    assert policy.expected_wait(x[0]) == pytest.approx(8.0)
    by_prefix(m, keys("z", 2), ctx())  # not named: a session of its own
    assert policy.session_of(keys("z", 1)[0]) not in (None, "s1")


def test_a_turn_is_found_by_its_prefix_when_unnamed() -> None:
    clock = FakeClock()
    m = manager(16, clock)
    a = keys("a", 8)
    by_prefix(m, a[:3], ctx())
    clock.now = 4.0
    by_prefix(m, a[:6], ctx())  # continues turn 1 (its last block is in this prompt)
    clock.now = 9.0
    by_prefix(m, a, ctx())
    policy = m.policy
    assert isinstance(policy, SessionPolicy)
    assert len({policy.session_of(k) for k in a}) == 1
    clock.now = 10.0
    assert policy.expected_wait(a[0]) == pytest.approx(3.5)  # median gap 4.5, away 1


# --- admission ---------------------------------------------------------------------------


def warm(m: ao.CPUOffloadingManager, clock: FakeClock) -> None:
    """Measure WARM_GAPS gaps of a named one-block session, 10 s apart."""
    w = keys("w", 1)
    for i in range(WARM_GAPS + 1):
        clock.now = 10.0 * i
        by_prefix(m, w, ctx("w"))


def test_a_session_never_pushes_out_its_own_prefix_for_its_tail() -> None:
    clock = FakeClock()
    m = manager(8, clock)
    warm(m, clock)
    a = keys("a", 10)
    clock.now += 8.5
    by_prefix(m, a[:6], ctx())
    clock.now += 1.0  # w is due in 0.5 s, A (a turn a second) in 1 s
    skipped = m.stats().store_skipped
    assert by_prefix(m, a, ctx()) == 6
    # One free slot: a6 is stored; a7-a9 would have pushed out a0-a5 or w (due first).
    assert present(m, a) == [True] * 7 + [False] * 3
    assert m.stats().store_skipped == skipped + 3
    assert present(m, keys("w", 1)) == [True]


def test_lru_evicts_the_prefix_end_to_store_blocks_behind_it() -> None:
    m = ao.CPUOffloadingManager(8, "lru")
    a = keys("a", 10)
    by_prefix(m, a[:6], ctx())
    by_prefix(m, a, ctx())
    assert m.lookup_prefix(a, observe=False) == 4  # a6-a9 stored behind a gap


def test_admission_waits_for_measured_gaps_and_can_be_switched_off() -> None:
    clock = FakeClock()
    cold = manager(8, clock)
    a = keys("a", 10)
    by_prefix(cold, a[:6], ctx())
    by_prefix(cold, a, ctx())
    assert cold.stats().store_skipped == 0  # no gap measured yet: every block is stored
    off = manager(8, clock, admission=False)
    warm(off, clock)
    by_prefix(off, a[:6], ctx())
    by_prefix(off, a, ctx())
    assert off.stats().store_skipped == 0


# --- time and bad input ------------------------------------------------------------------


def test_a_clock_that_goes_back_counts_no_negative_gap() -> None:
    clock = FakeClock()
    m = manager(8, clock)
    a = keys("a", 3)
    clock.now = 100.0
    by_prefix(m, a[:2], ctx())
    clock.now = 50.0
    by_prefix(m, a, ctx())
    policy = m.policy
    assert isinstance(policy, SessionPolicy)
    clock.now = 100.0
    assert policy.expected_wait(a[0]) == 0.0  # gap 0, away 0


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"overdue": 0}, ValueError, "overdue"),
        ({"overdue": -1.0}, ValueError, "overdue"),
        ({"overdue": math.nan}, ValueError, "overdue"),
        ({"overdue": math.inf}, ValueError, "overdue"),
        ({"overdue": True}, ValueError, "overdue"),
        ({"overdue": "2"}, ValueError, "overdue"),
        ({"history": 0}, ValueError, "history"),
        ({"history": 2.5}, ValueError, "history"),
        ({"max_sessions": 0}, ValueError, "max_sessions"),
        ({"clock": 3.0}, TypeError, "clock"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, Any], error: type[Exception], names: str) -> None:
    with pytest.raises(error, match=names):
        SessionPolicy(8, **kwargs)


def test_a_clock_that_gives_no_number_is_named_and_changes_nothing() -> None:
    value: list[Any] = [0.0]
    m = ao.CPUOffloadingManager(4, SessionPolicy(4, clock=lambda: value[0]))
    by_prefix(m, keys("a", 2), ctx())
    before = list(m.policy.items())
    for bad in (math.nan, "soon", None):
        value[0] = bad
        with pytest.raises(ValueError, match="clock"):
            m.lookup_prefix(keys("a", 3), ctx())
    assert list(m.policy.items()) == before


@pytest.mark.parametrize("bad", ["", 7, b"s1"])
@pytest.mark.parametrize("via", ["field", "kv_transfer_params"])
def test_a_bad_session_name_is_named_and_changes_nothing(bad: Any, via: str) -> None:
    clock = FakeClock()
    m = manager(8, clock)
    a = keys("a", 3)
    by_prefix(m, a[:2], ctx())
    before = list(m.policy.items())
    bad_ctx = ctx(bad) if via == "field" else ctx(params={"session_id": bad})
    with pytest.raises(ValueError, match="session"):
        m.lookup_prefix(a, bad_ctx)
    with pytest.raises(ValueError, match="session"):
        m.prepare_store(a[2:], bad_ctx)
    assert list(m.policy.items()) == before
    assert m.block_of(a[2]) is None


def test_keys_that_are_not_bytes_are_refused() -> None:
    policy = SessionPolicy(4)
    with pytest.raises(TypeError, match="bytes"):
        policy.on_request(["k1"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="bytes"):
        policy.touch(["k1"])  # type: ignore[list-item]
    assert len(policy) == 0


def test_registered_and_bounded_in_sessions() -> None:
    assert get_policy_cls("session") is SessionPolicy
    clock = FakeClock()
    m = manager(4, clock, max_sessions=8)
    for i in range(40):  # one-turn sessions, each its own
        clock.now = float(i)
        by_prefix(m, keys(f"s{i}-", 1), ctx())
    policy = m.policy
    assert isinstance(policy, SessionPolicy)
    assert len(policy._sessions) <= 8
    assert len(policy) == 4


def test_a_new_session_is_never_the_one_forgotten() -> None:
    """With every other session holding blocks, the limit forgets none rather than the
    session just made: its blocks must stay evictable (and listed)."""
    clock = FakeClock()
    m = manager(6, clock, max_sessions=2)
    for i in range(5):
        clock.now = float(i)
        by_prefix(m, keys(f"s{i}-", 2), ctx())
    policy = m.policy
    assert isinstance(policy, SessionPolicy)
    held = {key for key, _ in policy.items()}
    assert len(held) == len(policy) == 6
    assert {policy.session_of(k) for k in held} <= set(policy._sessions)
    by_prefix(m, keys("t", 6), ctx())  # evicts every other block: all are reachable
    assert present(m, keys("t", 6)) == [True] * 6


def test_a_block_two_sessions_use_is_shared_and_kept_while_used() -> None:
    """A system prompt used by every session must not go with the session that used
    it last: it leaves for the shared queue, ranked by its own last use."""
    clock = FakeClock()
    m = manager(12, clock)
    system = keys("sys", 2)
    a = system + keys("a", 3)
    b = system + keys("b", 3)
    by_prefix(m, a, ctx())
    clock.now = 1.0
    by_prefix(m, b, ctx())  # B uses A's system prompt: shared from now on
    policy = m.policy
    assert isinstance(policy, SessionPolicy)
    assert policy.session_of(system[0]) == policy.session_of(system[1]) == 0
    assert policy.session_of(b[2]) not in (0, policy.session_of(a[2]))
    clock.now = 2.0
    # B, seen last, has the furthest next turn (its full gap): its own blocks go first,
    # from its tail; the system prompt, just used, stays.
    by_prefix(m, keys("c", 6), ctx())  # 2 slots short
    assert present(m, system) == [True, True]
    assert present(m, b) == [True, True, True, False, False]


@pytest.mark.parametrize("by", ["name", "instance"])
def test_a_managers_clock_is_its_policys(by: str) -> None:
    """``CPUOffloadingManager(clock=...)`` times the session policy too, not only the
    pins: the wait it ranks by moves with the manager's clock (it read the wall clock,
    so that a property test's replays on a busy machine decided differently from their
    first run: tests/test_policies.py, FlakyStrategyDefinition in a CI run). A clock
    that is not callable is a TypeError naming it."""
    clock = FakeClock()
    policy = "session" if by == "name" else SessionPolicy(8)
    m = ao.CPUOffloadingManager(8, policy, clock=clock)
    a = keys("a", 2)
    for t in (0.0, 10.0):
        clock.now = t
        serve_request(m, a, ctx=ctx())
    session = m.policy
    assert isinstance(session, SessionPolicy)
    clock.now = 14.0  # a gap of 10 s, away 4: due in 6
    assert session.expected_wait(a[0]) == pytest.approx(6.0)
    clock.now = 19.0
    assert session.expected_wait(a[0]) == pytest.approx(1.0)
    with pytest.raises(TypeError, match="clock"):
        ao.CPUOffloadingManager(8, "session", clock=5.0)  # type: ignore[arg-type]
