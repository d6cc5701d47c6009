"""The demo: a tiny run is correct and its report agrees with the engine; the CLI."""

from __future__ import annotations

import asyncio
import io
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from asyncoffload import AsyncOffloadEngine, EngineConfig, Transfer, cli
from asyncoffload.demo import (
    BlockAllocator,
    DemoConfig,
    DemoConfigError,
    DemoReport,
    SimulatedKVCache,
    run_demo,
)
from asyncoffload.keys import make_offload_key
from asyncoffload.replay import replay
from asyncoffload.workloads import summarize
from tests.servers import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import kv_index

# Small enough for well under a second a run; capacity far below the working set.
TINY: dict[str, Any] = dict(
    requests=60,
    system_prompts=2,
    system_prompt_blocks=4,
    turns=4,
    blocks_per_turn=2.0,
    output_tokens=24.0,
    arrival_rate=400.0,
    think_time_s=0.02,
    cpu_blocks=48,
    layers=2,
    kv_heads=1,
    head_dim=16,
    concurrency=4,
    time_scale=0.0,
)


def tiny(**overrides: Any) -> DemoConfig:
    return DemoConfig(**{**TINY, **overrides})


@pytest.mark.parametrize("policy", ["lru", "arc", "kv", "auto"])
async def test_the_demo_drives_its_policy_as_the_replay_does(policy: str) -> None:
    # Served one at a time, the demo's requests (lookup, prepare_load of the hits,
    # prepare_store of the rest: the engine touches both) make the CPU tier decide as
    # the replay's manager does: the same hits, stores and evictions. Before issue 24
    # the engine touched only the loaded blocks: ARC never adapted (its ghosts are
    # used by misses) and kv saw a fraction of each request.
    cfg = tiny(requests=400, concurrency=1, policy=policy, cpu_blocks=40)
    requests = cfg.workload()
    assert max(len(req.keys) for req in requests) <= cfg.cpu_blocks  # no cut stores
    report = await run_demo(cfg, progress=False)
    ref = replay(requests, cfg.cpu_blocks, policy=policy)
    s = report.stats
    assert ref.evicted > 0 and ref.hit_blocks > 0
    assert (s.lookup_hits, s.blocks_stored, s.blocks_evicted) == (
        ref.hit_blocks,
        ref.stored,
        ref.evicted,
    )


def assert_consistent(report: DemoReport, cfg: DemoConfig) -> None:
    s = report.stats
    summary = summarize(cfg.workload())
    block_bytes = cfg.block_bytes
    assert report.requests == cfg.requests
    assert report.prompt_tokens == summary.input_tokens
    assert report.hit_blocks + report.computed_blocks == summary.total_blocks
    assert 0 <= report.hit_tokens <= report.prompt_tokens
    assert report.hit_tokens <= report.hit_blocks * cfg.block_size
    # Every block loaded was checked, and the engine counted the same loads.
    assert report.verified_blocks == report.hit_blocks == s.blocks_loaded
    assert s.bytes_loaded == s.blocks_loaded * block_bytes
    assert s.bytes_stored == s.blocks_stored * block_bytes
    assert report.bytes_moved == s.bytes_stored + s.bytes_loaded
    assert report.stores_rejected == s.stores_rejected
    assert s.blocks_stored <= report.computed_blocks
    assert s.in_flight == 0 and s.transfers_failed == 0
    assert s.manager.ready <= cfg.cpu_blocks
    assert s.manager.ready == s.blocks_stored - s.blocks_evicted
    # The subscriber saw every event: one per store, one per eviction batch.
    ev = report.events
    assert ev.lagged == 0 and ev.missed == 0
    assert report.events_delivered == ev.events == s.events_published
    assert ev.stored_events + ev.removed_events == ev.events
    assert ev.stored_keys == s.blocks_stored
    assert ev.removed_keys == s.blocks_evicted
    assert s.completion in ("eventfd", "pipe", "poll")


@pytest.mark.parametrize("policy", ["lru", "arc"])
async def test_tiny_run_is_correct_and_consistent(policy: str) -> None:
    cfg = tiny(policy=policy)
    report = await run_demo(cfg, progress=False)
    assert report.ok
    assert report.mismatches == 0 and report.failed_requests == 0
    assert report.stats.blocks_stored > 0
    # Shared system prompts and earlier turns: some prompt tokens come from the tier.
    assert report.hit_tokens > 0 and report.verified_blocks > 0
    # 48 slots for hundreds of distinct blocks: the tier evicts.
    assert report.stats.blocks_evicted > 0
    assert_consistent(report, cfg)
    assert report.loop in ("asyncio", "uvloop")
    assert report.loop == (
        "uvloop" if "uvloop" in type(asyncio.get_running_loop()).__module__ else "asyncio"
    )


async def test_paced_run_with_poll_completion() -> None:
    # Arrivals and compute on the clock (about 0.2 s of workload), the poll mechanism.
    cfg = tiny(time_scale=1.0, completion="poll", arrival_rate=300.0)
    report = await run_demo(cfg, progress=False)
    assert report.ok
    assert report.stats.completion == "poll"
    assert report.hit_tokens > 0
    assert_consistent(report, cfg)


async def test_large_tier_hits_everything_reusable() -> None:
    # A tier that holds the whole workload, one request at a time: every block seen
    # before is a hit, so the hit count is exactly the workload's reuse.
    cfg = tiny(cpu_blocks=4096, concurrency=1)
    report = await run_demo(cfg, progress=False)
    summary = summarize(cfg.workload())
    assert report.ok
    assert report.stats.blocks_evicted == 0
    assert report.hit_blocks == summary.total_blocks - summary.unique_blocks
    assert report.stats.blocks_stored == summary.unique_blocks
    assert_consistent(report, cfg)


def corrupt_every_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flip one bit of the first block of every load, after its copy and before the
    demo checks it: through the public API only, whatever the copy engine."""
    caches: list[SimulatedKVCache] = []
    make_cache = SimulatedKVCache.__init__

    def recording_init(self: SimulatedKVCache, *args: Any, **kwargs: Any) -> None:
        make_cache(self, *args, **kwargs)
        caches.append(self)

    load = AsyncOffloadEngine.prepare_load

    async def corrupting_load(
        self: AsyncOffloadEngine, keys: Any, gpu_blocks: Any, ctx: Any = None
    ) -> Transfer:
        handle = await load(self, keys, gpu_blocks, ctx)
        await handle
        caches[-1].kv_caches[-1][1, gpu_blocks[0]].view(-1).view(torch.uint8)[3] ^= 0x10
        return handle

    monkeypatch.setattr(SimulatedKVCache, "__init__", recording_init)
    monkeypatch.setattr(AsyncOffloadEngine, "prepare_load", corrupting_load)


async def test_corrupted_loads_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    corrupt_every_load(monkeypatch)
    report = await run_demo(tiny(), progress=False)
    assert report.stats.loads > 0
    assert report.mismatches == report.stats.loads  # one bad block per load
    assert not report.ok
    assert "FAILED" in report.format_table(columns=400)


async def test_table_lists_the_numbers() -> None:
    report = await run_demo(tiny(), progress=False)
    table = report.format_table(columns=400)
    for label in (
        "requests",
        "prefix-hit rate (tokens)",
        "blocks stored / loaded / evicted",
        "GB moved",
        "GB/s",
        "completion-callback latency",
        "events delivered",
        "wall time",
        "verification",
    ):
        assert label in table
    s = report.stats
    assert f"{s.blocks_stored:,} / {s.blocks_loaded:,} / {s.blocks_evicted:,}" in table
    assert f"{s.events_published:,} of {s.events_published:,} published" in table
    assert f"verified {report.verified_blocks:,} blocks, 0 mismatches" in table
    # Aligned: every value starts in the same column.
    lines = table.splitlines()
    col = lines[0].index("value")
    assert all(line[col - 2 : col] == "  " for line in lines[2:])


async def test_progress_bar() -> None:
    shown = io.StringIO()
    await run_demo(tiny(), progress="always", stream=shown)
    text = shown.getvalue()
    assert f"{TINY['requests']}/{TINY['requests']} requests" in text
    assert text.endswith("\n")
    # "auto" draws only on a terminal; a StringIO is not one.
    hidden = io.StringIO()
    await run_demo(tiny(), progress="auto", stream=hidden)
    assert hidden.getvalue() == ""


async def test_torch_threads_restored_and_bad_gpu_blocks() -> None:
    before = torch.get_num_threads()
    await run_demo(tiny(torch_threads=1), progress=False)
    assert torch.get_num_threads() == before
    with pytest.raises(DemoConfigError, match="largest request"):
        await run_demo(tiny(gpu_blocks=2), progress=False)
    assert torch.get_num_threads() == before


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown cache policy"):
        DemoConfig(policy="nope")
    with pytest.raises(ValueError, match="multiple of 4"):
        DemoConfig(block_size=1, kv_heads=1, head_dim=3)
    with pytest.raises(ValueError):
        DemoConfig(cpu_blocks=0)
    with pytest.raises(ValueError):
        DemoConfig(bogus=1)  # type: ignore[call-arg]
    assert DemoConfig().block_bytes == 8 * 2 * 16 * 4 * 64 * 2


def test_simulated_kv_cache_checks_bytes() -> None:
    kv = SimulatedKVCache(layers=2, num_blocks=8, block_size=4, kv_heads=1, head_dim=8)
    keys = [make_offload_key(bytes([i]) * 32) for i in range(3)]
    kv.write(keys, [5, 1, 2])
    assert kv.check(keys, [5, 1, 2]) == 0
    assert kv.check(keys, [1, 5, 2]) == 2  # two blocks swapped
    kv.kv_caches[1][1, 2].view(-1).view(torch.uint8)[0] ^= 1  # layer 1, V, block 2
    assert kv.check(keys, [5, 1, 2]) == 1
    assert kv.check([], []) == 0


async def _until(cond: Callable[[], bool]) -> None:
    """Let other tasks run until ``cond()`` holds (no timed sleeps)."""
    for _ in range(100):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_block_allocator_waits_in_order() -> None:
    alloc = BlockAllocator(10)
    first = await alloc.allocate(8)
    assert len(set(first)) == 8 and alloc.num_free == 2
    big = asyncio.create_task(alloc.allocate(5))
    small = asyncio.create_task(alloc.allocate(1))
    await _until(lambda: len(alloc._waiters) == 2)
    # First come, first served: the small request waits behind the big one.
    assert not big.done() and not small.done()
    alloc.free(first[:4])  # 6 free: enough for both, in order
    got_big = await big
    got_small = await small
    assert len(got_big) == 5 and len(got_small) == 1 and alloc.num_free == 0
    assert len({*got_big, *got_small, *first[4:]}) == 10
    # A cancelled waiter leaves the queue and takes nothing.
    stuck = asyncio.create_task(alloc.allocate(10))
    await _until(lambda: len(alloc._waiters) == 1)
    stuck.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stuck
    assert not alloc._waiters
    alloc.free([*got_big, *got_small, *first[4:]])
    assert sorted(await alloc.allocate(10)) == list(range(10))
    with pytest.raises(ValueError, match="has 10"):
        await alloc.allocate(11)


# --- the command line ------------------------------------------------------------------

CLI_TINY = [
    "demo",
    "--requests=40",
    "--system-prompts=2",
    "--system-prompt-blocks=4",
    "--turns=3",
    "--blocks-per-turn=2",
    "--cpu-blocks=32",
    "--layers=1",
    "--concurrency=4",
    "--time-scale=0",
    "--no-progress",
]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_cli_demo(loop: str, capsys: pytest.CaptureFixture[str]) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    assert cli.main([*CLI_TINY, f"--loop={loop}"]) == 0
    out, err = capsys.readouterr()
    assert "asyncoffload demo: 40 chat requests" in out
    assert "prefix-hit rate (tokens)" in out
    assert "blocks stored / loaded / evicted" in out
    assert f"loop / completion / backend       {loop} / " in out
    assert ", 0 mismatches" in out
    assert "[" not in err  # no progress bar when asked for none


def test_the_demo_runs_the_engines_default_policy_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Issue 40: `make demo` (the CLI without --policy) pinned lru while the engine's
    # default is auto.
    default = EngineConfig().policy
    assert DemoConfig().policy == default
    assert cli.main([*CLI_TINY, "--loop=asyncio"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table wraps long values
    assert f"policy {default} (the default), following " in out
    assert "blocks declined (CPU tier) " in out
    assert cli.main([*CLI_TINY, "--loop=asyncio", "--policy=arc"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "policy arc (workload:" in out and "(the default)" not in out


def test_cli_reports_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt_every_load(monkeypatch)
    assert cli.main([*CLI_TINY, "--loop=asyncio"]) == 1
    out, err = capsys.readouterr()
    assert "FAILED" in out and "FAILED" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required: COMMAND"),
        (["nope"], "invalid choice"),
        (["demo", "--cpu-blocks", "0"], "--cpu-blocks: expected a positive integer"),
        (["demo", "--requests", "many"], "--requests: expected a positive integer"),
        (["demo", "--policy", "nope"], "--policy: invalid choice"),
        (["demo", "--loop", "trio"], "--loop: invalid choice"),
        (["demo", "--time-scale", "-1"], "--time-scale: expected a non-negative number"),
        (["demo", "--arrival-rate", "inf"], "--arrival-rate: expected a positive number"),
        (["demo", "--progress", "--no-progress"], "not allowed with"),
        (["demo", "--unknown"], "unrecognized arguments"),
        ([*CLI_TINY, "--gpu-blocks=1"], "largest request"),
    ],
)
def test_cli_bad_options(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err


def test_cli_help_lists_demo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    assert "demo" in capsys.readouterr().out


# --- integrations: --publish, --metrics-port ---------------------------------------------


def test_a_consumer_refuses_a_reply_that_is_not_the_servers() -> None:
    """A socket that sends the request back (as the consumer's own socket does when it
    connects to itself, before a server binds an ephemeral port): 2 frames, named in a
    ConnectionError, nothing applied; with time to wait it asks again, then gives up."""
    port = free_port(pair=True)
    ctx: zmq.Context[Any] = zmq.Context()
    # A ROUTER answers the peer that asked (a DEALER would deal its answers round robin,
    # to the closed sockets of earlier attempts too: lost, a timeout in a busy make test).
    echo = ctx.socket(zmq.ROUTER)
    echo.bind(f"tcp://127.0.0.1:{port + 1}")
    stop = threading.Event()

    def echoing() -> None:
        while not stop.is_set():
            if echo.poll(20):
                echo.send_multipart(echo.recv_multipart())

    thread = threading.Thread(target=echoing)
    thread.start()
    sub = kv_index.Subscriber(
        f"tcp://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{port + 1}",
        "kv",
        context=ctx,
        replay_timeout_ms=2000,
    )
    try:
        with pytest.raises(ConnectionError, match=r"answered 2 frames, not \[empty, seq"):
            sub.connect()
        assert sub.last_seq == -1 and sub.replayed == 0
        sub.disconnect()
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="answered 2 frames"):
            sub.connect(wait_s=0.3)  # asked again until the bound, not given up at once
        assert time.monotonic() - started >= 0.3
    finally:
        stop.set()
        thread.join(10)
        sub.disconnect()
        echo.close(linger=0)
        ctx.destroy(linger=0)


async def test_a_consumer_indexes_what_the_demo_publishes() -> None:
    port = free_port(pair=True)
    cfg = tiny(
        requests=200, time_scale=0.5, publish=f"tcp://127.0.0.1:{port}", publish_topic="kv@demo"
    )
    assert cfg.replay_endpoint == f"tcp://127.0.0.1:{port + 1}"
    ctx: zmq.Context[Any] = zmq.Context()
    # The replay socket's answers wait up to 2 s (the example's default): 200 ms failed
    # once in a make test on the two busy CPUs (a gap's replay in sub.poll).
    sub = kv_index.Subscriber(
        cfg.publish or "", cfg.replay_endpoint, "kv@demo", context=ctx, replay_timeout_ms=2000
    )
    demo = asyncio.create_task(run_demo(cfg, progress=False))
    try:
        while True:  # the publisher binds once the demo has started
            try:
                await asyncio.to_thread(sub.connect)
                break
            except TimeoutError:
                sub.disconnect()
                assert not demo.done(), "the demo ended before its publisher answered"
        while not demo.done():
            await asyncio.to_thread(sub.poll, 20)
        report = demo.result()
        await asyncio.to_thread(sub.poll, 200)
    finally:
        sub.disconnect()
        ctx.destroy(linger=0)
    assert_consistent(report, cfg)
    pub = report.publisher
    assert pub is not None and pub.events_dropped == 0
    assert sub.last_seq == pub.last_seq and sub.lost == 0
    assert report.stats.blocks_evicted > 0
    assert len(sub.index.tiers["CPU"]) == report.stats.manager.ready
    table = report.format_table(columns=400)
    assert f"on tcp://127.0.0.1:{port} (replay tcp://127.0.0.1:{port + 1})" in table


async def test_metrics_are_served_while_the_demo_runs() -> None:
    report = await run_demo(tiny(metrics_port=0, publish="tcp://127.0.0.1:*"), progress=False)
    assert report.metrics_url is not None and report.metrics_url.startswith("http://127.0.0.1:")
    assert report.publish_endpoints is not None
    assert report.publish_endpoints[1] is None  # no replay port to derive from '*'
    assert "Prometheus metrics" in report.format_table(columns=400)


def test_cli_publish_rows_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*CLI_TINY, "--loop=asyncio", "--publish", "tcp://127.0.0.1:*"]) == 0
    assert "KV events (vLLM format)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main([*CLI_TINY, "--publish", "127.0.0.1:5557"])
    assert "must be 'tcp://host:port'" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit):
            cli.main([*CLI_TINY, "--publish", f"tcp://127.0.0.1:{port}"])
    assert f"cannot bind the endpoint 'tcp://127.0.0.1:{port}'" in capsys.readouterr().err


def test_cli_demo_with_a_cpu_tier_smaller_than_the_largest_request_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each stored prompt has more new blocks than the 8-block tier: the demo stores the
    front that fits (CapacityError) and says how often."""
    argv = ["--requests", "20", "--cpu-blocks", "8", "--layers", "1", "--time-scale", "0"]
    assert cli.main(["demo", *argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "stores larger than the CPU tier" in out
    assert "their first 8 new blocks offered instead" in out
    assert "OK: verified" in out


async def test_a_store_larger_than_the_tier_stores_its_front() -> None:
    cfg = DemoConfig(requests=20, cpu_blocks=8, layers=1, time_scale=0.0, system_prompt_blocks=16)
    report = await run_demo(cfg, progress=False)
    assert report.ok
    assert report.stores_cut > 0
    assert report.stats.blocks_stored > 0
