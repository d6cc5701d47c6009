"""An adaptive policy (``auto``): the tier follows whichever candidate would hit most.

No single policy wins everywhere: ``kv`` leads on multi-turn chat at small capacities,
LRU where recency is all there is, ARC where scans pass through a hot set. This policy
runs a *miniature simulation* of each candidate (SHARDS, Waldspurger et al., FAST'15;
"Cache Modeling and Optimization using Miniature Simulations", ATC'17) and lets the real
tier follow the one that hits most lately.

Shadows. Each candidate (default ``lru``, ``arc``, ``kv``) runs as a shadow tier of
``capacity * rate`` slots on a spatially sampled share ``rate`` of the workload, driven
exactly as the manager drives a policy: a request's prefix lookup (its hits are the
shadow's score), its ``touch``, then the store of its misses with the policy's own
admission and an all-or-nothing eviction that protects the store's keys. Shadows hold
keys only (one shared, idle block record), so a shadow of ``kv`` behaves like ``kv``.

Sampling is deterministic, by the key's bytes (CRC-32 of the key: trace keys are often
small counters, whose leading bytes are all zero, and Python's ``hash`` is salted), so
replays are reproducible. It samples whole requests, by the key at depth ``depth`` (8)
of the prompt, or its last key for a shorter one: the turns of a conversation share
their first turn's leading blocks, so a conversation is in the sample or out of it as a
whole, and the shadow of ``kv`` sees true request lengths and true last blocks (its
classes). The rate is ``1/16``, raised so that a shadow has at least ``min_shadow``
(256) slots; a tier of fewer slots is simulated at full size.

Leader. Scores are each shadow's prefix hits and the sampled prompt blocks, halved every
epoch of ``epoch * shadow capacity`` (4x) sampled blocks: a decayed window. At an
epoch's end the tier switches to the best shadow once it has beaten the leader's hit
rate by more than ``margin`` (0.005) at ``patience`` (2) epoch ends in a row. It starts
as ``initial`` (``kv``, the best candidate at most points measured).

Switching hands every tracked block, ready or being stored, to the new candidate (reset
first), in recency order (the old candidate's ``items()`` order; ``kv``'s by last use):
the block records are shared, so reference counts and slots are untouched, and nothing
is lost or duplicated. Between switches every call but ``touch`` goes straight to the
leader (rebound methods, no indirection), so every :class:`CachePolicy` guarantee is
the leader's own: no eviction of pinned, in-flight or protected blocks, eviction all or
nothing. A switch forgets the new leader's history (ghosts, learned values); the
shadows keep theirs.

How the choices were measured (block hit rates of full-size replays of ``lru``, ``arc``,
``kv`` at 1-50% capacity on four tuning workloads: ``synthetic:20000``, a second chat
workload with longer think times, a scan-over-hot-set workload and one whose hot set
shifts; the conversation trace and the ``family:`` traces were held out):

- *Which sampling.* Following the shadow that hit most over the whole run loses, against
  the best candidate, at worst / in sum over the 24 points: 0.013 / 0.036 sampling
  single blocks (SHARDS proper: ``kv``'s shadow sees sub-requests and loses its edge, so
  LRU is picked where ``kv`` is 0.013 better), 0.013 / 0.038 sampling requests by their
  first key (a shared system prompt puts every request in or out: no sample at all on
  two workloads), 0.013 / 0.055 by depth 1, 0.006 / 0.014 by depth 4, 0.004 / 0.008
  by depth 8. On the held-out conversation trace depth 8 picks the best candidate at
  every capacity; depth 1 would lose 0.031 at 5%, single blocks 0.002 at 20%.
- *Hysteresis.* Halving every 2 shadow capacities and switching at the first win flapped
  (up to 50 switches at 1%) and lost up to 0.016 to ``kv`` (each switch to ``kv``
  starts its learning over); every 4 with ``patience=2`` flaps at most 4 times, and no
  point is more than 0.004 below the best of LRU and ARC.
- *Cost* (manager time per prompt block against LRU, same process): 3 shadows at rate
  1/16 add 0.2-0.3x; with ``min_shadow=512`` the 1% tiers (rate ~1/3) cost 1.6-1.8x
  LRU, with 256 1.2-1.4x, losing at most 0.004 at any point. ``auto`` costs 1.05-1.20x
  LRU from 1% to 50% on the conversation trace and ``synthetic:20000`` (its leader,
  ``kv``, runs in C and is cheaper than LRU).

Why miniature simulation and not expert weighting (LeCaR, CACHEUS): LeCaR's experts each
rank the *real* resident set and learn from its evictions, which means running every
candidate at full size on every request (LRU + ARC + ``kv``: about 1 + 1.6 + 1.0 = 3.6x
LRU's manager time, against a budget of 1.5x), and candidates that can rank blocks they
did not choose, which ``kv``'s admission and learned table cannot. Shadows run the
unchanged policies on a sixteenth of the traffic.

Under a request-scoped manager (vLLM's pattern) the policy is ``touch_before_store``:
every candidate gets the engine's touch at a request's first store.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import compress, repeat
from operator import is_
from typing import Any
from zlib import crc32

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies.base import CachePolicy, get_policy_cls, register_policy

__all__ = ["AdaptivePolicy", "Shadow"]

#: Candidates, in order of preference on equal scores.
CANDIDATES = ("lru", "arc", "kv")
#: Sampling thresholds compare the CRC-32 of a key with ``rate * 2**32``.
_FULL = 1 << 32


class Shadow:
    """A candidate run as a small tier on the sampled requests: key-only blocks."""

    __slots__ = ("block", "capacity", "hits", "name", "policy")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.policy: CachePolicy = get_policy_cls(name)(capacity)
        #: One idle record for every block: the shadow never loads or pins.
        self.block = BlockStatus(0)
        self.block.ref_cnt = 0
        #: Prefix hits, decayed with the epochs.
        self.hits = 0.0

    def request(self, keys: Sequence[OffloadKey]) -> None:
        """One request as the manager runs it: prefix lookup, touch, store of the rest."""
        policy = self.policy
        # A touch moves blocks, never adds or drops one: what is resident now is
        # what the store finds after it. Whole lists at a time, in C.
        found = list(map(policy.get, keys))
        n = found.index(None) if None in found else len(found)
        self.hits += n
        policy.touch(keys)
        if n == len(found):
            return
        rest = keys[n:]
        offered = list(compress(rest, map(is_, found[n:], repeat(None))))
        free = self.capacity - len(policy)
        to_store = policy.admissible(offered, len(offered) > free)
        if not to_store:
            return
        if len(to_store) > free and policy.evict(len(to_store) - free, set(rest)) is None:
            return  # refused, as the manager's store would be
        policy.insert_many(list(zip(to_store, repeat(self.block))))

    def clear(self) -> None:
        self.policy.clear()
        self.hits = 0.0


@register_policy("auto")
class AdaptivePolicy(CachePolicy):
    """Follows the candidate whose sampled shadow hits most (see the module docstring)."""

    touch_before_store = True
    observes_store_misses = True

    def __init__(
        self,
        capacity: int,
        *,
        candidates: Sequence[str] = CANDIDATES,
        initial: str = "kv",
        rate: float = 1 / 16,
        min_shadow: int = 256,
        sampling: str = "request",
        depth: int = 8,
        epoch: float = 4.0,
        margin: float = 0.005,
        patience: int = 2,
    ) -> None:
        """``candidates`` name registered policies (not ``auto``); ``initial`` is the
        first leader. ``rate`` is the sampled share, raised to give each shadow at least
        ``min_shadow`` slots; ``sampling`` is ``"request"`` (by the key at ``depth``)
        or ``"block"``. Every ``epoch`` shadow capacities of sampled blocks the scores
        halve and the leader may change, to a shadow whose hit rate beats it by more
        than ``margin`` at ``patience`` epoch ends in a row."""
        super().__init__(capacity)
        names = list(dict.fromkeys(candidates))
        if not names:
            raise ValueError("candidates must name at least one policy")
        for name in names:
            if get_policy_cls(name) is AdaptivePolicy:
                raise ValueError("auto cannot be its own candidate")
        if initial not in names:
            raise ValueError(f"initial {initial!r} is not one of the candidates {names}")
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        if min_shadow < 1:
            raise ValueError(f"min_shadow must be >= 1, got {min_shadow}")
        if sampling not in ("request", "block"):
            raise ValueError(f"sampling must be 'request' or 'block', got {sampling!r}")
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        if not epoch > 0:
            raise ValueError(f"epoch must be positive, got {epoch}")
        if not margin >= 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.candidates = tuple(names)
        self.initial = initial
        self.sampling = sampling
        self.depth = depth
        self.margin = margin
        self.patience = patience
        rate = min(1.0, max(rate, min_shadow / capacity))
        #: Keys whose CRC-32 is below this are sampled.
        self._limit = min(_FULL, max(1, round(rate * _FULL)))
        self.rate = self._limit / _FULL
        self.shadow_capacity = max(1, round(capacity * self.rate))
        self._epoch_blocks = max(1.0, epoch * self.shadow_capacity)
        self.shadows = [Shadow(name, self.shadow_capacity) for name in names]
        self._policies: dict[str, CachePolicy] = {}
        self._seen = 0.0
        self._epoch_seen = 0.0
        #: The shadow that beat the leader at the last epoch ends, and how many in a row.
        self._challenger: str | None = None
        self._streak = 0
        #: Leader changes since creation or the last ``clear``.
        self.switches = 0
        self._leader: CachePolicy = self._policy_for(initial)
        self._bind()

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
        """Each shadow's hit rate over the decayed window (0 before any sample)."""
        seen = self._seen
        return {s.name: s.hits / seen if seen else 0.0 for s in self.shadows}

    def snapshot(self) -> dict[str, Any]:
        """Everything the policy holds, as plain values (for tests): the leader and its
        state, the scores and each shadow's state."""
        return {
            "leader": self.leader,
            "blocks": [(key, block.block_id, block.ref_cnt) for key, block in self.items()],
            "leader_state": _state(self._leader),
            "shadows": [(s.name, s.hits, _state(s.policy)) for s in self.shadows],
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
        self.get = leader.get  # type: ignore[method-assign]
        self.insert = leader.insert  # type: ignore[method-assign]
        self.insert_many = leader.insert_many  # type: ignore[method-assign]
        self.remove = leader.remove  # type: ignore[method-assign]
        self.evict = leader.evict  # type: ignore[method-assign]
        self.admissible = leader.admissible  # type: ignore[method-assign]
        self.items = leader.items  # type: ignore[method-assign]
        self._leader_touch: Callable[[Sequence[OffloadKey]], None] = leader.touch

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

    def _end_epoch(self) -> None:
        seen = self._seen
        leader = self._leader.name
        lead = best = next(s for s in self.shadows if s.name == leader)
        for s in self.shadows:
            if s.hits > best.hits:
                best = s
        if best is not lead and best.hits - lead.hits > self.margin * seen:
            if best.name == self._challenger:
                self._streak += 1
            else:
                self._challenger, self._streak = best.name, 1
            if self._streak >= self.patience:
                self.switch_to(best.name)
        else:
            self._challenger, self._streak = None, 0
        self._seen = seen * 0.5
        for s in self.shadows:
            s.hits *= 0.5
        self._epoch_seen = 0.0

    # --- CachePolicy ------------------------------------------------------------------

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        if keys:
            limit = self._limit
            sample: Sequence[OffloadKey] = ()
            if self.sampling == "request":
                if crc32(keys[min(self.depth, len(keys) - 1)]) < limit:
                    sample = keys
            elif limit == _FULL:
                sample = keys
            else:
                sample = list(compress(keys, map(limit.__gt__, map(crc32, keys))))
            if sample:
                if len(set(sample)) != len(sample):
                    # A request-scoped touch lists its loaded keys, then all it offers.
                    sample = list(dict.fromkeys(sample))
                for shadow in self.shadows:
                    shadow.request(sample)
                self._seen += len(sample)
                self._epoch_seen += len(sample)
                if self._epoch_seen >= self._epoch_blocks:
                    self._end_epoch()
        self._leader_touch(keys)

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
        """Forget everything: blocks, shadows, scores; the leader is ``initial`` again."""
        for policy in self._policies.values():
            policy.clear()
        for shadow in self.shadows:
            shadow.clear()
        self._seen = self._epoch_seen = 0.0
        self._challenger, self._streak = None, 0
        self.switches = 0
        self._leader = self._policy_for(self.initial)
        self._bind()

    def __len__(self) -> int:
        return len(self._leader)

    def __repr__(self) -> str:
        scores = ", ".join(f"{name} {rate:.3f}" for name, rate in self.scores().items())
        return (
            f"<AdaptivePolicy leader={self.leader} [{len(self)} of {self.capacity}, "
            f"shadows of {self.shadow_capacity} at rate {self.rate:.4f}: {scores}; "
            f"{self.switches} switches]>"
        )


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
