"""The prompt builders of :mod:`asyncoffload.workloads`' generators, one a family.

A generator hands its arguments to :mod:`asyncoffload.workloads`' one session-and-arrival
loop with its family's builder (``chat``, ``sessions``, ``agent``, ``rag``, ``scan``,
``diurnal``, ``mixed`` here). The loop checks the arguments (:func:`check_args`), and the
builder makes the family's shared prompts and a :class:`Plan`: the random stream, how
sessions start and how fast, and the mean think time between turns. The loop then draws
the session starts and think times and makes the requests; what a family adds is a
:class:`Dialog` a session: the keys and lengths of each turn's prompt, whether another
turn follows, whether it is a session at all, and what the reply adds to the
conversation.

Builders read the generator's arguments by name (``params``: its ``locals()`` on entry),
the names :func:`check_args` knows. The random draws, their order included, define a
family's traces (equal seeds, equal requests), so each builder draws what it always has,
when it always has. Nothing here is public API: import from :mod:`asyncoffload.workloads`.

The trace families (all but ``chat``, :func:`~asyncoffload.workloads.synthetic_chat`'s
token-id sessions) follow :func:`~asyncoffload.workloads.synthetic_sessions`' conventions,
each as fast: keys alone, no token ids; every block of a prompt has a key, the last
usually partial (``len(keys) == ceil(input_tokens / block_size)``); shared prefixes
(system, tool and app prompts, document chunks) are whole blocks; keys are a counter under
a namespace drawn from the family's own random stream, so workloads of different seeds or
families share no key.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple, cast

from asyncoffload.keys import OffloadKey, hash_token_blocks, make_offload_key

__all__ = [
    "RAG_ORDERS",
    "Dialog",
    "Params",
    "Plan",
    "agent",
    "chat",
    "check_args",
    "check_int",
    "diurnal",
    "mixed",
    "rag",
    "scan",
    "sessions",
    "think_time",
]

#: A generator's arguments by name.
Params = Mapping[str, Any]


# --- arguments -------------------------------------------------------------------------


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _check_at_least(name: str, value: float, low: float) -> None:
    if isinstance(value, bool) or not value >= low or not math.isfinite(value):
        raise ValueError(f"{name} must be a number >= {low}, got {value!r}")


def check_int(name: str, value: int, *, positive: bool) -> None:
    """``value`` is a positive (else non-negative) int, not a bool."""
    if isinstance(value, bool) or not isinstance(value, int) or value < int(positive):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be a {kind} int, got {value!r}")


def _check_number(name: str, value: float, low: float, high: float) -> None:
    """``value`` is a number in ``[low, high]`` (bools, NaN and other types refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")


#: How :func:`~asyncoffload.workloads.synthetic_rag` orders a request's retrieved chunks.
RAG_ORDERS = ("score", "id")


def _check_order(name: str, value: str) -> None:
    if value not in RAG_ORDERS:
        raise ValueError(f"{name} must be one of {', '.join(RAG_ORDERS)}, got {value!r}")


def _rules() -> dict[str, Callable[[str, Any], None]]:
    """The check of every generator parameter but ``seed``, by name (a name means one
    thing in every generator): given the name and the value."""
    rules: dict[str, Callable[[str, Any], None]] = {}
    for names, rule in (
        (
            "num_requests system_prompt_blocks tool_prompt_blocks chunks_per_request",
            lambda name, value: check_int(name, value, positive=False),
        ),
        (
            "num_system_prompts turns block_size vocab_size num_tool_prompts num_chunks "
            "chunk_blocks hot_prefixes num_phases",
            lambda name, value: check_int(name, value, positive=True),
        ),
        (
            "blocks_per_turn output_tokens arrival_rate output_blocks task_blocks call_tokens "
            "result_tokens question_tokens hot_blocks scan_blocks prefix_blocks",
            _check_positive,
        ),
        ("think_time_s step_time_s", lambda name, value: _check_at_least(name, value, 0)),
        ("mean_turns mean_steps", lambda name, value: _check_at_least(name, value, 1)),
        (
            "scan_fraction overlap scan_share",
            lambda name, value: _check_number(name, value, 0, 1),
        ),
        ("zipf_s", lambda name, value: _check_number(name, value, 0, 10)),
        ("order", _check_order),
    ):
        rules.update(dict.fromkeys(names.split(), rule))
    return rules


_RULES = _rules()


def check_args(params: Params) -> None:
    """Check a generator's arguments in order (``seed`` apart: see :func:`_family_rng`);
    ``ValueError`` naming the first bad one."""
    for name, value in params.items():
        if name != "seed":
            _RULES[name](name, value)
            if name == "chunks_per_request" and value > params["num_chunks"]:
                raise ValueError(
                    f"chunks_per_request must be at most num_chunks ({params['num_chunks']}), "
                    f"got {value!r}"
                )


def _family_rng(family: str, seed: int) -> random.Random:
    """The random stream of ``family`` at ``seed`` (an int): families drawn with the same
    seed are independent (a str seed hashes all its characters)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return random.Random(f"{family}:{seed}")


# --- random draws and keys -------------------------------------------------------------


def _uniform_mean(rng: random.Random, mean: float) -> int:
    """An int uniform in ``[1, 2 * mean - 1]`` (mean ``mean``), at least 1."""
    hi = max(1, round(2 * mean) - 1)
    return rng.randint(1, hi)


def think_time(rng: random.Random, mean: float) -> float:
    """An exponential time of mean ``mean`` (0 when ``mean`` is 0)."""
    return rng.expovariate(1.0 / mean) if mean > 0 else 0.0


#: The group index part of every generated key (group 0).
_GROUP_0 = make_offload_key(b"\0")[1:]


class _FreshKeys:
    """Keys never handed out before: a counter under a random 8-byte namespace."""

    __slots__ = ("_namespace", "_next")

    def __init__(self, rng: random.Random) -> None:
        self._namespace = rng.randbytes(8)
        self._next = 0

    def take(self, n: int) -> list[OffloadKey]:
        ns, start = self._namespace, self._next
        self._next = start + n
        raw = [ns + i.to_bytes(8, "big") + _GROUP_0 for i in range(start, start + n)]
        return cast("list[OffloadKey]", raw)


def _zipf_cum_weights(n: int, s: float) -> list[float]:
    """Cumulative weights of ranks ``0..n-1``, rank ``i`` weighing ``(i + 1) ** -s``."""
    return list(itertools.accumulate((i + 1) ** -s for i in range(n)))


def _draw_distinct(
    rng: random.Random, ranks: range, cum: list[float], k: int, s: float
) -> list[int]:
    """``k`` distinct ranks drawn one after the other, rank ``r`` with weight
    ``(r + 1) ** -s`` (``cum``: the cumulative weights), without replacement, in draw
    order."""
    picked: list[int] = []
    seen: set[int] = set()
    # Rejection draws the next pick from the rest's weights; it stalls only when the
    # picks hold nearly all the weight, where the equivalent exponential-key draw
    # (Efraimidis-Spirakis: the k largest u ** (1 / w), in order) takes over.
    total, hi, uniform = cum[-1], len(cum) - 1, rng.random
    for _ in range(8 * k + 8):
        if len(picked) == k:
            return picked
        rank = bisect.bisect(cum, uniform() * total, 0, hi)  # rng.choices(ranks, cum)
        if rank not in seen:
            seen.add(rank)
            picked.append(rank)
    if len(picked) == k:
        return picked
    # log(u) / w is u ** (1 / w) in order, and stays finite for the tiniest weights.
    order = sorted(ranks, key=lambda r: math.log(1.0 - rng.random()) * (r + 1) ** s)
    return order[-k:][::-1]


# --- dialogs and plans -----------------------------------------------------------------


class Dialog:
    """One session as the arrival loop drives it: :meth:`prompt` gives a turn's request,
    then :meth:`follow` says whether another turn comes (the loop draws its think time
    after). ``label`` names the session (with its index) once :meth:`prompt` has run."""

    __slots__ = ("label",)

    #: Whether its requests belong to a session (``req_id`` ``"<label><i>-t<turn>"``,
    #: the session ``"<label><i>"``) or stand alone (``"<label><i>"``, no session).
    sessions: ClassVar[bool] = True

    def __init__(self, label: str) -> None:
        self.label = label

    def prompt(self) -> tuple[list[OffloadKey], int, int]:
        """The next turn's prompt keys, its length in tokens and its output's length."""
        raise NotImplementedError

    def follow(self, output_tokens: int) -> bool:
        """Whether a turn follows the last prompt's, reading that prompt and its output
        of ``output_tokens`` tokens (one turn by default)."""
        return False


class Plan(NamedTuple):
    """What the arrival loop needs of a family's builder."""

    rng: random.Random
    #: The session starting at a time (seconds).
    open_session: Callable[[float], Dialog]
    #: Sessions started per second (a Poisson process).
    session_rate: float
    #: The mean think time between a session's turns, seconds (exponential).
    think_time_s: float = 0.0


class _ChatSession(Dialog):
    """A :func:`chat` session: its running token list and the keys of its full blocks,
    ``turns`` turns."""

    __slots__ = ("_chat", "_hashes", "_keys", "_left", "_tokens")

    def __init__(self, chat: _Chat, prompt: int) -> None:
        super().__init__("s")
        tokens, hashes = chat.system[prompt]
        self._chat, self._left = chat, chat.turns
        self._tokens, self._hashes = list(tokens), list(hashes)
        self._keys = list(chat.system_keys[prompt])

    def _extend(self, new_tokens: list[int]) -> None:
        """Append tokens, hashing the blocks that became full."""
        block_size = self._chat.block_size
        self._tokens.extend(new_tokens)
        start = len(self._hashes) * block_size
        parent = self._hashes[-1] if self._hashes else None
        fresh = hash_token_blocks(self._tokens[start:], block_size, parent=parent)
        self._hashes.extend(fresh)
        self._keys.extend(make_offload_key(h) for h in fresh)

    def prompt(self) -> tuple[list[OffloadKey], int, int]:
        chat = self._chat
        self._extend(chat.tokens(_uniform_mean(chat.rng, chat.user_tokens)))
        return self._keys, len(self._tokens), _uniform_mean(chat.rng, chat.output_tokens)

    def follow(self, output_tokens: int) -> bool:
        self._left -= 1
        if not self._left:
            return False
        self._extend(self._chat.tokens(output_tokens))
        return True


class _Chat:
    """:func:`chat`'s system prompts (token ids and their block hashes) and draws."""

    def __init__(self, p: Params) -> None:
        self.rng = random.Random(p["seed"])
        self.vocab = range(p["vocab_size"])
        self.block_size, self.turns = p["block_size"], p["turns"]
        self.user_tokens = p["blocks_per_turn"] * self.block_size
        self.output_tokens = p["output_tokens"]
        self.system: list[tuple[list[int], list[bytes]]] = []
        for _ in range(p["num_system_prompts"]):
            toks = self.tokens(p["system_prompt_blocks"] * self.block_size)
            self.system.append((toks, hash_token_blocks(toks, self.block_size)))
        self.system_keys = [[make_offload_key(h) for h in hashes] for _, hashes in self.system]

    def tokens(self, n: int) -> list[int]:
        return self.rng.choices(self.vocab, k=n)

    def open(self, _start: float) -> Dialog:
        return _ChatSession(self, self.rng.randrange(len(self.system)))


def chat(p: Params) -> Plan:
    """:func:`~asyncoffload.workloads.synthetic_chat`: random token ids, keys the chained
    hashes of full blocks, ``turns`` turns a session."""
    sessions = _Chat(p)
    return Plan(sessions.rng, sessions.open, p["arrival_rate"] / p["turns"], p["think_time_s"])


class _Keyed(Dialog):
    """A session of keys alone (:class:`_KeyedSessions`)."""

    __slots__ = ("_keys", "_left", "_new", "_sessions", "_tokens")

    def __init__(self, sessions: _KeyedSessions, keys: list[OffloadKey], turns: int) -> None:
        super().__init__(sessions.label)
        self._sessions, self._keys, self._left = sessions, keys, turns
        self._tokens = len(keys) * sessions.block_size
        self._new = sessions.first_tokens

    def prompt(self) -> tuple[list[OffloadKey], int, int]:
        s, keys = self._sessions, self._keys
        self._tokens += _uniform_mean(s.rng, self._new)
        keys += s.fresh.take(-(-self._tokens // s.block_size) - len(keys))
        return keys, self._tokens, _uniform_mean(s.rng, s.output_tokens)

    def follow(self, output_tokens: int) -> bool:
        s = self._sessions
        if s.turns_first:
            self._left -= 1
            if not self._left:
                return False
        elif s.rng.random() >= s.more_turns:
            return False
        # The output continues the prompt's partial last block: that block's key goes.
        del self._keys[self._tokens // s.block_size :]
        self._tokens += output_tokens
        self._new = s.turn_tokens
        return True


class _KeyedSessions:
    """Multi-turn sessions of keys alone, as in :func:`sessions`: each on the shared
    prefix of full blocks ``prefix(start)``, its first turn adding about ``first_tokens``
    tokens and every later one its predecessor's output and about ``turn_tokens`` more
    (``tokens``: those two and the mean output). Every block of a prompt has a key, the
    last usually partial and re-keyed by the next turn. A session has a geometric number
    of turns (at least 1, mean ``mean_turns``), drawn when it opens (before its prefix)
    with ``turns_first``, else turn by turn."""

    def __init__(
        self,
        rng: random.Random,
        fresh: _FreshKeys,
        prefix: Callable[[float], list[OffloadKey]],
        label: str,
        *,
        mean_turns: float,
        tokens: tuple[float, float, float],
        block_size: int,
        turns_first: bool = False,
    ) -> None:
        self.rng, self.fresh, self.prefix, self.label = rng, fresh, prefix, label
        self.more_turns = 1 - 1 / mean_turns
        self.first_tokens, self.turn_tokens, self.output_tokens = tokens
        self.block_size, self.turns_first = block_size, turns_first

    def open(self, start: float) -> Dialog:
        turns = 0
        if self.turns_first:
            turns = 1
            while self.rng.random() < self.more_turns:
                turns += 1
        return _Keyed(self, list(self.prefix(start)), turns)


def sessions(p: Params) -> Plan:
    """:func:`~asyncoffload.workloads.synthetic_sessions` (the ``chat`` family): system
    prompts of Zipf popularity, turns drawn when a session opens."""
    rng = random.Random(p["seed"])
    keyed = _chat_sessions(p, rng)
    return Plan(rng, keyed.open, p["arrival_rate"] / p["mean_turns"], p["think_time_s"])


def _chat_sessions(p: Params, rng: random.Random) -> _KeyedSessions:
    """:func:`sessions`' sessions, drawn from ``rng`` (their keys' namespace too)."""
    fresh = _FreshKeys(rng)
    block_size = p["block_size"]
    system = [fresh.take(p["system_prompt_blocks"]) for _ in range(p["num_system_prompts"])]
    prompts = range(p["num_system_prompts"])
    popularity = list(itertools.accumulate(1 / (i + 1) for i in prompts))

    def system_prompt(_start: float) -> list[OffloadKey]:
        return system[rng.choices(prompts, cum_weights=popularity)[0]]

    user = p["blocks_per_turn"] * block_size
    return _KeyedSessions(
        rng,
        fresh,
        system_prompt,
        "s",
        mean_turns=p["mean_turns"],
        tokens=(user, user, p["output_blocks"] * block_size),
        block_size=block_size,
        turns_first=True,
    )


def agent(p: Params) -> Plan:
    """:func:`~asyncoffload.workloads.synthetic_agent`: tool prompts of Zipf popularity,
    steps drawn turn by turn, each step's new input the previous call's result."""
    rng = _family_rng("agent", p["seed"])
    fresh = _FreshKeys(rng)
    tools = [fresh.take(p["tool_prompt_blocks"]) for _ in range(p["num_tool_prompts"])]
    popularity = _zipf_cum_weights(p["num_tool_prompts"], 1.0)
    choices = range(p["num_tool_prompts"])

    def tool_prompt(_start: float) -> list[OffloadKey]:
        return tools[rng.choices(choices, cum_weights=popularity)[0]]

    keyed = _KeyedSessions(
        rng,
        fresh,
        tool_prompt,
        "a",
        mean_turns=p["mean_steps"],
        # A step's new input is the previous call's result (the call is its output).
        tokens=(p["task_blocks"] * p["block_size"], p["result_tokens"], p["call_tokens"]),
        block_size=p["block_size"],
    )
    return Plan(rng, keyed.open, p["arrival_rate"] / p["mean_steps"], p["step_time_s"])


def diurnal(p: Params) -> Plan:
    """:func:`~asyncoffload.workloads.synthetic_diurnal`: app prompts drawn from the hot
    set of the phase a session starts in, turns drawn turn by turn."""
    rng = _family_rng("diurnal", p["seed"])
    fresh = _FreshKeys(rng)
    num_phases: int = p["num_phases"]
    hot_prefixes: int = p["hot_prefixes"]

    def app_prompt() -> list[OffloadKey]:
        return fresh.take(_uniform_mean(rng, p["prefix_blocks"]))

    kept = round(p["overlap"] * hot_prefixes)
    phases = [[app_prompt() for _ in range(hot_prefixes)]]
    for _ in range(num_phases - 1):
        hot = rng.sample(phases[-1], kept)
        hot += [app_prompt() for _ in range(hot_prefixes - kept)]
        rng.shuffle(hot)
        phases.append(hot)
    cum = _zipf_cum_weights(hot_prefixes, p["zipf_s"])
    ranks = range(hot_prefixes)
    phase_s = p["num_requests"] / p["arrival_rate"] / num_phases

    def phase_prompt(start: float) -> list[OffloadKey]:
        phase = min(num_phases - 1, int(start / phase_s))
        return phases[phase][rng.choices(ranks, cum_weights=cum)[0]]

    user = p["blocks_per_turn"] * p["block_size"]
    keyed = _KeyedSessions(
        rng,
        fresh,
        phase_prompt,
        "d",
        mean_turns=p["mean_turns"],
        tokens=(user, user, p["output_blocks"] * p["block_size"]),
        block_size=p["block_size"],
    )
    return Plan(rng, keyed.open, p["arrival_rate"] / p["mean_turns"], p["think_time_s"])


class _Rag(Dialog):
    """:func:`rag`'s requests, one a session: the system prompt, ``chunks_per_request``
    chunks drawn by popularity and laid out in ``order``, a unique question."""

    __slots__ = ("_by_id", "_chunk_id", "_chunk_keys", "_cum", "_fresh", "_p", "_system", "rng")

    sessions = False

    def __init__(self, p: Params) -> None:
        super().__init__("q")
        self.rng, self._p = _family_rng("rag", p["seed"]), p
        self._fresh = _FreshKeys(self.rng)
        self._system = self._fresh.take(p["system_prompt_blocks"])
        self._cum = _zipf_cum_weights(p["num_chunks"], p["zipf_s"])
        self._chunk_id = list(range(p["num_chunks"]))
        self.rng.shuffle(self._chunk_id)
        self._by_id = p["order"] == "id"
        # The keys of a chunk behind a prefix, by (the prefix's last key, chunk rank).
        self._chunk_keys: dict[tuple[bytes, int], list[OffloadKey]] = {}

    def prompt(self) -> tuple[list[OffloadKey], int, int]:
        p, rng, fresh = self._p, self.rng, self._fresh
        k, chunk_blocks, block_size = p["chunks_per_request"], p["chunk_blocks"], p["block_size"]
        picked = _draw_distinct(rng, range(p["num_chunks"]), self._cum, k, p["zipf_s"])
        if self._by_id:
            picked.sort(key=self._chunk_id.__getitem__)
        keys = list(self._system)
        for rank in picked:
            memo = (keys[-1] if keys else b"", rank)
            found = self._chunk_keys.get(memo)
            if found is None:
                found = self._chunk_keys[memo] = fresh.take(chunk_blocks)
            keys += found
        n_question = _uniform_mean(rng, p["question_tokens"])
        keys += fresh.take(-(-n_question // block_size))
        n_tokens = (p["system_prompt_blocks"] + k * chunk_blocks) * block_size + n_question
        return keys, n_tokens, _uniform_mean(rng, p["output_tokens"])


def rag(p: Params) -> Plan:
    """:func:`~asyncoffload.workloads.synthetic_rag`: single requests arriving at
    ``arrival_rate``."""
    requests = _Rag(p)
    return Plan(requests.rng, lambda _start: requests, p["arrival_rate"])


class _Scan(Dialog):
    """:func:`scan`'s requests, one a session: a one-off scan (label ``scan``) or a
    question on a hot prefix of Zipf popularity (``hot``), behind the system prompt."""

    __slots__ = ("_cum", "_fresh", "_hot", "_p", "_system", "rng")

    sessions = False

    def __init__(self, p: Params, rng: random.Random) -> None:
        super().__init__("")
        self.rng, self._p = rng, p
        self._fresh = _FreshKeys(self.rng)
        self._system = self._fresh.take(p["system_prompt_blocks"])
        hot_blocks = p["hot_blocks"]
        self._hot = [
            self._fresh.take(_uniform_mean(self.rng, hot_blocks)) for _ in range(p["hot_prefixes"])
        ]
        self._cum = _zipf_cum_weights(p["hot_prefixes"], p["zipf_s"])

    def prompt(self) -> tuple[list[OffloadKey], int, int]:
        p, rng, block_size = self._p, self.rng, self._p["block_size"]
        keys = list(self._system)
        if rng.random() < p["scan_fraction"]:
            self.label = "scan"
            n_new = _uniform_mean(rng, p["scan_blocks"] * block_size)
        else:
            self.label = "hot"
            keys += self._hot[rng.choices(range(p["hot_prefixes"]), cum_weights=self._cum)[0]]
            n_new = _uniform_mean(rng, p["question_tokens"])
        n_tokens = len(keys) * block_size + n_new
        keys += self._fresh.take(-(-n_new // block_size))
        return keys, n_tokens, _uniform_mean(rng, p["output_tokens"])


def scan(p: Params) -> Plan:
    """:func:`~asyncoffload.workloads.synthetic_scan`: single requests arriving at
    ``arrival_rate``."""
    requests = _Scan(p, _family_rng("scan", p["seed"]))
    return Plan(requests.rng, lambda _start: requests, p["arrival_rate"])


#: The system prompt of :func:`mixed`'s scan stream, in full blocks (as
#: :func:`~asyncoffload.workloads.synthetic_scan`'s default).
_MIXED_SCAN_SYSTEM_BLOCKS = 1


def mixed(p: Params) -> Plan:
    """:func:`~asyncoffload.workloads.synthetic_mixed`: :func:`scan`'s requests and
    :func:`sessions`' sessions, their Poisson processes merged (drawn as one of the summed
    rate, each start a scan request with its stream's share of that rate). Both streams
    draw from the ``mixed`` family's random stream, their keys' namespaces too."""
    rng = _family_rng("mixed", p["seed"])
    scans = _Scan({**p, "system_prompt_blocks": _MIXED_SCAN_SYSTEM_BLOCKS}, rng)
    chats = _chat_sessions(p, rng)
    # Requests per second: scan_share of arrival_rate are scans (one a start), the rest
    # chat turns (mean_turns a session).
    scan_rate = p["scan_share"] * p["arrival_rate"]
    start_rate = scan_rate + (1 - p["scan_share"]) * p["arrival_rate"] / p["mean_turns"]

    def open_session(start: float) -> Dialog:
        return scans if rng.random() * start_rate < scan_rate else chats.open(start)

    return Plan(rng, open_session, start_rate, p["think_time_s"])
