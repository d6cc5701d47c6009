"""Retention hints through vLLM: ``kv_transfer_params["asyncoffload_retention"]`` on
vLLM's own request contexts, read by the scheduler's manager (issue 40)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import pytest
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from asyncoffload.integrations.vllm import AsyncOffloadManager, AsyncOffloadSpec
from asyncoffload.manager import CPUOffloadingManager
from asyncoffload.manager.retention import RETENTION_PARAM, Retention, retention_from_params
from tests.helpers import FakeClock
from tests.vllm.test_spec import _caches, _config, _extra, _keys, _spec, _worker


def _manager(**settings: Any) -> AsyncOffloadManager:
    manager = _spec(**settings).get_manager()
    assert isinstance(manager, AsyncOffloadManager)
    return manager


def _counters(manager: AsyncOffloadManager) -> dict[str, Any]:
    stats = manager.get_stats()
    assert stats is not None
    return stats.reduce()


def _hinted(req_id: str, hint: Any) -> ReqContext:
    return ReqContext(req_id=req_id, kv_transfer_params={RETENTION_PARAM: hint})


def _serve(manager: AsyncOffloadManager, ctx: ReqContext, keys: list[OffloadKey]) -> None:
    """One request as vLLM's connector drives it: start, store, finish."""
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)


def _resident(manager: AsyncOffloadManager) -> set[bytes]:
    inner = manager.manager
    assert isinstance(inner, CPUOffloadingManager)
    return set(inner.resident_keys())


def test_a_hinted_requests_blocks_outlive_a_flood_until_their_ttl() -> None:
    manager = _manager(pin_budget=0.5)
    assert isinstance(manager, AsyncOffloadManager) and not manager.native
    inner = manager.manager
    assert isinstance(inner, CPUOffloadingManager)
    clock = inner.pins.clock = FakeClock(1000.0)
    kept = _keys("a", "b")
    _serve(manager, _hinted("r", {"ttl_s": 30}), kept)
    flood = _keys(*(f"f{i}" for i in range(3 * inner.num_blocks)))
    for i in range(0, len(flood), 4):
        _serve(manager, ReqContext(req_id=f"f{i}"), flood[i : i + 4])
    assert set(kept) <= _resident(manager)  # LRU would have evicted them first
    values = _counters(manager)
    assert values["vllm:asyncoffload_pinned_blocks"] == 2
    clock.now += 31  # past the TTL: the pins expire, the blocks are ordinary again
    for i in range(0, len(flood), 4):
        _serve(manager, ReqContext(req_id=f"g{i}"), _keys(*(f"g{i}.{j}" for j in range(4))))
    assert not set(kept) & _resident(manager)
    later = _counters(manager)
    assert later["vllm:asyncoffload_pins_expired"] == 2
    assert later["vllm:asyncoffload_pinned_blocks"] == 0


def test_a_load_of_a_hinted_request_refreshes_the_pin() -> None:
    manager = _manager(pin_budget=0.5)
    inner = manager.manager
    assert isinstance(inner, CPUOffloadingManager)
    clock = inner.pins.clock = FakeClock(1000.0)
    kept = _keys("a", "b")
    _serve(manager, _hinted("r0", {"ttl_s": 30}), kept)
    clock.now += 20
    ctx = _hinted("r1", {"ttl_s": 30})
    manager.on_new_request(ctx)
    manager.prepare_load(kept, ctx)
    manager.complete_load(kept, ctx)
    manager.on_request_finished(ctx)
    clock.now += 20  # 40 s after the store, 20 s after the hit
    for i in range(0, 3 * inner.num_blocks, 4):
        _serve(manager, ReqContext(req_id=f"f{i}"), _keys(*(f"f{i}.{j}" for j in range(4))))
    assert set(kept) <= _resident(manager)


def test_without_a_pin_budget_a_hint_is_refused_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager = _manager()  # retention off: the C core where it builds
    assert isinstance(manager, AsyncOffloadManager)
    with caplog.at_level(logging.WARNING, "asyncoffload"):
        _serve(manager, _hinted("r", {"ttl_s": 30}), _keys("a"))
    assert "set pin_budget in kv_connector_extra_config" in caplog.text
    values = _counters(manager)
    assert values["vllm:asyncoffload_pins_refused"] == 1
    assert "vllm:asyncoffload_pins_refused" not in _counters(manager)  # increments


@pytest.mark.parametrize(
    ("hint", "message"),
    [
        ({"ttl_s": -1}, r"asyncoffload_retention'\]\.ttl_s must be a positive"),
        ({"ttl_s": 0}, r"asyncoffload_retention'\]\.ttl_s must be a positive"),
        ({"ttl_s": 2 * 86_400}, r"ttl_s must be at most 86400 s"),
        ({"ttl_s": "30"}, r"ttl_s must be a number of seconds"),
        ({"retention_class": "urgent"}, r"retention_class must be one of low, normal, high"),
        ({"ttl": 30}, r"unknown field\(s\) ttl"),
        ([30], r"must be an object"),
    ],
)
def test_a_malformed_hint_is_refused_by_name_and_the_request_runs(
    hint: Any, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match=message):  # what a server can check first
        retention_from_params({RETENTION_PARAM: hint})
    manager = _manager(pin_budget=0.5)
    inner = manager.manager
    assert isinstance(inner, CPUOffloadingManager)
    with caplog.at_level(logging.WARNING, "asyncoffload"):
        _serve(manager, _hinted("r", hint), _keys("a"))
    assert "retention hint refused" in caplog.text and "request r:" in caplog.text
    assert set(_keys("a")) <= _resident(manager)  # stored all the same, unpinned
    assert inner.pins.stats().pinned == 0
    assert _counters(manager)["vllm:asyncoffload_pins_refused"] == 1


def test_the_pin_budget_refuses_pins_past_it_and_counts_them() -> None:
    manager = _manager(pin_budget=0.05)  # 3 of 64 slots
    inner = manager.manager
    assert isinstance(inner, CPUOffloadingManager)
    assert inner.pins.limit == 3
    _serve(manager, _hinted("r", {"ttl_s": 30}), _keys(*"abcde"))
    stats = inner.pins.stats()
    assert (stats.pinned, stats.refused) == (3, 2)
    assert set(inner.pins._pins) == set(cast(Any, _keys(*"abc")))  # the prompt's head first
    assert _counters(manager)["vllm:asyncoffload_pins_refused"] == 2


@pytest.mark.parametrize("budget", [0, -0.5, 1.5, True, "half"])
def test_a_pin_budget_outside_0_1_names_the_key(budget: object) -> None:
    with pytest.raises(ValueError, match=r"\['pin_budget'\]: .*pin_budget must be a share"):
        AsyncOffloadSpec(_config(_extra(pin_budget=budget)))


def test_a_hint_is_held_for_its_request_only() -> None:
    manager = _manager(pin_budget=1.0)
    inner = manager.manager
    assert isinstance(inner, CPUOffloadingManager)
    ctx = _hinted("r", {"ttl_s": 5, "retention_class": "high"})
    manager.on_new_request(ctx)
    assert inner.pins.retention_of(cast(Any, ctx)) == Retention(5.0, "high")
    manager.on_request_finished(ctx)
    assert inner.pins.retention_of(cast(Any, ctx)) is None


def test_a_hinted_requests_blocks_are_pinned_on_disk_and_vllm_sees_no_pin_event(
    tmp_path: Path,
) -> None:
    from tests.vllm.test_tiers_vllm import CHUNK, _store, _tier

    (tmp_path / "shm").mkdir()
    extra = _extra(
        cpu_bytes_to_use=4 * CHUNK,
        tiers=[_tier(tmp_path / "disk", pin_budget=0.5)],
        host_pool_dir=str(tmp_path / "shm"),
        pin_budget=0.5,
    )
    spec = OffloadingSpecFactory.create_spec(_config(extra))
    assert isinstance(spec, AsyncOffloadSpec)
    worker = _worker(spec, _caches(num_blocks=16))
    manager = spec.get_manager()
    assert isinstance(manager, AsyncOffloadManager) and manager.tiers is not None
    try:
        kept = _keys("a", "b")
        ctx = _hinted("r", {"ttl_s": 60, "retention_class": "high"})
        manager.on_new_request(ctx)
        _store(manager, worker, kept, [0, 1], ctx)  # vLLM completes stores without a hint
        manager.on_request_finished(ctx)
        index = manager.tiers.core.tiers[0].index
        assert all(key in index.pins for key in kept)  # carried down from the CPU tier
        assert index.pins.retention_of_key(cast(Any, kept[0])) == Retention(60.0, "high")
        events = list(manager.take_events())
        assert events and all(not getattr(e, "retention", None) for e in events)
        stored = {k for e in events if not e.removed for k in e.keys}
        assert set(kept) <= stored
    finally:
        worker.shutdown()
        manager.shutdown()
