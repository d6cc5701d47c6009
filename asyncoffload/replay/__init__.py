"""Replay a workload through the CPU tier's manager and measure what its policy keeps.

:func:`replay` drives a real :class:`~asyncoffload.manager.CPUOffloadingManager` through
the sequence a scheduler runs for every request, in arrival order:

1. ``lookup_prefix`` of the prompt's blocks: the leading stored blocks are prefix hits;
2. ``prepare_load`` / ``touch`` / ``complete_load`` of the hits;
3. ``touch`` / ``prepare_store`` / ``complete_store`` of the rest (stores complete at
   once: the replay measures what the tier holds, not how fast it copies).

These are the calls the engine makes for a request that looks up its prompt, loads the
hits and stores the rest (``EngineConfig.touch_on_load`` and ``touch_on_store``, both on
by default), so the replay's policy decides as the engine's does (tests/test_demo.py
serves a workload through the demo and compares).

It reports prefix hits in tokens and blocks, blocks written / evicted / held back by
admission, and the bytes the copies would move. :func:`replay_engine` runs the same
sequence through the full async engine on the CPU backend, with real bytes.

With ``disk_capacity``, a disk tier sits below the CPU tier, indexed by a second
:class:`~asyncoffload.manager.CPUOffloadingManager` (the bookkeeping the engine's tier
uses), driven as the engine drives its tiers: the prefix walk goes on while each key is
ready in the CPU tier or on disk, and each hit counts in the tier it is served from, the
CPU tier first; the touch goes to both tiers; blocks served from disk are promoted, read
back into slots the CPU tier reserves for them (``CPUOffloadingManager.reserve``:
possibly evicting there, past the CPU tier's admission, not written to disk again);
blocks the CPU tier stores are written through to disk (inclusive), gated by the disk's
admission (default :data:`DISK_ADMISSION`, a block's second offer; ``None``: every
block).

:func:`belady` is the offline bound over the same access stream: Belady's MIN (evict the
block whose next use is furthest away), which also declines to store a block that is
never used again. It needs the future, so it is not a registered policy.

:func:`replay_matrix` runs policies x capacities; :func:`format_table` and
:func:`plot` (:func:`figure`) present the results. :func:`parse_family_source` reads the
replay's ``family:NAME[:N][:PARAM=VALUE]...`` sources (a seeded trace family of
:mod:`asyncoffload.workloads`).

The modules: :mod:`~asyncoffload.replay.result` (:class:`ReplayResult`),
:mod:`~asyncoffload.replay.manager` (:func:`replay`), :mod:`~asyncoffload.replay.bound`
(:func:`belady`), :mod:`~asyncoffload.replay.engine` (:func:`replay_engine`),
:mod:`~asyncoffload.replay.sources` (trace families), :mod:`~asyncoffload.replay.matrix`
(:func:`replay_matrix`), :mod:`~asyncoffload.replay.report` (table, plot, JSON) and
:mod:`~asyncoffload.replay.command` (``asyncoffload replay``: check, load, run, print).
"""

from __future__ import annotations

from asyncoffload.replay.bound import BELADY, BeladyPolicy, NeverAgainAdmission, belady
from asyncoffload.replay.engine import replay_engine
from asyncoffload.replay.manager import DISK_ADMISSION, parse_disk_admission, replay
from asyncoffload.replay.matrix import parse_spec, replay_matrix
from asyncoffload.replay.report import figure, format_table, infinite_tier_hit_rate, plot
from asyncoffload.replay.result import LLAMA3_8B_BYTES_PER_TOKEN, ReplayResult, capacity_blocks
from asyncoffload.replay.sources import (
    FAMILY_REQUESTS,
    FAMILY_SOURCE,
    FamilySource,
    is_family_source,
    parse_family_source,
)

__all__ = [
    "BELADY",
    "DISK_ADMISSION",
    "FAMILY_REQUESTS",
    "FAMILY_SOURCE",
    "LLAMA3_8B_BYTES_PER_TOKEN",
    "BeladyPolicy",
    "FamilySource",
    "NeverAgainAdmission",
    "ReplayResult",
    "belady",
    "capacity_blocks",
    "figure",
    "format_table",
    "infinite_tier_hit_rate",
    "is_family_source",
    "parse_disk_admission",
    "parse_family_source",
    "parse_spec",
    "plot",
    "replay",
    "replay_engine",
    "replay_matrix",
]
