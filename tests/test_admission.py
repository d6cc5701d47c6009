"""Admission filters (``asyncoffload/manager/admission.py``): the registry, "ghost" and
"adaptive" in the manager, and their configuration (``EngineConfig``, the engine).

"ghost" is also checked against a brute-force model: a list of remembered keys, oldest
first, bounded in length, with an LRU tier written as one list.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import asyncoffload as ao
from asyncoffload._registry import Registry
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import admission as admission_mod
from asyncoffload.manager.admission import (
    AdaptiveAdmission,
    AdmissionFilter,
    GhostAdmission,
    available_admissions,
    get_admission_cls,
    register_admission,
)
from asyncoffload.manager.policies import KVPolicy, LRUPolicy
from tests.helpers import make_engine


def _k(i: int) -> OffloadKey:
    return ao.make_offload_key(b"adm" + i.to_bytes(5, "big"))


def _names(keys: Sequence[OffloadKey]) -> list[int]:
    return [int.from_bytes(key[3:8], "big") for key in keys]


def _ghost(m: ao.CPUOffloadingManager) -> list[OffloadKey]:
    """The keys a ghost filter remembers, oldest first (private; for exact checks)."""
    adm = m._admission
    assert isinstance(adm, GhostAdmission)
    return list(adm._ghost)


def _store(m: ao.CPUOffloadingManager, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
    """Offer ``keys``; complete what is written; the keys written."""
    out = m.prepare_store(keys)
    assert out is not None
    if out.keys_to_store:
        m.complete_store(out.keys_to_store)
    return out.keys_to_store


def _request(
    m: ao.CPUOffloadingManager, keys: Sequence[OffloadKey]
) -> ao.PrepareStoreOutput | None:
    """A serving engine's calls for one request: touch, store what follows the hits."""
    m.touch(keys)
    out = m.prepare_store(keys[m.lookup_prefix(keys) :])
    if out is not None and out.keys_to_store:
        m.complete_store(out.keys_to_store)
    return out


# --- the registry ----------------------------------------------------------------------


def test_builtin_filters_are_registered() -> None:
    names = available_admissions()
    assert names == sorted(names)
    assert {"ghost", "adaptive"} <= set(names)
    assert get_admission_cls("ghost") is GhostAdmission
    assert get_admission_cls("adaptive") is AdaptiveAdmission
    assert (GhostAdmission.name, AdaptiveAdmission.name) == ("ghost", "adaptive")


def test_unknown_filter_name_lists_the_known_ones() -> None:
    known = ", ".join(available_admissions())
    with pytest.raises(
        ValueError, match=f"unknown admission filter 'nope'; known filters: {known}"
    ):
        get_admission_cls("nope")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Registry[AdmissionFilter]:
    """A copy of the registry, restored after the test."""
    copy = admission_mod._REGISTRY.copy()
    monkeypatch.setattr(admission_mod, "_REGISTRY", copy)
    return copy


class _Nothing(AdmissionFilter):
    """Admits nothing (a test filter)."""

    def admissible(self, keys: Sequence[OffloadKey], full: bool) -> list[OffloadKey]:
        return []

    def clear(self) -> None:
        pass


def test_register_a_filter_and_use_it_by_name(
    registry: Registry[AdmissionFilter],
) -> None:
    cls = register_admission("nothing")(_Nothing)
    assert cls is _Nothing and _Nothing.name == "nothing"
    assert "nothing" in available_admissions()
    assert get_admission_cls("nothing") is _Nothing
    assert register_admission("nothing")(_Nothing) is _Nothing  # the same again: fine
    m = ao.CPUOffloadingManager(4, admission="nothing")
    assert m.admission_name == "nothing"
    assert _store(m, [_k(0), _k(1)]) == []
    assert m.stats().store_skipped == 2
    assert ao.EngineConfig(admission="nothing").admission == "nothing"


def test_register_rejects_a_taken_name_and_non_filters(
    registry: Registry[AdmissionFilter],
) -> None:
    before = registry.as_dict()

    class Other(_Nothing):
        pass

    with pytest.raises(ValueError, match="'ghost' is already registered"):
        register_admission("ghost")(Other)
    with pytest.raises(TypeError, match="not an AdmissionFilter subclass"):
        register_admission("bad")(object)  # type: ignore[type-var]
    assert registry.as_dict() == before
    assert get_admission_cls("ghost") is GhostAdmission


@pytest.mark.parametrize("capacity", [0, -3])
def test_filters_need_a_positive_capacity(capacity: int) -> None:
    for cls in (GhostAdmission, AdaptiveAdmission):
        with pytest.raises(ValueError, match="capacity must be positive"):
            cls(capacity)


@pytest.mark.parametrize("factor", [0.0, -1.0, math.nan])
def test_ghost_factor_must_be_positive(factor: float) -> None:
    for cls in (GhostAdmission, AdaptiveAdmission):
        with pytest.raises(ValueError, match="ghost_factor must be positive"):
            cls(4, ghost_factor=factor)


# --- configuration: the manager, EngineConfig, the engine --------------------------------


def test_manager_takes_a_name_an_instance_or_none() -> None:
    assert ao.CPUOffloadingManager(4).admission_name is None
    assert ao.CPUOffloadingManager(4, admission=None).admission_name is None
    assert ao.CPUOffloadingManager(4, admission="ghost").admission_name == "ghost"
    adm = AdaptiveAdmission(4)
    m = ao.CPUOffloadingManager(4, admission=adm)
    assert m.admission_name == "adaptive"
    assert m._admission is adm
    # store_threshold 0 or 1 (store on first offer) goes with a filter.
    assert ao.CPUOffloadingManager(4, store_threshold=1, admission="ghost").store_threshold == 1


def test_manager_rejects_unknown_filter_names() -> None:
    known = ", ".join(available_admissions())
    with pytest.raises(
        ValueError, match=f"unknown admission filter 'bogus'; known filters: {known}"
    ):
        ao.CPUOffloadingManager(4, admission="bogus")


def test_manager_rejects_a_filter_with_store_threshold() -> None:
    for name in ("ghost", "adaptive"):
        with pytest.raises(ValueError, match="either store_threshold or an admission filter"):
            ao.CPUOffloadingManager(4, store_threshold=2, admission=name)


def test_manager_rejects_what_is_not_a_filter() -> None:
    with pytest.raises(TypeError, match="admission must be a name or an AdmissionFilter"):
        ao.CPUOffloadingManager(4, admission=object())  # type: ignore[arg-type]


def test_rejected_construction_leaves_nothing_behind(
    registry: Registry[AdmissionFilter],
) -> None:
    before = registry.as_dict()
    policy = KVPolicy(4)
    adm = GhostAdmission(4)
    with pytest.raises(ValueError):
        ao.CPUOffloadingManager(4, policy, admission="bogus")
    with pytest.raises(ValueError):
        ao.CPUOffloadingManager(4, policy, store_threshold=3, admission=adm)
    with pytest.raises(TypeError):
        ao.CPUOffloadingManager(4, policy, admission=3)  # type: ignore[arg-type]
    assert registry.as_dict() == before
    assert len(policy) == 0 and list(adm._ghost) == []
    # Both are as good as new: a manager built with them works as one built from names.
    m = ao.CPUOffloadingManager(4, policy, admission=adm)
    fresh = ao.CPUOffloadingManager(4, "kv", admission="ghost")
    for mgr in (m, fresh):
        assert _store(mgr, [_k(0)]) == []
        assert _store(mgr, [_k(0)]) == [_k(0)]
    assert m.stats() == fresh.stats()


def test_engine_config_admission_names() -> None:
    assert ao.EngineConfig().admission is None
    for name in ("ghost", "adaptive"):
        assert ao.EngineConfig(admission=name).admission == name
    for none in ("none", "None", "NONE", ""):
        assert ao.EngineConfig(admission=none).admission is None
    assert ao.EngineConfig(admission="ghost", store_threshold=1).store_threshold == 1


def test_engine_config_rejects_unknown_filters_naming_the_known_ones() -> None:
    known = ", ".join(available_admissions())
    with pytest.raises(ValueError, match=f"unknown admission filter 'bogus'; known: {known}"):
        ao.EngineConfig(admission="bogus")
    with pytest.raises(ValueError):
        ao.EngineConfig(admission=5)


def test_engine_config_rejects_a_filter_with_store_threshold() -> None:
    with pytest.raises(ValueError, match="set either store_threshold or admission, not both"):
        ao.EngineConfig(admission="ghost", store_threshold=2)


def test_engine_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCOFFLOAD_ADMISSION", "none")
    assert ao.EngineConfig.from_env().admission is None
    monkeypatch.setenv("ASYNCOFFLOAD_ADMISSION", "ghost")
    assert ao.EngineConfig.from_env().admission == "ghost"
    assert ao.EngineConfig.from_env(admission=None).admission is None  # overrides win
    monkeypatch.setenv("ASYNCOFFLOAD_STORE_THRESHOLD", "2")
    with pytest.raises(ValueError, match="set either store_threshold or admission"):
        ao.EngineConfig.from_env()
    monkeypatch.setenv("ASYNCOFFLOAD_ADMISSION", "nope")
    with pytest.raises(ValueError, match="unknown admission filter 'nope'"):
        ao.EngineConfig.from_env(store_threshold=0)


async def test_engine_stores_through_its_configured_filter() -> None:
    engine, _ = make_engine(cpu_blocks=4, gpu_blocks=8, admission="ghost", copy_engine="threads")
    async with engine:
        assert engine.manager.admission_name == "ghost"
        keys = [_k(0), _k(1)]
        first = await engine.prepare_store(keys, [0, 1])
        assert first is not None
        assert first.keys_to_store == []  # held back: nothing copied
        await first
        second = await engine.prepare_store(keys, [0, 1])
        assert second is not None
        assert second.keys_to_store == keys
        await second
        assert engine.manager.lookup_prefix(keys) == 2
        assert engine.manager.stats().store_skipped == 2


async def test_a_store_handle_names_the_keys_it_skipped_and_those_declined() -> None:
    # Issue 40: a store whose handle resolved could skip a block without saying so, and
    # a caller that loaded every key it offered crashed on it.
    engine, _ = make_engine(cpu_blocks=4, gpu_blocks=8, admission="ghost", copy_engine="threads")
    async with engine:
        a, b, c = _k(0), _k(1), _k(2)
        first = await engine.prepare_store([a, b], [0, 1])
        assert first is not None
        assert first.keys_to_store == []
        assert first.skipped_keys == first.declined_keys == [a, b]
        assert repr(first) == "<Transfer store 0 blocks (2 skipped, 2 declined) done>"
        await first
        second = await engine.prepare_store([a, b, c], [0, 1, 2])  # a, b: offered twice
        assert second is not None
        assert (second.keys_to_store, second.skipped_keys, second.declined_keys) == (
            [a, b],
            [c],
            [c],
        )
        # While a is being stored by the second call, a third skips it without declining.
        third = await engine.prepare_store([a, c], [0, 2])
        assert third is not None
        assert (third.keys_to_store, third.skipped_keys, third.declined_keys) == ([c], [a], [])
        await asyncio.gather(second, third)
        with pytest.raises(ao.UnknownKeyError, match=_k(3).hex()):
            await engine.prepare_load([a, _k(3)], [4, 5])
        declined = await engine.prepare_store([_k(3)], [3])
        assert declined is not None and declined.declined_keys == [_k(3)]
        await declined
        with pytest.raises(ao.UnknownKeyError, match=f"key {_k(3).hex()} is not stored"):
            await engine.prepare_load([a, _k(3)], [4, 5])
        load = await engine.prepare_load([a], [4])
        assert load.skipped_keys == [] and load.declined_keys == []
        await load
        assert engine.manager.stats().store_skipped == 2 + 1 + 1


# --- ghost -------------------------------------------------------------------------------


def test_ghost_holds_a_first_offer_back_and_stores_the_second() -> None:
    m = ao.CPUOffloadingManager(4, admission="ghost")
    a, b = _k(0), _k(1)
    out = m.prepare_store([a, b])
    assert out is not None
    assert (out.keys_to_store, out.store_spec.block_ids, out.evicted_keys) == ([], (), [])
    assert m.stats().store_skipped == 2
    assert m.take_events() == []
    assert m.lookup(a) is ao.LookupResult.MISS
    assert m.num_free == 4
    assert _store(m, [b]) == [b]  # second offer
    assert [(e.removed, e.keys) for e in m.take_events()] == [(False, (b,))]
    assert _ghost(m) == [a]  # a stored key is no longer remembered
    assert _store(m, [a, _k(2)]) == [a]
    assert m.stats().store_skipped == 3
    assert (m.stats().stored, m.stats().ready) == (2, 2)


def test_ghost_readmits_evicted_keys_on_their_next_offer() -> None:
    m = ao.CPUOffloadingManager(2, admission="ghost")
    a, b, c = _k(0), _k(1), _k(2)
    for key in (a, b, c):
        _store(m, [key])
    _store(m, [a])
    _store(m, [b])
    assert _store(m, [c]) == [c]  # evicts a (LRU)
    assert [e.keys for e in m.take_events() if e.removed] == [(a,)]
    assert _ghost(m) == [a]
    assert _store(m, [a]) == [a]  # back on its first offer since it went
    assert _ghost(m) == [b]
    assert m.stats().store_skipped == 3


def test_ghost_memory_is_bounded_oldest_forgotten() -> None:
    adm = GhostAdmission(4, ghost_factor=0.5)  # remembers 2 keys
    m = ao.CPUOffloadingManager(4, admission=adm)
    k0, k1, k2 = _k(0), _k(1), _k(2)
    for key in (k0, k1, k2):
        assert _store(m, [key]) == []
    assert list(adm._ghost) == [k1, k2]
    assert _store(m, [k0]) == []  # forgotten: a first offer again (k1 forgotten now)
    assert _store(m, [k2]) == [k2]
    assert _store(m, [k1]) == []
    # At least one key, however small the factor.
    tiny = GhostAdmission(1, ghost_factor=0.1)
    tiny.record([k0, k1], [])
    assert tiny.admissible([k0, k1], True) == [k1]


def test_ghost_memory_bounds_evicted_keys_too() -> None:
    adm = GhostAdmission(2, ghost_factor=2.0)  # remembers 4 keys
    keys = [_k(i) for i in range(6)]
    adm.on_evict(keys[:3])
    adm.record(keys[3:4], [])
    adm.on_evict(keys[4:])
    assert list(adm._ghost) == keys[2:]
    assert adm.admissible(keys, True) == keys[2:]
    adm.on_evict(keys[2:3])  # evicted again: the most recent now
    adm.on_evict([_k(9)])
    assert list(adm._ghost) == [keys[4], keys[5], keys[2], _k(9)]


def test_ghost_forgets_a_key_only_when_it_must() -> None:
    adm = GhostAdmission(2, ghost_factor=1.0)  # remembers 2 keys
    m = ao.CPUOffloadingManager(2, admission=adm)
    a, b, c, x = _k(0), _k(1), _k(2), _k(3)
    for key in (a, a, b, b, x, c):
        _store(m, [key])
    assert list(adm._ghost) == [x, c]  # full
    assert _store(m, [c]) == [c]  # admitted; evicts a, which is remembered
    assert [e.keys for e in m.take_events() if e.removed] == [(a,)]
    # c leaves the ghost list as it is admitted, then a is remembered: nothing is lost.
    assert list(adm._ghost) == [x, a]


def test_ghost_filter_is_cleared_by_reset_cache() -> None:
    m = ao.CPUOffloadingManager(4, admission="ghost")
    a, b = _k(0), _k(1)
    _store(m, [a])
    _store(m, [b])
    _store(m, [b])
    m.reset_cache()
    assert _ghost(m) == []
    assert _store(m, [a]) == []  # a first offer again
    assert _store(m, [a]) == [a]


@pytest.mark.parametrize("name", ["ghost", "adaptive"])
def test_refused_store_changes_no_admission_state(name: str) -> None:
    a, b, c, d = _k(0), _k(1), _k(2), _k(3)

    def build() -> ao.CPUOffloadingManager:
        m = ao.CPUOffloadingManager(2, admission=name)
        for key in (a, a, b, b):
            _store(m, [key])
        assert [key for key, _ in m.policy.items()] == [a, b]
        if name == "ghost":
            assert _store(m, [c]) == []  # remembered: admitted on its next offer
        m.prepare_load([a, b])  # both pinned: no room
        return m

    m, twin = build(), build()
    adm = m._admission
    assert adm is not None
    before = sorted((k, repr(v)) for k, v in vars(adm).items())
    assert m.prepare_store([c]) is None  # c would be admitted, but there is no room
    assert sorted((k, repr(v)) for k, v in vars(adm).items()) == before
    assert m.stats() == twin.stats()
    assert [(e.removed, e.keys) for e in m.take_events()] == [
        (e.removed, e.keys) for e in twin.take_events()
    ]
    # Later decisions are those of a twin that never made the refused call.
    for mgr in (m, twin):
        mgr.complete_load([a, b])
    got = []
    for mgr in (m, twin):
        out = _request(mgr, [c, d])
        assert out is not None
        got.append((out.keys_to_store, out.evicted_keys))
    assert got[0] == got[1]
    assert got[0] == (([c], [a]) if name == "ghost" else ([c, d], [a, b]))
    assert m.stats() == twin.stats()


def test_ghost_sees_only_keys_not_stored() -> None:
    m = ao.CPUOffloadingManager(4, admission="ghost")
    a, b = _k(0), _k(1)
    _store(m, [a])
    _store(m, [a])
    out = m.prepare_store([a, b])  # a is stored: not offered to the filter
    assert out is not None
    assert out.keys_to_store == []
    assert m.stats().store_skipped == 2  # a's first offer, b's first offer
    assert _ghost(m) == [b]


# --- ghost against a brute-force model ---------------------------------------------------


class RefGhostLRU:
    """An LRU tier of ``capacity`` slots with the ghost rule, brute force."""

    def __init__(self, capacity: int, ghost_factor: float) -> None:
        self.capacity = capacity
        self.bound = max(1, int(capacity * ghost_factor))
        self.order: list[OffloadKey] = []  # least recently used first
        self.ref: dict[OffloadKey, int] = {}  # -1 writing, 0 idle, n pinned
        self.ghost: list[OffloadKey] = []  # oldest first
        self.skipped = 0

    def remember(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            if key in self.ghost:
                self.ghost.remove(key)
            self.ghost.append(key)
        while len(self.ghost) > self.bound:
            del self.ghost[0]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self.order:
                self.order.remove(key)
                self.order.append(key)

    def prepare_store(
        self, keys: Sequence[OffloadKey]
    ) -> tuple[list[OffloadKey], list[OffloadKey]] | None:
        offered = [key for key in keys if key not in self.ref]
        admitted = [key for key in offered if key in self.ghost]
        victims: list[OffloadKey] = []
        if admitted:
            need = len(admitted) - (self.capacity - len(self.ref))
            if need > 0:
                idle = [k for k in self.order if self.ref[k] == 0 and k not in keys]
                if len(idle) < need:
                    return None  # nothing changes, the ghost list included
                victims = idle[:need]
                for key in victims:
                    self.order.remove(key)
                    del self.ref[key]
        # The manager tells the filter what it stored, then what it evicted.
        self.ghost = [key for key in self.ghost if key not in admitted]
        self.remember([key for key in offered if key not in admitted])
        self.remember(victims)
        self.skipped += len(offered) - len(admitted)
        for key in admitted:
            self.order.append(key)
            self.ref[key] = -1
        return admitted, victims

    def complete_store(self, keys: Sequence[OffloadKey], success: bool) -> None:
        for key in keys:
            if self.ref.get(key, 0) >= 0:
                continue
            if success:
                self.ref[key] = 0
            else:
                del self.ref[key]
                self.order.remove(key)

    def reset(self) -> None:
        self.order, self.ref, self.ghost = [], {}, []


POOL = [_k(i) for i in range(14)]
GHOST_OPS = ["store"] * 6 + ["complete"] * 3 + ["touch"] * 2 + ["load", "unload", "reset"]


@dataclass
class GhostStep:
    kind: str
    keys: list[OffloadKey]
    success: bool = True

    def __repr__(self) -> str:
        return f"{self.kind}({_names(self.keys)}{'' if self.success else ', fail'})"


def _subset(data: st.DataObject, pool: Sequence[OffloadKey], most: int) -> list[OffloadKey]:
    if not pool:
        return []
    picks = data.draw(st.lists(st.integers(0, len(pool) - 1), unique=True, max_size=most))
    return [pool[i] for i in picks]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    capacity=st.integers(1, 6),
    ghost_factor=st.sampled_from([0.3, 0.5, 1.0, 2.0, 8.0]),
)
def test_ghost_matches_reference_model(
    data: st.DataObject, capacity: int, ghost_factor: float
) -> None:
    adm = GhostAdmission(capacity, ghost_factor=ghost_factor)
    m = ao.CPUOffloadingManager(capacity, LRUPolicy(capacity), admission=adm)
    ref = RefGhostLRU(capacity, ghost_factor)
    for step in range(data.draw(st.integers(1, 60), label="n_ops")):
        blocks = {key: block.ref_cnt for key, block in m.policy.items()}
        kind = GHOST_OPS[data.draw(st.integers(0, len(GHOST_OPS) - 1))]
        if kind == "store":
            op = GhostStep("store", _subset(data, POOL, 4))
        elif kind == "complete":
            pending = [k for k, r in blocks.items() if r < 0]
            op = GhostStep("complete", _subset(data, pending, 3), data.draw(st.integers(0, 3)) > 0)
        elif kind == "touch":
            op = GhostStep("touch", _subset(data, POOL, 4))
        elif kind == "load":
            op = GhostStep("load", _subset(data, [k for k, r in blocks.items() if r >= 0], 2))
        elif kind == "unload":
            op = GhostStep("unload", _subset(data, [k for k, r in blocks.items() if r > 0], 2))
        elif all(r == 0 for r in blocks.values()):
            op = GhostStep("reset", [])
        else:
            op = GhostStep("touch", [])
        note(f"{step}: {op!r}")
        if op.kind == "store":
            out = m.prepare_store(op.keys)
            got = None if out is None else (out.keys_to_store, out.evicted_keys)
            assert got == ref.prepare_store(op.keys)
            events = [(e.removed, e.keys) for e in m.take_events()]
            assert events == ([(True, tuple(got[1]))] if got and got[1] else [])
        elif op.kind == "complete":
            m.complete_store(op.keys, success=op.success)
            ref.complete_store(op.keys, op.success)
        elif op.kind == "touch":
            m.touch(op.keys)
            ref.touch(op.keys)
        elif op.kind == "load":
            m.prepare_load(op.keys)
            for key in op.keys:
                ref.ref[key] += 1
        elif op.kind == "unload":
            m.complete_load(op.keys)
            for key in op.keys:
                ref.ref[key] -= 1
        else:
            m.reset_cache()
            ref.reset()
        m.take_events()
        assert list(adm._ghost) == ref.ghost
        assert len(ref.ghost) <= ref.bound
        assert [k for k, _ in m.policy.items()] == ref.order
        assert {k: b.ref_cnt for k, b in m.policy.items()} == ref.ref
        assert m.stats().store_skipped == ref.skipped
        # Its decision for every key of the pool, now.
        assert adm.admissible(POOL, True) == [key for key in POOL if key in ref.ghost]


# --- adaptive ----------------------------------------------------------------------------


def _adaptive(capacity: int) -> tuple[ao.CPUOffloadingManager, AdaptiveAdmission]:
    adm = AdaptiveAdmission(capacity)
    return ao.CPUOffloadingManager(capacity, admission=adm), adm


def test_adaptive_lifetime_is_capacity_over_the_smoothed_write_rate() -> None:
    m, adm = _adaptive(4)
    assert adm.lifetime == math.inf  # nothing written yet
    rate = 0.0
    written = 0
    for i in range(100):
        m.touch([_k(i)])
        rate += (written - rate) / 64.0
        assert adm.lifetime == (4 / rate if rate else math.inf)
        written = len(_store(m, [_k(i)]))  # one block per request while admitted
    assert 4.0 < adm.lifetime < 4 / (1 - (63 / 64) ** 90)
    # Requests that write nothing (the first one still counts the last write): the rate
    # decays, the lifetime grows.
    m.touch([])
    longer = adm.lifetime
    for _ in range(5):
        m.touch([])
        assert adm.lifetime > longer
        longer = adm.lifetime
    adm.clear()
    assert adm.lifetime == math.inf and not adm.holding_back


def test_adaptive_admits_everything_while_the_tier_has_room() -> None:
    m, adm = _adaptive(64)
    for i in range(60):  # one-off blocks, never asked for again
        assert _request(m, [_k(i)]) is not None
    assert m.stats().store_skipped == 0 and m.stats().stored == 60
    assert not adm.holding_back


def test_adaptive_admits_everything_while_newcomers_come_back() -> None:
    # Each block is asked for by two requests in a row, then never again: newcomers come
    # back, evicted blocks never do.
    m, adm = _adaptive(4)
    for i in range(40):
        _request(m, [_k(i)])
        _request(m, [_k(i)])
        assert not adm.holding_back
    stats = m.stats()
    assert (stats.stored, stats.store_skipped) == (40, 0)
    assert stats.evicted == 36  # the tier was full: admission was decided with full=True


def _working_set_with_one_offs(
    m: ao.CPUOffloadingManager, rounds: int, start: int = 0
) -> list[tuple[bool, bool]]:
    """Per round, a request for one block of a working set of 6 (cycled, larger than the
    tier of 4, so its blocks are evicted and come back) and one for a new block never
    asked for again. Whether each request wrote its block."""
    out = []
    for i in range(start, start + rounds):
        ws = _request(m, [_k(i % 6)])
        one_off = _request(m, [_k(1000 + i)])
        assert ws is not None and one_off is not None
        out.append((bool(ws.keys_to_store), bool(one_off.keys_to_store)))
    return out


def test_adaptive_holds_first_offers_back_when_evicted_blocks_return_and_newcomers_do_not() -> None:
    m, adm = _adaptive(4)
    written = _working_set_with_one_offs(m, 6)
    # Until an evicted block has come back, everything is admitted.
    assert written == [(True, True)] * 6
    assert not adm.holding_back and m.stats().store_skipped == 0
    written = _working_set_with_one_offs(m, 30, start=6)
    assert adm.holding_back
    # From then on, like "ghost": one-off blocks are held back, working-set blocks
    # (remembered when evicted) get back in.
    assert written == [(True, False)] * 30
    stats = m.stats()
    assert stats.store_skipped == 30
    assert stats.stored == 6 * 2 + 30
    assert adm.lifetime < 20


def test_adaptive_stops_holding_back_when_newcomers_start_coming_back() -> None:
    m, adm = _adaptive(4)
    _working_set_with_one_offs(m, 36)
    assert adm.holding_back
    switched = None
    for i in range(40):
        key = _k(2000 + i)
        first = _request(m, [key])
        second = _request(m, [key])
        assert first is not None and second is not None
        if adm.holding_back:
            # Held back on its first offer, written on its second.
            assert (first.keys_to_store, second.keys_to_store) == ([], [key])
        elif switched is None:
            switched = i
        else:
            assert (first.keys_to_store, second.keys_to_store) == ([key], [])
    assert switched is not None and switched < 20
    assert not adm.holding_back


def test_adaptive_admissible_declines_only_when_full_and_holding_back() -> None:
    m, adm = _adaptive(4)
    _working_set_with_one_offs(m, 12)
    assert adm.holding_back
    new = [_k(5000), _k(5001)]
    remembered = _k(12 % 6)  # evicted earlier, remembered
    assert remembered not in m.policy
    assert adm.admissible([*new, remembered], True) == [remembered]
    assert adm.admissible([*new, remembered], False) == [*new, remembered]
    # In the manager: with a free slot (a failed store), a one-block store fits and is
    # written although the filter is holding back.
    out = m.prepare_store([remembered])
    assert out is not None
    m.complete_store([remembered], success=False)
    assert m.num_free == 1
    assert adm.holding_back
    assert _store(m, [new[0]]) == [new[0]]
    assert _store(m, [new[1]]) == []  # full again: held back
