"""The trace families (issue 15): each deterministic per seed, sorted, prefix-chained, with
its defining property; bad parameters named; the replay's ``family:...`` sources."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict
from typing import Any

import pytest

from asyncoffload.cli import main
from asyncoffload.keys import OffloadKey
from asyncoffload.replay import FAMILY_REQUESTS, FamilySource, parse_family_source
from asyncoffload.workloads import (
    Request,
    families,
    summarize,
    synthetic_agent,
    synthetic_diurnal,
    synthetic_mixed,
    synthetic_rag,
    synthetic_scan,
    synthetic_sessions,
    trace_family,
)

NAMES = ["chat", "agent", "rag", "scan", "diurnal", "mixed"]


def _generate(name: str, n: int = 1500, seed: int = 0, **params: Any) -> list[Request]:
    return trace_family(name).generate(n, seed=seed, **params)


def _sessions(reqs: list[Request]) -> dict[str, list[Request]]:
    by: dict[str, list[Request]] = defaultdict(list)
    for r in reqs:
        by[r.session_id].append(r)
    return by


def _assert_prefix_chained(reqs: list[Request]) -> None:
    """A key stands for its whole prefix: wherever it appears, the key before it agrees
    (and so, by induction, every key before it)."""
    parent_of: dict[OffloadKey, OffloadKey | None] = {}
    for r in reqs:
        for parent, key in zip((None, *r.keys), r.keys):
            assert parent_of.setdefault(key, parent) == parent, r.req_id


# --- every family ----------------------------------------------------------------------


def test_the_registry_names_every_family_in_order() -> None:
    assert list(families()) == NAMES
    for name, family in families().items():
        assert family.name == name and family.summary
        assert "seed" not in family.parameters() and "block_size" not in family.parameters()
    families().clear()  # a copy: the registry stays whole
    assert list(families()) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_per_seed_and_different_across_seeds(name: str) -> None:
    a = _generate(name, 600, seed=3)
    assert a == _generate(name, 600, seed=3)
    b = _generate(name, 600, seed=4)
    assert [r.keys for r in a] != [r.keys for r in b]
    # Different seeds draw different namespaces: no key in common.
    assert not {k for r in a for k in r.keys} & {k for r in b for k in r.keys}


@pytest.mark.parametrize("name", NAMES)
def test_count_order_and_block_layout(name: str) -> None:
    reqs = _generate(name, 1000, seed=1, block_size=64)
    assert len(reqs) == 1000
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    assert len({r.req_id for r in reqs}) == len(reqs)
    for r in reqs:
        assert r.block_size == 64
        # Every block has a key, the last possibly partial (Mooncake's layout).
        assert len(r.keys) == -(-r.input_tokens // 64) >= 1
        assert len(set(r.keys)) == len(r.keys)
        assert r.output_tokens >= 1


@pytest.mark.parametrize("name", NAMES)
def test_keys_are_prefix_chained(name: str) -> None:
    _assert_prefix_chained(_generate(name, 2000, seed=2))


@pytest.mark.parametrize("name", NAMES)
def test_no_requests(name: str) -> None:
    assert _generate(name, 0) == []


@pytest.mark.parametrize("name", ["chat", "agent", "diurnal"])
def test_turns_extend_the_conversation(name: str) -> None:
    reqs = _generate(name, 1500, seed=5)
    sessions = _sessions(reqs)
    assert len(sessions) < len(reqs) / 1.5
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, cur in itertools.pairwise(turns):
            assert cur.input_tokens > prev.input_tokens + prev.output_tokens
            # The next turn re-reads every full block; the partial last one is re-keyed.
            full = prev.input_tokens // prev.block_size
            assert cur.keys[:full] == prev.keys[:full]


def test_chat_is_the_synthetic_source() -> None:
    assert _generate("chat", 500, seed=7) == synthetic_sessions(500, seed=7)


def test_families_of_one_seed_share_no_key() -> None:
    keys = [{k for r in _generate(name, 300, seed=0) for k in r.keys} for name in NAMES[1:]]
    assert sum(map(len, keys)) == len(set[bytes]().union(*keys))


def test_mixed_shares_no_key_with_the_families_it_mixes() -> None:
    # Its streams are scan's and chat's generators, drawn from its own random stream.
    mixed = {k for r in _generate("mixed", 600, seed=0) for k in r.keys}
    for name in ("scan", "chat"):
        assert not mixed & {k for r in _generate(name, 600, seed=0) for k in r.keys}


# --- what defines each family ------------------------------------------------------------


def test_agent_steps_start_with_a_few_long_shared_tool_prompts() -> None:
    reqs = synthetic_agent(3000, num_tool_prompts=3, tool_prompt_blocks=12, seed=1)
    prefixes = Counter(r.keys[:12] for r in reqs)
    assert len(prefixes) == 3
    assert all(count > 100 for count in prefixes.values())
    # Long: the tool prompt is most of a typical step's prompt.
    assert statistics.median(len(r.keys) for r in reqs) < 2 * 12
    # Loops of many short steps: each adds a call and a result, about two blocks or less.
    sessions = _sessions(reqs)
    assert statistics.mean(len(turns) for turns in sessions.values()) > 5
    growth = [
        cur.input_tokens - prev.input_tokens
        for turns in sessions.values()
        for prev, cur in itertools.pairwise(turns)
    ]
    assert statistics.mean(growth) < 2 * 512


def test_agent_tool_prompts_differ_from_their_first_block() -> None:
    reqs = synthetic_agent(1000, num_tool_prompts=4, seed=2)
    assert len({r.keys[0] for r in reqs}) == 4


def test_rag_chunk_popularity_is_zipf_like() -> None:
    # The block right after the 2-block system prompt is the first retrieved chunk.
    reqs = synthetic_rag(4000, num_chunks=5000, zipf_s=1.0, seed=1)
    assert len({r.keys[:2] for r in reqs}) == 1
    counts = sorted(Counter(r.keys[2] for r in reqs).values(), reverse=True)
    assert counts[0] > 30 * statistics.median(counts)
    # Popularity falls with rank about as 1 / rank: the second is about half the first.
    assert 0.3 < counts[1] / counts[0] < 0.8
    # Flat popularity (s = 0): no chunk stands out.
    flat = Counter(r.keys[2] for r in synthetic_rag(4000, num_chunks=5000, zipf_s=0.0, seed=1))
    assert max(flat.values()) < 10


def test_rag_prompt_is_system_chunks_and_a_unique_question() -> None:
    reqs = synthetic_rag(2000, chunks_per_request=3, chunk_blocks=2, seed=3)
    seen: Counter[OffloadKey] = Counter(k for r in reqs for k in r.keys)
    for r in reqs:
        chunk_end = 2 + 3 * 2
        assert r.input_tokens > chunk_end * 512
        # The question's blocks are never seen in another request.
        assert all(seen[k] == 1 for k in r.keys[chunk_end:])


def test_rag_order_by_id_makes_equal_chunk_sets_share_a_prefix() -> None:
    # Every request retrieves the whole corpus: sorted by id they all lay it out alike,
    # in retrieval order they do not.
    by_id = synthetic_rag(200, num_chunks=5, chunks_per_request=5, order="id", seed=1)
    assert len({r.keys[:7] for r in by_id}) == 1
    by_score = synthetic_rag(200, num_chunks=5, chunks_per_request=5, seed=1)
    assert len({r.keys[:7] for r in by_score}) > 10


def test_rag_draws_distinct_chunks_even_when_a_few_hold_all_the_weight() -> None:
    reqs = synthetic_rag(50, num_chunks=40, chunks_per_request=40, zipf_s=10.0, seed=2)
    assert all(len(r.keys) == 2 + 40 + 1 for r in reqs)


def test_scan_one_offs_share_nothing_past_the_system_prompt() -> None:
    reqs = synthetic_scan(4000, system_prompt_blocks=2, scan_fraction=0.3, seed=1)
    seen: Counter[OffloadKey] = Counter(k for r in reqs for k in r.keys)
    scans = [r for r in reqs if r.req_id.startswith("scan")]
    hot = [r for r in reqs if r.req_id.startswith("hot")]
    assert len(scans) + len(hot) == len(reqs)
    assert 0.25 < len(scans) / len(reqs) < 0.35
    assert len({r.keys[:2] for r in reqs}) == 1
    for r in scans:
        assert all(seen[k] == 1 for k in r.keys[2:])
    # Scans are long, and they bring most of the unique blocks.
    assert statistics.mean(len(r.keys) for r in scans) > 2 * statistics.mean(
        len(r.keys) for r in hot
    )
    assert sum(len(r.keys) - 2 for r in scans) > 0.5 * summarize(reqs).unique_blocks
    # The hot prefixes come back: their first block is re-read again and again.
    assert max(Counter(r.keys[2] for r in hot).values()) > 50


def test_scan_without_scans_is_only_the_hot_set() -> None:
    reqs = synthetic_scan(500, scan_fraction=0.0, seed=2)
    assert all(r.req_id.startswith("hot") for r in reqs)


def _mixed_streams(reqs: list[Request]) -> tuple[list[Request], list[Request]]:
    """The scan stream's requests (no session) and the chat stream's, in order."""
    scans = [r for r in reqs if not r.session_id]
    assert all(r.req_id.startswith(("hot", "scan")) for r in scans)
    return scans, [r for r in reqs if r.session_id]


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
def test_mixed_interleaves_both_kinds_in_about_the_requested_share(share: float) -> None:
    # Short think times: the sessions are soon under way, at their full request rate.
    reqs = synthetic_mixed(6000, scan_share=share, think_time_s=10.0, seed=1)
    scans, chats = _mixed_streams(reqs)
    assert len(scans) + len(chats) == len(reqs) == 6000
    assert share - 0.03 < len(scans) / len(reqs) < share + 0.05
    # Interleaved over the whole trace, not one stream after the other; at first the
    # sessions have had only their first turns, so scans are more.
    first, last = reqs[:1000], reqs[-2000:]
    assert share < sum(not r.session_id for r in first) / len(first) < share + 0.2
    assert abs(sum(not r.session_id for r in last) / len(last) - share) < 0.05
    # The scan stream is synthetic_scan's: one-off scans among hot re-reads.
    one_offs = [r for r in scans if r.req_id.startswith("scan")]
    assert 0.2 < len(one_offs) / len(scans) < 0.3
    assert max(Counter(r.keys[1] for r in scans if r.req_id.startswith("hot")).values()) > 30


def test_mixed_scans_come_first_while_the_first_sessions_get_under_way() -> None:
    # Sessions of 8 turns 2 minutes apart (the defaults) reach their full rate after
    # about 16 minutes: over 6000 requests (about 17 minutes) scans are well over 0.8.
    scans, chats = _mixed_streams(synthetic_mixed(6000, seed=1))
    assert len(scans) / 6000 > 0.84
    assert max(r.turn for r in chats) >= 7


def test_mixed_chat_sessions_sit_behind_long_shared_system_prompts() -> None:
    reqs = synthetic_mixed(
        6000, scan_share=0.5, mean_turns=3.0, num_system_prompts=20, system_prompt_blocks=14, seed=2
    )
    scans, chats = _mixed_streams(reqs)
    prompts = Counter(r.keys[:14] for r in chats if r.turn == 0)
    # Few prompts, shared by many sessions (Zipf: the first by the most).
    assert len(prompts) <= 20 and len({p[0] for p in prompts}) == len(prompts)
    assert sum(prompts.values()) > 500 and max(prompts.values()) > 0.15 * sum(prompts.values())
    # Whole blocks of system prompt alone: never in a scan-stream request, and every
    # chat prompt goes on past them.
    prompt_keys = {k for p in prompts for k in p}
    assert not prompt_keys & {k for r in scans for k in r.keys}
    assert all(r.input_tokens > 14 * r.block_size and r.keys[:14] in prompts for r in chats)
    # So the key at depth 8 of every chat request is one of a few (what sampling by it
    # lumps together), where the scans' one-offs each have their own.
    assert len({r.keys[8] for r in chats}) == len(prompts)
    sessions = _sessions(chats)
    assert statistics.mean(map(len, sessions.values())) > 1.5
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, cur in itertools.pairwise(turns):
            full = prev.input_tokens // prev.block_size
            assert cur.keys[:full] == prev.keys[:full]


def test_mixed_defaults_are_long_prompts_and_prefixes() -> None:
    params = trace_family("mixed").parameters()
    assert params["scan_share"] == 0.8
    assert params["system_prompt_blocks"] == 12 > 8
    assert params["hot_blocks"] == 24.0
    assert params["num_system_prompts"] == 32
    reqs = synthetic_mixed(3000, seed=3)
    scans, chats = _mixed_streams(reqs)
    assert len({r.keys[:12] for r in chats}) <= 32
    # A hot prefix is most of its request: one system block, the prefix, a question.
    hot = [r for r in scans if r.req_id.startswith("hot")]
    assert 18 < statistics.mean(len(r.keys) for r in hot) < 32


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_mixed_at_a_share_of_0_or_1_is_one_stream(share: float) -> None:
    reqs = synthetic_mixed(800, scan_share=share, seed=4)
    scans, chats = _mixed_streams(reqs)
    assert len(reqs) == 800
    assert (scans, chats) == ((reqs, []) if share else ([], reqs))


def _phase_prompts(reqs: list[Request], phases: int, n: int, rate: float) -> list[Counter[bytes]]:
    """Per phase, how many sessions started on each app prompt (named by its first key)."""
    phase_s = n / rate / phases
    by: list[Counter[bytes]] = [Counter() for _ in range(phases)]
    for r in reqs:
        if r.turn == 0:
            by[min(phases - 1, int(r.arrival_s / phase_s))][r.keys[0]] += 1
    return by


def test_diurnal_hot_set_shifts_between_phases() -> None:
    n = 8000
    reqs = synthetic_diurnal(n, num_phases=4, hot_prefixes=50, overlap=0.3, seed=1)
    first, second, *_, last = _phase_prompts(reqs, 4, n, 3.0)
    top = {k for k, _ in first.most_common(10)}
    assert not top & {k for k, _ in last.most_common(10)}
    assert len(set(first) & set(last)) < 0.2 * len(first)
    # Consecutive phases overlap.
    assert len(set(first) & set(second)) >= 5


@pytest.mark.parametrize(("overlap", "shared"), [(0.0, False), (1.0, True)])
def test_diurnal_overlap_bounds(overlap: float, shared: bool) -> None:
    n = 4000
    reqs = synthetic_diurnal(n, num_phases=3, hot_prefixes=20, overlap=overlap, seed=2)
    by = _phase_prompts(reqs, 3, n, 3.0)
    if shared:
        assert len(set[bytes]().union(*by)) <= 20
    else:
        assert not set(by[0]) & set(by[1]) and not set(by[1]) & set(by[2])


# --- bad parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "override", "match"),
    [
        ("agent", {"num_tool_prompts": 0}, "num_tool_prompts"),
        ("agent", {"tool_prompt_blocks": -1}, "tool_prompt_blocks"),
        ("agent", {"mean_steps": 0.5}, "mean_steps"),
        ("agent", {"call_tokens": 0.0}, "call_tokens"),
        ("agent", {"result_tokens": float("nan")}, "result_tokens"),
        ("agent", {"step_time_s": -1.0}, "step_time_s"),
        ("rag", {"num_chunks": 0}, "num_chunks"),
        ("rag", {"chunks_per_request": 11, "num_chunks": 10}, "chunks_per_request"),
        ("rag", {"zipf_s": -0.5}, "zipf_s"),
        ("rag", {"zipf_s": float("nan")}, "zipf_s"),
        ("rag", {"chunk_blocks": 0}, "chunk_blocks"),
        ("rag", {"order": "random"}, "order"),
        ("rag", {"question_tokens": 0.0}, "question_tokens"),
        ("scan", {"hot_prefixes": 0}, "hot_prefixes"),
        ("scan", {"scan_fraction": 1.5}, "scan_fraction"),
        ("scan", {"scan_fraction": True}, "scan_fraction"),
        ("scan", {"scan_blocks": 0.0}, "scan_blocks"),
        ("scan", {"hot_blocks": -2.0}, "hot_blocks"),
        ("diurnal", {"num_phases": 0}, "num_phases"),
        ("diurnal", {"overlap": -0.1}, "overlap"),
        ("diurnal", {"prefix_blocks": 0.0}, "prefix_blocks"),
        ("diurnal", {"mean_turns": 0.0}, "mean_turns"),
        ("diurnal", {"arrival_rate": 0.0}, "arrival_rate"),
        ("chat", {"num_system_prompts": 0}, "num_system_prompts"),
        ("mixed", {"scan_share": 1.5}, "scan_share"),
        ("mixed", {"scan_share": -0.1}, "scan_share"),
        ("mixed", {"scan_share": True}, "scan_share"),
        ("mixed", {"scan_share": float("nan")}, "scan_share"),
        ("mixed", {"system_prompt_blocks": -1}, "system_prompt_blocks"),
        ("mixed", {"num_system_prompts": 0}, "num_system_prompts"),
        ("mixed", {"hot_blocks": 0.0}, "hot_blocks"),
        ("mixed", {"blocks_per_turn": float("inf")}, "blocks_per_turn"),
        ("mixed", {"mean_turns": 0.5}, "mean_turns"),
    ],
)
def test_bad_parameters_are_named(name: str, override: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        trace_family(name).generate(10, **override)


@pytest.mark.parametrize("name", NAMES)
def test_bad_common_arguments_are_named(name: str) -> None:
    family = trace_family(name)
    with pytest.raises(ValueError, match="num_requests"):
        family.generate(-1)
    with pytest.raises(ValueError, match="block_size"):
        family.generate(10, block_size=0)
    with pytest.raises(ValueError, match="'nonsense'"):
        family.generate(10, nonsense=1)


def test_a_seed_must_be_an_int() -> None:
    with pytest.raises(ValueError, match="seed"):
        synthetic_scan(10, seed="3")  # type: ignore[arg-type]


def test_an_unknown_family_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*chat, agent, rag, scan, diurnal, mixed"):
        trace_family("nope")


# --- the replay's family sources ---------------------------------------------------------


def test_parse_a_family_source() -> None:
    source = parse_family_source("family:agent:20000:seed=3")
    assert source == FamilySource("agent", 20000, 3)
    assert str(source) == "family:agent:20000:seed=3"
    rag = parse_family_source("family:rag:zipf_s=1.2:order=id:num_chunks=500")
    assert rag == FamilySource(
        "rag", None, None, (("zipf_s", 1.2), ("order", "id"), ("num_chunks", 500))
    )
    assert parse_family_source(str(rag)) == rag
    assert parse_family_source("family:scan") == FamilySource("scan")


def test_a_family_source_makes_its_requests() -> None:
    source = parse_family_source("family:rag:700:num_chunks=300")
    reqs = source.requests(seed=5, block_size=128, limit=400)
    assert reqs == synthetic_rag(400, num_chunks=300, block_size=128, seed=5)
    # Its own seed wins over the caller's.
    seeded = parse_family_source("family:rag:300:seed=1")
    assert seeded.requests(seed=9) == synthetic_rag(300, seed=1)
    assert FAMILY_REQUESTS == 20_000


@pytest.mark.parametrize(
    ("text", "part"),
    [
        ("family", "expected family:NAME"),
        ("family:", "expected family:NAME"),
        ("family:nope:100", "unknown trace family 'nope'"),
        ("family:rag:lots", "got 'lots'"),
        ("family:rag:0", "got '0'"),
        ("family:rag:100:200", "expected PARAM=VALUE, got '200'"),
        ("family:rag:100:zipf=1", "no parameter 'zipf'"),
        ("family:rag:100:zipf_s=steep", "zipf_s takes a number, got 'steep'"),
        ("family:rag:100:num_chunks=1.5", "num_chunks takes an integer, got '1.5'"),
        ("family:rag:100:zipf_s=-1", "zipf_s must be"),
        ("family:rag:100:order=random", "order must be one of score, id"),
        ("family:rag:100:seed=x", "seed takes an integer, got 'x'"),
        ("family:rag:100:seed=1:seed=2", "seed is given twice"),
        ("family:rag:100:zipf_s=1:zipf_s=2", "zipf_s is given twice"),
        ("family:rag:100:block_size=16", "--block-size"),
    ],
)
def test_a_bad_family_source_names_the_bad_part(text: str, part: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_family_source(text)
    msg = str(info.value)
    assert msg.startswith(repr(text)) and part in msg, msg


def test_the_replay_command_runs_a_family(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "family:rag:300", "--capacity", "10%", "--policy", "lru", "arc", "kv"]
    assert main([*argv, "--no-bound", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "family:rag:300: 300 requests" in out and "arc" in out


def test_the_replay_command_names_a_bad_family_source(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["replay", "family:rag:100:zipf=2", "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "TRACE: 'family:rag:100:zipf=2': the rag family has no parameter 'zipf'" in err


def test_the_replay_help_lists_the_families(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    out = capsys.readouterr().out
    assert "family:NAME[:N][:PARAM=VALUE]" in out
    for name, family in families().items():
        assert f"  {name:<8} {family.summary}" in out
