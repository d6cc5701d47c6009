"""Through vLLM's adapter, ``auto`` hears every request once, whole (issue 40).

The adapter's manager is request-scoped: vLLM (0.32 to 0.34) looks a request's keys up
one by one, loads and offers them (vLLM 0.34's own manager reports those first accesses
to its policy, ``on_request_access``), and never calls ``touch`` (0.34 has none). ``auto``
must still hear each request, once, with all its keys: at its first store, or when it
ends if it stores nothing. Driven here as vLLM's connector drives a manager
(connector_replay), on whichever vLLM is installed (the 0.34 overlay lane included).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest
from vllm.v1.kv_offload.base import OffloadKey

from asyncoffload.integrations.vllm import AsyncOffloadManager
from asyncoffload.integrations.vllm.connector_replay import replay_like_connector
from asyncoffload.integrations.vllm.versions import installed_api
from asyncoffload.keys import OffloadKey as OurKey
from asyncoffload.manager import CPUOffloadingManager
from asyncoffload.manager.policies import AdaptivePolicy
from asyncoffload.replay import capacity_blocks
from asyncoffload.workloads import families, summarize

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from policy_families import regime_change


def test_auto_hears_each_request_once_through_vllms_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    heard: list[tuple[OurKey, ...]] = []
    hear = AdaptivePolicy.on_request

    def on_request(self: AdaptivePolicy, keys: Sequence[OurKey]) -> None:
        heard.append(tuple(keys))
        hear(self, keys)

    monkeypatch.setattr(AdaptivePolicy, "on_request", on_request)
    requests = families()["mixed"].generate(400, seed=1)
    prompts = [cast(list[OffloadKey], list(r.keys)) for r in requests]
    cap = capacity_blocks(0.1, summarize(requests).unique_blocks)
    manager = AsyncOffloadManager(cap, "auto", enable_events=True)
    stats = replay_like_connector(prompts, [manager])
    assert stats.hit_blocks > 0 and stats.stored_blocks > 0
    # Every request heard once, with all its keys (head first), whatever it hit.
    assert Counter(heard) == Counter(tuple(p) for p in prompts), installed_api().version
    python = manager.manager
    assert isinstance(python, CPUOffloadingManager)  # auto runs on the Python manager
    policy = python.policy
    assert isinstance(policy, AdaptivePolicy)
    assert all(rate > 0 for rate in policy.scores().values())


def test_through_vllms_calls_auto_reacts_to_a_change_of_leader() -> None:
    # benchmarks/policy_families.py's regime change: kv leads for 2,000 requests (16
    # capacities of 1,000 blocks), then LRU and ARC lead by 0.1-0.3. Driven as vLLM's
    # connector drives the adapter (stores a step or two after the lookups, no touch),
    # auto hears each request in time to leave kv within 2 capacities of the change.
    requests = regime_change(2000, 1500)
    prompts = [cast(list[OffloadKey], list(r.keys)) for r in requests]
    cap = 1000
    change = sum(len(p) for p in prompts[:2000])
    manager = AsyncOffloadManager(cap, "auto")
    replay_like_connector(prompts, [manager], check=False)
    python = manager.manager
    assert isinstance(python, CPUOffloadingManager)
    policy = python.policy
    assert isinstance(policy, AdaptivePolicy)
    assert policy.timeline, (repr(policy), installed_api().version)
    at, old, new = policy.timeline[0]
    assert old == "kv" and new in ("lru", "arc"), policy.timeline
    assert change < at <= change + 2 * cap, (at - change) / cap
