"""Tenant quotas and opt-out under vLLM's scheduler contract (issue 40): a request's
cache_salt is its tenant, with vLLM's own ReqContext (which has no salt)."""

from __future__ import annotations

import logging

import pytest
from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from asyncoffload.integrations.vllm.manager import (
    BLOCKS_OPTED_OUT,
    BLOCKS_QUOTA_REFUSED,
    AsyncOffloadManager,
)
from asyncoffload.integrations.vllm.settings import VllmOffloadSettings
from asyncoffload.manager.native import native_manager_available
from asyncoffload.manager.quotas import NO_STORE_KEY


def keys(tag: int, n: int) -> list[OffloadKey]:
    return [OffloadKey(bytes([tag, i]) * 16 + b"\0\0\0\0") for i in range(n)]


def request(m: AsyncOffloadManager, req_id: str, salt: str | None, **params: object) -> ReqContext:
    m.expect_request(req_id, salt)  # what AsyncOffloadConnector.on_new_request does
    ctx = ReqContext(req_id=req_id, kv_transfer_params=dict(params) or None)
    m.on_new_request(ctx)
    return ctx


def counter(m: AsyncOffloadManager, name: str) -> int:
    """The increment of counter ``name`` that ``get_stats`` reports now."""
    values: dict[str, dict[tuple[str, ...], int]] = m.get_stats()._values
    return sum(values.get(name, {}).values())


def store(m: AsyncOffloadManager, ks: list[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
    out = m.prepare_store(ks, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    return list(out.keys_to_store)


def test_cache_salts_are_tenants_a_flood_never_evicts_the_steady_salt() -> None:
    m = AsyncOffloadManager(16, "lru", quotas={"flood": 8, "steady": 8})
    assert not m.native  # quotas run on the Python manager
    steady = keys(1, 6)
    assert store(m, steady, request(m, "s0", "steady")) == steady
    for r in range(5):
        ctx = request(m, f"f{r}", "flood")
        assert len(store(m, keys(10 + r, 10), ctx)) == 8  # 2 over its quota
        m.on_request_finished(ctx)
        assert all(m.lookup(k, ReqContext(req_id="x")).name == "HIT" for k in steady)
    stats = m.manager.stats()
    flood = {t.tenant: t for t in stats.tenants}["flood"]
    assert flood.refused == stats.quota_refused == 10 and flood.held == 8
    assert counter(m, BLOCKS_QUOTA_REFUSED) == 10


@pytest.mark.parametrize("native", [False, True])
def test_an_opted_out_request_stores_nothing_and_is_counted(native: bool) -> None:
    if native and not native_manager_available():
        pytest.skip("the native manager core does not build here")
    m = AsyncOffloadManager(8, "arc", native=native)  # 0.33+ runs lru in Python only
    assert m.native == native
    ctx = request(m, "r", None, **{NO_STORE_KEY: True})
    out = m.prepare_store(keys(1, 3), ctx)
    assert out is not None and list(out.keys_to_store) == []
    assert counter(m, BLOCKS_OPTED_OUT) == 3
    assert store(m, keys(1, 3), request(m, "q", None)) == keys(1, 3)


def test_a_bad_opt_out_value_is_logged_and_not_cached(caplog: pytest.LogCaptureFixture) -> None:
    m = AsyncOffloadManager(8, "lru")
    with caplog.at_level(logging.WARNING, "asyncoffload.vllm"):
        ctx = request(m, "r", None, **{NO_STORE_KEY: "please"})
    assert NO_STORE_KEY in caplog.text and "not cached" in caplog.text
    out = m.prepare_store(keys(1, 2), ctx)
    assert out is not None and list(out.keys_to_store) == []


def test_quota_settings_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\[.*'x' is not a known tenant"):
        VllmOffloadSettings.from_extra_config(
            {"cpu_bytes_to_use": 1 << 20, "tenants": ["a"], "quotas": {"x": 4}}
        )
    with pytest.raises(ValueError, match=r"a share must be above 0%"):
        VllmOffloadSettings.from_extra_config(
            {"cpu_bytes_to_use": 1 << 20, "tenants": ["a"], "quotas": {"a": "0%"}}
        )
