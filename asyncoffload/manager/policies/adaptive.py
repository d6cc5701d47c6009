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
the real tier behind it starts cold, and judging it by that would switch straight back.

Feed. Under a manager that does not track requests (the engine's and the replay's),
the request arrives with ``lookup_prefix`` (``on_request``; the engine's ``alookup``
looks up twice and feeds once); under a request-scoped manager (vLLM's pattern) with the
request's touch at its first store. ``touch`` and every other call go straight to the
leader (rebound methods, no indirection), so every :class:`CachePolicy` guarantee is
the leader's own.

Leader. Scores are prompt blocks hit against blocks seen, twice: over a window halved
every epoch of ``epoch * capacity`` (4x) blocks, and since the last switch. At an
epoch's end the tier switches to the best candidate once it leads the leader by more
than ``margin`` (0.005) in both, at ``patience`` (2) epoch ends in a row; while the
leader learns online (``kv``: its table starts empty, and its ghost's too) and fewer
than ``warmup`` (12) capacities have gone by, only a lead of 4x the margin counts. It
starts as ``initial`` (``kv``). A switch starts every score again.

Switching hands every tracked block, ready or being stored, to the new candidate (reset
first), in recency order (the old candidate's ``items()`` order; ``kv``'s by last use):
the block records are shared, so reference counts and slots are untouched, and nothing
is lost or duplicated. ARC starts where its ghost is (T1's target, its ghost lists, T2
for the blocks its ghost has in T2); the others start with no history. The old leader's
ghost runs again from where it stopped, stale until the traffic refreshes it.

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

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import repeat
from typing import Any

from asyncoffload._native import load_mgrcore
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus, LookupResult
from asyncoffload.manager.policies.arc import ARCPolicy
from asyncoffload.manager.policies.base import CachePolicy, get_policy_cls, register_policy

__all__ = ["AdaptivePolicy", "Ghost"]


#: Candidates, in order of preference on equal scores.
CANDIDATES = ("lru", "arc", "kv")
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
        "name",
        "native",
        "policy",
        "request",
        "total",
    )

    def __init__(self, name: str, capacity: int, *, native: bool | None = None) -> None:
        self.name = name
        self.capacity = capacity
        #: Prefix hits, decayed with the epochs, and since the start (or ``clear``).
        self.hits = 0.0
        self.total = 0
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
        epoch: float = 4.0,
        margin: float = 0.005,
        patience: int = 2,
        warmup: float = 12.0,
        native: bool | None = None,
    ) -> None:
        """``candidates`` name registered policies (not ``auto``); ``initial`` is the
        first leader. Every ``epoch`` capacities of prompt blocks the scores halve and
        the leader may change, to a ghost whose hit rate beats the leader's by more than
        ``margin``, over the decayed window and since the start, at ``patience`` epoch
        ends in a row (4 times ``margin`` while the leader learns online, as ``kv`` does,
        and fewer than ``warmup`` capacities of prompt blocks have gone by).
        ``native`` runs the ghosts on the C core (``True``: or raise; ``False``: in
        Python; ``None``: where it builds)."""
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
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if not warmup >= 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.candidates = tuple(names)
        self.initial = initial
        self.margin = margin
        self.patience = patience
        self._epoch_blocks = max(1.0, epoch * capacity)
        self._warmup_blocks = warmup * capacity
        self.ghosts = [Ghost(name, capacity, native=native) for name in names]
        self._policies: dict[str, CachePolicy] = {}
        self._seen = 0.0
        self._epoch_seen = 0.0
        self._total = 0
        #: The ghost that beat the leader at the last epoch ends, and how many in a row.
        self._challenger: str | None = None
        self._streak = 0
        #: Leader changes since creation or the last ``clear``.
        self.switches = 0
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
            "ghosts": [(g.name, g.hits, g.state()) for g in self.ghosts],
            "seen": (self._seen, self._epoch_seen),
            "challenger": (self._challenger, self._streak),
            "switches": self.switches,
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
        new = self._policy_for(name)
        new.clear()
        if isinstance(new, ARCPolicy):
            # ARC starts where its ghost is: T1's target, the ghost lists, T2 membership.
            _adopt_arc(new, next(g for g in self.ghosts if g.name == name), blocks)
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
        self._bind()
        # Every score starts again: the real tier is now another candidate's, and the
        # old leader's ghost runs again from where it stopped (stale until it catches
        # up). The warm-up counts again too.
        self._reset_scores()

    def _reset_scores(self) -> None:
        for g in self.ghosts:
            g.hits = 0.0
            g.total = 0
        self._seen = self._epoch_seen = 0.0
        self._total = 0

    def _end_epoch(self) -> None:
        seen = self._seen
        lead = best = self._lead
        for s in self.ghosts:
            if s.hits > best.hits:
                best = s
        # A leader that learns as it goes (kv) is left early on only for a clear lead:
        # its ghost is learning too, and a cold start of it costs more than it shows.
        margin = self.margin
        if self._leader.learns_online and self._total < self._warmup_blocks:
            margin *= 4
        if (
            best is not lead
            and best.hits - lead.hits > margin * seen
            and best.total - lead.total > margin * self._total
        ):
            if best.name == self._challenger:
                self._streak += 1
            else:
                self._challenger, self._streak = best.name, 1
            if self._streak >= self.patience:
                self.switch_to(best.name)  # every score starts again
                return
        else:
            self._challenger, self._streak = None, 0
        self._seen = seen * 0.5
        for g in self.ghosts:
            g.hits *= 0.5
        self._epoch_seen = 0.0

    # --- CachePolicy ------------------------------------------------------------------

    def on_request(self, keys: Sequence[OffloadKey]) -> None:
        if not keys:
            return
        if len(set(keys)) != len(keys):
            # A request-scoped touch lists its loaded keys, then all it offers.
            keys = list(dict.fromkeys(keys))
        for ghost in self._running:
            n = ghost.request(keys)
            if n:
                ghost.hits += n
                ghost.total += n
        k = len(keys)
        self._seen += k
        self._total += k
        lead = self._lead
        if self._lead_paused:
            # The leader's own: the real tier's prefix of blocks present (ready or being
            # stored, as a ghost's stores complete at once).
            found = list(map(self._leader_get, keys))
            n = found.index(None) if None in found else len(found)
            if n:
                lead.hits += n
                lead.total += n
        elif self._total >= self._warmup_blocks:
            self._pause_lead()
        self._epoch_seen += k
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
