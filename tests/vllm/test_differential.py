"""Through vLLM, ``lru`` and ``arc`` decide exactly as vLLM's own manager does.

The installed vLLM's ``CPUOffloadingManager`` and ours are driven in lockstep the way
vLLM 0.32's OffloadingConnector calls them (connector_replay); every lookup, load and
store slot, evicted key and event must be equal, call for call. Ours runs on the Python
manager and on the C core (``native``); for ``kv``, which vLLM lacks, the two are checked
against each other the same way.
"""

from __future__ import annotations

import random
from typing import cast

import pytest
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy

from asyncoffload.integrations.vllm import AsyncOffloadManager
from asyncoffload.integrations.vllm.connector_replay import (
    ManagerMismatch,
    record_calls,
    replay_like_connector,
)
from asyncoffload.integrations.vllm.versions import installed_api
from asyncoffload.keys import make_offload_key
from asyncoffload.manager.native import NativeManager, native_manager_available
from asyncoffload.manager.policies.arc import ARCPolicy
from asyncoffload.manager.policies.kv import KVPolicy
from asyncoffload.replay import capacity_blocks
from asyncoffload.workloads import load_mooncake
from tests.helpers import trace_path

TRACE = trace_path()
# CI has ../shared beside the clone; a bare clone has not.
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason=f"the Mooncake trace is not at {TRACE}")


def _key(name: str, group: int = 0) -> OffloadKey:
    return cast(OffloadKey, make_offload_key(name.encode() * 8, group))


def _pair(
    capacity: int, policy: str, native: bool = False
) -> list[CPUOffloadingManager | AsyncOffloadManager]:
    return [
        CPUOffloadingManager(capacity, policy, enable_events=True),
        AsyncOffloadManager(capacity, policy, enable_events=True, native=native),
    ]


def _target_t1(manager: AsyncOffloadManager) -> float:
    """ARC's target size of T1, from either implementation."""
    ours = manager.manager
    if isinstance(ours, NativeManager):
        return ours.target_t1
    policy = ours.policy
    assert isinstance(policy, ARCPolicy)
    return policy.target_t1


#: Ours on the Python manager and on the C core.
NATIVE = pytest.mark.parametrize(
    "native",
    [
        pytest.param(False, id="python"),
        pytest.param(
            True,
            id="native",
            marks=pytest.mark.skipif(
                not native_manager_available(), reason="the native core cannot be built here"
            ),
        ),
    ],
)
#: vLLM 0.33+'s lru (a running request's blocks ranked together) runs on the Python
#: manager only; arc on both.
VLLM = installed_api()
POLICY_NATIVE = pytest.mark.parametrize(
    ("policy", "native"),
    [
        pytest.param(policy, native, id=f"{policy}-{'native' if native else 'python'}", marks=marks)
        for policy in ("lru", "arc")
        for native, marks in (
            (False, ()),
            (True, pytest.mark.skipif(not native_manager_available(), reason="no native core")),
        )
        if not (native and policy == "lru" and VLLM.ranked_lru)
    ],
)


@pytest.fixture(scope="module")
def conversation() -> list[list[OffloadKey]]:
    """The Mooncake conversation trace: each request's keys of full 512-token blocks."""
    return [
        cast(list[OffloadKey], list(r.keys[: r.input_tokens // r.block_size]))
        for r in load_mooncake(TRACE)
    ]


#: The tier's share of the trace's blocks; the middle one in `make test-long` (the budget
#: of `make test-vllm`: about 13 s).
SHARES = [0.01, pytest.param(0.05, marks=pytest.mark.long), 0.10]


@pytest.mark.timeout(300)
@POLICY_NATIVE
@pytest.mark.parametrize("share", SHARES)
@needs_trace
def test_conversation_trace_decisions_equal_vllms(
    policy: str, share: float, native: bool, conversation: list[list[OffloadKey]]
) -> None:
    unique = len({key for keys in conversation for key in keys})
    capacity = capacity_blocks(share, unique)
    stats = replay_like_connector(conversation, _pair(capacity, policy, native))
    # The replay exercised what matters: hits, evictions, deferrals behind pending stores.
    assert stats.requests == len(conversation)
    assert stats.hit_blocks > 0
    assert stats.evicted_blocks > 0
    assert stats.events > 0


@pytest.mark.timeout(300)
@pytest.mark.skipif(not native_manager_available(), reason="the native core cannot be built here")
@pytest.mark.parametrize("share", SHARES)
@needs_trace
def test_conversation_trace_kv_decides_alike_in_c_and_python(
    share: float, conversation: list[list[OffloadKey]]
) -> None:
    """kv through vLLM's calls on the C core and on the Python manager: the same answers
    call for call, the same counters (blocks declined included) and, at the end, the same
    learned state."""
    unique = len({key for keys in conversation for key in keys})
    capacity = capacity_blocks(share, unique)
    python, native = (
        AsyncOffloadManager(capacity, "kv", enable_events=True, native=flag)
        for flag in (False, True)
    )
    stats = replay_like_connector(conversation, [python, native])
    assert stats.hit_blocks > 0
    assert python.stats() == native.stats()
    assert native.stats().evicted > 0
    if share < 0.1:
        assert native.stats().store_skipped > 0  # the admission declined blocks
    core, reference = native.manager, python.manager
    assert isinstance(core, NativeManager)
    assert not isinstance(reference, NativeManager)
    assert isinstance(reference.policy, KVPolicy)
    learned = core.snapshot()["kv"]
    assert {k: learned[k] for k in reference.policy.snapshot()} == reference.policy.snapshot()


@pytest.mark.timeout(300)
@POLICY_NATIVE
def test_random_workloads_with_two_groups_decide_as_vllm(policy: str, native: bool) -> None:
    """Short random request streams over few keys (so pending stores, pinned blocks,
    refused stores and ghost hits all happen), keys of two KV-cache groups per request
    (group 0's chunks, then group 1's, as the connector offers them), with varied
    transfer and request durations."""
    rng = random.Random(7)
    names = "abcdefghij"
    for _ in range(400):
        requests = []
        for _ in range(rng.randint(2, 10)):
            chosen = rng.sample(names, rng.randint(1, 5))
            groups = rng.choice([(0,), (0, 1)])
            requests.append([_key(name, g) for g in groups for name in chosen])
        replay_like_connector(
            requests,
            _pair(rng.randint(1, 8), policy, native),
            load_steps=rng.randint(1, 3),
            store_steps=rng.randint(1, 4),
            decode_steps=rng.randint(1, 4),
        )


@NATIVE
def test_arc_adapts_to_ghost_hits_offered_to_stores(native: bool) -> None:
    """vLLM's ARC moves its T1 target when a store is offered a key it evicted
    recently (a store miss in B1 / B2), before inserting it. A small case where that
    changes the victim: both managers must evict the same keys and end with the same
    target."""
    requests = [[_key(c) for c in r] for r in ("bc", "b", "a", "acd", "cb")]
    vllm = CPUOffloadingManager(2, "arc", enable_events=True)
    ours = AsyncOffloadManager(2, "arc", enable_events=True, native=native)
    replay_like_connector(requests, [vllm, ours], load_steps=1, store_steps=1, decode_steps=1)
    theirs = vllm._policy
    assert isinstance(theirs, ARCCachePolicy)
    assert _target_t1(ours) == theirs.target_t1_size > 0


def test_arc_without_store_miss_adaptation_would_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same case with the store-miss hook disabled (as our ARC was before): the
    lockstep check catches the difference and names the call and both answers."""
    monkeypatch.setattr(ARCPolicy, "on_store_miss", lambda self, keys: None)
    requests = [[_key(c) for c in r] for r in ("bc", "b", "a", "acd", "cb")]
    with pytest.raises(ManagerMismatch, match=r"step \d+: prepare_store\(.*answered"):
        replay_like_connector(
            requests, _pair(2, "arc"), load_steps=1, store_steps=1, decode_steps=1
        )


def test_record_calls_keeps_every_call_in_order() -> None:
    requests = [[_key(c) for c in r] for r in ("ab", "ab", "c")]
    calls, stats = record_calls(requests, AsyncOffloadManager(4, "lru", enable_events=True))
    methods = [method for method, _ in calls]
    assert methods[0] == "on_new_request"
    assert methods.count("on_new_request") == methods.count("on_request_finished") == 3
    assert methods.count("prepare_load") == 1  # the second "ab" hits both
    assert stats.hit_blocks == 2
    assert stats.stored_blocks == 3
