"""Prometheus metrics: scraped values equal the engine's own counters, registries stay
separate, scrapes from other threads read on the loop, and bad arguments register nothing."""

from __future__ import annotations

import asyncio
import logging
import threading
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

import asyncoffload as ao
from asyncoffload.histogram import HistogramSnapshot
from asyncoffload.integrations.kv_events import PublisherStats
from asyncoffload.integrations.prometheus import EngineMetrics
from tests.helpers import FailingBackend, make_engine, make_keys, random_kv

_SampleKey = tuple[str, tuple[tuple[str, str], ...]]

_COUNTERS = {
    "blocks_stored", "blocks_loaded", "blocks_evicted", "bytes_stored", "bytes_loaded",
    "store_skipped_blocks", "stores_rejected", "transfers", "transfers_failed",
    "store_failed_blocks", "lookups", "lookup_blocks", "lookup_hit_blocks",
    "events_published", "events_dropped", "tier_lookup_hit_blocks", "tier_io_bytes",
    "tier_failed_blocks", "tier_dropped_blocks", "retention_pins", "quota_refused_blocks",
    "opted_out_blocks", "tier_write_shed_blocks", "tier_write_yielded_blocks",
    "tier_load_decision_blocks",
}  # fmt: skip
_GAUGES = {
    "tier_capacity_blocks", "tier_blocks", "transfers_in_flight", "event_subscribers",
    "event_subscriber_lag_max_events", "event_subscriber_lag_events",
    "retention_pinned_blocks", "retention_pin_limit_blocks", "tier_write_lag_seconds",
}  # fmt: skip
_HISTOGRAMS = {
    "transfer_duration_seconds", "transfer_throughput_bytes_per_second",
    "completion_callback_latency_seconds",
}  # fmt: skip


@dataclass
class _CountingPublisher:
    """Plain counters behind the ``PublisherLike`` protocol (stands in for the real
    publisher in these tests)."""

    endpoint: str
    counts: PublisherStats

    def stats(self) -> PublisherStats:
        return self.counts


def _publisher(endpoint: str, base: int = 1) -> _CountingPublisher:
    return _CountingPublisher(endpoint, PublisherStats(*range(base, base + 10)))


class _ThreadRecordingEngine(ao.AsyncOffloadEngine):
    """An engine that records the thread of every ``stats()`` call."""

    def __init__(self, kv: Sequence[torch.Tensor], config: ao.EngineConfig) -> None:
        super().__init__(kv, config)
        self.stats_threads: list[int] = []

    def stats(self) -> ao.EngineStats:
        self.stats_threads.append(threading.get_ident())
        return super().stats()


# --- helpers -------------------------------------------------------------------------


def _key(name: str, labels: dict[str, str]) -> _SampleKey:
    # Bucket bounds compare as numbers: "1e+09" and "1000000000.0" are one bound.
    norm = {k: (repr(float(v)) if k == "le" else v) for k, v in labels.items()}
    return name, tuple(sorted(norm.items()))


def _samples(families: Iterable[Metric]) -> dict[_SampleKey, float]:
    out: dict[_SampleKey, float] = {}
    for family in families:
        for sample in family.samples:
            key = _key(sample.name, sample.labels)
            assert key not in out, f"duplicate sample {key}"
            out[key] = sample.value
    return out


def _parse(text: str) -> dict[_SampleKey, float]:
    return _samples(text_string_to_metric_families(text))


def _fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body: bytes = resp.read()
    return body.decode()


def _expected(
    s: ao.EngineStats, ns: str = "asyncoffload", const: dict[str, str] | None = None
) -> dict[_SampleKey, float]:
    """Every sample the engine's stats should produce, written out independently."""
    out: dict[_SampleKey, float] = {}
    extra = const or {}

    def put(name: str, value: float, **labels: str) -> None:
        out[_key(f"{ns}_{name}", {**labels, **extra})] = float(value)

    def put_hist(name: str, snap: HistogramSnapshot, **labels: str) -> None:
        bounds = [*snap.bounds, float("inf")]
        for bound, count in zip(bounds, snap.cumulative()):
            put(f"{name}_bucket", count, le=repr(bound), **labels)
        put(f"{name}_count", snap.samples, **labels)
        put(f"{name}_sum", snap.total, **labels)

    m = s.manager
    live = [sub.buffered for sub in s.subscriptions if not sub.closed]
    put("blocks_stored_total", s.blocks_stored, medium="CPU")
    put("blocks_loaded_total", s.blocks_loaded, medium="CPU")
    put("blocks_evicted_total", s.blocks_evicted, medium="CPU")
    put("bytes_stored_total", s.bytes_stored)
    put("bytes_loaded_total", s.bytes_loaded)
    put("store_skipped_blocks_total", m.store_skipped, medium="CPU")
    put("stores_rejected_total", s.stores_rejected)
    put("transfers_total", s.stores, direction="store")
    put("transfers_total", s.loads, direction="load")
    put("transfers_failed_total", s.transfers_failed)
    put("store_failed_blocks_total", m.store_failed, medium="CPU")
    put("lookups_total", s.lookups)
    put("lookup_blocks_total", s.lookup_keys)
    put("lookup_hit_blocks_total", s.lookup_hits)
    put("events_published_total", s.events_published)
    put("events_dropped_total", s.events_dropped)
    put("tier_capacity_blocks", m.num_blocks, medium="CPU")
    put("tier_blocks", m.ready, medium="CPU", state="ready")
    put("tier_blocks", m.write_pending, medium="CPU", state="writing")
    put("tier_blocks", m.pinned, medium="CPU", state="pinned")
    put("tier_blocks", m.free, medium="CPU", state="free")
    put("transfers_in_flight", s.in_flight)
    put("event_subscribers", s.subscribers)
    put("event_subscriber_lag_max_events", max(live, default=0))
    put("event_subscriber_lag_events", sum(live))
    put_hist("transfer_duration_seconds", s.store_duration, direction="store")
    put_hist("transfer_duration_seconds", s.load_duration, direction="load")
    put_hist("transfer_throughput_bytes_per_second", s.store_throughput, direction="store")
    put_hist("transfer_throughput_bytes_per_second", s.load_throughput, direction="load")
    put_hist("completion_callback_latency_seconds", s.callback_latency)
    for t in s.tiers:
        tm, medium = t.manager, t.medium
        put("blocks_stored_total", t.blocks_written, medium=medium)
        put("blocks_loaded_total", t.blocks_read, medium=medium)
        put("blocks_evicted_total", tm.evicted, medium=medium)
        put("store_skipped_blocks_total", tm.store_skipped, medium=medium)
        put("store_failed_blocks_total", t.write_failures, medium=medium)
        put("tier_capacity_blocks", tm.num_blocks, medium=medium)
        for state, value in (
            ("ready", tm.ready),
            ("writing", tm.write_pending),
            ("pinned", tm.pinned),
            ("free", tm.free),
        ):
            put("tier_blocks", value, medium=medium, state=state)
        put("tier_lookup_hit_blocks_total", t.lookup_hits, medium=medium)
        put("tier_io_bytes_total", t.bytes_written, medium=medium, direction="write")
        put("tier_io_bytes_total", t.bytes_read, medium=medium, direction="read")
        for cause, n in t.failures.items():
            put("tier_failed_blocks_total", n, medium=medium, cause=cause)
        put("tier_dropped_blocks_total", t.dropped, medium=medium)
        put("tier_write_shed_blocks_total", t.write_shed, medium=medium)
        put("tier_write_yielded_blocks_total", t.write_yielded, medium=medium)
        put("tier_write_lag_seconds", t.write_lag_s, medium=medium)
        for decision in ("loaded", "recomputed_by_choice", "recomputed_after_deadline"):
            put(
                "tier_load_decision_blocks_total",
                getattr(t, decision),
                medium=medium,
                decision=decision,
            )
    for medium, p in (("CPU", s.pins), *((t.medium, t.pins) for t in s.tiers)):
        assert p is not None  # every tier of the engine has retention pins
        put("retention_pinned_blocks", p.pinned, medium=medium)
        put("retention_pin_limit_blocks", p.limit, medium=medium)
        for outcome, n in (
            ("pinned", p.pins),
            ("refreshed", p.refreshed),
            ("refused", p.refused),
            ("expired", p.expired),
            ("released", p.released),
        ):
            put("retention_pins_total", n, medium=medium, outcome=outcome)
    for tier, tm in (("CPU", m), *((t.name, t.manager) for t in s.tiers)):
        for tenant in tm.tenants:
            put("quota_refused_blocks_total", tenant.refused, tier=tier, tenant=tenant.tenant)
        put("opted_out_blocks_total", tm.opted_out, tier=tier)
    return out


def _expected_publisher(
    p: _CountingPublisher, ns: str = "asyncoffload", const: dict[str, str] | None = None
) -> dict[_SampleKey, float]:
    c = p.counts
    labels = {"endpoint": p.endpoint, **(const or {})}
    values = {
        "kv_events_batches_published_total": c.batches_published,
        "kv_events_published_total": c.events_published,
        "kv_events_dropped_total": c.events_dropped,
        "kv_events_resyncs_total": c.resyncs,
        "kv_events_replay_requests_total": c.replay_requests,
        "kv_events_replay_errors_total": c.replay_errors,
        "kv_events_batches_replayed_total": c.batches_replayed,
        "kv_events_last_seq": c.last_seq,
        "kv_events_replay_buffered_batches": c.replay_buffered,
        "kv_events_lag_events": c.lag,
    }
    return {_key(f"{ns}_{name}", labels): float(v) for name, v in values.items()}


async def _store(engine: ao.AsyncOffloadEngine, keys: list[ao.OffloadKey]) -> None:
    handle = await engine.prepare_store(keys, range(len(keys)))
    assert handle is not None
    await handle


async def _workload(engine: ao.AsyncOffloadEngine) -> ao.EventSubscription:
    """Evictions, skipped offers, loads, a failed store, and a subscriber that never
    reads (returned: it must stay referenced to stay subscribed)."""
    backend = engine.backend
    assert isinstance(backend, FailingBackend)
    lagging = engine.events(max_buffer=4)
    batches = [make_keys(8, bytes([i])) for i in range(5)]
    for _ in range(2):  # store_threshold=2: each key's first offer is skipped
        for keys in batches:
            await _store(engine, keys)
    last = batches[-1]
    n = engine.lookup(last)
    assert n == len(last)
    await (await engine.prepare_load(last[:n], range(16, 16 + n)))
    assert engine.lookup(batches[0]) == 0  # evicted
    backend.fail_store = True
    doomed = make_keys(4, b"doomed")
    await _store(engine, doomed)  # first offer: skipped
    with pytest.raises(ao.TransferError):
        await _store(engine, doomed)
    backend.fail_store = False
    return lagging


def _failing_engine() -> ao.AsyncOffloadEngine:
    engine, _ = make_engine(16, 64, backend_cls=FailingBackend, store_threshold=2)
    return engine


# --- tests ---------------------------------------------------------------------------


async def test_scraped_over_http_equals_engine_stats() -> None:
    engine = _failing_engine()
    async with engine:
        lagging = await _workload(engine)
        before = engine.stats()
        assert before.blocks_evicted > 0
        assert before.manager.store_skipped > 0
        assert before.loads > 0 and before.blocks_loaded > 0 and before.bytes_loaded > 0
        assert before.events_dropped > 0
        assert before.transfers_failed > 0 and before.manager.store_failed > 0
        assert lagging.statistics().buffered == 4
        with EngineMetrics(engine) as metrics:
            port = metrics.serve(0)
            text = await asyncio.to_thread(_fetch, port)
            stats = engine.stats()
    scraped = _parse(text)
    assert scraped == _expected(stats)
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families == {
        **{f"asyncoffload_{n}": "counter" for n in _COUNTERS},
        **{f"asyncoffload_{n}": "gauge" for n in _GAUGES},
        **{f"asyncoffload_{n}": "histogram" for n in _HISTOGRAMS},
    }
    assert scraped[_key("asyncoffload_event_subscriber_lag_max_events", {})] == 4
    assert scraped[_key("asyncoffload_transfers_total", {"direction": "load"})] == 1


async def test_a_disk_tier_is_scraped_with_its_medium(tmp_path: Path) -> None:
    import errno

    from asyncoffload.tiers.disk import DiskStore

    kv = [torch.randint(0, 256, (16, 4096), dtype=torch.uint8) for _ in range(2)]
    cfg = ao.EngineConfig(cpu_blocks=2, tiers=[ao.DiskTier(tmp_path, 64 * 12288, admission=None)])
    async with ao.AsyncOffloadEngine(kv, cfg) as engine:
        keys = [ao.make_offload_key(bytes([i]) * 16) for i in range(6)]
        for i in range(0, 6, 2):
            handle = await engine.prepare_store(keys[i : i + 2], [i, i + 1])
            assert handle is not None
            await handle
            await engine.flush()
        assert engine.lookup(keys) == 6
        tier = engine.tiers[0]
        assert isinstance(tier, DiskStore)
        tier.pool.set_fault(False, 1, errno.EIO)
        with pytest.raises(ao.TransferError):
            await (await engine.prepare_load(keys[:2], [8, 9]))
        tier.pool.set_fault(False, 0, 0)
        await (await engine.prepare_load(keys[2:4], [10, 11]))
        with EngineMetrics(engine) as metrics:
            text = generate_latest(metrics.registry).decode()
            stats = engine.stats()
    scraped = _parse(text)
    assert scraped == _expected(stats)
    disk = {"medium": "DISK"}
    assert scraped[_key("asyncoffload_blocks_stored_total", disk)] == 6
    assert scraped[_key("asyncoffload_blocks_loaded_total", disk)] == 2
    assert scraped[_key("asyncoffload_tier_failed_blocks_total", {**disk, "cause": "EIO"})] == 2
    assert scraped[_key("asyncoffload_tier_dropped_blocks_total", disk)] == 2


async def test_default_registry_is_a_fresh_one_per_instance() -> None:
    first, second = _failing_engine(), _failing_engine()
    async with first, second:
        await _store(first, make_keys(2))
        await _store(first, make_keys(2))  # the second offer stores
        with EngineMetrics(first) as m1, EngineMetrics(second) as m2:
            assert m1.registry is not REGISTRY and m2.registry is not REGISTRY
            assert m1.registry is not m2.registry
            assert b"asyncoffload" not in generate_latest(REGISTRY)
            stored = _key("asyncoffload_blocks_stored_total", {"medium": "CPU"})
            assert _samples(m1.registry.collect())[stored] == 2
            assert _samples(m2.registry.collect())[stored] == 0


async def test_registry_argument_registers_there_and_refuses_duplicates() -> None:
    registry = CollectorRegistry()
    engine = _failing_engine()
    async with engine:
        with EngineMetrics(engine, registry=registry) as metrics:
            assert metrics.registry is registry
            assert _samples(registry.collect()) == _expected(engine.stats())
            with pytest.raises(ValueError, match="Duplicated timeseries"):
                EngineMetrics(engine, registry=registry)
            with EngineMetrics(engine, registry=registry, namespace="other"):
                names = {f.name for f in registry.collect()}
                assert "other_tier_blocks" in names and "asyncoffload_tier_blocks" in names
            assert not any(f.name.startswith("other_") for f in registry.collect())
        assert list(registry.collect()) == []


async def test_global_registry_is_joined_only_when_passed() -> None:
    engine = _failing_engine()
    async with engine:
        metrics = EngineMetrics(engine, registry=REGISTRY)
        try:
            assert b"asyncoffload_tier_capacity_blocks" in generate_latest(REGISTRY)
        finally:
            metrics.close()
        assert b"asyncoffload" not in generate_latest(REGISTRY)


async def test_close_stops_the_server_and_unregisters_idempotently() -> None:
    engine = _failing_engine()
    async with engine:
        metrics = EngineMetrics(engine)
        port = metrics.serve(0)
        assert port > 0
        assert f"serving :{port}" in repr(metrics)
        with pytest.raises(RuntimeError, match="already serving"):
            metrics.serve(0)
        assert "asyncoffload_tier_blocks" in await asyncio.to_thread(_fetch, port)
        metrics.close()
        assert repr(metrics).startswith("<EngineMetrics closed not serving")
        with pytest.raises(OSError):
            await asyncio.to_thread(_fetch, port)
        assert list(metrics.registry.collect()) == []
        metrics.close()
        with pytest.raises(RuntimeError, match="closed"):
            metrics.serve(0)


async def test_collect_from_another_thread_reads_on_the_loop() -> None:
    engine = _ThreadRecordingEngine(random_kv(2, 32), ao.EngineConfig(cpu_blocks=8))
    keys = make_keys(4)
    async with engine:
        await _store(engine, keys)
        with EngineMetrics(engine) as metrics:
            loop_thread = threading.get_ident()
            scrape = asyncio.get_running_loop().run_in_executor(
                None, _samples, metrics.registry.collect()
            )
            # The scrape is answered only when the loop regains control, after these.
            for _ in range(3):
                engine.lookup(keys)
            samples = await scrape
            assert engine.stats_threads == [loop_thread]
            assert samples[_key("asyncoffload_lookups_total", {})] == 3
            assert samples == _expected(engine.stats())


async def test_collect_on_the_loop_thread_reads_directly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = _ThreadRecordingEngine(random_kv(2, 32), ao.EngineConfig(cpu_blocks=8))
    async with engine:
        await _store(engine, make_keys(4))
        with EngineMetrics(engine, timeout_s=30) as metrics:
            samples = _samples(metrics.collect())
            assert engine.stats_threads == [threading.get_ident()]
            assert samples == _expected(engine.stats())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_collect_before_the_engine_has_a_loop_reads_directly() -> None:
    engine = _ThreadRecordingEngine(random_kv(2, 32), ao.EngineConfig(cpu_blocks=8))
    assert engine.loop is None
    with EngineMetrics(engine) as metrics:
        samples = await asyncio.to_thread(_samples, metrics.collect())
    assert len(engine.stats_threads) == 1 and engine.stats_threads[0] != threading.get_ident()
    assert samples == _expected(engine.stats())
    async with engine:  # closes its backend
        pass


async def test_blocked_loop_falls_back_to_a_direct_read_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = _ThreadRecordingEngine(random_kv(2, 32), ao.EngineConfig(cpu_blocks=8))
    async with engine:
        await _store(engine, make_keys(4))
        with EngineMetrics(engine, timeout_s=0.05) as metrics:
            results: list[dict[_SampleKey, float]] = []

            def scrape_twice() -> None:
                results.append(_samples(metrics.collect()))
                results.append(_samples(metrics.collect()))

            scraper = threading.Thread(target=scrape_twice)
            scraper.start()
            scraper.join()  # blocks the loop: it cannot answer either scrape
            assert engine.stats_threads == [scraper.ident, scraper.ident]
            await asyncio.sleep(0)  # the abandoned reads run now, and do nothing
            assert engine.stats_threads == [scraper.ident, scraper.ident]
            assert results[0] == results[1] == _expected(engine.stats())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "did not answer" in warnings[0].getMessage()


BAD_ARGUMENTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"namespace": ""}, ValueError, "namespace"),
    ({"namespace": "1st"}, ValueError, "namespace"),
    ({"namespace": "my-app"}, ValueError, "namespace"),
    ({"namespace": 3}, TypeError, "namespace must be a str"),
    ({"const_labels": {"bad-name": "x"}}, ValueError, "const label name"),
    ({"const_labels": {"__name__": "x"}}, ValueError, "reserved"),
    ({"const_labels": {"medium": "x"}}, ValueError, "used by the metrics"),
    ({"const_labels": {"le": "x"}}, ValueError, "used by the metrics"),
    ({"const_labels": {"model": 3}}, TypeError, "value must be a str"),
    ({"timeout_s": 0}, ValueError, "timeout_s"),
    ({"timeout_s": -1.0}, ValueError, "timeout_s"),
    ({"timeout_s": float("nan")}, ValueError, "timeout_s"),
    ({"timeout_s": "2"}, TypeError, "timeout_s"),
    ({"publishers": [object()]}, TypeError, "publisher"),
    ({"publishers": [_publisher("tcp://a"), _publisher("tcp://a")]}, ValueError, "endpoint"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_ARGUMENTS)
async def test_bad_arguments_raise_and_register_nothing(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    registry = CollectorRegistry()
    engine = _failing_engine()
    async with engine:
        with pytest.raises(error, match=match):
            EngineMetrics(engine, registry=registry, **kwargs)
    assert list(registry.collect()) == []


async def test_bad_engine_or_registry_raise_type_error() -> None:
    not_an_engine: Any = object()
    with pytest.raises(TypeError, match="AsyncOffloadEngine"):
        EngineMetrics(not_an_engine)
    engine = _failing_engine()
    not_a_registry: Any = object()
    async with engine:
        with pytest.raises(TypeError, match="CollectorRegistry"):
            EngineMetrics(engine, registry=not_a_registry)
    assert b"asyncoffload" not in generate_latest(REGISTRY)


async def test_publisher_metrics_carry_the_endpoint_and_its_stats() -> None:
    engine = _failing_engine()
    first, second = _publisher("tcp://*:5557", base=1), _publisher("ipc:///tmp/kv", base=100)
    async with engine:
        with EngineMetrics(engine, publishers=[first]) as metrics:
            samples = _samples(metrics.collect())
            assert samples == {**_expected(engine.stats()), **_expected_publisher(first)}

            metrics.add_publisher(second)
            first.counts = first.counts._replace(events_published=500, lag=7)
            samples = _samples(metrics.collect())
            assert samples == {
                **_expected(engine.stats()),
                **_expected_publisher(first),
                **_expected_publisher(second),
            }
            assert samples[_key("asyncoffload_kv_events_lag_events", {"endpoint": "tcp://*:5557"})]
            with pytest.raises(ValueError, match="already exported"):
                metrics.add_publisher(_publisher("ipc:///tmp/kv"))
            not_a_publisher: Any = object()
            with pytest.raises(TypeError, match="endpoint"):
                metrics.add_publisher(not_a_publisher)


async def test_const_labels_and_namespace_apply_to_every_sample() -> None:
    engine = _failing_engine()
    const = {"model": "llama-8b", "replica": "0"}
    pub = _publisher("tcp://*:5557")
    async with engine:
        await _store(engine, make_keys(2))
        with EngineMetrics(engine, namespace="svc", const_labels=const, publishers=[pub]) as m:
            text = generate_latest(m.registry).decode()
            stats = engine.stats()
    families = list(text_string_to_metric_families(text))
    assert families
    for family in families:
        assert family.name.startswith("svc_")
        for sample in family.samples:
            assert {k: sample.labels.get(k) for k in const} == const, sample
    expected = {**_expected(stats, "svc", const), **_expected_publisher(pub, "svc", const)}
    assert _parse(text) == expected


async def test_describe_names_every_family_collect_yields() -> None:
    engine = _failing_engine()
    async with engine:
        with EngineMetrics(engine, publishers=[_publisher("tcp://a")]) as metrics:
            described = {(f.name, f.type) for f in metrics.describe()}
            collected = {(f.name, f.type) for f in metrics.collect()}
            assert described == collected
            assert all(not f.samples for f in metrics.describe())


async def test_quota_refusals_and_opt_outs_are_scraped_per_tier_and_tenant(tmp_path: Path) -> None:
    kv = [torch.randint(0, 256, (16, 4096), dtype=torch.uint8) for _ in range(2)]
    disk = ao.DiskTier(tmp_path, 64 * 12288, admission=None, quotas={"a": 1})
    cfg = ao.EngineConfig(cpu_blocks=8, tenants=["a"], quotas={"a": 2}, tiers=[disk])
    async with ao.AsyncOffloadEngine(kv, cfg) as engine:
        keys = [ao.make_offload_key(bytes([i]) * 16) for i in range(5)]
        handle = await engine.prepare_store(keys[:3], [0, 1, 2], ao.ReqContext("r", tenant="a"))
        assert handle is not None and len(handle.declined_keys) == 1
        await handle
        opted = ao.ReqContext("o", no_store=True)
        handle = await engine.prepare_store(keys[3:], [3, 4], opted)
        assert handle is not None and handle.keys_to_store == []
        await engine.flush()
        with EngineMetrics(engine) as metrics:
            text = generate_latest(metrics.registry).decode()
            stats = engine.stats()
    scraped = _parse(text)
    assert scraped == _expected(stats)
    name = stats.tiers[0].name
    refused = "asyncoffload_quota_refused_blocks_total"
    assert scraped[_key(refused, {"tier": "CPU", "tenant": "a"})] == 1
    assert scraped[_key(refused, {"tier": name, "tenant": "a"})] == 1  # 2 written through
    assert scraped[_key("asyncoffload_opted_out_blocks_total", {"tier": "CPU"})] == 2
