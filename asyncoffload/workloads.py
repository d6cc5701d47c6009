"""Workloads: streams of requests, each a prompt's prefix-chained block keys and an arrival time.

A :class:`Request` is what a serving loop needs to exercise an offload engine: when it
arrives, the keys of its prompt's full blocks (prefix-chained, so equal keys mean equal
prefixes), and how many tokens it reads and writes. Generators and trace loaders all
produce ``list[Request]`` sorted by arrival, so a serving loop or benchmark takes any of
them.

:func:`synthetic_chat` makes a multi-turn chat workload: sessions share a few system
prompts, and every turn's prompt is the whole conversation so far plus a new user
message, so prefixes are shared within a session (turn after turn) and across sessions
(the system prompt).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from asyncoffload.keys import OffloadKey, hash_token_blocks, make_offload_key

__all__ = ["Request", "WorkloadSummary", "summarize", "synthetic_chat"]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload.

    ``keys`` are the offload keys of the prompt's full blocks, in order; a trailing
    partial block has no key, so ``len(keys) == input_tokens // block_size``.
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

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


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


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _uniform_mean(rng: random.Random, mean: float) -> int:
    """An int uniform in ``[1, 2 * mean - 1]`` (mean ``mean``), at least 1."""
    hi = max(1, round(2 * mean) - 1)
    return rng.randint(1, hi)


class _Session:
    """A conversation's running token list and the keys of its full blocks."""

    __slots__ = ("hashes", "keys", "tokens")

    def __init__(self, tokens: list[int], hashes: list[bytes], keys: list[OffloadKey]) -> None:
        self.tokens = tokens
        self.hashes = hashes
        self.keys = keys

    def extend(self, new_tokens: list[int], block_size: int) -> None:
        """Append tokens, hashing the blocks that became full."""
        self.tokens.extend(new_tokens)
        start = len(self.hashes) * block_size
        parent = self.hashes[-1] if self.hashes else None
        fresh = hash_token_blocks(self.tokens[start:], block_size, parent=parent)
        self.hashes.extend(fresh)
        self.keys.extend(make_offload_key(h) for h in fresh)


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
    ``seed``.
    """
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 0:
        raise ValueError(f"num_requests must be a non-negative int, got {num_requests!r}")
    for name, ivalue in (
        ("num_system_prompts", num_system_prompts),
        ("turns", turns),
        ("block_size", block_size),
        ("vocab_size", vocab_size),
    ):
        if isinstance(ivalue, bool) or not isinstance(ivalue, int) or ivalue <= 0:
            raise ValueError(f"{name} must be a positive int, got {ivalue!r}")
    if (
        isinstance(system_prompt_blocks, bool)
        or not isinstance(system_prompt_blocks, int)
        or system_prompt_blocks < 0
    ):
        raise ValueError(
            f"system_prompt_blocks must be a non-negative int, got {system_prompt_blocks!r}"
        )
    _check_positive("blocks_per_turn", blocks_per_turn)
    _check_positive("output_tokens", output_tokens)
    _check_positive("arrival_rate", arrival_rate)
    if not (think_time_s >= 0 and math.isfinite(think_time_s)):
        raise ValueError(f"think_time_s must be >= 0, got {think_time_s!r}")

    rng = random.Random(seed)
    vocab = range(vocab_size)

    def tokens(n: int) -> list[int]:
        return rng.choices(vocab, k=n)

    system_prompts: list[tuple[list[int], list[bytes]]] = []
    for _ in range(num_system_prompts):
        toks = tokens(system_prompt_blocks * block_size)
        system_prompts.append((toks, hash_token_blocks(toks, block_size)))
    sys_keys = [[make_offload_key(h) for h in hashes] for _, hashes in system_prompts]

    # Sessions are generated in start order until no later one can arrive before the
    # num_requests-th arrival seen so far; then the earliest num_requests are kept.
    session_rate = arrival_rate / turns
    mean_user_tokens = blocks_per_turn * block_size
    out: list[Request] = []
    # Max-heap (negated) of the num_requests earliest arrivals so far.
    earliest: list[float] = []
    start = 0.0
    session_idx = 0
    while num_requests:
        start += rng.expovariate(session_rate)
        if len(earliest) == num_requests and start > -earliest[0]:
            break
        prompt = rng.randrange(num_system_prompts)
        sys_tokens, sys_hashes = system_prompts[prompt]
        session = _Session(list(sys_tokens), list(sys_hashes), list(sys_keys[prompt]))
        session_id = f"s{session_idx}"
        session_idx += 1
        t = start
        for turn in range(turns):
            if turn:
                t += rng.expovariate(1.0 / think_time_s) if think_time_s > 0 else 0.0
            session.extend(tokens(_uniform_mean(rng, mean_user_tokens)), block_size)
            n_out = _uniform_mean(rng, output_tokens)
            out.append(
                Request(
                    req_id=f"{session_id}-t{turn}",
                    arrival_s=t,
                    keys=tuple(session.keys),
                    input_tokens=len(session.tokens),
                    output_tokens=n_out,
                    session_id=session_id,
                    turn=turn,
                )
            )
            if len(earliest) < num_requests:
                heapq.heappush(earliest, -t)
            elif t < -earliest[0]:
                heapq.heapreplace(earliest, -t)
            if turn + 1 < turns:
                session.extend(tokens(n_out), block_size)

    out.sort(key=lambda r: r.arrival_s)
    return out[:num_requests]
