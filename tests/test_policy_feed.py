"""Every documented call pattern feeds ``auto``: each request is heard once, whole.

``auto`` (:class:`~asyncoffload.manager.policies.AdaptivePolicy`) scores its candidates on
the requests it hears (``on_request``). A call pattern that never tells it of a request
leaves it on its first candidate for good (issue 40: driven by per-key ``lookup`` and
``touch``, it heard nothing). The patterns: ``lookup_prefix`` (the engine's, the
replay's), per-key ``lookup`` plus ``touch``, and a request-scoped manager (vLLM's
adapter; tests/vllm/test_policy_feed_vllm.py drives it as vLLM's connector does).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import asyncoffload as ao
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.policies import AdaptivePolicy
from asyncoffload.replay import capacity_blocks
from asyncoffload.replay.manager import serve_request
from asyncoffload.workloads import Request, families, summarize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from policy_families import regime_change

Heard = list[tuple[OffloadKey, ...]]


def workload(n: int = 600, family: str = "mixed") -> list[Request]:
    return families()[family].generate(n, seed=0)


def listening(monkeypatch: pytest.MonkeyPatch) -> Heard:
    """Every request any ``auto`` hears from now on, in order."""
    heard: Heard = []
    hear = AdaptivePolicy.on_request

    def on_request(self: AdaptivePolicy, keys: Sequence[OffloadKey]) -> None:
        heard.append(tuple(keys))
        hear(self, keys)

    monkeypatch.setattr(AdaptivePolicy, "on_request", on_request)
    return heard


def by_prefix(m: ao.CPUOffloadingManager, keys: Sequence[OffloadKey]) -> int:
    n = m.lookup_prefix(keys)
    serve_request(m, keys, n)
    return n


def key_by_key(m: ao.CPUOffloadingManager, keys: Sequence[OffloadKey]) -> int:
    """Per-key ``lookup`` up to the first key not ready (docs/api.md's manager calls)."""
    n = 0
    for key in keys:
        if m.lookup(key) is not ao.LookupResult.HIT:
            break
        n += 1
    serve_request(m, keys, n)
    return n


Driver = Callable[[ao.CPUOffloadingManager, Sequence[OffloadKey]], int]


def run(
    driver: Driver, requests: Sequence[Request], cap: int, **options: Any
) -> tuple[list[int], dict[str, Any]]:
    """Each request's prefix hits, and what ``auto`` holds at the end."""
    policy = AdaptivePolicy(cap, **options)
    m = ao.CPUOffloadingManager(cap, policy=policy)
    hits = [driver(m, req.keys) for req in requests]
    return hits, policy.snapshot()


def test_per_key_lookups_and_touches_feed_auto_as_lookup_prefix_does() -> None:
    # One window, no switch: the two call patterns must leave auto exactly alike (its
    # ghosts' hits included), as they leave the real tier alike.
    requests = workload()
    cap = capacity_blocks(0.1, summarize(requests).unique_blocks)
    prefix = run(by_prefix, requests, cap, epoch=1e9)
    per_key = run(key_by_key, requests, cap, epoch=1e9)
    assert prefix[1]["ghosts"][0][1] > 0  # the ghosts scored something
    assert per_key[0] == prefix[0]
    assert per_key[1] == prefix[1]


def test_per_key_lookups_hear_each_request_once_and_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    heard = listening(monkeypatch)
    m = ao.CPUOffloadingManager(6, policy="auto")
    keys = [ao.make_offload_key(bytes([i]) * 8) for i in range(8)]
    a, b, c, d, e = keys[:5]
    key_by_key(m, [a, b, c])  # all missed, all stored
    key_by_key(m, [a, b, c, d, e])  # a b c hit, d missed; d e stored
    assert heard == [(a, b, c), (a, b, c, d, e)]
    # A request that found every key is heard at its load's touch.
    for key in (a, b):
        assert m.lookup(key) is ao.LookupResult.HIT
    m.prepare_load([a, b])
    m.touch([a, b])
    m.complete_load([a, b])
    assert heard[2:] == [(a, b)]
    # One that missed and stores nothing is heard at the next touch, before that one's
    # request; a key looked up again starts another request (a caller that looks twice).
    f, g = keys[5], keys[6]
    assert m.lookup(f) is ao.LookupResult.MISS
    assert m.lookup(f) is ao.LookupResult.MISS
    assert m.lookup(g) is ao.LookupResult.MISS
    assert len(heard) == 3  # a lookup never changes the policy
    m.touch([f, g])
    assert heard[3:] == [(f,), (f, g)]
    # lookup_prefix hears the walks set aside, then its own request (the open walk's).
    assert m.lookup(g) is ao.LookupResult.MISS
    m.prepare_store([g])  # ends the walk: it missed and touched nothing
    assert m.lookup(f) is ao.LookupResult.MISS
    m.lookup_prefix([f, keys[7]])
    assert heard[5:] == [(g,), (f, keys[7])]
    m.prepare_store([f, keys[7]])  # a store never tells the policy of a request
    assert len(heard) == 7


def test_driven_key_by_key_auto_leaves_a_candidate_that_loses() -> None:
    # Started on lru where scans pass through a hot set (ARC and kv keep it), with short
    # epochs: before issue 40 auto heard nothing this way and stayed on lru for good.
    requests = workload(1500, "scan")
    cap = capacity_blocks(0.05, summarize(requests).unique_blocks)
    fast: dict[str, Any] = {"initial": "lru", "epoch": 1.0, "patience": 1, "warmup": 0.0}
    prefix = run(by_prefix, requests, cap, **fast)
    per_key = run(key_by_key, requests, cap, **fast)
    assert prefix[1]["switches"] >= 1
    assert per_key[1]["switches"] >= 1
    assert per_key[1]["leader"] != "lru"


def test_a_request_scoped_manager_feeds_auto_each_request_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    heard = listening(monkeypatch)
    m = ao.CPUOffloadingManager(8, policy="auto", request_scoped=True)
    keys = [ao.make_offload_key(bytes([i]) * 8) for i in range(6)]
    a, b, c, d = keys[:4]
    for i, req in enumerate([[a, b, c], [a, b, c, d], [a, b]]):
        ctx = ao.ReqContext(req_id=f"r{i}")
        m.on_new_request(ctx)
        n = 0
        for key in req:  # vLLM looks keys up one by one
            if m.lookup(key, ctx) is not ao.LookupResult.HIT:
                break
            n += 1
        if n:
            m.prepare_load(req[:n], ctx)
            m.complete_load(req[:n], ctx)
        if n < len(req):
            out = m.prepare_store(req[n:], ctx)
            assert out is not None
            m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
    # The third stores nothing: heard when it ends.
    assert heard == [(a, b, c), (a, b, c, d), (a, b)]


def request_scoped(m: ao.CPUOffloadingManager, keys: Sequence[OffloadKey], i: int) -> int:
    """vLLM's pattern on a request-scoped manager: per-key lookups with the request's
    context, the load, the store, the request's end; no ``touch``."""
    ctx = ao.ReqContext(req_id=f"r{i}")
    m.on_new_request(ctx)
    n = 0
    for key in keys:
        if m.lookup(key, ctx) is not ao.LookupResult.HIT:
            break
        n += 1
    if n:
        m.prepare_load(keys[:n], ctx)
        m.complete_load(keys[:n], ctx)
    if n < len(keys):
        out = m.prepare_store(keys[n:], ctx)
        if out is not None and out.keys_to_store:
            m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    return n


#: The regime change: kv leads for the first 2,000 requests (16 capacities of 1,000
#: blocks), then LRU and ARC lead by 0.1-0.3 (tests/test_policy_adaptive.py).
BEFORE, AFTER, CAP = 2000, 1500, 1000


def assert_reacted_to_the_change(policy: AdaptivePolicy, requests: Sequence[Request]) -> None:
    """``auto`` left kv for LRU or ARC within 2 capacities of traffic after the change:
    it heard the requests, all of them, in time."""
    change = sum(len(r.keys) for r in requests[:BEFORE])
    assert policy.timeline, repr(policy)
    at, old, new = policy.timeline[0]
    assert old == "kv" and new in ("lru", "arc"), policy.timeline
    assert change < at <= change + 2 * CAP, (at - change) / CAP


@pytest.mark.parametrize("pattern", ["lookup_prefix", "lookup and touch", "request-scoped"])
def test_auto_reacts_to_a_change_of_leader_under_every_call_pattern(pattern: str) -> None:
    # Each way of calling the manager must tell auto of every request, in time: driven
    # so, it leaves kv within 2 capacities of the change, as the replay's auto does. A
    # pattern that fed nothing (per-key lookups before issue 40) never switches.
    requests = regime_change(BEFORE, AFTER)
    policy = AdaptivePolicy(CAP)
    m = ao.CPUOffloadingManager(CAP, policy=policy, request_scoped=pattern == "request-scoped")
    for i, req in enumerate(requests):
        if pattern == "lookup_prefix":
            by_prefix(m, req.keys)
        elif pattern == "lookup and touch":
            key_by_key(m, req.keys)
        else:
            request_scoped(m, req.keys, i)
    assert_reacted_to_the_change(policy, requests)
