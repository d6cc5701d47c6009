"""The synthetic chat workload: deterministic, prefix-chained, shared where it should be."""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from typing import Any

import pytest

from asyncoffload.keys import OffloadKey
from asyncoffload.workloads import Request, summarize, synthetic_chat

SMALL: dict[str, Any] = dict(
    num_system_prompts=3,
    system_prompt_blocks=4,
    turns=4,
    blocks_per_turn=2.0,
    output_tokens=40.0,
    block_size=16,
    arrival_rate=50.0,
    think_time_s=0.5,
)


def _sessions(reqs: list[Request]) -> dict[str, list[Request]]:
    by: dict[str, list[Request]] = defaultdict(list)
    for r in reqs:
        by[r.session_id].append(r)
    return by


def test_deterministic_for_a_seed() -> None:
    a = synthetic_chat(200, seed=7, **SMALL)
    b = synthetic_chat(200, seed=7, **SMALL)
    c = synthetic_chat(200, seed=8, **SMALL)
    assert a == b
    assert [r.keys for r in a] != [r.keys for r in c]


def test_count_order_and_token_counts() -> None:
    reqs = synthetic_chat(300, seed=1, **SMALL)
    assert len(reqs) == 300
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] >= 0
    assert len({r.req_id for r in reqs}) == len(reqs)
    for r in reqs:
        assert len(r.keys) == r.input_tokens // 16 == r.num_blocks
        assert r.output_tokens >= 1
        assert all(isinstance(k, bytes) for k in r.keys)
        assert len(set(r.keys)) == len(r.keys)
        assert 0 <= r.turn < SMALL["turns"]


def test_turns_extend_the_conversation() -> None:
    reqs = synthetic_chat(300, seed=2, **SMALL)
    for turns in _sessions(reqs).values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, cur in itertools.pairwise(turns):
            assert cur.arrival_s >= prev.arrival_s
            # Prompt k+1 = prompt k + reply k + a new user message (each >= 1 token).
            assert cur.input_tokens >= prev.input_tokens + prev.output_tokens + 1
            assert cur.keys[: len(prev.keys)] == prev.keys


def test_system_prompts_are_shared_across_sessions() -> None:
    reqs = synthetic_chat(400, seed=3, **SMALL)
    spb = SMALL["system_prompt_blocks"]
    firsts = [turns[0] for turns in _sessions(reqs).values()]
    groups: dict[tuple[OffloadKey, ...], list[Request]] = defaultdict(list)
    for r in firsts:
        groups[r.keys[:spb]].append(r)
    assert len(groups) == SMALL["num_system_prompts"]
    # Different system prompts differ from their first block on.
    assert len({prefix[0] for prefix in groups}) == SMALL["num_system_prompts"]
    for members in groups.values():
        assert len(members) > 1
        # Past the system prompt, every session is its own.
        tails = [r.keys[spb] for r in members if len(r.keys) > spb]
        assert len(set(tails)) == len(tails)


def test_keys_are_prefix_chained() -> None:
    # A key stands for its whole prefix: wherever it appears, the keys before it agree.
    reqs = synthetic_chat(300, seed=4, **SMALL)
    prefix_of: dict[OffloadKey, tuple[OffloadKey, ...]] = {}
    for r in reqs:
        for i, key in enumerate(r.keys):
            prefix = r.keys[:i]
            assert prefix_of.setdefault(key, prefix) == prefix


def test_summary_and_rate() -> None:
    reqs = synthetic_chat(500, seed=5, **SMALL)
    s = summarize(reqs)
    assert s.requests == 500
    assert s.total_blocks == sum(len(r.keys) for r in reqs)
    assert s.unique_blocks == len({k for r in reqs for k in r.keys})
    assert s.max_request_blocks == max(len(r.keys) for r in reqs)
    assert s.input_tokens == sum(r.input_tokens for r in reqs)
    assert s.sessions == len(_sessions(reqs))
    assert 0.3 < s.reusable_fraction < 1.0
    # Poisson arrivals at about arrival_rate per second.
    rate = s.requests / s.duration_s
    assert SMALL["arrival_rate"] / 2 < rate < SMALL["arrival_rate"] * 2


def test_edge_cases() -> None:
    assert synthetic_chat(0, **SMALL) == []
    assert summarize([]).total_blocks == 0
    # No system prompt, no think time: turns share an arrival and keep their order.
    reqs = synthetic_chat(50, **{**SMALL, "system_prompt_blocks": 0, "think_time_s": 0.0})
    for turns in _sessions(reqs).values():
        assert len({r.arrival_s for r in turns}) == 1
        assert [r.turn for r in turns] == list(range(len(turns)))
    # A block larger than any prompt: no keys at all, still consistent.
    tiny_turns = {"block_size": 4096, "system_prompt_blocks": 0, "blocks_per_turn": 0.01}
    big = synthetic_chat(20, **{**SMALL, **tiny_turns})
    assert all(r.keys == () and r.input_tokens < 4096 for r in big)


def test_request_is_frozen_with_slots() -> None:
    r = synthetic_chat(1, **SMALL)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.arrival_s = 1.0  # type: ignore[misc]
    assert not hasattr(r, "__dict__")
    assert hash(r) == hash(dataclasses.replace(r))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"num_system_prompts": 0}, "num_system_prompts"),
        ({"turns": 0}, "turns"),
        ({"block_size": 0}, "block_size"),
        ({"system_prompt_blocks": -1}, "system_prompt_blocks"),
        ({"blocks_per_turn": 0.0}, "blocks_per_turn"),
        ({"output_tokens": float("nan")}, "output_tokens"),
        ({"arrival_rate": -1.0}, "arrival_rate"),
        ({"think_time_s": -0.1}, "think_time_s"),
    ],
)
def test_bad_arguments(override: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        synthetic_chat(10, **{**SMALL, **override})
    with pytest.raises(ValueError, match="num_requests"):
        synthetic_chat(-1, **SMALL)
