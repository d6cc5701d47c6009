"""Prometheus metrics for an :class:`~asyncoffload.AsyncOffloadEngine`.

:class:`EngineMetrics` is a custom collector: at each scrape it reads ``engine.stats()``
(and the ``stats()`` of any KV-event publishers) and turns them into counter, gauge and
histogram families, so a scraped value is exactly the engine's own counter and nothing
is counted twice. It registers with a registry of its own unless given one, and
:meth:`EngineMetrics.serve` exposes that registry over HTTP.

The engine's state belongs to its event-loop thread, while scrapes run on the HTTP
server's threads: a scrape from another thread reads the stats on the loop (see
:meth:`EngineMetrics.collect`). docs/metrics.md lists every metric.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Final, Literal, NamedTuple, Protocol, cast
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from asyncoffload.engine import AsyncOffloadEngine, EngineStats
from asyncoffload.histogram import HistogramSnapshot
from asyncoffload.integrations.kv_events import PublisherStats
from asyncoffload.manager.pins import PinStats

__all__ = ["EngineMetrics", "PublisherLike"]

log = logging.getLogger(__name__)

_METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Label names the metrics use themselves (and "le" of histogram buckets).
_OWN_LABELS = frozenset({"medium", "state", "direction", "endpoint", "le"})


class PublisherLike(Protocol):
    """What :class:`EngineMetrics` reads of a KV-event publisher (such as the one of
    :mod:`asyncoffload.integrations.kv_events`). ``stats()`` is read from the scraping
    thread, so it must be safe to call from any thread."""

    @property
    def endpoint(self) -> str:
        """Where it publishes; the ``endpoint`` label of its metrics."""
        ...

    def stats(self) -> PublisherStats: ...


class _Spec(NamedTuple):
    kind: Literal["counter", "gauge", "histogram"]
    #: Without the namespace, and without the ``_total`` of counters.
    name: str
    labels: tuple[str, ...]
    doc: str


_C: Final = "counter"
_G: Final = "gauge"
_H: Final = "histogram"
_M = ("medium",)

_ENGINE_SPECS: tuple[_Spec, ...] = (
    _Spec(_C, "blocks_stored", _M, "Blocks made loadable by successful stores."),
    _Spec(_C, "blocks_loaded", _M, "Blocks handed to loads (counted when a load starts)."),
    _Spec(_C, "blocks_evicted", _M, "Blocks evicted to make room for stores."),
    _Spec(_C, "bytes_stored", (), "Bytes copied out by successful stores."),
    _Spec(_C, "bytes_loaded", (), "Bytes copied back by successful loads."),
    _Spec(
        _C,
        "store_skipped_blocks",
        _M,
        "Offered blocks held back by store_threshold, the admission filter or the policy.",
    ),
    _Spec(_C, "stores_rejected", (), "prepare_store calls refused for lack of evictable room."),
    _Spec(
        _C,
        "quota_refused_blocks",
        ("tier", "tenant"),
        "Blocks a tier refused a tenant over its quota (what did not fit once the tenant's "
        "own idle, unpinned blocks were evicted), per tier (CPU or a lower tier's name) and "
        "tenant.",
    ),
    _Spec(
        _C,
        "opted_out_blocks",
        ("tier",),
        "Blocks a tier did not store because their request opted out (ReqContext.no_store).",
    ),
    _Spec(_C, "transfers", ("direction",), "Copies submitted, per direction."),
    _Spec(_C, "transfers_failed", (), "Copies that failed, both directions."),
    _Spec(_C, "store_failed_blocks", _M, "Blocks dropped because their store failed."),
    _Spec(_C, "lookups", (), "lookup calls."),
    _Spec(_C, "lookup_blocks", (), "Keys asked for by lookup calls."),
    _Spec(_C, "lookup_hit_blocks", (), "Leading keys lookup calls found ready."),
    _Spec(_C, "events_published", (), "Events published to the event hub."),
    _Spec(_C, "events_dropped", (), "Events lost by overflowing subscriptions, per subscription."),
    _Spec(_G, "tier_capacity_blocks", _M, "Slots of the tier."),
    _Spec(
        _G,
        "tier_blocks",
        ("medium", "state"),
        "Blocks of the tier by state; pinned blocks are also counted as ready.",
    ),
    _Spec(
        _C,
        "tier_lookup_hit_blocks",
        _M,
        "Leading keys of lookups found only in this lower tier.",
    ),
    _Spec(
        _C,
        "tier_io_bytes",
        ("medium", "direction"),
        "Bytes a lower tier wrote (write-through) and read back (promotions).",
    ),
    _Spec(
        _C,
        "tier_failed_blocks",
        ("medium", "cause"),
        "Blocks a lower tier failed to write or read, by cause (corrupt, stale, wrong_key, "
        "short, missing, timeout, or an errno name); each failed read is a miss.",
    ),
    _Spec(_C, "tier_dropped_blocks", _M, "Blocks dropped from a lower tier after a failed check."),
    _Spec(
        _C,
        "tier_write_shed_blocks",
        _M,
        "Blocks of write-through a lower tier shed while its writes lagged (backpressure); "
        "the CPU tier keeps them.",
    ),
    _Spec(
        _C,
        "tier_write_yielded_blocks",
        _M,
        "Blocks whose write-through waited behind a lower tier's lagging writes and that "
        "the CPU tier evicted before the write went: not written (backpressure).",
    ),
    _Spec(_G, "tier_write_lag_seconds", _M, "EMA of a lower tier's write time in flight."),
    _Spec(
        _C,
        "tier_load_decision_blocks",
        ("medium", "decision"),
        "Load or recompute: lower-tier blocks promoted (loaded), recomputed because reading "
        "was expected to be slower (recomputed_by_choice), or recomputed because their read "
        "overran its deadline (recomputed_after_deadline).",
    ),
    _Spec(_G, "retention_pinned_blocks", _M, "Blocks held by retention pins now."),
    _Spec(_G, "retention_pin_limit_blocks", _M, "The most blocks pins may hold (pin_budget)."),
    _Spec(
        _C,
        "retention_pins",
        ("medium", "outcome"),
        "Retention pins by outcome: pinned (new), refreshed (a hit), refused (over the pin "
        "budget: the block is stored unpinned), expired, released (unpinned, or the block "
        "left the tier).",
    ),
    _Spec(_G, "transfers_in_flight", (), "Copies submitted and not yet completed."),
    _Spec(_G, "event_subscribers", (), "Live event subscriptions."),
    _Spec(_G, "event_subscriber_lag_max_events", (), "Most events buffered by one subscription."),
    _Spec(_G, "event_subscriber_lag_events", (), "Events buffered, summed over subscriptions."),
    _Spec(
        _H,
        "transfer_duration_seconds",
        ("direction",),
        "Submission to end of copy, per successful copy.",
    ),
    _Spec(
        _H,
        "transfer_throughput_bytes_per_second",
        ("direction",),
        "Bytes over duration, per successful copy of non-zero duration.",
    ),
    _Spec(_H, "completion_callback_latency_seconds", (), "End of copy to completion callback run."),
)

_E = ("endpoint",)
_PUBLISHER_SPECS: tuple[_Spec, ...] = (
    _Spec(_C, "kv_events_batches_published", _E, "Event batches sent."),
    _Spec(_C, "kv_events_published", _E, "Wire events sent in those batches."),
    _Spec(_C, "kv_events_dropped", _E, "Engine events the publisher lost."),
    _Spec(_C, "kv_events_resyncs", _E, "Resyncs (AllBlocksCleared, then a snapshot)."),
    _Spec(_C, "kv_events_replay_requests", _E, "Replay requests answered."),
    _Spec(_C, "kv_events_replay_errors", _E, "Replay requests refused as malformed."),
    _Spec(_C, "kv_events_batches_replayed", _E, "Batches sent in replay replies."),
    _Spec(_G, "kv_events_last_seq", _E, "Sequence number of the last batch (-1 before one)."),
    _Spec(_G, "kv_events_replay_buffered_batches", _E, "Batches held for replay."),
    _Spec(_G, "kv_events_lag_events", _E, "Engine events waiting in the publisher."),
)

#: Label values (in the order of the spec's labels) and the value.
_Sample = tuple[tuple[str, ...], "float | HistogramSnapshot"]


def _engine_samples(s: EngineStats, medium: str) -> dict[str, Sequence[_Sample]]:
    m = s.manager
    live = [sub.buffered for sub in s.subscriptions if not sub.closed]
    out: dict[str, Sequence[_Sample]] = {
        "blocks_stored": [((medium,), s.blocks_stored)],
        "blocks_loaded": [((medium,), s.blocks_loaded)],
        "blocks_evicted": [((medium,), s.blocks_evicted)],
        "bytes_stored": [((), s.bytes_stored)],
        "bytes_loaded": [((), s.bytes_loaded)],
        "store_skipped_blocks": [((medium,), m.store_skipped)],
        "stores_rejected": [((), s.stores_rejected)],
        "transfers": [(("store",), s.stores), (("load",), s.loads)],
        "transfers_failed": [((), s.transfers_failed)],
        "store_failed_blocks": [((medium,), m.store_failed)],
        "lookups": [((), s.lookups)],
        "lookup_blocks": [((), s.lookup_keys)],
        "lookup_hit_blocks": [((), s.lookup_hits)],
        "events_published": [((), s.events_published)],
        "events_dropped": [((), s.events_dropped)],
        "tier_capacity_blocks": [((medium,), m.num_blocks)],
        "tier_blocks": [
            ((medium, "ready"), m.ready),
            ((medium, "writing"), m.write_pending),
            ((medium, "pinned"), m.pinned),
            ((medium, "free"), m.free),
        ],
        "transfers_in_flight": [((), s.in_flight)],
        "event_subscribers": [((), s.subscribers)],
        "event_subscriber_lag_max_events": [((), max(live, default=0))],
        "event_subscriber_lag_events": [((), sum(live))],
        "transfer_duration_seconds": [
            (("store",), s.store_duration),
            (("load",), s.load_duration),
        ],
        "transfer_throughput_bytes_per_second": [
            (("store",), s.store_throughput),
            (("load",), s.load_throughput),
        ],
        "completion_callback_latency_seconds": [((), s.callback_latency)],
    }
    for name, rows in (*_tier_samples(s).items(), *_tenant_samples(s).items()):
        out[name] = [*out.get(name, ()), *rows]
    pin_rows = _pin_samples([(medium, s.pins), *((t.medium, t.pins) for t in s.tiers)])
    out.update(pin_rows)
    return out


def _pin_samples(tiers: Sequence[tuple[str, PinStats | None]]) -> dict[str, list[_Sample]]:
    """Each tier's retention pins (those of a manager that has them)."""
    out: dict[str, list[_Sample]] = {
        "retention_pinned_blocks": [],
        "retention_pin_limit_blocks": [],
        "retention_pins": [],
    }
    for medium, p in tiers:
        if p is None:
            continue
        out["retention_pinned_blocks"].append(((medium,), p.pinned))
        out["retention_pin_limit_blocks"].append(((medium,), p.limit))
        out["retention_pins"] += [
            ((medium, "pinned"), p.pins),
            ((medium, "refreshed"), p.refreshed),
            ((medium, "refused"), p.refused),
            ((medium, "expired"), p.expired),
            ((medium, "released"), p.released),
        ]
    return out


def _tenant_samples(s: EngineStats) -> dict[str, list[_Sample]]:
    """Each tier's quota refusals per tenant with a quota there, and its opt-outs."""
    refused: list[_Sample] = []
    opted: list[_Sample] = []
    for tier, m in (("CPU", s.manager), *((t.name, t.manager) for t in s.tiers)):
        refused += [((tier, t.tenant), t.refused) for t in m.tenants]
        opted.append(((tier,), m.opted_out))
    return {"quota_refused_blocks": refused, "opted_out_blocks": opted}


def _tier_samples(s: EngineStats) -> dict[str, list[_Sample]]:
    """The lower tiers' rows: the per-medium families gain one row per tier, and the
    tier-only families get theirs."""
    names = (
        "blocks_stored",
        "blocks_loaded",
        "blocks_evicted",
        "store_skipped_blocks",
        "store_failed_blocks",
        "tier_capacity_blocks",
        "tier_blocks",
        "tier_lookup_hit_blocks",
        "tier_io_bytes",
        "tier_failed_blocks",
        "tier_dropped_blocks",
        "tier_write_shed_blocks",
        "tier_write_yielded_blocks",
        "tier_write_lag_seconds",
        "tier_load_decision_blocks",
    )
    out: dict[str, list[_Sample]] = {name: [] for name in names}
    rows = out
    for t in s.tiers:
        medium, m = t.medium, t.manager
        rows["blocks_stored"].append(((medium,), t.blocks_written))
        rows["blocks_loaded"].append(((medium,), t.blocks_read))
        rows["blocks_evicted"].append(((medium,), m.evicted))
        rows["store_skipped_blocks"].append(((medium,), m.store_skipped))
        rows["store_failed_blocks"].append(((medium,), t.write_failures))
        rows["tier_capacity_blocks"].append(((medium,), m.num_blocks))
        rows["tier_blocks"] += [
            ((medium, "ready"), m.ready),
            ((medium, "writing"), m.write_pending),
            ((medium, "pinned"), m.pinned),
            ((medium, "free"), m.free),
        ]
        out["tier_lookup_hit_blocks"].append(((medium,), t.lookup_hits))
        out["tier_io_bytes"] += [
            ((medium, "write"), t.bytes_written),
            ((medium, "read"), t.bytes_read),
        ]
        out["tier_failed_blocks"] += [
            ((medium, cause), n) for cause, n in sorted(t.failures.items())
        ]
        out["tier_dropped_blocks"].append(((medium,), t.dropped))
        out["tier_write_shed_blocks"].append(((medium,), t.write_shed))
        out["tier_write_yielded_blocks"].append(((medium,), t.write_yielded))
        out["tier_write_lag_seconds"].append(((medium,), t.write_lag_s))
        out["tier_load_decision_blocks"] += [
            ((medium, "loaded"), t.loaded),
            ((medium, "recomputed_by_choice"), t.recomputed_by_choice),
            ((medium, "recomputed_after_deadline"), t.recomputed_after_deadline),
        ]
    return out


def _publisher_samples(publishers: Sequence[PublisherLike]) -> dict[str, list[_Sample]]:
    out: dict[str, list[_Sample]] = {spec.name: [] for spec in _PUBLISHER_SPECS}
    for publisher in publishers:
        p = publisher.stats()
        label = (publisher.endpoint,)
        for name, value in (
            ("kv_events_batches_published", p.batches_published),
            ("kv_events_published", p.events_published),
            ("kv_events_dropped", p.events_dropped),
            ("kv_events_resyncs", p.resyncs),
            ("kv_events_replay_requests", p.replay_requests),
            ("kv_events_replay_errors", p.replay_errors),
            ("kv_events_batches_replayed", p.batches_replayed),
            ("kv_events_last_seq", p.last_seq),
            ("kv_events_replay_buffered_batches", p.replay_buffered),
            ("kv_events_lag_events", p.lag),
        ):
            out[name].append((label, value))
    return out


def _buckets(snap: HistogramSnapshot) -> list[tuple[str, float]]:
    bounds = [*map(floatToGoString, snap.bounds), "+Inf"]
    return list(zip(bounds, map(float, snap.cumulative())))


def _check_publisher(publisher: object) -> PublisherLike:
    endpoint = getattr(publisher, "endpoint", None)
    if not isinstance(endpoint, str) or not callable(getattr(publisher, "stats", None)):
        raise TypeError(
            f"a publisher needs an 'endpoint' str and a 'stats()' method, got {publisher!r}"
        )
    return cast(PublisherLike, publisher)


class EngineMetrics:
    """Prometheus metrics of ``engine``, read at scrape time.

    Registers a collector with ``registry``: by default a fresh ``CollectorRegistry``
    (``self.registry``), never ``prometheus_client.REGISTRY`` unless passed. Every metric
    name starts with ``namespace + "_"``, and every sample carries ``const_labels``.
    ``publishers`` are KV-event publishers (see :class:`PublisherLike`), labelled by
    their ``endpoint``.

    A scrape from a thread other than the engine's loop waits up to ``timeout_s`` for
    the loop to read the stats (see :meth:`collect`).

    Raises ``TypeError`` for an argument of the wrong type and ``ValueError`` for a bad
    namespace, a bad or reserved const label name, a non-positive ``timeout_s``, two
    publishers with one endpoint, or names already registered in ``registry``
    (``DuplicateTimeseries``); nothing is registered then. Call :meth:`close` (or use
    ``with``) to stop the HTTP server and unregister.
    """

    def __init__(
        self,
        engine: AsyncOffloadEngine,
        *,
        registry: CollectorRegistry | None = None,
        namespace: str = "asyncoffload",
        publishers: Sequence[PublisherLike] = (),
        const_labels: Mapping[str, str] | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        if not isinstance(engine, AsyncOffloadEngine):
            raise TypeError(f"engine must be an AsyncOffloadEngine, got {type(engine).__name__}")
        if registry is not None and not isinstance(registry, CollectorRegistry):
            raise TypeError(f"registry must be a CollectorRegistry, got {type(registry).__name__}")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        if not _METRIC_PREFIX.fullmatch(namespace):
            raise ValueError(
                f"namespace {namespace!r} is not a metric name: it must match "
                f"{_METRIC_PREFIX.pattern}"
            )
        labels = dict(const_labels) if const_labels is not None else {}
        for name, value in labels.items():
            if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name):
                raise ValueError(f"const label name {name!r} must match {_LABEL_NAME.pattern}")
            if name.startswith("__"):
                raise ValueError(f"const label name {name!r}: names starting '__' are reserved")
            if name in _OWN_LABELS:
                raise ValueError(
                    f"const label name {name!r} is used by the metrics themselves "
                    f"({', '.join(sorted(_OWN_LABELS))})"
                )
            if not isinstance(value, str):
                raise TypeError(f"const label {name!r}: value must be a str, got {value!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number, got {timeout_s!r}")
        if not (0 < timeout_s < math.inf):
            raise ValueError(f"timeout_s must be positive and finite, got {timeout_s!r}")
        checked = [_check_publisher(p) for p in publishers]
        endpoints = [p.endpoint for p in checked]
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"two publishers share an endpoint: {endpoints}")

        self._engine = engine
        self._medium: str = engine.manager.medium.value
        self._prefix = namespace + "_"
        self._const_names = tuple(labels)
        self._const_values = tuple(labels.values())
        self._timeout_s = float(timeout_s)
        # Replaced, never mutated: a scrape iterates a tuple no other thread changes.
        self._publishers: tuple[PublisherLike, ...] = tuple(checked)
        self._lock = threading.Lock()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._warned = False
        self.registry: CollectorRegistry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)

    # --- lifecycle -------------------------------------------------------------------

    def add_publisher(self, publisher: PublisherLike) -> None:
        """Export ``publisher``'s counters from the next scrape on. ``TypeError`` if it
        is not publisher-like, ``ValueError`` if its endpoint is already exported."""
        checked = _check_publisher(publisher)
        with self._lock:
            if any(p.endpoint == checked.endpoint for p in self._publishers):
                raise ValueError(f"a publisher on {checked.endpoint!r} is already exported")
            self._publishers = (*self._publishers, checked)

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve ``self.registry`` at ``http://{addr}:{port}/metrics`` from a daemon
        thread and return the bound port (``port=0`` picks a free one).

        ``RuntimeError`` if already serving or closed; ``OSError`` if the address cannot
        be bound (nothing is started then).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("EngineMetrics is closed")
            if self._server is not None:
                raise RuntimeError("EngineMetrics is already serving")
            server, thread = start_http_server(port, addr, registry=self.registry)
            self._server, self._thread = server, thread
            return int(server.server_port)

    def close(self) -> None:
        """Stop the HTTP server, if any, and unregister from the registry. Idempotent.

        Blocks until the server's accept loop has stopped (up to its 0.5 s poll); a
        scrape already being answered completes on its own thread.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, thread = self._server, self._thread
            self._server = self._thread = None
            self.registry.unregister(self)
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()

    def __enter__(self) -> EngineMetrics:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- the collector ---------------------------------------------------------------

    def describe(self) -> Iterator[Metric]:
        """Every family this collector can produce, without samples. The registry uses
        the names to refuse a second collector that would export the same ones."""
        for spec in (*_ENGINE_SPECS, *_PUBLISHER_SPECS):
            yield self._family(spec)

    def collect(self) -> Iterator[Metric]:
        """The metrics now, from one ``engine.stats()`` and each publisher's ``stats()``.

        Safe from any thread. When the engine's loop is running and this is not its
        thread, the stats are read by a callback on the loop, waited for up to
        ``timeout_s``; past that (a blocked loop) they are read here instead, racing the
        loop, and a warning is logged once. Otherwise they are read here.
        """
        engine = _engine_samples(self._read_stats(), self._medium)
        for spec in _ENGINE_SPECS:
            yield self._family(spec, engine[spec.name])
        if self._publishers:
            published = _publisher_samples(self._publishers)
            for spec in _PUBLISHER_SPECS:
                yield self._family(spec, published[spec.name])

    def _read_stats(self) -> EngineStats:
        engine = self._engine
        loop = engine.loop
        if loop is None or not loop.is_running() or _running_loop() is loop:
            return engine.stats()
        result: concurrent.futures.Future[EngineStats] = concurrent.futures.Future()

        def read() -> None:
            if not result.set_running_or_notify_cancel():
                return  # the scrape gave up waiting
            try:
                result.set_result(engine.stats())
            except BaseException as exc:
                result.set_exception(exc)

        try:
            loop.call_soon_threadsafe(read)
        except RuntimeError:  # the loop closed since is_running()
            return engine.stats()
        try:
            return result.result(self._timeout_s)
        except concurrent.futures.TimeoutError:
            if not result.cancel():  # it started after all: its result is moments away
                return result.result()
        if not self._warned:
            self._warned = True
            log.warning(
                "the engine's event loop did not answer a metrics scrape within %.3g s; "
                "reading its stats from the scraping thread (warned once)",
                self._timeout_s,
            )
        return engine.stats()

    def _family(self, spec: _Spec, samples: Sequence[_Sample] = ()) -> Metric:
        name = self._prefix + spec.name
        labels = (*spec.labels, *self._const_names)
        const = self._const_values
        if spec.kind == "histogram":
            hist = HistogramMetricFamily(name, spec.doc, labels=labels)
            for values, snap in samples:
                assert isinstance(snap, HistogramSnapshot)
                hist.add_metric([*values, *const], _buckets(snap), snap.total)
            return hist
        family: CounterMetricFamily | GaugeMetricFamily
        if spec.kind == "counter":
            family = CounterMetricFamily(name, spec.doc, labels=labels)
        else:
            family = GaugeMetricFamily(name, spec.doc, labels=labels)
        for values, value in samples:
            assert not isinstance(value, HistogramSnapshot)
            family.add_metric([*values, *const], float(value))
        return family

    def __repr__(self) -> str:
        with self._lock:
            server = self._server
            state = "closed" if self._closed else "open"
            n = len(self._publishers)
        where = f"serving :{server.server_port}" if server is not None else "not serving"
        return f"<EngineMetrics {state} {where} [{self._prefix}* | {n} publishers]>"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
