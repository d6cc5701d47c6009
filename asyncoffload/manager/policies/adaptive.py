"""An adaptive policy (``auto``): the tier follows whichever candidate hits most at full size.

No single policy wins everywhere: ``kv`` leads on multi-turn chat at small capacities,
LRU where recency is all there is, ARC where scans pass through a hot set. This policy
measures every candidate (default ``lru``, ``arc``, ``kv``) at the tier's full size, on
every request, and the real tier follows the one that hits most lately.

Ghosts. A candidate that does not lead runs as a *ghost*: a tier of the real tier's
capacity that holds keys only, driven exactly as the engine and the replay drive the
real manager (prefix lookup, the load's touch of the hits, the store's touch of the
rest, the store with the policy's own admission and an all-or-nothing eviction that
protects the store's keys), each store complete at once. Ghosts run on the manager's C
core (``mgrcore.simulate``: one call a request, deciding exactly as the Python manager
and policies do); where it cannot be built (``ASYNCOFFLOAD_NO_NATIVE``, no compiler),
the same decisions are made in Python, at about 1x LRU's manager time per candidate.

The leader is scored by the real tier itself: a request's prefix of blocks present
(ready, or being stored: a ghost's stores complete at once, so under concurrent
requests this is what its ghost would count). Its ghost waits meanwhile, which is what
keeps ``auto`` within 1.5x LRU's manager time (one ghost fewer). While nothing has
switched, the real tier's score and its ghost's are the same number
(tests/test_policy_adaptive.py). A new leader is scored by its ghost, which ran while
another led and is warm, until ``warmup`` capacities of prompt blocks have gone by:
the real tier behind it is still the old leader's.

Feed. Under a manager that does not track requests (the engine's and the replay's),
the request arrives with ``lookup_prefix`` (``on_request``; the engine's ``alookup``
looks up twice and feeds once); under a request-scoped manager (vLLM's pattern) with the
request's touch at its first store. ``touch`` and every other call go straight to the
leader (rebound methods, no indirection), so every :class:`CachePolicy` guarantee is
the leader's own.

Leader (issue 40). After each request every rival (a candidate not leading) adds to its
*surplus* its prefix hits less the leader's, less ``margin`` (0.005) per prompt block,
floored at 0: a CUSUM (Page, 1954) of its lead, which forgets everything before the
lead last fell to nothing. So no past lead of the leader holds off a sustained change:
the rule of before compared hit rates since the last switch, and on a trace where kv led
for 16 capacities and then trailed LRU and ARC by 0.08 it never switched. At every
epoch end (``epoch``: a quarter capacity of prompt blocks) the tier switches once a
rival's surplus is at least ``surplus`` (0.1) capacities of blocks and ``confidence``
(2.5) times the root of the summed squares of its per-request differences over the run
(a lead made by a few large requests is noise until more agree: one request of the
Claude Code sessions is a capacity at 1%). A sustained lead of d reaches the first bar
``surplus / (d - margin)`` capacities after it shows (1.3 for 0.08). The bar says when
to leave; where to, the largest surplus says, cleared or not (a rival behind a noisier
run may be further ahead). While a leader that learns as it goes
(``kv``) is in its first 12 capacities of traffic, the bar is 4 times higher: its
deficit then overstates what it loses. It starts as ``initial`` (``kv``). A switch
starts every score again.

Switching hands every tracked block, ready or being stored, to the new candidate (reset
first), in recency order (the old candidate's ``items()`` order; ``kv``'s by last use):
the block records are shared, so reference counts and slots are untouched, and nothing
is lost or duplicated. The new leader starts where its ghost is: ARC with T1's target,
its ghost lists and T2 for the blocks its ghost has in T2; kv with its ghost's table,
counts and clock and what it knows of each block (:meth:`KVPolicy.adopt`: a kv started
empty would learn again for capacities, and switching into it cost 0.08-0.22
capacities of hits on ``mixed`` at 10%; adopted, 0-0.05). The old leader's ghost, which
waited, starts again from the real tier (:meth:`Ghost.restart`: kv with what the real
kv learned, ARC with its T2, not its target or ghost lists), so that a return to it is
judged by what it would hold.

Why full-size ghosts and not a sample. Until issue 24 the candidates ran as miniature
tiers (1/16 of the capacity) on a 1/16 sample of the requests (SHARDS, Waldspurger et
al., FAST'15), sampled by the CRC-32 of the prompt's key at depth 8. On the ``mixed``
trace family (docs/policies.md) those miniature tiers ranked ``kv`` first where ARC hit
0.017-0.019 more at full size. Behind system prompts longer than 8 blocks the sample
is a few lumps (every request behind one prompt in or out together), but sampling
single blocks or by the last key ranked ``kv`` first too: requests that do not shrink
with the sample make a miniature tier a different cache. Full-size ghosts in C cost
less than the sampled Python shadows did, and have no sample to be fooled by.

Why not expert weighting (LeCaR, CACHEUS): its experts each rank the *real* resident
set and learn from its evictions, and they must rank blocks they did not choose, which
``kv``'s admission and learned table cannot. Ghosts run the unchanged policies.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import repeat
from typing import Any

from asyncoffload._native import load_mgrcore
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus, LookupResult
from asyncoffload.manager.policies.arc import ARCPolicy
from asyncoffload.manager.policies.base import CachePolicy, get_policy_cls, register_policy
from asyncoffload.manager.policies.kv import KVPolicy, adoption

__all__ = ["AdaptivePolicy", "Ghost"]


#: Candidates, in order of preference on equal scores.
CANDIDATES = ("lru", "arc", "kv")
#: The switch rule's defaults (see :class:`AdaptivePolicy`; chosen on the tuning traces
#: of docs/policies.md).
EPOCH = 0.25
MARGIN = 0.005
SURPLUS = 0.1
CONFIDENCE = 2.5
PATIENCE = 1
WARMUP = 2.0
#: The scores' window: they halve every WINDOW capacities of traffic (or every epoch,
#: if longer), at an epoch's end.
WINDOW = 4.0
#: While a leader that learns online is in the first LEARNING capacities of traffic
#: (since the start or ``clear``), the surplus it must be beaten by is LEARNING_STRAIN
#: times higher.
LEARNING = 12.0
LEARNING_STRAIN = 4.0
#: kv's ghost list, in capacities (KVPolicy's default ``ghost_factor``, the C core's).
KV_GHOST_FACTOR = 4.0
#: Switches that ``AdaptivePolicy.timeline`` remembers.
TIMELINE = 256
_RESULTS = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING)


class Ghost:
    """A candidate run at the tier's full size on every request, keys only.

    ``request(keys)`` runs one request as the engine runs it and returns its prefix
    hits: lookup, the load's touch of the hits, the store's touch of the rest, the store
    (admission, eviction protecting the request's keys, insert), at once complete. On
    the C core (``native``) when it builds, else with the policy's Python code: the same
    decisions either way."""

    __slots__ = (
        "block",
        "capacity",
        "core",
        "hits",
        "last",
        "name",
        "native",
        "policy",
        "request",
        "spread",
        "surplus",
        "total",
    )

    def __init__(self, name: str, capacity: int, *, native: bool | None = None) -> None:
        self.name = name
        self.capacity = capacity
        #: Prefix hits, decayed with the epochs, and since the start (or ``clear``).
        self.hits = 0.0
        self.total = 0
        #: The last request's prefix hits.
        self.last = 0
        #: Hits gained over the leader less the margin, since that was last 0 (blocks),
        #: and the squares of the per-request differences summed over that run.
        self.surplus = 0.0
        self.spread = 0.0
        self.core: Any = None
        self.policy: CachePolicy | None = None
        mgrcore = load_mgrcore() if native is not False else None
        if mgrcore is not None and (
            name not in mgrcore.POLICIES or capacity > mgrcore.MAX_NUM_BLOCKS
        ):
            mgrcore = None  # not in C, or past its slot ids: Python (nothing per slot)
        if native and mgrcore is None:
            raise RuntimeError(f"the native manager core cannot run a {name} ghost here")
        self.native = mgrcore is not None
        #: One idle record for every block of a Python ghost: it never loads or pins.
        self.block = BlockStatus(0)
        self.block.ref_cnt = 0
        if mgrcore is not None:
            self.core = mgrcore.Manager(capacity, name, False, _RESULTS)
            self.request: Callable[[Sequence[OffloadKey]], int] = self.core.simulate
        else:
            self.policy = get_policy_cls(name)(capacity)
            self.request = self._python_request

    def _python_request(self, keys: Sequence[OffloadKey]) -> int:
        # CPUOffloadingManager's decisions, with every block idle and ready.
        policy = self.policy
        assert policy is not None
        get = policy.get
        n = 0
        for key in keys:
            if get(key) is None:
                break
            n += 1
        if n:
            policy.touch(keys[:n])
        if n < len(keys):
            rest = keys[n:]
            policy.touch(rest)
            offered = [key for key in rest if get(key) is None]
            if offered:
                free = self.capacity - len(policy)
                to_store = policy.admissible(offered, len(offered) > free)
                if to_store and (
                    len(to_store) <= free
                    or policy.evict(len(to_store) - free, set(rest)) is not None
                ):
                    policy.insert_many(list(zip(to_store, repeat(self.block))))
        return n

    def resident(self) -> int:
        """Blocks the ghost holds."""
        if self.core is not None:
            return len(self.core.resident_keys())
        assert self.policy is not None
        return len(self.policy)

    def state(self) -> object:
        """Everything the ghost holds, as plain values (for tests)."""
        if self.core is not None:
            return self.core.snapshot()
        assert self.policy is not None
        return _state(self.policy)

    def restart(self, policy: CachePolicy, keys: Sequence[OffloadKey]) -> None:
        """Start again where a real tier running ``policy`` (this ghost's candidate) is:
        holding ``keys`` (least recently used first), with kv's learned state and ARC's
        T2 membership (not its ghost lists or target: they start empty)."""
        self.clear()
        if isinstance(policy, KVPolicy):
            state = policy.snapshot()
            if self.core is None:
                assert isinstance(self.policy, KVPolicy)
                self.policy.adopt(state, [(key, self.block) for key in keys])
                return
            held, gone = adoption(state, keys, int(self.capacity * KV_GHOST_FACTOR))
            self.core.kv_restore(
                int(state["tick"]),
                int(state["inserts"]),
                float(state["last_victim"]),
                state["entered"],
                state["reused"],
                state["table"],
                held,
                gone,
                int(state["rebuilds"]),
                state["rebuild_ticks"],
                int(state["traffic"]),
            )
            return
        request = self.request
        for key in keys:
            request((key,))  # a miss, stored: in this order
        if isinstance(policy, ARCPolicy):
            for key in policy.t2:
                request((key,))  # a second use: into T2, in T2's order

    def kv_state(self) -> dict[str, Any]:
        """A kv ghost's state, as :meth:`KVPolicy.snapshot` gives it."""
        if self.core is not None:
            state: dict[str, Any] = self.core.snapshot()["kv"]
            return state
        assert isinstance(self.policy, KVPolicy)
        return self.policy.snapshot()

    def clear(self) -> None:
        """Forget everything, history (ghost lists, learned values) included."""
        if self.core is not None:
            self.core = type(self.core)(self.capacity, self.name, False, _RESULTS)
            self.request = self.core.simulate
        else:
            assert self.policy is not None
            self.policy.clear()
        self.hits = 0.0
        self.total = 0
        self.last = 0
        self.surplus = self.spread = 0.0


@register_policy("auto")
class AdaptivePolicy(CachePolicy):
    """Follows the candidate whose full-size ghost hits most (see the module docstring)."""

    touch_before_store = True
    observes_store_misses = True
    observes_requests = True

    def __init__(
        self,
        capacity: int,
        *,
        candidates: Sequence[str] = CANDIDATES,
        initial: str = "kv",
        epoch: float = EPOCH,
        margin: float = MARGIN,
        surplus: float = SURPLUS,
        confidence: float = CONFIDENCE,
        patience: int = PATIENCE,
        warmup: float = WARMUP,
        native: bool | None = None,
    ) -> None:
        """``candidates`` name registered policies (not ``auto``); ``initial`` is the
        first leader. After each request every rival adds its prefix hits less the
        leader's, less ``margin`` per prompt block, to its surplus (floored at 0). At
        the end of every ``epoch`` capacities of prompt blocks the tier switches once a
        rival's surplus is at least ``surplus`` capacities of blocks (4 times that while
        a leader that learns online is in its first 12 capacities) and ``confidence``
        times the root of the summed squares of its per-request differences, at
        ``patience`` epoch ends in a row, to the rival with the largest surplus. The
        scores (:meth:`scores`) halve every 4 capacities or every epoch, whichever is
        longer. A new leader is scored by its ghost for ``warmup``
        capacities of prompt blocks. ``native`` runs the ghosts on the C core (``True``:
        or raise; ``False``: in Python; ``None``: where it builds)."""
        super().__init__(capacity)
        names = list(dict.fromkeys(candidates))
        if not names:
            raise ValueError("candidates must name at least one policy")
        for name in names:
            if get_policy_cls(name) is AdaptivePolicy:
                raise ValueError("auto cannot be its own candidate")
        if initial not in names:
            raise ValueError(f"initial {initial!r} is not one of the candidates {names}")
        if not epoch > 0:
            raise ValueError(f"epoch must be positive, got {epoch}")
        if not margin >= 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if not surplus >= 0:
            raise ValueError(f"surplus must be >= 0, got {surplus}")
        if not confidence >= 0:
            raise ValueError(f"confidence must be >= 0, got {confidence}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if not warmup >= 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.candidates = tuple(names)
        self.initial = initial
        self.margin = margin
        self.confidence = confidence
        self.patience = patience
        self._surplus_blocks = surplus * capacity
        self._epoch_blocks = max(1.0, epoch * capacity)
        self._window_blocks = max(epoch, WINDOW) * capacity
        self._learning_blocks = LEARNING * capacity
        self._warmup_blocks = warmup * capacity
        self.ghosts = [Ghost(name, capacity, native=native) for name in names]
        self._policies: dict[str, CachePolicy] = {}
        self._seen = 0.0
        self._epoch_seen = 0.0
        self._window_seen = 0.0
        self._total = 0
        #: The ghost that beat the leader at the last epoch ends, and how many in a row.
        self._challenger: str | None = None
        self._streak = 0
        #: Leader changes since creation or the last ``clear``, and the last
        #: :data:`TIMELINE` of them: ``(prompt blocks seen before it, from, to)``.
        self.switches = 0
        self.timeline: deque[tuple[int, str, str]] = deque(maxlen=TIMELINE)
        self._traffic = 0
        self._leader: CachePolicy = self._policy_for(initial)
        self._bind()
        self._pause_lead()  # the real tier is the initial leader from the start

    # --- the leader -------------------------------------------------------------------

    @property
    def leader(self) -> str:
        """The candidate the tier follows now."""
        return self._leader.name

    @property
    def leader_policy(self) -> CachePolicy:
        """The leader's policy instance (for inspection; never call it directly)."""
        return self._leader

    def scores(self) -> dict[str, float]:
        """Each ghost's hit rate over the decayed window (0 before any request)."""
        seen = self._seen
        return {g.name: g.hits / seen if seen else 0.0 for g in self.ghosts}

    def snapshot(self) -> dict[str, Any]:
        """Everything the policy holds, as plain values (for tests): the leader and its
        state, the scores and each ghost's state."""
        return {
            "leader": self.leader,
            "blocks": [(key, block.block_id, block.ref_cnt) for key, block in self.items()],
            "leader_state": _state(self._leader),
            "ghosts": [(g.name, g.hits, g.surplus, g.spread, g.state()) for g in self.ghosts],
            "seen": (self._seen, self._epoch_seen),
            "window_seen": self._window_seen,
            "challenger": (self._challenger, self._streak),
            "switches": self.switches,
            "timeline": list(self.timeline),
        }

    def _policy_for(self, name: str) -> CachePolicy:
        policy = self._policies.get(name)
        if policy is None:
            policy = self._policies[name] = get_policy_cls(name)(self.capacity)
        return policy

    def _bind(self) -> None:
        # Straight to the leader: no indirection on the manager's hot calls.
        leader = self._leader
        self._leader_get = leader.get
        self._lead = next(g for g in self.ghosts if g.name == leader.name)
        self._rivals = [g for g in self.ghosts if g is not self._lead]
        # A new leader is scored by its ghost (warm: it ran while another led) through
        # the warm-up, then by the real tier, and its ghost waits (see the module doc).
        self._running = list(self.ghosts)
        self._lead_paused = False
        self.get = leader.get  # type: ignore[method-assign]
        self.insert = leader.insert  # type: ignore[method-assign]
        self.insert_many = leader.insert_many  # type: ignore[method-assign]
        self.remove = leader.remove  # type: ignore[method-assign]
        self.evict = leader.evict  # type: ignore[method-assign]
        self.admissible = leader.admissible  # type: ignore[method-assign]
        self.items = leader.items  # type: ignore[method-assign]
        self.touch = leader.touch  # type: ignore[method-assign]

    def _pause_lead(self) -> None:
        self._running = [g for g in self.ghosts if g is not self._lead]
        self._lead_paused = True

    def switch_to(self, name: str) -> None:
        """Make ``name`` the leader now, handing it every tracked block in recency
        order (a no-op if it leads already). The policy calls it at an epoch's end;
        tests and experiments may call it between manager calls."""
        if name not in self.candidates:
            raise ValueError(f"{name!r} is not one of the candidates {list(self.candidates)}")
        old = self._leader
        if old.name == name:
            return
        blocks = _recency_order(old)
        if self._lead_paused:
            # The old leader's ghost waited while the real tier ran its policy: it starts
            # again from the real tier (stale or, for an initial leader, empty, it would
            # judge that candidate by a tier it no longer is).
            self._lead.restart(old, [key for key, _ in blocks])
        new = self._policy_for(name)
        new.clear()
        ghost = next(g for g in self.ghosts if g.name == name)
        if isinstance(new, ARCPolicy):
            # ARC starts where its ghost is: T1's target, the ghost lists, T2 membership.
            _adopt_arc(new, ghost, blocks)
        elif isinstance(new, KVPolicy):
            # kv too: its ghost's table, counts and clock, and what it knows of each
            # block (a kv started empty would learn again for capacities).
            new.adopt(ghost.kv_state(), blocks)
        else:
            insert = new.insert
            for key, block in blocks:
                insert(key, block)
        if len(new) != len(blocks):  # pragma: no cover - a candidate's own bug
            raise RuntimeError(f"switching to {name} tracked {len(new)} of {len(blocks)} blocks")
        old.clear()
        self._leader = new
        self._challenger, self._streak = None, 0
        self.switches += 1
        self.timeline.append((self._traffic, old.name, name))
        self._bind()
        # Every score starts again: the real tier is now another candidate's. The
        # warm-up counts again too.
        self._reset_scores()

    def _reset_scores(self) -> None:
        for g in self.ghosts:
            g.hits = 0.0
            g.total = 0
            g.surplus = g.spread = 0.0
        self._seen = self._epoch_seen = self._window_seen = 0.0
        self._total = 0

    def _end_epoch(self) -> None:
        # The bar: ``surplus`` capacities of blocks (four times that while a leader that
        # learns as it goes, kv, is in its first LEARNING capacities: its deficit then
        # overstates what it loses), and ``confidence`` times the root of the summed
        # squares of the run's per-request differences.
        bar = self._surplus_blocks
        if self._leader.learns_online and self._traffic < self._learning_blocks:
            bar *= LEARNING_STRAIN
        z = self.confidence
        best = None
        for g in self._rivals:
            if (
                g.surplus > 0.0
                and g.surplus >= bar
                and g.surplus >= z * math.sqrt(g.spread)
                and (best is None or g.surplus > best.surplus)
            ):
                best = g
        if best is not None:
            # The bar says when to leave; where to, the largest surplus says, cleared or
            # not (a rival behind a noisier run may be further ahead).
            for g in self._rivals:
                if g.surplus > best.surplus:
                    best = g
            if best.name == self._challenger:
                self._streak += 1
            else:
                self._challenger, self._streak = best.name, 1
            if self._streak >= self.patience:
                self.switch_to(best.name)  # every score starts again
                return
        else:
            self._challenger, self._streak = None, 0
        self._epoch_seen = 0.0
        if self._window_seen >= self._window_blocks:
            self._window_seen = 0.0
            self._seen *= 0.5
            for g in self.ghosts:
                g.hits *= 0.5

    # --- CachePolicy ------------------------------------------------------------------

    def on_request(self, keys: Sequence[OffloadKey]) -> None:
        if not keys:
            return
        if len(set(keys)) != len(keys):
            # A request-scoped touch lists its loaded keys, then all it offers.
            keys = list(dict.fromkeys(keys))
        for ghost in self._running:
            n = ghost.last = ghost.request(keys)
            if n:
                ghost.hits += n
                ghost.total += n
        k = len(keys)
        self._seen += k
        self._total += k
        self._traffic += k
        lead = self._lead
        if self._lead_paused:
            # The leader's own: the real tier's prefix of blocks present (ready or being
            # stored, as a ghost's stores complete at once).
            found = list(map(self._leader_get, keys))
            n = lead.last = found.index(None) if None in found else len(found)
            if n:
                lead.hits += n
                lead.total += n
        elif self._total >= self._warmup_blocks:
            self._pause_lead()
        # Each rival's surplus over the leader: a CUSUM of the per-request lead less the
        # margin, which forgets everything before the lead last fell to nothing.
        n = lead.last
        toll = self.margin * k
        for ghost in self._rivals:
            x = ghost.last - n
            gain = ghost.surplus + x - toll
            if gain > 0.0:
                ghost.surplus = gain
                ghost.spread += x * x
            elif ghost.surplus:
                ghost.surplus = ghost.spread = 0.0
        self._epoch_seen += k
        self._window_seen += k
        if self._epoch_seen >= self._epoch_blocks:
            self._end_epoch()

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._leader.touch(keys)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        if self._leader.observes_store_misses:
            self._leader.on_store_miss(keys)

    # The manager's calls below are rebound to the leader's by ``_bind``; these bodies
    # only say what they do.

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._leader.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self._leader.insert(key, block)

    def insert_many(self, items: Iterable[tuple[OffloadKey, BlockStatus]]) -> None:
        self._leader.insert_many(items)

    def admissible(self, keys: list[OffloadKey], full: bool) -> list[OffloadKey]:
        return self._leader.admissible(keys, full)

    def remove(self, key: OffloadKey) -> None:
        self._leader.remove(key)

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        return self._leader.evict(n, protected)

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return self._leader.items()

    def clear(self) -> None:
        """Forget everything: blocks, ghosts, scores; the leader is ``initial`` again."""
        for policy in self._policies.values():
            policy.clear()
        for ghost in self.ghosts:
            ghost.clear()
        self._reset_scores()
        self._challenger, self._streak = None, 0
        self.switches = 0
        self.timeline.clear()
        self._traffic = 0
        self._leader = self._policy_for(self.initial)
        self._bind()
        self._pause_lead()

    def __len__(self) -> int:
        return len(self._leader)

    def __repr__(self) -> str:
        scores = ", ".join(f"{name} {rate:.3f}" for name, rate in self.scores().items())
        where = "C" if all(g.native for g in self.ghosts) else "Python"
        return (
            f"<AdaptivePolicy leader={self.leader} [{len(self)} of {self.capacity}, "
            f"full-size ghosts in {where}: {scores}; {self.switches} switches]>"
        )


def _adopt_arc(new: ARCPolicy, ghost: Ghost, blocks: list[tuple[OffloadKey, BlockStatus]]) -> None:
    """Start ARC ``new`` on ``blocks`` (recency order) with what its ghost learned: the
    target size of T1, its ghost lists, and T2 for the blocks the ghost has in T2."""
    if ghost.core is not None:
        snap = ghost.core.snapshot()
        t2_keys = {row[0] for row in snap["lists"][1]}
        b1, b2 = snap["lists"][2], snap["lists"][3]
        target = float(snap["target_t1"])
    else:
        g = ghost.policy
        assert isinstance(g, ARCPolicy)
        t2_keys, b1, b2, target = set(g.t2), list(g.b1), list(g.b2), g.target_t1
    for key, block in blocks:
        (new.t2 if key in t2_keys else new.t1)[key] = block
        new._blocks[key] = block
    held = new._blocks
    new.b1.update((key, None) for key in b1 if key not in held)
    new.b2.update((key, None) for key in b2 if key not in held)
    new.target_t1 = min(target, float(new.capacity))


def _recency_order(policy: CachePolicy) -> list[tuple[OffloadKey, BlockStatus]]:
    """``policy``'s blocks, least recently used first as far as it can tell: ``kv``
    (whose ``items()`` go class by class) by last use, the others in ``items()`` order."""
    snapshot: Callable[[], dict[str, Any]] | None = getattr(policy, "snapshot", None)
    if policy.name == "kv" and snapshot is not None:
        rows = [row for queue in snapshot()["queues"] for row in queue]
        rows.sort(key=lambda row: row[2])  # stable: queue order breaks ties
        get = policy.get
        out: list[tuple[OffloadKey, BlockStatus]] = []
        for row in rows:
            block = get(row[0])
            assert block is not None
            out.append((row[0], block))
        return out
    return list(policy.items())


def _state(policy: CachePolicy) -> object:
    """A candidate's state as plain values: ``kv``'s own dump, else its attributes."""
    snapshot: Callable[[], object] | None = getattr(policy, "snapshot", None)
    if snapshot is not None:
        return snapshot()
    out = []
    for name, value in sorted(vars(policy).items()):
        if callable(value):
            continue  # bound methods kept as attributes (a fast ``get``) are not state
        if isinstance(value, dict):
            value = [
                (k, (v.block_id, v.ref_cnt) if isinstance(v, BlockStatus) else v)
                for k, v in value.items()
            ]
        out.append((name, repr(value)))
    return out
