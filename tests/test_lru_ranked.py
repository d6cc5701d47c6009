"""vLLM 0.33+'s LRU (``RankedLRUPolicy``) and vLLM 0.34's offer count, on the manager alone.

The lockstep differential against vLLM's own manager runs in tests/vllm
(test_differential.py, on the 0.33 and 0.34 overlays); these are the rules one by one."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from asyncoffload.keys import OffloadKey, make_offload_key
from asyncoffload.manager import CPUOffloadingManager, ReqContext
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies import RankedLRUPolicy, RequestScope


def k(name: str) -> OffloadKey:
    return make_offload_key(name.encode() * 4, 0)


def ready(policy: RankedLRUPolicy, keys: list[OffloadKey], request: RequestScope | None) -> None:
    policy.insert_ranked([(key, BlockStatus(i)) for i, key in enumerate(keys)], request)
    for key in keys:
        block = policy.get(key)
        assert block is not None
        block.ref_cnt = 0


def victims(
    policy: RankedLRUPolicy, n: int, protected: set[OffloadKey] | None = None
) -> list[OffloadKey]:
    out = policy.evict(n, protected or set())
    assert out is not None
    return [key for key, _ in out]


def test_a_running_requests_later_insert_ranks_before_a_newer_requests_blocks() -> None:
    policy = RankedLRUPolicy(8)
    a = RequestScope({k("a1"): 32, k("a2"): 64})
    b = RequestScope({k("b1"): 32})
    ready(policy, [k("a1")], a)  # request a draws its rank
    ready(policy, [k("b1")], b)  # then b
    ready(policy, [k("a2")], a)  # a's later block keeps a's (older) rank, tail first
    assert victims(policy, 3) == [k("a2"), k("a1"), k("b1")]


def test_an_access_moves_an_older_block_up_to_the_requests_rank() -> None:
    policy = RankedLRUPolicy(8)
    ready(policy, [k("old")], None)
    ready(policy, [k("x")], None)
    r = RequestScope({k("old"): 32})
    policy.on_request_access([k("old")], r)
    assert victims(policy, 2) == [k("x"), k("old")]


def test_an_access_never_moves_a_block_down() -> None:
    policy = RankedLRUPolicy(8)
    early = RequestScope({k("p"): 32})
    policy.on_request_access([], early)  # early draws its rank first
    ready(policy, [k("x")], None)
    ready(policy, [k("p")], None)  # fresher than x and than early's rank
    policy.on_request_access([k("p")], early)  # would rank p below x: p stays
    assert victims(policy, 2) == [k("x"), k("p")]


def test_the_finished_request_makes_its_head_most_recent() -> None:
    policy = RankedLRUPolicy(8)
    r = RequestScope({k("h"): 32, k("t"): 64})
    ready(policy, [k("h"), k("t")], r)
    ready(policy, [k("other")], None)
    policy.on_request_finished([[k("h"), k("t")]], {k("h"), k("t")}, set())
    assert victims(policy, 3) == [k("other"), k("t"), k("h")]


def test_eviction_passes_over_pinned_and_protected_blocks_all_or_nothing() -> None:
    policy = RankedLRUPolicy(8)
    ready(policy, [k("a"), k("b"), k("c")], None)
    pinned = policy.get(k("a"))
    assert pinned is not None
    pinned.ref_cnt = 1
    assert policy.evict(3, {k("b")}) is None
    assert len(policy) == 3
    assert victims(policy, 1, {k("b")}) == [k("c")]
    pinned.ref_cnt = 0
    assert victims(policy, 2) == [k("a"), k("b")]


def test_clear_forgets_every_requests_rank() -> None:
    policy = RankedLRUPolicy(8)
    r = RequestScope({k("a"): 32, k("z"): 32})
    ready(policy, [k("a")], r)
    policy.clear()
    ready(policy, [k("y")], None)
    ready(policy, [k("z")], r)  # r draws a new rank after the clear, newer than y's
    assert victims(policy, 2) == [k("y"), k("z")]


def test_the_manager_tells_a_ranked_policy_of_first_uses_and_inserts() -> None:
    policy = RankedLRUPolicy(3)
    manager = CPUOffloadingManager(3, policy, request_scoped=True)
    seen: list[list[OffloadKey]] = []
    real = policy.on_request_access

    def heard(keys: Sequence[OffloadKey], scope: RequestScope) -> None:
        seen.append(list(keys))
        real(keys, scope)

    policy.on_request_access = heard  # type: ignore[method-assign,assignment]
    ctx = ReqContext(req_id="r")
    manager.on_new_request(ctx)
    out = manager.prepare_store([k("a"), k("b")], ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    manager.prepare_load([k("a")], ctx)  # already seen: not heard again
    manager.prepare_store([k("a"), k("c")], ctx)
    assert seen == [[k("a"), k("b")], [k("c")]]


@pytest.mark.parametrize("threshold", [2, 3])
def test_a_key_counts_once_per_request_toward_the_store_threshold(threshold: int) -> None:
    manager = CPUOffloadingManager(
        4, "lru", threshold, request_scoped=True, count_once_per_request=True
    )
    ctx = ReqContext(req_id="r")
    for _ in range(threshold + 2):  # re-offers of one request (a preempted one)
        out = manager.prepare_store([k("a")], ctx)
        assert out is not None and out.keys_to_store == []
    assert manager.stats().store_skipped == 1  # skipped once, not per re-offer
    for i in range(threshold - 1):  # other requests' offers count
        out = manager.prepare_store([k("a")], ReqContext(req_id=f"other{i}"))
    assert out is not None and out.keys_to_store == [k("a")]


def test_without_count_once_every_offer_counts() -> None:
    manager = CPUOffloadingManager(4, "lru", 2, request_scoped=True)
    ctx = ReqContext(req_id="r")
    first = manager.prepare_store([k("a")], ctx)
    assert first is not None and first.keys_to_store == []
    second = manager.prepare_store([k("a")], ctx)
    assert second is not None and second.keys_to_store == [k("a")]


class PositionedContext(ReqContext):
    """A context that names its keys' end tokens, as vLLM's does."""

    _offload_key_positions: dict[OffloadKey, int]


def test_auto_hears_a_request_stored_chunk_by_chunk_whole_and_once() -> None:
    """vLLM stores a long prompt over several steps. ``auto``'s ghosts hear the request
    once, with every key vLLM named a position for, not only the first chunk."""
    manager = CPUOffloadingManager(64, "auto", request_scoped=True)
    keys = [k(f"p{i}") for i in range(8)]
    ctx = PositionedContext(req_id="long")
    ctx._offload_key_positions = {key: 32 * (i + 1) for i, key in enumerate(keys)}
    manager.on_new_request(ctx)
    for lo in (0, 3, 6):  # three chunks of prefill
        out = manager.prepare_store(keys[lo : lo + 3], ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    seen, _ = manager.policy.snapshot()["seen"]  # type: ignore[attr-defined]
    assert seen == len(keys)
