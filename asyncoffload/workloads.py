"""Workloads: streams of requests, each a prompt's prefix-chained block keys and an arrival time.

A :class:`Request` is what a serving loop needs to exercise an offload engine: when it
arrives, the keys of its prompt's blocks in order (prefix-chained, so equal keys mean
equal prefixes), and how many tokens it reads and writes. Generators and trace loaders
all produce ``list[Request]`` sorted by arrival, so a serving loop or benchmark takes any
of them.

:func:`synthetic_chat` makes a multi-turn chat workload from random token ids: sessions
share a few system prompts, and every turn's prompt is the whole conversation so far plus
a new user message, so prefixes are shared within a session (turn after turn) and across
sessions (the system prompt). Only its full blocks have keys.

:func:`load_mooncake` (and :func:`iter_mooncake`) read a Mooncake request trace (JSONL,
one request a line with ``hash_ids`` for its 512-token blocks, the last one usually
partial); :func:`load_block_trace` a trace of block ids alone (kv-cache-tester's Claude
Code sessions: 64-token blocks, gzip-compressed). :func:`synthetic_sessions` makes
workloads of that shape without token ids, fast enough for hundreds of thousands of
requests, to check conclusions beyond one trace.

:func:`families` names the trace families a cache policy is judged on, each a generator
of that kind, seeded: ``chat`` (:func:`synthetic_sessions`), ``agent`` (tool loops on long
shared tool prompts, :func:`synthetic_agent`), ``rag`` (chunks of Zipf popularity,
:func:`synthetic_rag`), ``scan`` (one-off scans through a hot set,
:func:`synthetic_scan`), ``diurnal`` (a hot set that shifts in phases,
:func:`synthetic_diurnal`) and ``mixed`` (scans and chat on long system prompts
interleaved, :func:`synthetic_mixed`).

Every generator runs the same session-and-arrival loop: sessions start as a Poisson
process, a session's turns come an exponential think time apart (single-request families:
one turn, no session), and generation stops once the ``num_requests`` earliest requests
are known. A family adds its prompt builder (:mod:`asyncoffload.workload_families`): what
each turn's prompt holds, how many turns a session has, what a reply adds.
"""

from __future__ import annotations

import gzip
import heapq
import inspect
import json
import os
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from asyncoffload import workload_families as _builders
from asyncoffload.keys import OffloadKey, make_offload_key
from asyncoffload.workload_families import (
    RAG_ORDERS,
    Params,
    Plan,
    check_args,
    check_int,
    think_time,
)

__all__ = [
    "RAG_ORDERS",
    "Request",
    "TraceFamily",
    "TraceFormatError",
    "WorkloadSummary",
    "families",
    "iter_mooncake",
    "load_block_trace",
    "load_mooncake",
    "summarize",
    "synthetic_agent",
    "synthetic_chat",
    "synthetic_diurnal",
    "synthetic_mixed",
    "synthetic_rag",
    "synthetic_scan",
    "synthetic_sessions",
    "trace_family",
]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload.

    ``keys`` are the offload keys of the prompt's blocks of ``block_size`` tokens, in
    order. Every block but the last is full; the last may be partial (trace sources and
    :func:`synthetic_sessions`: ``len(keys) == ceil(input_tokens / block_size)``) or a
    trailing partial block may have no key (:func:`synthetic_chat`:
    ``len(keys) == input_tokens // block_size``). Either way
    ``block_size * (len(keys) - 1) < input_tokens`` when there are keys.
    """

    req_id: str
    #: Seconds from the start of the workload.
    arrival_s: float
    keys: tuple[OffloadKey, ...]
    #: Prompt length in tokens.
    input_tokens: int
    #: Tokens the request generates.
    output_tokens: int
    #: The conversation it belongs to ("" when the source has none).
    session_id: str = ""
    #: Its position in the session, from 0.
    turn: int = 0
    #: Tokens per block.
    block_size: int = 16

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def last_block_partial(self) -> bool:
        """Whether the last keyed block holds fewer than ``block_size`` tokens."""
        return self.input_tokens < self.block_size * len(self.keys)

    def block_tokens(self) -> list[int]:
        """Tokens in each keyed block: ``block_size`` for all but the last, which holds
        what is left of the prompt, up to ``block_size`` (tokens past the last key, a
        partial block without a key, are not counted)."""
        n = len(self.keys)
        if not n:
            return []
        sizes = [self.block_size] * n
        sizes[-1] = min(self.block_size, self.input_tokens - self.block_size * (n - 1))
        return sizes


@dataclass(frozen=True, slots=True)
class WorkloadSummary:
    """Aggregate shape of a workload."""

    requests: int
    sessions: int
    #: Blocks summed over every request's prompt.
    total_blocks: int
    #: Distinct keys over the whole workload.
    unique_blocks: int
    max_request_blocks: int
    input_tokens: int
    output_tokens: int
    #: Arrival of the last request, seconds.
    duration_s: float

    @property
    def reusable_fraction(self) -> float:
        """Share of prompt blocks seen before in the workload: the hit rate of an
        infinite cache with instant stores."""
        if self.total_blocks == 0:
            return 0.0
        return 1.0 - self.unique_blocks / self.total_blocks


def summarize(requests: Sequence[Request]) -> WorkloadSummary:
    """Count what ``requests`` holds."""
    unique: set[OffloadKey] = set()
    total = max_blocks = in_tok = out_tok = 0
    sessions: set[str] = set()
    for req in requests:
        unique.update(req.keys)
        total += len(req.keys)
        max_blocks = max(max_blocks, len(req.keys))
        in_tok += req.input_tokens
        out_tok += req.output_tokens
        sessions.add(req.session_id)
    return WorkloadSummary(
        requests=len(requests),
        sessions=len(sessions),
        total_blocks=total,
        unique_blocks=len(unique),
        max_request_blocks=max_blocks,
        input_tokens=in_tok,
        output_tokens=out_tok,
        duration_s=requests[-1].arrival_s if requests else 0.0,
    )


class _Earliest:
    """The ``n`` earliest arrival times seen so far, to cut a workload at ``n`` requests.

    Generators make sessions in start order and stop at the first start that
    :meth:`too_late` rejects; the ``n`` earliest requests made by then are final.
    """

    __slots__ = ("_heap", "_n")

    def __init__(self, n: int) -> None:
        self._n = n
        #: Max-heap (negated).
        self._heap: list[float] = []

    def add(self, t: float) -> None:
        if len(self._heap) < self._n:
            heapq.heappush(self._heap, -t)
        elif t < -self._heap[0]:
            heapq.heapreplace(self._heap, -t)

    def too_late(self, t: float) -> bool:
        """Whether nothing arriving after ``t`` can be among the ``n`` earliest."""
        return len(self._heap) == self._n and t > -self._heap[0]


def _generate(build: Callable[[Params], Plan], params: Params) -> list[Request]:
    """The requests of a generator: ``params`` are its arguments (its ``locals()`` on
    entry), checked, and ``build`` its family's prompts.

    Sessions start as a Poisson process of the plan's rate and open on their family's
    prompts (:class:`~asyncoffload.workload_families.Dialog`); a session's turns come an
    exponential think time apart. Sessions are made in start order until no later start
    can be among the ``num_requests`` earliest requests, which are returned in arrival
    order (the sessions still open then are cut short).
    """
    check_args(params)
    num_requests, block_size = params["num_requests"], params["block_size"]
    plan = build(params)
    rng = plan.rng
    out: list[Request] = []
    earliest = _Earliest(num_requests)
    start = 0.0
    index = 0
    while num_requests:
        start += rng.expovariate(plan.session_rate)
        if earliest.too_late(start):
            break
        dialog = plan.open_session(start)
        t = start
        turn = 0
        while True:
            keys, input_tokens, output_tokens = dialog.prompt()
            name = f"{dialog.label}{index}"
            sessions = dialog.sessions
            out.append(
                Request(
                    req_id=f"{name}-t{turn}" if sessions else name,
                    arrival_s=t,
                    keys=tuple(keys),
                    input_tokens=input_tokens,
                    output_tokens=output_tokens,
                    session_id=name if sessions else "",
                    turn=turn,
                    block_size=block_size,
                )
            )
            earliest.add(t)
            if not dialog.follow(output_tokens):
                break
            turn += 1
            t += think_time(rng, plan.think_time_s)
        index += 1
    out.sort(key=lambda r: r.arrival_s)
    return out[:num_requests]


def synthetic_chat(
    num_requests: int,
    *,
    num_system_prompts: int = 4,
    system_prompt_blocks: int = 32,
    turns: int = 5,
    blocks_per_turn: float = 6.0,
    output_tokens: float = 128.0,
    block_size: int = 16,
    arrival_rate: float = 100.0,
    think_time_s: float = 1.0,
    vocab_size: int = 32_000,
    seed: int = 0,
) -> list[Request]:
    """A multi-turn chat workload of ``num_requests`` requests, sorted by arrival.

    Sessions start as a Poisson process (``arrival_rate / turns`` per second, so requests
    arrive at about ``arrival_rate`` per second) and each has ``turns`` turns (the
    sessions still open when the workload ends are cut short). A session picks one of
    ``num_system_prompts`` system prompts of ``system_prompt_blocks`` blocks; turn ``k``
    comes an exponential think time (mean ``think_time_s``) after turn ``k - 1`` and its
    prompt is the system prompt, every earlier user message and reply, and a new user
    message of about ``blocks_per_turn`` blocks (uniform, that mean). Replies are about
    ``output_tokens`` tokens (uniform, that mean).

    Token ids are random (``vocab_size``) and keys are their chained block hashes
    (:func:`~asyncoffload.hash_token_blocks`), so the result is deterministic for a
    ``seed``. Only full blocks have keys.
    """
    return _generate(_builders.chat, locals())


def synthetic_sessions(
    num_requests: int,
    *,
    num_system_prompts: int = 8,
    system_prompt_blocks: int = 4,
    mean_turns: float = 3.0,
    blocks_per_turn: float = 6.0,
    output_blocks: float = 1.0,
    block_size: int = 512,
    arrival_rate: float = 3.0,
    think_time_s: float = 120.0,
    seed: int = 0,
) -> list[Request]:
    """A Mooncake-style multi-turn workload of ``num_requests`` requests, sorted by
    arrival, made of keys alone (no token ids), so it is fast at any size.

    Sessions start as a Poisson process (``arrival_rate / mean_turns`` per second, so
    requests arrive at about ``arrival_rate`` per second) and have a geometric number of
    turns (at least 1, mean ``mean_turns``; the sessions still open when the workload
    ends are cut short). A session picks one of ``num_system_prompts`` system prompts of
    ``system_prompt_blocks`` full blocks, prompt ``i`` with probability proportional to
    ``1 / (i + 1)`` (Zipf). Turn ``k`` comes an exponential think time (mean
    ``think_time_s``) after turn ``k - 1``; its prompt is turn ``k - 1``'s prompt, its
    reply (about ``output_blocks`` blocks) and a new user message (about
    ``blocks_per_turn`` blocks), token counts uniform with those means.

    As in a Mooncake trace, every block of a prompt has a key and the last is usually
    partial: turn ``k`` shares turn ``k - 1``'s full blocks, and its later blocks
    (including the one that was turn ``k - 1``'s partial last block) get fresh keys.
    Keys are a counter under a namespace drawn from ``seed``, so workloads of different
    seeds share no key (nor with traces: the hash part is 16 bytes, not 8); the result is
    deterministic for a ``seed``.
    """
    return _generate(_builders.sessions, locals())


# --- trace families ------------------------------------------------------------------


def synthetic_agent(
    num_requests: int,
    *,
    num_tool_prompts: int = 4,
    tool_prompt_blocks: int = 16,
    task_blocks: float = 1.0,
    mean_steps: float = 10.0,
    call_tokens: float = 100.0,
    result_tokens: float = 400.0,
    block_size: int = 512,
    arrival_rate: float = 3.0,
    step_time_s: float = 20.0,
    seed: int = 0,
) -> list[Request]:
    """Tool-using agent loops: ``num_requests`` requests, sorted by arrival.

    Every agent run (a session) starts on one of ``num_tool_prompts`` long tool-definition
    prompts of ``tool_prompt_blocks`` full blocks (8k tokens by default: the system
    prompt and tools' JSON schemas of a coding or browsing agent), prompt ``i`` with
    probability proportional to ``1 / (i + 1)``, then a task of about ``task_blocks``
    blocks. It then loops over a geometric number of steps (at least 1, mean
    ``mean_steps``): each step is a request whose output is a tool call (about
    ``call_tokens`` tokens); the call and its result (about ``result_tokens`` tokens)
    are appended to the conversation, and the next step comes an exponential time (mean
    ``step_time_s``: the model's decode and the tool's run) later. So every request starts
    with one of a few long shared prefixes and re-reads its run's whole history, steps
    are short, and a run's blocks come back after about ``arrival_rate * step_time_s``
    other requests. Runs start as a Poisson process of ``arrival_rate / mean_steps`` per
    second. Token counts are uniform with the means given; the layout of blocks and
    keys is :func:`synthetic_sessions`' (the last block partial, re-keyed by the next
    step). Deterministic for a ``seed``.
    """
    return _generate(_builders.agent, locals())


def synthetic_rag(
    num_requests: int,
    *,
    num_chunks: int = 20_000,
    chunks_per_request: int = 4,
    zipf_s: float = 1.0,
    chunk_blocks: int = 1,
    order: str = "score",
    system_prompt_blocks: int = 2,
    question_tokens: float = 64.0,
    output_tokens: float = 256.0,
    block_size: int = 512,
    arrival_rate: float = 3.0,
    seed: int = 0,
) -> list[Request]:
    """Retrieval-augmented generation: ``num_requests`` single-turn requests, sorted by
    arrival (a Poisson process of ``arrival_rate`` per second), no sessions.

    A request's prompt is a system prompt of ``system_prompt_blocks`` full blocks shared
    by all, ``chunks_per_request`` distinct chunks retrieved from a corpus of
    ``num_chunks`` chunks of ``chunk_blocks`` full blocks each (512 tokens by default: a
    common chunk size), and a unique question of about ``question_tokens`` tokens
    (uniform, that mean; its blocks are never seen again). Chunk popularity is Zipf: the
    chunk of popularity rank ``r`` (from 0) is retrieved with weight ``(r + 1) **
    -zipf_s``, chunks drawn one after the other without replacement.

    Keys are prefix-chained, so a chunk is a hit only behind the same chunks: a chunk's
    keys are those of its text *after everything before it*, and the same chunk after
    a different prefix is new blocks (as in vLLM's prefix cache). ``order`` says how
    retrieved chunks are laid out, and so how chunk popularity shows up as prefix reuse:

    - ``"score"`` (default): in retrieval order, most relevant first, the order of the
      draws. Popular chunks are drawn first more often, so the most popular chunks
      often sit right after the system prompt and are reused there; a request reuses
      its first ``j`` chunks only when an earlier one retrieved the same ``j`` chunks
      in the same order, which grows rare fast with ``j``.
    - ``"id"``: sorted by chunk id (ids are a random permutation of popularity ranks),
      as servers that sort retrieved chunks to make equal sets share a prefix do: a
      chunk is reused behind the same lower-id chunks, whatever their scores.

    Deterministic for a ``seed``.
    """
    return _generate(_builders.rag, locals())


def synthetic_scan(
    num_requests: int,
    *,
    hot_prefixes: int = 1000,
    hot_blocks: float = 8.0,
    zipf_s: float = 0.8,
    scan_fraction: float = 0.25,
    scan_blocks: float = 32.0,
    system_prompt_blocks: int = 1,
    question_tokens: float = 128.0,
    output_tokens: float = 256.0,
    block_size: int = 512,
    arrival_rate: float = 3.0,
    seed: int = 0,
) -> list[Request]:
    """A hot set with one-off scans mixed in (the classic scan-resistance test):
    ``num_requests`` single-turn requests, sorted by arrival (a Poisson process of
    ``arrival_rate`` per second), no sessions.

    Every prompt starts with a system prompt of ``system_prompt_blocks`` full blocks.
    With probability ``scan_fraction`` a request is a one-off scan (``req_id``
    ``"scan<i>"``): a long prompt of about ``scan_blocks`` blocks (uniform in tokens,
    that mean: a document to summarise, a batch job's input) never seen before or
    again. Otherwise (``"hot<i>"``) it re-reads one of ``hot_prefixes`` popular prefixes
    (each of about ``hot_blocks`` full blocks, uniform, drawn once: a shared document,
    a few-shot prompt), prefix of popularity rank ``r`` with weight ``(r + 1) **
    -zipf_s``, then asks a unique question of about ``question_tokens`` tokens. Scans
    bring most of the unique blocks, and a recency-only tier of a few percent of them
    lets the scans flush the hot set's tail between its re-reads. Deterministic for a
    ``seed``.
    """
    return _generate(_builders.scan, locals())


def synthetic_diurnal(
    num_requests: int,
    *,
    num_phases: int = 4,
    hot_prefixes: int = 200,
    prefix_blocks: float = 4.0,
    overlap: float = 0.25,
    zipf_s: float = 1.0,
    mean_turns: float = 2.0,
    blocks_per_turn: float = 2.0,
    output_blocks: float = 0.5,
    block_size: int = 512,
    arrival_rate: float = 3.0,
    think_time_s: float = 60.0,
    seed: int = 0,
) -> list[Request]:
    """A hot set that shifts over the day: ``num_requests`` requests of multi-turn
    sessions, sorted by arrival, in ``num_phases`` phases of equal duration (about
    ``num_requests / num_phases`` requests each).

    Each phase has its own hot set of ``hot_prefixes`` application prompts (system
    prompts of about ``prefix_blocks`` full blocks, uniform, drawn once), ranked at
    random: a session picks the prompt of rank ``r`` with weight ``(r + 1) ** -zipf_s``.
    A phase keeps ``round(overlap * hot_prefixes)`` prompts of the previous phase's hot
    set (chosen at random, and ranked anew) and brings fresh ones for the rest, so
    consecutive phases overlap and the first and last share little. A session's phase
    is the one it starts in. Sessions are :func:`synthetic_sessions`' (Poisson starts of
    ``arrival_rate / mean_turns`` per second, geometric turns of mean ``mean_turns``,
    about ``blocks_per_turn`` blocks of user message and ``output_blocks`` of reply per
    turn, exponential think times of mean ``think_time_s``). What was hot in one phase
    goes cold in the next: a policy that trusts old frequency keeps the wrong blocks.
    Deterministic for a ``seed``.
    """
    return _generate(_builders.diurnal, locals())


def synthetic_mixed(
    num_requests: int,
    *,
    scan_share: float = 0.8,
    hot_prefixes: int = 1000,
    hot_blocks: float = 24.0,
    zipf_s: float = 0.8,
    scan_fraction: float = 0.25,
    scan_blocks: float = 32.0,
    question_tokens: float = 128.0,
    output_tokens: float = 256.0,
    num_system_prompts: int = 32,
    system_prompt_blocks: int = 12,
    mean_turns: float = 8.0,
    blocks_per_turn: float = 8.0,
    output_blocks: float = 1.0,
    think_time_s: float = 120.0,
    block_size: int = 512,
    arrival_rate: float = 6.0,
    seed: int = 0,
) -> list[Request]:
    """Two kinds of traffic on one server: ``num_requests`` requests, sorted by arrival,
    about ``scan_share`` of them :func:`synthetic_scan`'s and the rest
    :func:`synthetic_sessions`' chat turns behind long shared system prompts.

    Requests arrive at about ``arrival_rate`` per second, the two streams merged by
    arrival: scan requests as a Poisson process of ``scan_share * arrival_rate`` per
    second, chat sessions as one of ``(1 - scan_share) * arrival_rate / mean_turns``.
    So ``scan_share`` is the scans' share of the requests once sessions are under way:
    the first sessions' later turns come over about ``mean_turns * think_time_s`` seconds
    (16 minutes by default), and until then scans are more (at seeds 0 and 1, 0.83 and
    0.85 of the first 20,000 requests by default, against 0.8).

    The scan stream is :func:`synthetic_scan`'s (``req_id`` ``"hot<i>"`` or
    ``"scan<i>"``, no session; ``hot_prefixes`` to ``output_tokens`` are its parameters,
    its system prompt one block) with longer hot prefixes (``hot_blocks``). The chat
    stream is :func:`synthetic_sessions`' (``"s<i>-t<turn>"``, session ``"s<i>"``;
    ``num_system_prompts`` to ``think_time_s``) with more and longer system prompts
    (``num_system_prompts`` of ``system_prompt_blocks`` full blocks), longer user
    messages (``blocks_per_turn``) and longer sessions (``mean_turns``). Keys are drawn
    from this family's own random stream, so neither stream shares a key with the
    ``scan`` or ``chat`` family (nor with another seed). Deterministic for a ``seed``.

    It reproduces a failure of the adaptive policy ``auto`` as of commit ff04eff, whose
    shadow tiers (1/16 of the capacity) see the requests whose key at depth 8 has a
    CRC-32 in the lowest 1/16: behind system prompts longer than 8 blocks, all the
    requests on one system prompt (and all re-reads of one hot prefix) are in the sample
    or out of it together, so the sample is a few lumps rather than a slice of the
    traffic, and its miniature tiers rank ``kv`` first at 10% capacity, where ARC hits
    about 0.02 more at full size (20,000 requests, seeds 0 and 1).
    """
    return _generate(_builders.mixed, locals())


@dataclass(frozen=True, slots=True)
class TraceFamily:
    """A named, seeded workload generator: one shape of traffic a cache policy must do
    well on. ``generate(n, seed=..., block_size=..., **params)`` makes ``n`` requests;
    ``params`` override the generator's defaults (:meth:`parameters`)."""

    name: str
    #: One line: what the family models.
    summary: str
    generator: Callable[..., list[Request]]

    def parameters(self) -> dict[str, object]:
        """The generator's tunable parameters and their defaults (``seed`` and
        ``block_size`` apart: every family takes them)."""
        return {
            name: p.default
            for name, p in inspect.signature(self.generator).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("seed", "block_size")
        }

    def generate(
        self, num_requests: int, *, seed: int = 0, block_size: int = 512, **params: object
    ) -> list[Request]:
        """``num_requests`` requests of this family. ``ValueError`` naming the parameter
        for an unknown or bad one."""
        known = self.parameters()
        for name in params:
            if name not in known:
                raise ValueError(
                    f"the {self.name} family has no parameter {name!r} (its parameters: "
                    f"{', '.join(known)}, and seed)"
                )
        return self.generator(num_requests, seed=seed, block_size=block_size, **params)


_FAMILIES = {
    f.name: f
    for f in (
        TraceFamily(
            "chat",
            "multi-turn chat on a few shared system prompts (as synthetic:N)",
            synthetic_sessions,
        ),
        TraceFamily(
            "agent",
            "agent loops: many short tool-call steps on a few long shared tool prompts",
            synthetic_agent,
        ),
        TraceFamily(
            "rag",
            "RAG: system prompt, k chunks of Zipf popularity, a unique question",
            synthetic_rag,
        ),
        TraceFamily(
            "scan",
            "a Zipf hot set of prefixes with long one-off scans mixed in",
            synthetic_scan,
        ),
        TraceFamily(
            "diurnal",
            "chat sessions on app prompts whose hot set shifts in phases",
            synthetic_diurnal,
        ),
        TraceFamily(
            "mixed",
            "scans over long hot prefixes and chat on long system prompts, interleaved",
            synthetic_mixed,
        ),
    )
}


def families() -> dict[str, TraceFamily]:
    """The trace families by name, in a fixed order: ``chat``, ``agent``, ``rag``,
    ``scan``, ``diurnal``, ``mixed``."""
    return dict(_FAMILIES)


def trace_family(name: str) -> TraceFamily:
    """The family called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"unknown trace family {name!r}: choose from {', '.join(_FAMILIES)}"
        ) from None


class TraceFormatError(ValueError):
    """A malformed request trace; the message names the file, the line and the problem."""


class _BadRecord(Exception):
    """What is wrong with one line of a trace (located by the caller)."""


_HASH_ID_LIMIT = 1 << 64
#: Counts (timestamps, lengths) fit in a signed 64-bit integer, as a JSON writer's do;
#: larger ones would make unusable requests (a timestamp past float range, for one).
_COUNT_LIMIT = 1 << 63
_JSON_TYPES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


def _describe(value: object) -> str:
    """``value``'s JSON type and (shortened) text, for error messages."""
    try:
        text = json.dumps(value)
    except RecursionError:  # nested about as deeply as json.loads allows
        text = "[...]" if type(value) is list else "{...}"
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{_JSON_TYPES.get(type(value), type(value).__name__)} {text}"


def _field(record: dict[str, object], name: str) -> object:
    try:
        return record[name]
    except KeyError:
        raise _BadRecord(f"missing field {name!r}") from None


def _count_field(record: dict[str, object], name: str) -> int:
    """Field ``name`` of ``record``, a non-negative integer."""
    value = _field(record, name)
    if type(value) is not int:
        raise _BadRecord(f"{name} must be an integer, got {_describe(value)}")
    if value < 0:
        raise _BadRecord(f"{name} must be >= 0, got {_shorten(value)}")
    if value >= _COUNT_LIMIT:
        raise _BadRecord(f"{name} must be < 2**63, got {_shorten(value)}")
    return value


def _shorten(number: int) -> str:
    """``number`` in decimal, its middle digits elided past 20 digits."""
    text = str(number)
    return text if len(text) <= 20 else f"{text[:8]}...{text[-8:]} ({len(text)} digits)"


def _json_error(e: json.JSONDecodeError) -> str:
    # Some of json's messages end in "at" ("Invalid control character at"), meant to be
    # followed by the position: say it once.
    return f"invalid JSON: {e.msg.removesuffix(' at')} at column {e.colno}"


def _parse_mooncake(
    line: bytes, block_size: int, lengths: bool = True
) -> tuple[int, int, int, list[int]]:
    """``(timestamp, input_length, output_length, hash_ids)`` of one trace line; without
    ``lengths`` (a trace of block ids only) every block is full and nothing is output."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise _BadRecord(_json_error(e)) from None
    except UnicodeDecodeError:
        raise _BadRecord("invalid JSON: not UTF-8 text") from None
    except RecursionError:
        raise _BadRecord("invalid JSON: arrays or objects nested too deeply") from None
    except ValueError:  # int(): more digits than sys.get_int_max_str_digits() allows
        limit = sys.get_int_max_str_digits()
        raise _BadRecord(f"invalid JSON: a number of more than {limit} digits") from None
    if type(record) is not dict:
        raise _BadRecord(f"expected a JSON object, got {_describe(record)}")
    timestamp = _count_field(record, "timestamp")
    if lengths:
        input_length = _count_field(record, "input_length")
        output_length = _count_field(record, "output_length")
    hash_ids = _field(record, "hash_ids")
    if type(hash_ids) is not list:
        raise _BadRecord(f"hash_ids must be an array of integers, got {_describe(hash_ids)}")
    if not hash_ids:
        raise _BadRecord("hash_ids is empty")
    if set(map(type, hash_ids)) != {int}:  # exact types: a bool is no id
        i, h = next((i, h) for i, h in enumerate(hash_ids) if type(h) is not int)
        raise _BadRecord(f"hash_ids[{i}] must be an integer, got {_describe(h)}")
    ids: list[int] = hash_ids
    if min(ids) < 0 or max(ids) >= _HASH_ID_LIMIT:
        i, h = next((i, h) for i, h in enumerate(ids) if not 0 <= h < _HASH_ID_LIMIT)
        raise _BadRecord(f"hash_ids[{i}] = {_shorten(h)} is outside [0, 2**64) (8 bytes)")
    if not lengths:
        return timestamp, block_size * len(ids), 0, ids
    blocks = -(-input_length // block_size)
    if len(ids) != blocks:
        raise _BadRecord(
            f"hash_ids has {len(ids)} ids, but input_length {input_length} makes "
            f"{blocks} blocks of {block_size} tokens"
        )
    return timestamp, input_length, output_length, ids


def iter_mooncake(
    path: str | os.PathLike[str],
    *,
    block_size: int = 512,
    limit: int | None = None,
    group_idx: int = 0,
) -> Iterator[Request]:
    """The requests of the Mooncake trace at ``path``, one at a time, in file order.

    Arguments are checked at once; the file is opened when iteration starts. See
    :func:`load_mooncake`.
    """
    check_int("block_size", block_size, positive=True)
    if limit is not None:
        check_int("limit", limit, positive=True)
    group = make_offload_key(b"\0", group_idx)[1:]  # group_idx's 4 bytes, checked
    return _read_mooncake(os.fspath(path), block_size, limit, group)


def _read_mooncake(
    path: str, block_size: int, limit: int | None, group: bytes, lengths: bool = True
) -> Iterator[Request]:
    stem = Path(path.removesuffix(".gz")).stem
    known: dict[int, bytes] = {}
    previous_ts = 0
    count = 0
    opened = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")  # noqa: SIM115
    with opened as f:
        lines = _gunzipped(f, path) if path.endswith(".gz") else f
        for line_no, line in enumerate(lines, 1):
            if line.isspace():
                continue
            try:
                timestamp, input_length, output_length, ids = _parse_mooncake(
                    line, block_size, lengths
                )
                if timestamp < previous_ts:
                    raise _BadRecord(
                        f"timestamp {timestamp} is earlier than the previous request's "
                        f"{previous_ts} (timestamps must not decrease)"
                    )
            except _BadRecord as e:
                raise TraceFormatError(f"{path}:{line_no}: {e}") from None
            previous_ts = timestamp
            # make_offload_key(h.to_bytes(8, "big"), group_idx), without its checks; one
            # key object per id (a trace repeats most of its ids: memory, and hashing
            # once).
            for h in ids:
                if h not in known:
                    known[h] = h.to_bytes(8, "big") + group
            keys = cast("tuple[OffloadKey, ...]", tuple(map(known.__getitem__, ids)))
            yield Request(
                req_id=f"{stem}:{line_no}",
                arrival_s=timestamp / 1000,
                keys=keys,
                input_tokens=input_length,
                output_tokens=output_length,
                block_size=block_size,
            )
            count += 1
            if count == limit:
                return


def _gunzipped(f: Iterable[bytes], path: str) -> Iterator[bytes]:
    """``f``'s lines, a compressed stream's damage (truncated, corrupt) as a
    :class:`TraceFormatError` naming ``path`` and the line it broke in."""
    line_no = 0
    lines = iter(f)
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise TraceFormatError(f"{path}:{line_no + 1}: damaged gzip data ({e})") from None
        line_no += 1
        yield line


def load_mooncake(
    path: str | os.PathLike[str],
    *,
    block_size: int = 512,
    limit: int | None = None,
    group_idx: int = 0,
) -> list[Request]:
    """The requests of the Mooncake trace at ``path`` (the first ``limit`` if given).

    Each line is a JSON object ``{"timestamp": ms, "input_length": tokens,
    "output_length": tokens, "hash_ids": [int, ...]}``; ``hash_ids`` name the prompt's
    ``block_size``-token blocks, prefix-chained (equal ids, equal prefixes), the last
    one partial unless ``input_length`` is a multiple of ``block_size``. A request's keys
    are ``make_offload_key(hash_id.to_bytes(8, "big"), group_idx)``, its arrival
    ``timestamp / 1000`` seconds, its ``req_id`` ``"<file stem>:<line number>"``; the
    trace has no sessions. Blank lines are skipped.

    Raises :class:`TraceFormatError`, naming the file and the 1-based line, for a line
    that is not valid JSON (numbers of more digits than ``int`` converts and nesting
    deeper than the parser follows included), not an object, lacks a field or has one
    that is not an integer in ``[0, 2**63)`` (``hash_ids``: a non-empty array of
    integers in ``[0, 2**64)``, ``ceil(input_length / block_size)`` of them), and for a
    timestamp earlier than the previous request's. No other error comes from the
    trace's contents. ``ValueError`` for bad arguments, ``OSError`` for an unreadable
    file.
    """
    return list(iter_mooncake(path, block_size=block_size, limit=limit, group_idx=group_idx))


def load_block_trace(
    path: str | os.PathLike[str],
    *,
    block_size: int = 64,
    limit: int | None = None,
    group_idx: int = 0,
) -> list[Request]:
    """The requests of a trace of block ids only at ``path`` (read through gzip when the
    name ends in ``.gz``), the first ``limit`` if given.

    Each line is a JSON object ``{"timestamp": ms, "hash_ids": [int, ...]}`` (other
    fields are ignored): the format of the Claude Code sessions of kv-cache-tester, 64
    tokens a block. The trace has no token counts, so every block is taken as full
    (``input_tokens == block_size * len(hash_ids)``) and nothing as output. Keys,
    arrivals, request ids and errors are :func:`load_mooncake`'s, less its checks of
    the lengths.
    """
    check_int("block_size", block_size, positive=True)
    if limit is not None:
        check_int("limit", limit, positive=True)
    group = make_offload_key(b"\0", group_idx)[1:]
    return list(_read_mooncake(os.fspath(path), block_size, limit, group, lengths=False))
