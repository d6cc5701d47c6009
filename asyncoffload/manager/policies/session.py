"""Session-aware eviction: keep the sessions whose next turn comes soon, cut from the tail.

Coding agents send a session's turns one after another, each prompt the previous one
plus what happened since (a tool's output, the model's answer, the user's next line),
with pauses while tools run or the user reads. Two things follow for a cache of prefix
blocks:

- **Tail first.** A turn hits its prefix up to the first block missing, so within a
  session the deepest block is the cheapest loss and the first block the dearest.
  A session's blocks are kept in one queue, evicted from its front: blocks no later
  turn touched first, then the latest turn's from its deepest up.
- **Next turn soon.** Every block of a session is read again at its next turn (or
  never), so all of them are worth the same: the time until that turn. The policy keeps
  each session's recent gaps between turns (the median of the last ``history``). A
  session idle for ``e`` seconds with a median gap ``g`` is *due* while ``e < overdue *
  g``: its next turn is expected in ``max(g - e, 0)``. Past that it is *idle*, and an
  idle session is expected back no sooner than it has already been away (``e``). The
  victim is the session whose next turn is furthest; a session seen once has the median
  gap of all sessions.

Sessions. A request names its session with :attr:`ReqContext.session` or
``kv_transfer_params["session_id"]`` (the manager hands each call's context to
:meth:`SessionPolicy.on_context`). Otherwise the policy derives it: a request continues
the session whose latest prompt ended with one of the request's blocks (the last two
blocks of each session's latest prompt are remembered: the last one is often partial
and rewritten by the next turn), else it starts a new one. A block that a second
session uses (a system prompt) leaves its session for a queue of shared blocks, least
recently used first, ranked like a session away since its last use.

Admission. A session's new blocks never evict its own older ones, nor the blocks of a
session due sooner: when storing all of them would, the deepest are declined (they
would be useless: a turn's prefix hit stops at the first block missing).

Time is ``clock()`` seconds (``time.monotonic`` by default; the replays pass the
trace's arrival times, the tests a fake clock). The policy hears each request once,
head first, through :meth:`~CachePolicy.on_request` (every documented call pattern
feeds it, as it feeds ``auto``); a touch without one keeps each block in its session.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import repeat
from typing import Any

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies.base import CachePolicy, register_policy

__all__ = ["SessionPolicy"]

#: The gap a session gets before any session has a second turn (seconds).
DEFAULT_GAP = 30.0
#: Gaps between turns measured before the gaps decide admission (and how often the
#: prior, the median of the last 256, is updated).
WARM_GAPS = 16
#: ``kv_transfer_params`` key that names a request's session.
SESSION_PARAM = "session_id"


class _Session:
    """One session: its blocks (evicted from the front), its latest turn and gaps."""

    __slots__ = ("blocks", "gap", "gaps", "last", "marks", "name", "seq", "version")

    def __init__(self, seq: int, name: str | None, now: float) -> None:
        self.seq = seq
        self.name = name
        self.blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.last = now
        self.gaps: deque[float] = deque()
        #: Median of ``gaps`` (``-1``: none yet).
        self.gap = -1.0
        #: The last blocks of its latest prompt (how a next turn finds it).
        self.marks: tuple[OffloadKey, ...] = ()
        #: Turns heard (its entries in the policy's heap of due sessions are this one's).
        self.version = 0

    def __repr__(self) -> str:
        label = self.name if self.name is not None else f"#{self.seq}"
        return f"_Session({label}, blocks={len(self.blocks)}, gap={self.gap:.3g})"


def _last(s: _Session) -> float:
    return s.last


def _median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@register_policy("session")
class SessionPolicy(CachePolicy):
    """Evicts the session whose next turn is furthest away, from its tail."""

    touch_before_store = True
    observes_requests = True

    def __init__(
        self,
        capacity: int,
        *,
        clock: Callable[[], float] | None = None,
        overdue: float = 1.0,
        history: int = 8,
        max_sessions: int | None = None,
        admission: bool = True,
    ) -> None:
        """``overdue``: a session is idle once away longer than this many of its median
        gaps; ``history``: the gaps remembered per session; ``max_sessions``: sessions
        remembered, those holding blocks included (default: ``max(1024, capacity)``;
        past it the longest-away session with no block is forgotten)."""
        super().__init__(capacity)
        if (
            isinstance(overdue, bool)
            or not isinstance(overdue, (int, float))
            or not math.isfinite(overdue)
            or overdue <= 0
        ):
            raise ValueError(f"overdue must be a positive finite number, got {overdue!r}")
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be an int >= 1, got {history!r}")
        if max_sessions is None:
            max_sessions = max(1024, capacity)
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, got {max_sessions!r}")
        self._clock: Callable[[], float] = time.monotonic
        if clock is not None:
            self.use_clock(clock)
        self.overdue = float(overdue)
        self.history = history
        self.max_sessions = max_sessions
        self.admission = admission
        self.clear()

    # --- state ------------------------------------------------------------------------

    def clear(self) -> None:
        #: Every block, with its session.
        self._owner: dict[OffloadKey, _Session] = {}
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        self.get = self._blocks.get  # type: ignore[method-assign,assignment]
        #: Sessions by number (the order they came in).
        self._sessions: dict[int, _Session] = {}
        #: The sessions holding blocks, by their latest turn, the longest away first.
        self._recency: OrderedDict[int, _Session] = OrderedDict()
        #: A heap of ``(-(last turn + gap), seq, version)``: the due session whose next
        #: turn is furthest comes first. Entries of another version, of a session gone
        #: idle or holding no block are stale (skipped, dropped at the next request).
        self._due: list[tuple[float, int, int]] = []
        self._named: dict[str, _Session] = {}
        #: The last blocks of each session's latest prompt.
        self._marks: dict[OffloadKey, _Session] = {}
        #: Keys of heard requests not stored yet, with their session.
        self._fresh: dict[OffloadKey, _Session] = {}
        self._current: _Session | None = None
        #: Blocks more than one session used (a system prompt): by their last use.
        self._shared = _Session(0, None, -math.inf)
        self._sessions[0] = self._shared
        self._pending_name: str | None = None
        self._recent_gaps: deque[float] = deque(maxlen=256)
        self._prior = DEFAULT_GAP
        #: Gaps measured so far (admission waits for :data:`WARM_GAPS`).
        self._measured = 0
        self._seq = 0
        self._now = -math.inf

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """Every block, session by session (in the order they came), each session's in
        eviction order."""
        return (item for s in self._sessions.values() for item in s.blocks.items())

    def __len__(self) -> int:
        return len(self._blocks)

    def session_of(self, key: OffloadKey) -> str | int | None:
        """The session a tracked block belongs to: its name, else its number (0: shared
        by sessions; for inspection and tests); ``None`` if the block is not tracked."""
        s = self._owner.get(key)
        if s is None:
            return None
        return s.name if s.name is not None else s.seq

    def expected_wait(self, key: OffloadKey) -> float | None:
        """Seconds until the block's session is expected back, as eviction ranks it."""
        s = self._owner.get(key)
        return None if s is None else self._wait(s, self._time())

    # --- time and sessions ------------------------------------------------------------

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Read the time from ``clock`` (seconds) from now on; ``TypeError`` if it is
        not callable."""
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {clock!r}")
        self._clock = clock

    def _time(self, advance: bool = False) -> float:
        """The clock now; one that goes back reads as the latest time a request came
        (``advance``: a request comes now)."""
        now = self._clock()
        if isinstance(now, bool) or not isinstance(now, (int, float)) or math.isnan(now):
            raise ValueError(f"clock must return seconds as a number, got {now!r}")
        if now <= self._now:
            return self._now
        if advance:
            self._now = float(now)
        return float(now)

    def _wait(self, s: _Session, now: float) -> float:
        """Expected seconds until ``s``'s next turn (shared blocks: since their use)."""
        away = now - s.last
        if s is self._shared:
            return away
        gap = s.gap if s.gap >= 0 else self._prior
        if away < self.overdue * gap:
            return gap - away if gap > away else 0.0
        return away

    def on_context(self, ctx: Any) -> None:
        """The manager's request context of the call that follows: a session it names
        (``ctx.session``, else ``kv_transfer_params["session_id"]``) is the next
        request's."""
        name = getattr(ctx, "session", None)
        if name is None:
            params = getattr(ctx, "kv_transfer_params", None)
            if isinstance(params, dict):
                name = params.get(SESSION_PARAM)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"a session must be named by a non-empty str, got {name!r}")
        self._pending_name = name

    def _new_session(self, name: str | None, now: float) -> _Session:
        self._seq += 1
        s = _Session(self._seq, name, now)
        self._sessions[s.seq] = s
        if name is not None:
            self._named[name] = s
        if len(self._sessions) > self.max_sessions:
            self._forget_sessions(s)
        return s

    def _forget_sessions(self, new: _Session) -> None:
        """Forget the longest-away sessions that hold no block (never ``new``), below
        the limit."""
        extra = len(self._sessions) - self.max_sessions + self.max_sessions // 8
        idle = sorted(
            (s for s in self._sessions.values() if not s.blocks and s.seq and s is not new),
            key=_last,
        )
        for s in idle[:extra]:
            self._drop(s)

    def _drop(self, s: _Session) -> None:
        del self._sessions[s.seq]
        for key in s.marks:
            if self._marks.get(key) is s:
                del self._marks[key]
        if s.name is not None and self._named.get(s.name) is s:
            del self._named[s.name]
        if self._current is s:
            self._current = None

    def _find(self, keys: Sequence[OffloadKey], name: str | None, now: float) -> _Session:
        if name is not None:
            s = self._named.get(name)
            return s if s is not None else self._new_session(name, now)
        marks = self._marks
        if marks:
            for key in reversed(keys):
                found = marks.get(key)
                if found is not None and found.name is None:
                    return found
        return self._new_session(None, now)

    def _turn(self, s: _Session, now: float) -> None:
        """A new turn of ``s`` at ``now``: its gap joins the medians."""
        gaps = s.gaps
        gaps.append(now - s.last)
        if len(gaps) > self.history:
            gaps.popleft()
        s.gap = _median(gaps)
        self._recent_gaps.append(gaps[-1])
        self._measured += 1
        if self._measured % WARM_GAPS == 0:
            self._prior = _median(self._recent_gaps)

    # --- CachePolicy ------------------------------------------------------------------

    def on_request(self, keys: Sequence[OffloadKey]) -> None:
        """A request arrives: find its session and count the gap since the session's
        last turn. Its blocks join the session when they are touched or stored (a
        lookup changes no block's place)."""
        if not keys:
            return
        for key in keys:
            if not isinstance(key, bytes):
                raise TypeError(f"keys must be bytes, got {type(key).__name__}")
        now = self._time(advance=True)
        name, self._pending_name = self._pending_name, None
        s = self._find(keys, name, now)
        if s.marks or s.gaps:
            self._turn(s, now)
        s.last = now
        s.version += 1
        if s.blocks:
            self._recency.move_to_end(s.seq)
            heapq.heappush(self._due, (-(now + self._gap(s)), s.seq, s.version))
        self._clean_due(now)
        marks = self._marks
        for key in s.marks:
            if marks.get(key) is s:
                del marks[key]
        s.marks = tuple(keys[-2:])
        for key in s.marks:
            marks[key] = s
        self._current = s
        fresh = self._fresh
        fresh.update(zip(keys, repeat(s)))
        if len(fresh) > 2 * self.capacity + len(keys):
            for key in list(fresh)[: len(fresh) - len(keys)]:
                del fresh[key]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Each block becomes the last of its session to go (``keys[0]`` the very last);
        a block the request of another session uses is shared from then on."""
        owner, blocks, fresh, shared = self._owner, self._blocks, self._fresh, self._shared
        used = False
        for key in reversed(keys):
            if not isinstance(key, bytes):
                raise TypeError(f"keys must be bytes, got {type(key).__name__}")
            held = owner.get(key)
            if held is None:
                continue
            s = fresh.pop(key, held) if fresh else held
            if s is held or s.seq not in self._sessions:
                held.blocks.move_to_end(key)
                if held is shared:
                    used = True
            else:
                used = True
                del held.blocks[key]
                if not held.blocks:
                    del self._recency[held.seq]
                if not shared.blocks:
                    self._recency[0] = shared
                shared.blocks[key] = blocks[key]
                owner[key] = shared
        if used:
            shared.last = self._time()
            self._recency.move_to_end(0)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.insert_many(((key, block),))

    def insert_many(self, items: Iterable[tuple[OffloadKey, BlockStatus]]) -> None:
        """A store's blocks (head first) join their request's session, ahead of its
        other blocks, the deepest first to go."""
        batch = items if isinstance(items, list) else list(items)
        blocks = self._blocks
        for key, _ in batch:
            if not isinstance(key, bytes):
                raise TypeError(f"keys must be bytes, got {type(key).__name__}")
            if key in blocks:
                raise ValueError("insert_many: key is already resident")
        if not batch:
            return
        fresh, owner = self._fresh, self._owner
        default = self._current
        if default is None:
            default = self._new_session(None, self._time())
            self._current = default
        unheard = []
        for key, block in batch:
            s = fresh.pop(key, None)
            blocks[key] = block
            if s is not None and s.seq in self._sessions:
                # Heard in its request: deeper than the request's blocks already held.
                owner[key] = s
                if not s.blocks:
                    self._holding(s)
                s.blocks[key] = block
                s.blocks.move_to_end(key, last=False)
            else:
                unheard.append((key, block))
        if unheard and not default.blocks:
            self._holding(default)
        for key, block in reversed(unheard):  # after the session's blocks, deepest first
            owner[key] = default
            default.blocks[key] = block

    def remove(self, key: OffloadKey) -> None:
        if self._blocks.pop(key, None) is None:
            return
        s = self._owner.pop(key)
        del s.blocks[key]
        if not s.blocks:
            del self._recency[s.seq]

    # --- ranking ----------------------------------------------------------------------

    def _gap(self, s: _Session) -> float:
        return s.gap if s.gap >= 0 else self._prior

    def _holding(self, s: _Session) -> None:
        """``s``, which held no block, gets one."""
        self._recency[s.seq] = s
        heapq.heappush(self._due, (-(s.last + self._gap(s)), s.seq, s.version))

    def _clean_due(self, now: float) -> None:
        """Drop stale entries from the top of the heap of due sessions, and rebuild it
        when most of it is stale."""
        due, recency, overdue = self._due, self._recency, self.overdue
        while due:
            _, seq, version = due[0]
            s = recency.get(seq)
            if s is not None and s.version == version and now - s.last < overdue * self._gap(s):
                break
            heapq.heappop(due)
        if len(due) > 2 * len(recency) + 64:
            due[:] = [
                (-(s.last + self._gap(s)), s.seq, s.version)
                for s in recency.values()
                if now - s.last < overdue * self._gap(s) and s.seq
            ]
            heapq.heapify(due)

    def _idle(self, now: float) -> Iterator[tuple[float, _Session]]:
        """Idle sessions holding blocks with their expected wait (their time away),
        the longest away first."""
        overdue, shared = self.overdue, self._shared
        for s in self._recency.values():
            away = now - s.last
            if away >= overdue * self._gap(s) or s is shared:
                yield away, s

    def _due_now(self, now: float) -> Iterator[tuple[float, _Session]]:
        """Due sessions holding blocks with their expected wait, the furthest first:
        the heap walked in order without changing it."""
        due, recency, overdue = self._due, self._recency, self.overdue
        if not due:
            return
        frontier = [(due[0], 0)]
        seen: set[int] = set()
        size = len(due)
        while frontier:
            (_, seq, version), i = heapq.heappop(frontier)
            for j in (2 * i + 1, 2 * i + 2):
                if j < size:
                    heapq.heappush(frontier, (due[j], j))
            s = recency.get(seq)
            if s is None or s.version != version or seq in seen:
                continue
            gap = self._gap(s)
            away = now - s.last
            if away < overdue * gap:
                seen.add(seq)
                yield (gap - away if gap > away else 0.0), s

    def _ranked(self, now: float) -> Iterator[_Session]:
        """Sessions holding blocks, the first victim first: the furthest next turn
        (ties: the longest away). Idle sessions come in order of their last turn, due
        ones from the heap; the two streams merge."""
        idle, due = self._idle(now), self._due_now(now)
        a, b = next(idle, None), next(due, None)
        while a is not None or b is not None:
            if b is None or (
                a is not None and (a[0] > b[0] or (a[0] == b[0] and a[1].last <= b[1].last))
            ):
                assert a is not None
                yield a[1]
                a = next(idle, None)
            else:
                yield b[1]
                b = next(due, None)

    def admissible(self, keys: list[OffloadKey], full: bool) -> list[OffloadKey]:
        """When storing would evict, the request's deepest blocks that could only go in
        by evicting blocks of their own session, or of a session due sooner, are
        declined."""
        if not full or not keys or not self.admission or self._measured < WARM_GAPS:
            return keys
        s = self._fresh.get(keys[0], self._current)
        if s is None:
            return keys
        room = self.capacity - len(self._blocks)
        now = self._time()
        mine = self._wait(s, now)
        want = len(keys)
        for victim in self._ranked(now):
            if victim is s or self._wait(victim, now) < mine:
                break
            for block in victim.blocks.values():
                if block.ref_cnt == 0:
                    room += 1
                    if room >= want:
                        return keys
        return keys[: max(room, 0)]

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        for s in self._ranked(self._time()):
            for key, block in s.blocks.items():
                if block.ref_cnt == 0 and key not in protected:
                    victims.append((key, block))
                    if len(victims) == n:
                        break
            if len(victims) == n:
                break
        else:
            return None
        blocks, owner, recency = self._blocks, self._owner, self._recency
        for key, _ in victims:
            del blocks[key]
            s = owner.pop(key)
            del s.blocks[key]
            if not s.blocks:
                del recency[s.seq]
        return victims
