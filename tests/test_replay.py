"""The replay harness, the offline bound and the ``asyncoffload replay`` command."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import pytest

from asyncoffload.cli import main
from asyncoffload.keys import OffloadKey, make_offload_key
from asyncoffload.manager import available_policies
from asyncoffload.replay import (
    BELADY,
    belady,
    capacity_blocks,
    format_table,
    parse_spec,
    plot,
    replay,
    replay_engine,
    replay_matrix,
)
from asyncoffload.workloads import Request, load_mooncake, summarize, synthetic_sessions
from tests.helpers import trace_path

TRACE = trace_path()


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


def req(ids: Sequence[int], tokens: int | None = None, block_size: int = 4) -> Request:
    return Request(
        req_id=f"r{len(ids)}",
        arrival_s=0.0,
        keys=tuple(key(i) for i in ids),
        input_tokens=tokens if tokens is not None else block_size * len(ids),
        output_tokens=1,
        block_size=block_size,
    )


def small_workload(seed: int = 0, n: int = 400) -> list[Request]:
    return synthetic_sessions(
        n, block_size=16, blocks_per_turn=3.0, system_prompt_blocks=2, think_time_s=5.0, seed=seed
    )


def lru_reference(requests: Sequence[Request], capacity: int) -> tuple[int, int, int]:
    """Hits, blocks written and evicted by vLLM-style LRU in the replay's sequence, written
    out by hand: touch moves the prompt's stored blocks to the front (first key most
    recent), the missing rest is appended in order, evicting from the back."""
    cache: OrderedDict[OffloadKey, None] = OrderedDict()
    hits = written = evicted = 0
    for r in requests:
        n = 0
        for k in r.keys:
            if k not in cache:
                break
            n += 1
        hits += n
        for k in reversed(r.keys):
            if k in cache:
                cache.move_to_end(k)
        new = [k for k in r.keys[n:] if k not in cache]
        protected = set(r.keys[n:])
        need = len(cache) + len(new) - capacity
        victims = [k for k in cache if k not in protected][: max(0, need)]
        if need > 0 and len(victims) < need:
            continue  # refused
        for k in victims:
            del cache[k]
        evicted += len(victims)
        for k in new:
            cache[k] = None
        written += len(new)
    return hits, written, evicted


def test_hits_are_leading_stored_blocks_in_blocks_and_tokens() -> None:
    reqs = [req([1, 2, 3], tokens=10), req([1, 2, 4], tokens=11), req([1, 2, 3, 5], tokens=15)]
    res = replay(reqs, 100, policy="lru")
    # second request hits 1,2; third hits 1,2,3 (the partial block 3 was stored by the first).
    assert res.hit_blocks == 2 + 3
    assert res.blocks == 10
    assert res.hit_tokens == 8 + 12
    assert res.tokens == 36
    assert res.stored == 3 + 1 + 1
    assert res.evicted == 0
    assert res.block_hit_rate == pytest.approx(0.5)
    assert res.token_hit_rate == pytest.approx(20 / 36)
    assert res.capacity_share == pytest.approx(100 / 5)


def test_bytes_count_the_tokens_of_the_blocks_moved() -> None:
    reqs = [req([1, 2, 3], tokens=10), req([1, 2, 3, 4], tokens=14)]
    res = replay(reqs, 100, bytes_per_token=2)
    # 4 + 4 + 2 tokens, then block 4 with the 2 tokens past 12.
    assert res.bytes_stored == (10 + 2) * 2
    # The second request reads its first three blocks, 12 of its tokens.
    assert res.hit_tokens == 12 and res.bytes_loaded == 12 * 2


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("capacity", [8, 40, 200])
def test_lru_replay_matches_a_hand_written_lru(seed: int, capacity: int) -> None:
    reqs = small_workload(seed)
    res = replay(reqs, capacity, policy="lru")
    assert (res.hit_blocks, res.stored, res.evicted) == lru_reference(reqs, capacity)


@pytest.mark.parametrize("policy", sorted(set(available_policies())))
def test_a_tier_holding_everything_hits_every_reuse(policy: str) -> None:
    reqs = small_workload(3)
    s = summarize(reqs)
    res = replay(reqs, s.unique_blocks, policy=policy)
    assert res.evicted == 0 and res.refused == 0
    assert res.hit_blocks == s.total_blocks - s.unique_blocks
    assert res.stored <= s.unique_blocks


def test_belady_with_room_for_everything_stores_only_what_is_reused() -> None:
    reqs = small_workload(4)
    s = summarize(reqs)
    res = belady(reqs, s.unique_blocks)
    assert res.hit_blocks == s.total_blocks - s.unique_blocks
    reused = {k for k, n in _counts(reqs).items() if n > 1}
    assert res.stored == len(reused)
    assert res.skipped == s.unique_blocks - len(reused)


def _counts(reqs: Sequence[Request]) -> dict[OffloadKey, int]:
    counts: dict[OffloadKey, int] = {}
    for r in reqs:
        for k in r.keys:
            counts[k] = counts.get(k, 0) + 1
    return counts


@pytest.mark.parametrize("seed", range(6))
def test_the_offline_bound_beats_every_online_policy(seed: int) -> None:
    reqs = small_workload(seed, n=300)
    unique = summarize(reqs).unique_blocks
    for share in (0.02, 0.1, 0.3):
        cap = capacity_blocks(share, unique)
        bound = belady(reqs, cap).hit_blocks
        for policy in available_policies():
            assert replay(reqs, cap, policy=policy).hit_blocks <= bound, (policy, share)


def test_results_do_not_depend_on_the_run() -> None:
    reqs = small_workload(5)
    for policy in available_policies():
        a = replay(reqs, 50, policy=policy)
        b = replay(reqs, 50, policy=policy)
        assert (a.hit_blocks, a.stored, a.evicted) == (b.hit_blocks, b.stored, b.evicted)


@pytest.mark.parametrize(
    ("policy", "admission"),
    [("lru", None), ("arc", None), ("kv", None), ("auto", None), ("lru", "ghost")],
)
async def test_the_engine_replay_moves_real_bytes_and_agrees(
    policy: str, admission: str | None
) -> None:
    reqs = small_workload(6, n=150)
    ref = replay(reqs, 60, policy=policy, admission=admission)
    res, mismatches = await replay_engine(reqs, 60, policy=policy, admission=admission)
    assert mismatches == 0
    assert res.hit_blocks > 0
    assert (res.hit_blocks, res.stored, res.evicted, res.skipped) == (
        ref.hit_blocks,
        ref.stored,
        ref.evicted,
        ref.skipped,
    )


def test_admission_holds_back_and_counts_what_it_skips() -> None:
    reqs = [req([1, 2]), req([1, 2]), req([1, 2])]
    res = replay(reqs, 10, admission="ghost")
    # First offer held back; second offer stored; third request hits.
    assert res.skipped == 2 and res.stored == 2 and res.hit_blocks == 2


def test_bad_arguments_name_what_is_wrong() -> None:
    reqs = [req([1])]
    with pytest.raises(ValueError, match="capacity"):
        replay(reqs, 0)
    with pytest.raises(ValueError, match="unknown cache policy 'nope'"):
        replay(reqs, 4, policy="nope")
    with pytest.raises(ValueError, match="unknown admission filter 'nope'"):
        replay(reqs, 4, admission="nope")
    with pytest.raises(ValueError, match="capacity share"):
        capacity_blocks(0.0, 10)
    with pytest.raises(ValueError, match="unknown cache policy 'x'"):
        parse_spec("x+ghost")
    with pytest.raises(ValueError, match="offline bound"):
        parse_spec("belady+ghost")
    assert parse_spec("lru+ghost") == ("lru", "ghost")


def test_matrix_table_and_plot(tmp_path: Path) -> None:
    reqs = small_workload(7, n=200)
    results = replay_matrix(reqs, [0.05, 0.2], ["lru", "kv+adaptive", BELADY])
    assert [r.label for r in results] == ["lru", "kv+adaptive", BELADY] * 2
    text = format_table(results)
    assert "lru hit / written" in text and "kv+adaptive hit / written" in text
    assert "5% (" in text and "20% (" in text
    out = tmp_path / "p.png"
    plot(results, str(out), title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("metric", ["block", "token"])
def test_the_plot_shows_the_chosen_metric_blocks_written_and_a_legend_off_the_points(
    metric: str,
) -> None:
    import matplotlib.pyplot as plt

    from asyncoffload.replay import figure

    reqs = small_workload(7, n=200)
    results = replay_matrix(reqs, [0.05, 0.2], ["lru", BELADY])
    fig = figure(results, title="t", metric=metric)
    try:
        hits, written = fig.axes
        assert metric in hits.get_ylabel() and "written" in written.get_ylabel()
        by_label = {line.get_label(): line for line in hits.get_lines()}
        lru = [r for r in results if r.label == "lru"]
        expected = [r.block_hit_rate if metric == "block" else r.token_hit_rate for r in lru]
        assert [float(y) for y in by_label["lru"].get_ydata()] == pytest.approx(expected)  # type: ignore[union-attr,arg-type]
        stored = {
            line.get_label(): [int(y) for y in line.get_ydata()]  # type: ignore[union-attr,arg-type]
            for line in written.get_lines()
        }
        assert stored["lru"] == [r.stored for r in lru]
        # The legend is the figure's, below both panels: it covers no point.
        assert hits.get_legend() is None and len(fig.legends) == 1
        fig.canvas.draw()
        legend_box = fig.legends[0].get_window_extent()
        for ax in fig.axes:
            assert legend_box.y1 <= ax.get_window_extent().y0
    finally:
        plt.close(fig)


@pytest.mark.parametrize("metric", ["block", "token"])
def test_the_infinite_tier_rate_is_what_the_bound_reaches_with_room_for_everything(
    metric: str,
) -> None:
    from asyncoffload.replay import infinite_tier_hit_rate

    reqs = small_workload(3, n=200)
    (everything,) = replay_matrix(reqs, [1.0], ["lru"])
    rate = everything.block_hit_rate if metric == "block" else everything.token_hit_rate
    assert infinite_tier_hit_rate(reqs, metric) == pytest.approx(rate)


# --- the command -------------------------------------------------------------------------


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_trace(tmp_path: Path) -> Path:
    rows: list[dict[str, object]] = []
    nxt = 100
    for i in range(60):
        conv = i % 6
        ids = [0] + [10 * conv + j + 1 for j in range(1 + i // 6 % 4)] + [nxt]
        nxt += 1
        rows.append(
            {
                "timestamp": i * 10,
                "input_length": 16 * len(ids) - 3,
                "output_length": 5,
                "hash_ids": ids,
            }
        )
    return write_trace(tmp_path / "t.jsonl", rows)


def test_command_prints_the_table_and_writes_plot_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tiny_trace(tmp_path)
    png, js = tmp_path / "o.png", tmp_path / "o.json"
    rc = main(
        [
            "replay",
            str(trace),
            "--block-size",
            "16",
            "--capacity",
            "10%",
            "50%",
            "--policy",
            "lru,kv",
            "lru+ghost",
            "--plot",
            str(png),
            "--json",
            str(js),
            "--no-progress",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "60 requests" in out
    for label in ("lru hit / written", "kv hit / written", "lru+ghost hit / written", BELADY):
        assert label in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(js.read_text())
    labels = {r["label"] for r in data["results"]}
    assert labels == {"lru", "kv", "lru+ghost", BELADY}
    lru10 = next(r for r in data["results"] if r["label"] == "lru" and r["capacity_share"] < 0.2)
    ref = replay(load_mooncake(trace, block_size=16), lru10["capacity"])
    assert lru10["hit_blocks"] == ref.hit_blocks


def test_command_progress_bar_goes_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tiny_trace(tmp_path)
    assert (
        main(
            [
                "replay",
                str(trace),
                "--block-size",
                "16",
                "--capacity",
                "50%",
                "--policy",
                "lru",
                "--no-bound",
                "--progress",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "100.0%" in err and "lru @ 50%" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity", "0%"], "--capacity"),
        (["--capacity", "abc"], "--capacity"),
        (["--capacity", "150%"], "--capacity"),
        (["--policy", "nope"], "unknown cache policy 'nope'"),
        (["--policy", "lru+nope"], "unknown admission filter 'nope'"),
    ],
)
def test_command_rejects_bad_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    trace = tiny_trace(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace), "--block-size", "16", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_command_names_the_bad_line_of_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
        '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": "x"}\n'
    )
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace), "--capacity", "50%", "--policy", "lru"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "hash_ids" in err
    with pytest.raises(SystemExit):
        main(["replay", str(tmp_path / "missing.jsonl")])
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        pytest.param('{"timestamp": ' + "9" * 5000 + "}", "more than 4300 digits", id="long-int"),
        pytest.param("[" * 100_000 + "]" * 100_000, "nested too deeply", id="deep-nesting"),
    ],
)
def test_command_reports_an_unparsable_trace_in_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, problem: str
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(line + "\n")
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace), "--capacity", "50%", "--policy", "lru"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"asyncoffload replay: error: {trace}:1: invalid JSON: ")
    assert problem in err


def test_command_reports_an_unreadable_trace_in_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(tmp_path)])  # a directory
    assert exc.value.code == 2
    message = f"cannot read the trace {str(tmp_path)!r}: Is a directory"
    assert capsys.readouterr().err == f"asyncoffload replay: error: {message}\n"


def test_command_through_the_engine_checks_bytes_and_agrees(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tiny_trace(tmp_path)
    js_engine, js_manager = tmp_path / "e.json", tmp_path / "m.json"
    common = ["--block-size", "16", "--capacity", "20%", "--policy", "lru", "kv", "--no-bound"]
    assert main(["replay", str(trace), *common, "--engine", "--json", str(js_engine)]) == 0
    out = capsys.readouterr().out
    assert "through the engine:" in out and "0 with wrong bytes" in out
    assert "engine time per block" in out
    assert main(["replay", str(trace), *common, "--json", str(js_manager)]) == 0
    fields = ("label", "hit_blocks", "stored", "evicted", "loaded")
    engine_rows = [{f: r[f] for f in fields} for r in json.loads(js_engine.read_text())["results"]]
    manager_rows = [
        {f: r[f] for f in fields} for r in json.loads(js_manager.read_text())["results"]
    ]
    assert engine_rows == manager_rows
    assert all(r["hit_blocks"] > 0 for r in engine_rows)


def test_command_runs_the_synthetic_workload(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["replay", "synthetic:300", "--capacity", "10%", "--policy", "lru", "kv"])
    assert rc == 0
    assert "300 requests" in capsys.readouterr().out


# --- the real trace ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def conversation() -> list[Request]:
    if not TRACE.exists():
        pytest.skip(f"the Mooncake trace is not at {TRACE}")
    return load_mooncake(TRACE)


def test_lru_and_the_bound_reproduce_the_published_figures(conversation: list[Request]) -> None:
    unique = summarize(conversation).unique_blocks
    cap = capacity_blocks(0.05, unique)
    assert round(replay(conversation, cap, policy="lru").block_hit_rate, 3) == 0.196
    assert round(belady(conversation, cap).block_hit_rate, 3) == 0.366


def test_the_kv_policy_beats_lru_on_the_conversation_trace(conversation: list[Request]) -> None:
    unique = summarize(conversation).unique_blocks
    for share in (0.01, 0.05, 0.2):
        cap = capacity_blocks(share, unique)
        lru = replay(conversation, cap, policy="lru")
        kv = replay(conversation, cap, policy="kv")
        assert kv.block_hit_rate >= lru.block_hit_rate - 0.01, share
        assert kv.stored <= lru.stored, share
    cap = capacity_blocks(0.05, unique)
    assert replay(conversation, cap, policy="kv").block_hit_rate >= 0.22


# --- a disk tier below the CPU tier --------------------------------------------------------


def test_a_disk_tier_turns_cpu_misses_into_disk_hits_promoted_back() -> None:
    reqs = [req([1, 2]), req([3, 4]), req([1, 2]), req([3, 4, 5]), req([5, 1])]
    # CPU tier alone (2 slots): 3,4 push out 1,2 and back; [3,4,5] does not fit; 5 and 1
    # are gone when [5,1] comes: no hit at all.
    assert replay(reqs, 2).hit_blocks == 0
    res = replay(reqs, 2, disk_capacity=10, disk_admission=None, bytes_per_token=1)
    # Every CPU store is written through: 1,2 then 3,4, then 5. [1,2] finds both on disk
    # (promoted, evicting 3,4); [3,4,5] finds 3,4 on disk (promoted, evicting 1,2), and
    # stores 5 (evicting 3 or 4); [5,1] finds 5 in the CPU tier and 1 on disk, promoted
    # in place of the other of 3,4.
    assert (res.cpu_hit_blocks, res.disk_hit_blocks, res.hit_blocks) == (1, 5, 6)
    assert (res.cpu_hit_tokens, res.disk_hit_tokens, res.hit_tokens) == (4, 20, 24)
    assert res.blocks == 11 and res.promoted == 5
    assert res.stored == 5  # misses stored from the GPU side; promotions apart
    assert res.evicted == 2 + 2 + (2 + 1) + 1
    assert (res.disk_stored, res.disk_evicted, res.disk_skipped) == (5, 0, 0)
    assert res.disk_bytes_stored == 5 * 4
    assert res.disk_capacity == 10 and res.disk_policy == "lru" and res.disk_admission is None
    assert res.cpu_block_hit_rate == pytest.approx(1 / 11)
    assert res.disk_block_hit_rate == pytest.approx(5 / 11)
    assert res.block_hit_rate == pytest.approx(6 / 11)
    assert res.hit_rates("token") == pytest.approx((4 / 44, 20 / 44, 24 / 44))


def test_without_a_disk_tier_nothing_reads_differently() -> None:
    reqs = small_workload(8)
    res = replay(reqs, 40)
    assert not res.has_disk and res.disk_capacity is None
    assert (res.disk_hit_blocks, res.disk_stored, res.promoted) == (0, 0, 0)
    assert res.cpu_hit_blocks == res.hit_blocks
    assert res.hit_rates() == (res.block_hit_rate, 0.0, res.block_hit_rate)
    assert "disk" not in format_table([res])


def test_the_disk_writes_every_stored_block_or_only_those_offered_twice() -> None:
    # Block 2 holds 2 tokens: bytes count each block's tokens, as bytes_stored does.
    reqs = [req([1, 2], tokens=6), req([3, 4]), req([1, 2], tokens=6)]
    every = replay(reqs, 2, disk_capacity=10, disk_admission=None, bytes_per_token=3)
    # Everything the CPU tier stores goes to disk: 1,2 (6 tokens), 3,4 (8 tokens);
    # the third request is served from disk.
    assert every.disk_stored == 4 and every.disk_bytes_stored == (6 + 8) * 3
    assert every.disk_hit_blocks == 2 and every.disk_skipped == 0
    second = replay(reqs, 2, disk_capacity=10, bytes_per_token=3)  # the default
    assert second.disk_admission == "frequency2"
    # First offers of 1,2 and 3,4 are held back; 1,2 come back (a miss, as no tier has
    # them), the CPU tier stores them again, and this second offer goes to disk.
    assert second.disk_stored == 2 and second.disk_bytes_stored == 6 * 3
    assert second.disk_skipped == 4 and second.disk_hit_blocks == 0


def test_a_tiered_replay_reads_the_cpu_tier_through_the_leader_its_lookup_left() -> None:
    """``auto`` may switch leaders in the lookup that a request starts with (its feed):
    the walk past the CPU tier's prefix must then ask the new leader. It asked the one
    before (reset by the switch): a block ready in the CPU tier behind a disk hit was
    taken for a disk hit too, and its promotion into the CPU tier that holds it failed
    (``ValueError: reserve: key ... is already present``)."""
    from asyncoffload.manager.policies import AdaptivePolicy

    class SwitchesAtTheFifth(AdaptivePolicy):
        calls = 0

        def on_request(self, keys: Sequence[OffloadKey]) -> None:
            self.calls += 1
            if self.calls == 5:
                self.switch_to("arc")
            super().on_request(keys)

    policy = SwitchesAtTheFifth(3, initial="lru")
    # A, B, C stored, then X evicts A from the CPU tier: CPU B, C, X; disk all four.
    reqs = [req([1]), req([2]), req([3]), req([9]), req([2, 1, 3])]
    res = replay(reqs, 3, policy=policy, disk_capacity=10, disk_admission=None)
    assert policy.switches == 1 and policy.leader == "arc"
    assert (res.cpu_hit_blocks, res.disk_hit_blocks) == (2, 1)


def test_a_promotion_skips_the_cpu_tiers_admission() -> None:
    reqs = [req([1, 2]), req([1, 2]), req([3, 4]), req([3, 4]), req([1, 2]), req([1, 2])]
    res = replay(reqs, 2, store_threshold=2, disk_capacity=10, disk_admission=None)
    # The CPU tier stores 1,2 and 3,4 on their second offers (4 held back), evicting
    # 1,2; their write-through put them on disk. The fifth request finds 1,2 on disk
    # and promotes them at once (an offer would be held back again), so the sixth finds
    # them in the CPU tier.
    assert (res.skipped, res.stored, res.disk_stored) == (4, 4, 4)
    assert (res.disk_hit_blocks, res.promoted, res.cpu_hit_blocks) == (2, 2, 2)


@pytest.mark.parametrize(
    ("policy", "admission"),
    [("lru", None), ("kv", None), ("arc", None), ("lru", "ghost"), ("kv", "adaptive")],
)
@pytest.mark.parametrize("seed", range(3))
def test_a_disk_tier_never_lowers_the_total_hit_rate(
    seed: int, policy: str, admission: str | None
) -> None:
    reqs = small_workload(seed)
    unique = summarize(reqs).unique_blocks
    for share in (0.02, 0.1):
        cap = capacity_blocks(share, unique)
        alone = replay(reqs, cap, policy=policy, admission=admission)
        for disk in (0.1, 1.0, 2.0):
            for disk_admission in (None, "frequency2"):
                res = replay(
                    reqs,
                    cap,
                    policy=policy,
                    admission=admission,
                    disk_capacity=capacity_blocks(disk, unique),
                    disk_admission=disk_admission,
                )
                assert res.block_hit_rate >= alone.block_hit_rate, (share, disk, disk_admission)
                assert res.hit_blocks == res.cpu_hit_blocks + res.disk_hit_blocks
        big = replay(
            reqs,
            cap,
            policy=policy,
            admission=admission,
            disk_capacity=2 * unique,
            disk_admission=None,
        )
        assert big.block_hit_rate > alone.block_hit_rate
        assert big.disk_evicted == 0


def test_disk_tier_arguments_are_checked() -> None:
    reqs = [req([1])]
    for bad in (0, -3):
        with pytest.raises(ValueError, match="disk capacity must be a positive number of blocks"):
            replay(reqs, 4, disk_capacity=bad)
    with pytest.raises(ValueError, match="unknown cache policy 'nope'"):
        replay(reqs, 4, disk_capacity=4, disk_policy="nope")
    with pytest.raises(ValueError, match="unknown disk admission 'frequency1'"):
        replay(reqs, 4, disk_capacity=4, disk_admission="frequency1")
    with pytest.raises(ValueError, match="capacity share"):
        replay_matrix(reqs, [0.5], ["lru"], disk_shares=[0.0])
    with pytest.raises(ValueError, match="CPU tier only"):
        replay_matrix(reqs, [0.5], ["lru"], disk_shares=[1.0], engine=True)
    assert replay(reqs, 4, disk_capacity=4, disk_admission="ghost").disk_admission == "ghost"
    assert replay(reqs, 4, disk_capacity=4, disk_admission="frequency3").disk_admission == (
        "frequency3"
    )


def test_matrix_with_a_disk_tier_and_its_table() -> None:
    reqs = small_workload(7, n=200)
    results = replay_matrix(reqs, [0.05], ["lru", BELADY], disk_shares=[None, 0.5, 2.0])
    # The online policy at each disk capacity (none included); the bound once, CPU only.
    assert [(r.label, r.disk_capacity_share) for r in results] == [
        ("lru", None),
        ("lru", 0.5),
        ("lru", 2.0),
        (BELADY, None),
    ]
    text = format_table(results, columns=200)
    assert "lru cpu / disk / total, GB to disk" in text and "belady (cpu only)" in text
    assert "none" in text and "50% (" in text and "200% (" in text
    for narrow in (60, 80):
        assert max(map(len, format_table(results, columns=narrow).splitlines())) < narrow


def test_command_models_a_disk_tier_on_the_real_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not TRACE.exists():
        pytest.skip(f"the Mooncake trace is not at {TRACE}")
    monkeypatch.setenv("COLUMNS", "100")
    js = tmp_path / "d.json"
    argv = ["replay", str(TRACE), "--limit", "1500", "--capacity", "5%", "--policy", "lru"]
    argv += ["--disk-shares", "0.5,1", "--json", str(js), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1,500 requests" in out and "GB written to disk" in out
    assert "lru cpu / disk / total, GB to disk" in out and "belady (cpu only)" in out
    assert max(len(line) for line in out.splitlines()) < 100
    rows = json.loads(js.read_text())["results"]
    lru = [r for r in rows if r["label"] == "lru"]
    assert sorted(r["disk_capacity_share"] or 0 for r in lru) == [0, 0.5, 1.0]
    for r in lru:
        for name in (
            "disk_hit_blocks",
            "disk_hit_tokens",
            "cpu_block_hit_rate",
            "disk_block_hit_rate",
            "block_hit_rate",
            "disk_stored",
            "disk_bytes_stored",
            "disk_evicted",
            "disk_capacity",
            "promoted",
        ):
            assert name in r, name
        assert r["cpu_block_hit_rate"] + r["disk_block_hit_rate"] == pytest.approx(
            r["block_hit_rate"]
        )
    disk = next(r for r in lru if r["disk_capacity_share"] == 1.0)
    assert disk["disk_admission"] == "frequency2" and disk["disk_policy"] == "lru"
    assert disk["disk_bytes_stored"] > 0 and disk["disk_hit_blocks"] > 0
    # The rows print what the JSON holds.
    cpu, on_disk, total = (disk[f"{t}block_hit_rate"] for t in ("cpu_", "disk_", ""))
    assert f"{cpu:.3f} / {on_disk:.3f} / {total:.3f}" in out


def test_command_without_disk_shares_writes_no_disk_fields(tmp_path: Path) -> None:
    trace = tiny_trace(tmp_path)
    js = tmp_path / "o.json"
    argv = ["replay", str(trace), "--block-size", "16", "--capacity", "20%", "--policy", "lru"]
    assert main([*argv, "--json", str(js), "--no-progress"]) == 0
    (lru, _bound) = json.loads(js.read_text())["results"]
    assert not any(name.startswith("disk_") or name == "promoted" for name in lru)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disk-shares", "0"], "--disk-shares"),
        (["--disk-shares", "-1"], "--disk-shares"),
        (["--disk-shares", "abc"], "--disk-shares"),
        (["--disk-shares", "1", "--disk-policy", "nope"], "--disk-policy"),
        (["--disk-shares", "1", "--disk-policy", "belady"], "--disk-policy"),
        (["--disk-shares", "1", "--disk-admission", "often"], "--disk-admission"),
        (["--disk-policy", "lru"], "--disk-policy: needs --disk-shares"),
        (["--disk-admission", "none"], "--disk-admission: needs --disk-shares"),
        (["--disk-shares", "1", "--engine"], "--disk-shares"),
    ],
)
def test_command_rejects_bad_disk_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    trace = tiny_trace(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace), "--block-size", "16", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_disk_tier_raises_the_conversation_trace_hit_rate(conversation: list[Request]) -> None:
    unique = summarize(conversation).unique_blocks
    cap = capacity_blocks(0.05, unique)
    alone = replay(conversation, cap)
    disk = replay(conversation, cap, disk_capacity=capacity_blocks(1.0, unique))
    assert disk.block_hit_rate > alone.block_hit_rate + 0.05
    assert disk.cpu_block_hit_rate == pytest.approx(alone.block_hit_rate, abs=0.01)
    assert disk.disk_hit_blocks > 0 and disk.disk_stored < disk.stored


def test_disk_hits_with_no_cpu_room_to_come_into_fail_as_the_engine_fails_them() -> None:
    reqs = [req([1, 2]), req([3, 4]), req([3, 1, 2])]
    res = replay(reqs, 2, disk_capacity=10, disk_admission=None)
    # The third request finds 3 in the CPU tier (pinned for its load) and 1,2 on disk,
    # and two CPU slots must be freed with only 4 to evict: the load fails, the
    # request hits nothing, and its store of 1,2 finds no room either.
    assert res.promote_failed == 1 and res.promoted == 0
    assert res.hit_blocks == 0 and res.refused == 1


# --- stores larger than the tier (CapacityError) -----------------------------------------


@pytest.mark.parametrize(
    ("policy", "admission"),
    [("lru", None), ("arc", None), ("kv", None), ("auto", None), ("lru", "ghost")],
)
async def test_the_engine_replay_agrees_at_a_capacity_smaller_than_a_request(
    policy: str, admission: str | None
) -> None:
    """Requests of up to ~20 blocks on a 6-block tier: the engine refuses the stores that
    cannot fit (CapacityError) where the manager returns None, and stores what admission
    makes fit as the manager does; the hits are the same."""
    reqs = small_workload(2, n=120)
    assert max(len(r.keys) for r in reqs) > 6
    ref = replay(reqs, 6, policy=policy, admission=admission)
    res, mismatches = await replay_engine(reqs, 6, policy=policy, admission=admission)
    assert mismatches == 0
    assert res.extra["too_large"] > 0
    assert (res.hit_blocks, res.stored, res.evicted, res.skipped, res.refused) == (
        ref.hit_blocks,
        ref.stored,
        ref.evicted,
        ref.skipped,
        ref.refused,
    )


def test_command_through_the_engine_at_a_capacity_smaller_than_a_request_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """family:chat:300 at 0.5% is a 10-block tier; its prompts reach dozens of blocks."""
    argv = ["family:chat:300", "--engine", "--capacity", "0.5%", "--policy", "lru"]
    assert main(["replay", *argv, "--no-progress"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "0.5% (10)" in out
    assert "0 with wrong bytes" in out
    assert "stores had more new blocks than the CPU tier holds: not stored" in out
