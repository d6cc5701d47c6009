"""The request-scoped manager in C: :class:`NativeManager`.

:class:`~asyncoffload.manager.CPUOffloadingManager` with ``request_scoped=True``, no
admission filter and ``store_threshold < 2`` (vLLM's call pattern: the
``AsyncOffloadManager`` adapter's default) with policy ``lru``, ``arc``, ``kv`` (with
:class:`~asyncoffload.manager.policies.KVPolicy`'s default options), ``s3fifo`` or
``sieve``, ported to C (``asyncoffload/_native/mgrcore.c``, compiled on first use). It
decides exactly as the Python manager and policy do: the same slots, victims, admissions,
events, lookups, errors, counters, request folding and, for ``kv``, the same learned
table, call for call (tests/test_mgrcore.py drives both in lockstep). The Python code
stays the reference and the fallback where the core cannot be built
(:func:`native_manager_available`).

The answers are raw, to keep objects off the hot path: slot ids as lists of ints,
stores as ``(keys_to_store, slot_ids, evicted_keys)`` tuples, events as
``(keys, removed)`` tuples (the same shape a Python manager gives its ``event_sink``).
Keys must be exact ``bytes``. ``positions`` (``on_request_finished``) must map keys to
int end tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from asyncoffload._native import load_mgrcore
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import LookupResult, ReqContext
from asyncoffload.manager.cpu import ManagerStats
from asyncoffload.manager.policies import get_policy_cls

__all__ = [
    "NATIVE_POLICIES",
    "NATIVE_POLICY_OPTIONS",
    "NativeManager",
    "RawEvent",
    "RawStore",
    "native_manager_available",
    "native_unsupported",
]

#: The policies the C core implements.
NATIVE_POLICIES = ("lru", "arc", "kv", "s3fifo", "sieve")

#: The policy options the C core takes, each only at the value it runs (KVPolicy's
#: defaults); any other value runs on the Python policy.
NATIVE_POLICY_OPTIONS: Mapping[str, Mapping[str, object]] = MappingProxyType(
    {
        "kv": MappingProxyType(
            {
                "ghost_factor": 4.0,
                "half_life": 4.0,
                "size_classes": True,
                "tail_classes": True,
                "admission": True,
            }
        )
    }
)

#: ``(keys_to_store, slot_ids, evicted_keys)``: what a ``prepare_store`` decided.
RawStore = tuple[list[OffloadKey], list[int], list[OffloadKey]]
#: ``(keys, removed)``: one event, stored (``False``) or removed (``True``).
RawEvent = tuple[list[OffloadKey], bool]


def native_unsupported(
    policy: str,
    store_threshold: int = 0,
    admission: object | None = None,
    policy_options: Mapping[str, object] | None = None,
) -> str | None:
    """Why the C core cannot run this configuration, or ``None`` when it can.
    ``policy_options`` are the policy's constructor options (``KVPolicy``'s
    ``half_life``, ...): the core runs them only at their defaults."""
    if policy not in NATIVE_POLICIES:
        return f"policy {policy!r} is not one of the native core's {', '.join(NATIVE_POLICIES)}"
    if policy_options:
        runs = NATIVE_POLICY_OPTIONS.get(policy, {})
        for name, value in policy_options.items():
            if name not in runs:
                return f"the native core's {policy} takes no option {name!r}"
            if value != runs[name]:
                return f"the native core runs {policy} with {name}={runs[name]!r} only"
    if admission is not None:
        return "the native core has no admission filter"
    if store_threshold >= 2:
        return "the native core has no store_threshold"
    return None


def native_manager_available() -> bool:
    """Whether the C core builds here (a compiler, the Python headers, and
    ``ASYNCOFFLOAD_NO_NATIVE`` unset)."""
    return load_mgrcore() is not None


class NativeManager:
    """A request-scoped manager of ``num_blocks`` CPU slots, in C.

    The methods are those of :class:`~asyncoffload.manager.CPUOffloadingManager` with the
    raw answers described in the module docstring. ``lookup_results`` are what
    :meth:`lookup` returns for a miss, a hit and a pending hit (by default our
    :class:`LookupResult`; an adapter passes its own). Raises ``RuntimeError`` where the
    core cannot be built and ``ValueError`` for a policy it lacks or ``policy_options`` it
    does not run (see :func:`native_unsupported`).
    """

    def __init__(
        self,
        num_blocks: int,
        policy: str = "lru",
        *,
        enable_events: bool = True,
        lookup_results: tuple[object, object, object] | None = None,
        policy_options: Mapping[str, object] | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        get_policy_cls(policy)  # unknown names fail as the Python manager's do
        why = native_unsupported(policy, policy_options=policy_options)
        if why is not None:
            raise ValueError(why)
        mgrcore = load_mgrcore()
        if mgrcore is None:
            raise RuntimeError("the native manager core is unavailable (see the log)")
        results = lookup_results or (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING)
        self._core: Any = mgrcore.Manager(num_blocks, policy, enable_events, tuple(results))
        self.num_blocks = num_blocks
        self.policy_name = policy

    @property
    def core(self) -> Any:
        """The C object; its methods are these, called directly (for adapters' hot paths)."""
        return self._core

    # --- introspection -----------------------------------------------------------------

    @property
    def last_store_size(self) -> int:
        """Slots the last ``prepare_store`` asked for, whether it got them or not."""
        return int(self._core.last_store_size)

    @property
    def num_free(self) -> int:
        return self.stats().free

    @property
    def target_t1(self) -> float:
        """ARC's target size of T1 (0.0 for the other policies)."""
        return float(self._core.target_t1)

    def stats(self) -> ManagerStats:
        return ManagerStats(*self._core.stats())

    def resident_keys(self) -> list[OffloadKey]:
        """Keys of the ready (loadable) blocks, in policy order."""
        keys: list[OffloadKey] = self._core.resident_keys()
        return keys

    def snapshot(self) -> dict[str, Any]:
        """The policy's lists (resident entries as ``(key, slot, ref_cnt, freq)``, ghosts as
        keys; see mgrcore.c), ARC's target, how many request logs and keys it holds, and
        for ``kv`` (under ``"kv"``) what ``KVPolicy.snapshot()`` gives and its parameters."""
        state: dict[str, Any] = self._core.snapshot()
        return state

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<NativeManager policy={self.policy_name} [{s.ready} ready, {s.pinned} pinned, "
            f"{s.write_pending} writing, {s.free} free of {s.num_blocks}]>"
        )

    # --- the manager's calls -------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext | None = None) -> LookupResult:
        result: LookupResult = self._core.lookup(key, ctx)
        return result

    def lookup_prefix(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> int:
        """How many leading ``keys`` are ready to load. Does not change recency."""
        count: int = self._core.lookup_prefix(keys, ctx)
        return count

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> list[int]:
        """Pin ready blocks; their slots in the order of ``keys``. Raises as
        :meth:`CPUOffloadingManager.prepare_load` does, pinning nothing."""
        slots: list[int] = self._core.prepare_load(keys, ctx)
        return slots

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        self._core.complete_load(keys, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        self._core.touch(keys, ctx)

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> RawStore | None:
        """Reserve slots for the keys not yet present: ``(keys_to_store, slot_ids,
        evicted_keys)``, or ``None`` when there is no room (the request's offer is still
        recorded, as the Python manager does)."""
        out: RawStore | None = self._core.prepare_store(keys, ctx)
        return out

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, success: bool = True
    ) -> None:
        self._core.complete_store(keys, ctx, success)

    def on_new_request(self, ctx: ReqContext) -> None:
        self._core.on_new_request(ctx)

    def on_request_finished(
        self, ctx: ReqContext, positions: Mapping[OffloadKey, int] | None = None
    ) -> None:
        self._core.on_request_finished(ctx, positions)

    def take_events(self) -> list[RawEvent]:
        """The ``(keys, removed)`` events since the last call, oldest first."""
        events: list[RawEvent] = self._core.take_events()
        return events

    def reset_cache(self, force: bool = False) -> None:
        """As :meth:`CPUOffloadingManager.reset_cache`."""
        self._core.reset_cache(force)
