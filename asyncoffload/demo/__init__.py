"""The demo: a simulated serving loop on the CPU backend, moving and checking real bytes.

A synthetic multi-turn chat workload (:func:`~asyncoffload.workloads.synthetic_chat`)
arrives as concurrent tasks. Each request looks up its prompt's prefix in the CPU tier,
loads the hit blocks into a simulated GPU KV cache
(:class:`~asyncoffload.simkv.SimulatedKVCache`, CPU tensors), checks them bit for bit,
"computes" the rest (writes their deterministic content and sleeps for a time
proportional to the tokens), and stores its new blocks. An event subscriber counts what
the engine publishes. The result is a :class:`DemoReport`.

Below the CPU tier there may be a disk tier (``disk_path``) and a shared tier on Redis /
Valkey (``remote_url``, below the disk tier). With a shared tier, every prompt is first
looked up with :meth:`~asyncoffload.AsyncOffloadEngine.alookup`, so blocks that another
demo process (same seed, same model settings) stored are found and loaded from the
server, checked bit for bit like the others.

The modules: :mod:`~asyncoffload.demo.settings` (:class:`DemoConfig` and its checks),
:mod:`~asyncoffload.demo.server` (the simulated server), :mod:`~asyncoffload.demo.run`
(:func:`run_demo`: the engine, its tiers and integrations, the run),
:mod:`~asyncoffload.demo.progress` (the live progress line),
:mod:`~asyncoffload.demo.report` (:class:`DemoReport`) and
:mod:`~asyncoffload.demo.command` (``asyncoffload demo``: run and print).
"""

from __future__ import annotations

from asyncoffload.demo.report import DemoReport, EventCounts
from asyncoffload.demo.run import run_demo
from asyncoffload.demo.server import BlockAllocator
from asyncoffload.demo.settings import DemoConfig, DemoConfigError
from asyncoffload.simkv import SimulatedKVCache

__all__ = [
    "BlockAllocator",
    "DemoConfig",
    "DemoConfigError",
    "DemoReport",
    "EventCounts",
    "SimulatedKVCache",
    "run_demo",
]
