"""How far a native facade could take the engine's load below its manager (issue 25).

``benchmarks/control_plane.py`` puts a 16-block load through the engine at 0.41-0.44 of
the manager alone (2.3-2.4x its time) on the 2-vCPU VM, where issue 25 asks for 0.5. This
script measures, in one process and in turn, on the same resident keys (uvloop, LRU, the
CPU backend's native copy):

- ``manager``: the manager's calls of a load (``lookup_prefix``, ``prepare_load``,
  ``touch``, ``complete_load``), as control_plane.py's baseline;
- ``engine``: ``engine.lookup`` then ``await (await engine.prepare_load(...))``, the
  public path (the one-step small copy);
- ``C glue``: ``engine.lookup``, then a coroutine that holds interrupts, checks the keys
  and block ids as the engine does, and calls ``load_step`` (benchmarks/facade_floor.c,
  compiled here with the system compiler): the manager's ``prepare_load``, the native
  copy of the slots, ``touch``, ``complete_load`` and a resolved future, with the glue
  between them in C.

The C glue is a floor, not an implementation: it keeps no counters or histograms, makes
no ``Transfer`` handle, has no undo for an interrupt between the manager's calls and no
fallback (faults, tiers, a lane busy). What it shows is how much of the engine's time is
Python glue a C facade would remove, and how much is the manager's own calls, which stay.

Run: ``.venv/bin/python benchmarks/facade_floor.py [--calls N] [--reps N]``
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from control_plane import make_keys, tiny_kv

import asyncoffload as ao
from asyncoffload import loops
from asyncoffload._checks import check_block_ids, check_keys
from asyncoffload._sigint import InterruptsHeld
from asyncoffload.handles import TransferResult

BLOCKS_PER_CALL = 16
CPU_BLOCKS = 4096


def build(workdir: str) -> ModuleType:
    """Compile benchmarks/facade_floor.c into ``workdir`` and import it."""
    source = Path(__file__).with_suffix(".c")
    target = Path(workdir) / f"facade_floor{sysconfig.get_config_var('EXT_SUFFIX')}"
    include = sysconfig.get_paths()["include"]
    cc = os.environ.get("CC", "cc")
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(source), "-o", str(target)],
        check=True,
    )
    spec = importlib.util.spec_from_file_location("facade_floor", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def measure(floor: ModuleType, calls: int, reps: int) -> dict[str, list[float]]:
    kv = tiny_kv(BLOCKS_PER_CALL)
    layout = ao.KVLayout.infer(kv)
    config = ao.EngineConfig(cpu_blocks=CPU_BLOCKS, policy="lru")
    async with ao.AsyncOffloadEngine(kv, config, layout=layout) as engine:
        ctx = ao.ReqContext("bench")
        gpu = list(range(BLOCKS_PER_CALL))
        keys = make_keys(0, CPU_BLOCKS)
        windows = [keys[s : s + BLOCKS_PER_CALL] for s in range(0, CPU_BLOCKS, BLOCKS_PER_CALL)]
        for window in windows:
            handle = await engine.prepare_store(window, gpu, ctx)
            assert handle is not None
            await handle
        manager = engine.manager
        backend: Any = engine.backend
        lane = getattr(backend, "_native_load", None)
        if lane is None or lane._core is None:
            raise SystemExit("needs the CPU backend's native lanes and the manager core")
        loop = asyncio.get_running_loop()
        nbytes = BLOCKS_PER_CALL * layout.block_bytes
        fixed = (manager.prepare_load, manager.touch, manager.complete_load, loop.create_future)
        copy = (lane._core.call_blocks, lane._copy_address, lane._tables.address, lane._direction)

        async def c_glue(window: list[ao.OffloadKey]) -> asyncio.Future[TransferResult]:
            with InterruptsHeld():
                checked = check_keys(window, "prepare_load")
                ids = check_block_ids(gpu, len(checked), layout.num_blocks, "prepare_load", True)
                future: asyncio.Future[TransferResult] = floor.load_step(
                    *fixed, TransferResult, checked, ctx, nbytes, *copy, ids
                )
                return future

        async def manager_load(window: list[ao.OffloadKey]) -> None:
            manager.lookup_prefix(window, ctx)
            manager.prepare_load(window, ctx)
            manager.touch(window, ctx)
            manager.complete_load(window, ctx)

        async def engine_load(window: list[ao.OffloadKey]) -> None:
            engine.lookup(window, ctx)
            await (await engine.prepare_load(window, gpu, ctx))

        async def glue_load(window: list[ao.OffloadKey]) -> None:
            engine.lookup(window, ctx)
            await (await c_glue(window))

        paths: dict[str, Callable[[list[ao.OffloadKey]], Awaitable[None]]] = {
            "manager": manager_load,
            "engine": engine_load,
            "C glue": glue_load,
        }
        out: dict[str, list[float]] = {name: [] for name in paths}
        for rep in range(reps + 1):  # the first is a warm-up
            for name, path in paths.items():
                t0 = time.perf_counter()
                for i in range(calls):
                    await path(windows[i % len(windows)])
                if rep:
                    out[name].append((time.perf_counter() - t0) / calls * 1e6)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--calls", type=int, default=20000, help="loads per path and repetition")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions; median")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        floor = build(workdir)
        times = loops.run(measure(floor, args.calls, args.reps), use_uvloop=True)
    base = statistics.median(times["manager"])
    print(f"16-block loads, uvloop, LRU, median of {args.reps} x {args.calls} calls")
    print("| path | us/call | vs manager |\n|---|---:|---:|")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"| {name} | {median:.2f} | {base / median:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
