"""Workloads: the synthetic generators (deterministic, prefix-chained, shared where they
should be) and the Mooncake trace loader (exact keys, strict about malformed lines)."""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from asyncoffload.keys import (
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from asyncoffload.workloads import (
    Request,
    TraceFormatError,
    iter_mooncake,
    load_block_trace,
    load_mooncake,
    summarize,
    synthetic_chat,
    synthetic_sessions,
)
from tests.helpers import trace_path

SMALL: dict[str, Any] = dict(
    num_system_prompts=3,
    system_prompt_blocks=4,
    turns=4,
    blocks_per_turn=2.0,
    output_tokens=40.0,
    block_size=16,
    arrival_rate=50.0,
    think_time_s=0.5,
)


def _sessions(reqs: list[Request]) -> dict[str, list[Request]]:
    by: dict[str, list[Request]] = defaultdict(list)
    for r in reqs:
        by[r.session_id].append(r)
    return by


def test_deterministic_for_a_seed() -> None:
    a = synthetic_chat(200, seed=7, **SMALL)
    b = synthetic_chat(200, seed=7, **SMALL)
    c = synthetic_chat(200, seed=8, **SMALL)
    assert a == b
    assert [r.keys for r in a] != [r.keys for r in c]


def test_count_order_and_token_counts() -> None:
    reqs = synthetic_chat(300, seed=1, **SMALL)
    assert len(reqs) == 300
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] >= 0
    assert len({r.req_id for r in reqs}) == len(reqs)
    for r in reqs:
        assert len(r.keys) == r.input_tokens // 16 == r.num_blocks
        assert r.output_tokens >= 1
        assert all(isinstance(k, bytes) for k in r.keys)
        assert len(set(r.keys)) == len(r.keys)
        assert 0 <= r.turn < SMALL["turns"]


def test_turns_extend_the_conversation() -> None:
    reqs = synthetic_chat(300, seed=2, **SMALL)
    for turns in _sessions(reqs).values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, cur in itertools.pairwise(turns):
            assert cur.arrival_s >= prev.arrival_s
            # Prompt k+1 = prompt k + reply k + a new user message (each >= 1 token).
            assert cur.input_tokens >= prev.input_tokens + prev.output_tokens + 1
            assert cur.keys[: len(prev.keys)] == prev.keys


def test_system_prompts_are_shared_across_sessions() -> None:
    reqs = synthetic_chat(400, seed=3, **SMALL)
    spb = SMALL["system_prompt_blocks"]
    firsts = [turns[0] for turns in _sessions(reqs).values()]
    groups: dict[tuple[OffloadKey, ...], list[Request]] = defaultdict(list)
    for r in firsts:
        groups[r.keys[:spb]].append(r)
    assert len(groups) == SMALL["num_system_prompts"]
    # Different system prompts differ from their first block on.
    assert len({prefix[0] for prefix in groups}) == SMALL["num_system_prompts"]
    for members in groups.values():
        assert len(members) > 1
        # Past the system prompt, every session is its own.
        tails = [r.keys[spb] for r in members if len(r.keys) > spb]
        assert len(set(tails)) == len(tails)


def _assert_prefix_chained(reqs: list[Request]) -> None:
    """A key stands for its whole prefix: wherever it appears, the key before it agrees
    (and so, by induction, every key before it)."""
    parent_of: dict[OffloadKey, OffloadKey | None] = {}
    for r in reqs:
        for parent, key in zip((None, *r.keys), r.keys):
            assert parent_of.setdefault(key, parent) == parent, r.req_id


def test_keys_are_prefix_chained() -> None:
    _assert_prefix_chained(synthetic_chat(300, seed=4, **SMALL))


def test_summary_and_rate() -> None:
    reqs = synthetic_chat(500, seed=5, **SMALL)
    s = summarize(reqs)
    assert s.requests == 500
    assert s.total_blocks == sum(len(r.keys) for r in reqs)
    assert s.unique_blocks == len({k for r in reqs for k in r.keys})
    assert s.max_request_blocks == max(len(r.keys) for r in reqs)
    assert s.input_tokens == sum(r.input_tokens for r in reqs)
    assert s.sessions == len(_sessions(reqs))
    assert 0.3 < s.reusable_fraction < 1.0
    # Poisson arrivals at about arrival_rate per second.
    rate = s.requests / s.duration_s
    assert SMALL["arrival_rate"] / 2 < rate < SMALL["arrival_rate"] * 2


def test_edge_cases() -> None:
    assert synthetic_chat(0, **SMALL) == []
    assert summarize([]).total_blocks == 0
    # No system prompt, no think time: turns share an arrival and keep their order.
    reqs = synthetic_chat(50, **{**SMALL, "system_prompt_blocks": 0, "think_time_s": 0.0})
    for turns in _sessions(reqs).values():
        assert len({r.arrival_s for r in turns}) == 1
        assert [r.turn for r in turns] == list(range(len(turns)))
    # A block larger than any prompt: no keys at all, still consistent.
    tiny_turns = {"block_size": 4096, "system_prompt_blocks": 0, "blocks_per_turn": 0.01}
    big = synthetic_chat(20, **{**SMALL, **tiny_turns})
    assert all(r.keys == () and r.input_tokens < 4096 for r in big)


def test_request_is_frozen_with_slots() -> None:
    r = synthetic_chat(1, **SMALL)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.arrival_s = 1.0  # type: ignore[misc]
    assert not hasattr(r, "__dict__")
    assert hash(r) == hash(dataclasses.replace(r))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"num_system_prompts": 0}, "num_system_prompts"),
        ({"turns": 0}, "turns"),
        ({"block_size": 0}, "block_size"),
        ({"system_prompt_blocks": -1}, "system_prompt_blocks"),
        ({"blocks_per_turn": 0.0}, "blocks_per_turn"),
        ({"output_tokens": float("nan")}, "output_tokens"),
        ({"arrival_rate": -1.0}, "arrival_rate"),
        ({"think_time_s": -0.1}, "think_time_s"),
    ],
)
def test_bad_arguments(override: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        synthetic_chat(10, **{**SMALL, **override})
    with pytest.raises(ValueError, match="num_requests"):
        synthetic_chat(-1, **SMALL)


# --- Request.block_tokens -------------------------------------------------------------


def _keys(*ids: int, group_idx: int = 0) -> tuple[OffloadKey, ...]:
    return tuple(make_offload_key(i.to_bytes(8, "big"), group_idx) for i in ids)


@pytest.mark.parametrize(
    ("input_tokens", "n_keys", "block_size", "tokens", "partial"),
    [
        (1100, 3, 512, [512, 512, 76], True),  # trace: the last block partial
        (1024, 2, 512, [512, 512], False),  # trace: an exact multiple
        (1, 1, 512, [1], True),
        (40, 2, 16, [16, 16], False),  # synthetic_chat: the partial tail has no key
        (10, 0, 16, [], False),
    ],
)
def test_block_tokens(
    input_tokens: int, n_keys: int, block_size: int, tokens: list[int], partial: bool
) -> None:
    r = Request("r", 0.0, _keys(*range(n_keys)), input_tokens, 1, block_size=block_size)
    assert r.block_tokens() == tokens
    assert r.last_block_partial is partial


def test_synthetic_chat_blocks_are_full() -> None:
    reqs = synthetic_chat(100, seed=9, **{**SMALL, "block_size": 8})
    for r in reqs:
        assert r.block_size == 8
        assert not r.last_block_partial
        assert r.block_tokens() == [8] * len(r.keys)
        assert 0 <= r.input_tokens - sum(r.block_tokens()) < 8


# --- load_mooncake ---------------------------------------------------------------------

MAX_ID = 2**64 - 1


def _line(
    timestamp: Any = 100, input_length: Any = 1100, output_length: Any = 5, hash_ids: Any = None
) -> str:
    if hash_ids is None:
        hash_ids = [0, 1, 2]
    return json.dumps(
        {
            "timestamp": timestamp,
            "input_length": input_length,
            "output_length": output_length,
            "hash_ids": hash_ids,
        }
    )


def _write(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(b"".join(x if isinstance(x, bytes) else x.encode() + b"\n" for x in lines))
    return path


def _good_trace(tmp_path: Path) -> Path:
    return _write(
        tmp_path / "tiny.jsonl",
        _line(0, 1100, 5, [0, 1, 2]),
        "",
        b"   \r\n",
        _line(250, 1024, 0, [0, 1]).encode() + b"\r\n",
        # Any field order; unknown fields are ignored.
        json.dumps(
            {
                "hash_ids": [0, 3, MAX_ID],
                "extra": "ignored",
                "output_length": 7,
                "input_length": 1025,
                "timestamp": 250,
            }
        ),
        _line(1500, 10, 3, [9]),
    )


def test_load_mooncake(tmp_path: Path) -> None:
    path = _good_trace(tmp_path)
    reqs = load_mooncake(path)
    assert [r.req_id for r in reqs] == ["tiny:1", "tiny:4", "tiny:5", "tiny:6"]
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 0.25, 1.5]
    assert [r.input_tokens for r in reqs] == [1100, 1024, 1025, 10]
    assert [r.output_tokens for r in reqs] == [5, 0, 7, 3]
    assert [r.keys for r in reqs] == [_keys(0, 1, 2), _keys(0, 1), _keys(0, 3, MAX_ID), _keys(9)]
    assert [r.block_tokens() for r in reqs] == [[512, 512, 76], [512, 512], [512, 512, 1], [10]]
    assert [r.last_block_partial for r in reqs] == [True, False, True, True]
    assert {(r.session_id, r.turn, r.block_size) for r in reqs} == {("", 0, 512)}
    # Equal ids, equal keys: the first two requests share their first two blocks.
    assert summarize(reqs).unique_blocks == 6
    assert load_mooncake(str(path)) == reqs
    assert list(iter_mooncake(path)) == reqs


def test_load_mooncake_limit_and_group(tmp_path: Path) -> None:
    path = _good_trace(tmp_path)
    full = load_mooncake(path)
    assert load_mooncake(path, limit=2) == full[:2]
    assert load_mooncake(path, limit=100) == full
    # The limit stops reading: a bad line after it is never seen.
    bad = _write(tmp_path / "bad.jsonl", _line(), _line(), "not json")
    assert len(load_mooncake(bad, limit=2)) == 2
    with pytest.raises(TraceFormatError):
        load_mooncake(bad, limit=3)
    grouped = load_mooncake(path, group_idx=3)
    for r, g in zip(full, grouped, strict=True):
        assert [get_offload_group_idx(k) for k in g.keys] == [3] * len(g.keys)
        assert [get_offload_block_hash(k) for k in g.keys] == [
            get_offload_block_hash(k) for k in r.keys
        ]


def test_load_mooncake_block_size(tmp_path: Path) -> None:
    path = _write(tmp_path / "b4.jsonl", _line(0, 9, 1, [5, 6, 7]), _line(1, 8, 1, [5, 6]))
    reqs = load_mooncake(path, block_size=4)
    assert [r.block_tokens() for r in reqs] == [[4, 4, 1], [4, 4]]
    # The same lines at the default 512 tokens a block have too many ids.
    with pytest.raises(TraceFormatError, match=r"b4\.jsonl:1: hash_ids has 3 ids"):
        load_mooncake(path)


def test_empty_trace(tmp_path: Path) -> None:
    assert load_mooncake(_write(tmp_path / "empty.jsonl", "", "  ")) == []


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        pytest.param('{"timestamp": 0,', "invalid JSON", id="truncated-json"),
        pytest.param(b"\xff\xfe{}\n", "invalid JSON", id="not-utf8"),
        pytest.param("[1, 2]", "expected a JSON object, got array", id="not-object"),
        pytest.param("42", "expected a JSON object, got integer", id="scalar"),
        pytest.param('{"input_length": 1, "output_length": 1, "hash_ids": [0]}',
                     "missing field 'timestamp'", id="missing-timestamp"),
        pytest.param('{"timestamp": 200, "input_length": 1, "output_length": 1}',
                     "missing field 'hash_ids'", id="missing-hash-ids"),
        pytest.param(_line(timestamp=True), "timestamp must be an integer, got boolean true",
                     id="bool-timestamp"),
        pytest.param(_line(input_length=1100.0), "input_length must be an integer, got number",
                     id="float-length"),
        pytest.param(_line(output_length="5"), 'output_length must be an integer, got string "5"',
                     id="str-length"),
        pytest.param(_line(output_length=None), "output_length must be an integer, got null",
                     id="null-length"),
        pytest.param(_line(output_length=-1), "output_length must be >= 0, got -1",
                     id="negative-length"),
        pytest.param(_line(timestamp=-5), "timestamp must be >= 0, got -5",
                     id="negative-timestamp"),
        pytest.param(_line(hash_ids="0,1,2"), "hash_ids must be an array of integers",
                     id="ids-not-list"),
        pytest.param(_line(input_length=0, hash_ids=[]), "hash_ids is empty", id="ids-empty"),
        pytest.param(_line(hash_ids=[0, True, 2]), "hash_ids[1] must be an integer, got boolean",
                     id="bool-id"),
        pytest.param(_line(hash_ids=[0, 1, 2.5]), "hash_ids[2] must be an integer, got number",
                     id="float-id"),
        pytest.param(_line(hash_ids=[0, -1, 2]), "hash_ids[1] = -1 is outside [0, 2**64)",
                     id="negative-id"),
        pytest.param(_line(hash_ids=[0, 1, 2**64]), f"hash_ids[2] = {2**64} is outside",
                     id="id-too-large"),
        pytest.param(_line(input_length=1100, hash_ids=[0, 1]),
                     "hash_ids has 2 ids, but input_length 1100 makes 3 blocks of 512 tokens",
                     id="too-few-ids"),
        pytest.param(_line(input_length=1024, hash_ids=[0, 1, 2]),
                     "hash_ids has 3 ids, but input_length 1024 makes 2 blocks",
                     id="too-many-ids"),
        pytest.param(_line(timestamp=99), "timestamp 99 is earlier than the previous request's 100",
                     id="timestamp-backwards"),
    ],
)  # fmt: skip
def test_malformed_line(tmp_path: Path, line: str | bytes, problem: str) -> None:
    # Line 1 is good (timestamp 100), line 2 blank, line 3 the bad one.
    path = _write(tmp_path / "bad.jsonl", _line(timestamp=100), "", line, _line(timestamp=200))
    with pytest.raises(TraceFormatError) as info:
        load_mooncake(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:3: "), msg
    assert problem in msg
    assert isinstance(info.value, ValueError)


def _bad_third_line(tmp_path: Path, line: str | bytes) -> str:
    """The TraceFormatError message of a trace whose line 3 is ``line``."""
    path = _write(tmp_path / "bad.jsonl", _line(timestamp=100), "", line)
    with pytest.raises(TraceFormatError) as info:
        load_mooncake(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:3: "), msg
    return msg


def test_a_number_longer_than_int_converts_names_the_line(tmp_path: Path) -> None:
    # json.loads raises a bare ValueError (int's 4,300-digit limit) for it.
    msg = _bad_third_line(tmp_path, '{"timestamp": ' + "9" * 5000 + "}")
    assert "a number of more than 4300 digits" in msg


def test_nesting_deeper_than_the_parser_follows_names_the_line(tmp_path: Path) -> None:
    # json.loads raises RecursionError for it.
    msg = _bad_third_line(tmp_path, '{"hash_ids": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nested too deeply" in msg


def test_a_count_past_int64_names_the_line(tmp_path: Path) -> None:
    # A timestamp past float range made timestamp / 1000 raise OverflowError.
    msg = _bad_third_line(tmp_path, _line(timestamp=10**400))
    assert "timestamp must be < 2**63, got 10000000...00000000 (401 digits)" in msg


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"a": "\x01"}', "invalid JSON: Invalid control character at column 8"),
        (b'{"a": "open', "invalid JSON: Unterminated string starting at column 7"),  # no newline
    ],
)
def test_json_error_positions_say_at_once(tmp_path: Path, line: str | bytes, problem: str) -> None:
    msg = _bad_third_line(tmp_path, line)
    assert problem in msg and "at at" not in msg


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": True}, ValueError, "block_size"),
        ({"block_size": 512.0}, ValueError, "block_size"),
        ({"limit": 0}, ValueError, "limit"),
        ({"limit": -3}, ValueError, "limit"),
        ({"group_idx": -1}, ValueError, "group_idx"),
        ({"group_idx": 1.0}, TypeError, "group_idx"),
    ],
)
def test_mooncake_bad_arguments(
    tmp_path: Path, kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    path = _good_trace(tmp_path)
    with pytest.raises(exc, match=match):
        load_mooncake(path, **kwargs)
    with pytest.raises(exc, match=match):
        iter_mooncake(path, **kwargs)  # checked before iterating


def test_mooncake_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_mooncake(tmp_path / "nope.jsonl")


def test_load_block_trace_reads_ids_alone_plain_or_gzipped(tmp_path: Path) -> None:
    # kv-cache-tester's format: a timestamp and the ids of full 64-token blocks.
    lines = [
        json.dumps({"timestamp": 5, "hash_ids": [1, 2, 3]}),
        "",
        json.dumps({"hash_ids": [1, 2], "timestamp": 7, "extra": "ignored"}),
    ]
    plain = _write(tmp_path / "cc.jsonl", *lines)
    packed = tmp_path / "cc.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    reqs = load_block_trace(packed)
    assert reqs == load_block_trace(plain)
    assert [r.req_id for r in reqs] == ["cc:1", "cc:3"]
    assert [r.arrival_s for r in reqs] == [0.005, 0.007]
    assert [r.keys for r in reqs] == [_keys(1, 2, 3), _keys(1, 2)]
    assert [r.block_tokens() for r in reqs] == [[64, 64, 64], [64, 64]]
    assert [r.output_tokens for r in reqs] == [0, 0]
    # One key object per id: the second request's keys are the first's.
    assert all(a is b for a, b in zip(reqs[0].keys, reqs[1].keys, strict=False))
    assert load_block_trace(packed, limit=1) == reqs[:1]
    assert [r.block_tokens() for r in load_block_trace(plain, block_size=16)][1] == [16, 16]
    # A Mooncake reader takes the compressed file too, and still wants its lengths.
    with pytest.raises(TraceFormatError, match=r"cc\.jsonl\.gz:1: missing field 'input_length'"):
        load_mooncake(packed)


def test_load_block_trace_names_what_is_wrong(tmp_path: Path) -> None:
    bad = _write(
        tmp_path / "bad.jsonl",
        json.dumps({"timestamp": 1, "hash_ids": [1]}),
        json.dumps({"timestamp": 2, "hash_ids": []}),
    )
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2: hash_ids is empty"):
        load_block_trace(bad)
    with pytest.raises(TraceFormatError, match=r"missing field 'timestamp'"):
        load_block_trace(_write(tmp_path / "t.jsonl", json.dumps({"hash_ids": [1]})))
    # A compressed file cut short: the line it broke in, not an EOFError.
    body = "".join(json.dumps({"timestamp": i, "hash_ids": [i]}) + "\n" for i in range(2000))
    whole = gzip.compress(body.encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceFormatError, match=r"cut\.jsonl\.gz:\d+: damaged gzip data"):
        load_block_trace(cut)
    with pytest.raises(ValueError, match="block_size"):
        load_block_trace(bad, block_size=0)
    with pytest.raises(ValueError, match="limit"):
        load_block_trace(bad, limit=0)


REAL_TRACE = trace_path()
CLAUDE_TRACE = trace_path("claude_code_sessions.jsonl.gz")


@pytest.mark.long
@pytest.mark.skipif(not CLAUDE_TRACE.exists(), reason=f"{CLAUDE_TRACE} is absent")
def test_real_claude_code_sessions() -> None:
    # ../shared/traces/PROVENANCE.md: 3,167 requests, 6,058,890 block references,
    # 223,469 unique.
    s = summarize(load_block_trace(CLAUDE_TRACE))
    assert (s.requests, s.total_blocks, s.unique_blocks) == (3_167, 6_058_890, 223_469)


@pytest.mark.skipif(not REAL_TRACE.exists(), reason=f"{REAL_TRACE} is absent")
def test_real_conversation_trace() -> None:
    reqs = load_mooncake(REAL_TRACE)
    s = summarize(reqs)
    assert s.requests == 12_031
    assert s.total_blocks == 288_500
    assert s.unique_blocks == 182_790
    assert s.duration_s == pytest.approx(3536.999)
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals)
    first = _keys(0)[0]
    for r in reqs:
        assert len(r.keys) == math.ceil(r.input_tokens / 512)
        assert sum(r.block_tokens()) == r.input_tokens
        assert r.keys[0] == first  # every conversation opens with the same system block
    assert sum(r.last_block_partial for r in reqs) == 12_031 - 22
    _assert_prefix_chained(reqs)


# --- synthetic_sessions ---------------------------------------------------------------

SESS: dict[str, Any] = dict(
    num_system_prompts=5,
    system_prompt_blocks=3,
    mean_turns=3.0,
    blocks_per_turn=2.0,
    output_blocks=0.5,
    block_size=64,
    arrival_rate=20.0,
    think_time_s=2.0,
)


def test_sessions_deterministic_for_a_seed() -> None:
    a = synthetic_sessions(500, seed=7, **SESS)
    assert a == synthetic_sessions(500, seed=7, **SESS)
    b = synthetic_sessions(500, seed=8, **SESS)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]
    # Seeds namespace the keys: two workloads never share one.
    assert not {k for r in a for k in r.keys} & {k for r in b for k in r.keys}


def test_sessions_shape() -> None:
    bs = SESS["block_size"]
    reqs = synthetic_sessions(2000, seed=1, **SESS)
    assert len(reqs) == 2000
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] >= 0
    assert len({r.req_id for r in reqs}) == len(reqs)
    for r in reqs:
        assert r.block_size == bs
        # Mooncake-style: every block has a key, the last one partial unless exact.
        assert len(r.keys) == math.ceil(r.input_tokens / bs)
        assert sum(r.block_tokens()) == r.input_tokens
        assert len(set(r.keys)) == len(r.keys)
        assert r.output_tokens >= 1
    assert sum(r.last_block_partial for r in reqs) > 0.9 * len(reqs)
    _assert_prefix_chained(reqs)


def test_sessions_turns_extend_the_conversation() -> None:
    bs = SESS["block_size"]
    reqs = synthetic_sessions(2000, seed=2, **SESS)
    by = _sessions(reqs)
    assert max(len(turns) for turns in by.values()) >= 4
    for turns in by.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, cur in itertools.pairwise(turns):
            assert cur.arrival_s >= prev.arrival_s
            # Prompt k+1 = prompt k + reply k + a new user message (each >= 1 token).
            assert cur.input_tokens >= prev.input_tokens + prev.output_tokens + 1
            # It shares prompt k's full blocks; the rest, partial block included, is new.
            full = prev.input_tokens // bs
            assert cur.keys[:full] == prev.keys[:full]
            assert not set(cur.keys[full:]) & set(prev.keys)


def test_sessions_share_system_prompts() -> None:
    spb, n_prompts = SESS["system_prompt_blocks"], SESS["num_system_prompts"]
    reqs = synthetic_sessions(3000, seed=3, **SESS)
    by = _sessions(reqs)
    groups: dict[tuple[OffloadKey, ...], int] = defaultdict(int)
    for turns in by.values():
        groups[turns[0].keys[:spb]] += 1
    assert len(groups) == n_prompts
    assert len({prefix[0] for prefix in groups}) == n_prompts
    # Zipf popularity: the favourite is picked far more often than the rarest.
    assert max(groups.values()) > 2 * min(groups.values())
    # Past the system prompt, every session is its own.
    owner: dict[OffloadKey, str] = {}
    for sid, turns in by.items():
        for r in turns:
            for key in r.keys[spb:]:
                assert owner.setdefault(key, sid) == sid


def test_sessions_poisson_arrivals() -> None:
    rate, mean_turns = 10.0, 3.0
    params = {**SESS, "arrival_rate": rate, "mean_turns": mean_turns, "think_time_s": 1.0}
    reqs = synthetic_sessions(30_000, seed=4, **params)
    duration = reqs[-1].arrival_s
    assert len(reqs) / duration == pytest.approx(rate, rel=0.05)
    by = _sessions(reqs)
    # Sessions start as a Poisson process: exponential gaps (mean = sd) of mean_turns / rate.
    starts = sorted(turns[0].arrival_s for turns in by.values())
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert statistics.fmean(gaps) == pytest.approx(mean_turns / rate, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(mean_turns / rate, rel=0.1)
    # Sessions that started early enough to finish have mean_turns turns on average.
    done = [len(t) for t in by.values() if t[0].arrival_s < duration / 2]
    assert statistics.fmean(done) == pytest.approx(mean_turns, rel=0.05)
    assert min(done) == 1
    # Think times between turns are exponential (mean = sd = think_time_s).
    thinks = [b.arrival_s - a.arrival_s for t in by.values() for a, b in itertools.pairwise(t)]
    assert statistics.fmean(thinks) == pytest.approx(params["think_time_s"], rel=0.05)
    assert statistics.stdev(thinks) == pytest.approx(params["think_time_s"], rel=0.1)


def test_sessions_edge_cases() -> None:
    assert synthetic_sessions(0, **SESS) == []
    one_turn = synthetic_sessions(300, seed=5, **{**SESS, "mean_turns": 1.0})
    assert {r.turn for r in one_turn} == {0}
    assert len(_sessions(one_turn)) == 300
    # No system prompt, no think time: turns share an arrival and share nothing across sessions.
    reqs = synthetic_sessions(
        300, seed=6, **{**SESS, "system_prompt_blocks": 0, "think_time_s": 0.0}
    )
    for turns in _sessions(reqs).values():
        assert len({r.arrival_s for r in turns}) == 1
    assert summarize([r for r in reqs if r.turn == 0]).reusable_fraction == 0.0


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"num_system_prompts": 0}, "num_system_prompts"),
        ({"system_prompt_blocks": -1}, "system_prompt_blocks"),
        ({"system_prompt_blocks": 2.0}, "system_prompt_blocks"),
        ({"mean_turns": 0.5}, "mean_turns"),
        ({"mean_turns": float("inf")}, "mean_turns"),
        ({"blocks_per_turn": 0.0}, "blocks_per_turn"),
        ({"output_blocks": float("nan")}, "output_blocks"),
        ({"block_size": 0}, "block_size"),
        ({"arrival_rate": -1.0}, "arrival_rate"),
        ({"think_time_s": -0.1}, "think_time_s"),
    ],
)
def test_sessions_bad_arguments(override: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        synthetic_sessions(10, **{**SESS, **override})
    with pytest.raises(ValueError, match="num_requests"):
        synthetic_sessions(-1, **SESS)
