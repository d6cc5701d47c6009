"""Mooncake Store throughput: asyncoffload's Mooncake tier against Mooncake's own client
moving the same payload bytes, side by side in one run.

Paths (``--paths``), per direction (write = put, read = get), on one ``mooncake_master``
on 127.0.0.1 started here:

- ``raw``: Mooncake's synchronous Python client (``MooncakeDistributedStore``) in this
  process, called directly: ``batch_put_from`` / ``batch_get_into`` of ``--batch`` blocks
  at a time, back to back, on a registered buffer. Each object is the payload alone.
  Nothing else runs: the ceiling for this client library.
- ``raw-2span``: the same client and calls as the tier's helper makes them,
  ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` of two spans per
  object, a 4096-byte header (from / into a registered buffer; its bytes neither
  written nor checked) then the payload: the ceiling for the tier's object layout.
- ``tier``: :class:`~asyncoffload.tiers.mooncake.MooncakeStore`, driven as the engine
  drives it: one ``submit_write`` / ``submit_read`` of all ``--blocks`` blocks, from /
  into host slots in a ``memfd``; the tier splits them into requests of ``batch_blocks``
  (``--batch``) to its helper process, whose replies wake a
  :class:`~asyncoffload.transfer.completion.CompletionBridge` (eventfd) on an asyncio
  (or ``--loop uvloop``) loop. Timed from the submission to the job's callback, so it
  includes what the tier adds: the messages to and from the helper, and the block
  format's header (written with the payload's CRC32C before a put; checked, with the
  CRC32C, after a get), sent as ``raw-2span`` sends it.

GB/s are 1e9 bytes/s of payload (``--blocks`` x ``--block-bytes``) for every path: the
``raw-2span`` and tier objects' 4096 header bytes count as their overhead. Each
repetition runs every path, in an order rotated by one each repetition: the writes, then
the reads of what that repetition wrote (fresh names every repetition: a put of a name
that exists is a no-op in Mooncake). Outside the timed region it checks every result
(a put 0, a get the object's size; the tier ``block_bytes``) and that the bytes read back
equal the bytes written (every path; the destination is zeroed before each read), then
removes every object (``remove_all(force=True)``), so the pool never fills (it would
evict, or fail puts for want of space); any failure ends the run with what failed. A
warm-up repetition (not reported) opens the transfer connections first. The table gives
the median and the range over repetitions and the ratio of medians to ``raw``; the
per-repetition ratios follow.

Caveats: this process's client and the tier's helper each give the pool a segment
(``--segment-bytes``), and the master places each object in either (its default,
random placement): a transfer to the caller's own segment is a memcpy (Mooncake's
``MC_STORE_MEMCPY``, on by default over TCP), one to the other process's goes over TCP
on loopback, in the same proportion for every path on average. Everything (master, both
clients, the helper) shares this machine's CPUs: on a small VM the figures are CPU-bound
and vary from run to run by tens of percent; compare paths within a run.

Mooncake's client and master listen on every interface, so the script runs inside a
private network namespace: it re-runs itself under ``unshare --net`` (root) unless
``--in-netns`` says it already is in one. (This file is named as Mooncake's package is;
it takes its own folder off ``sys.path`` first.)

Run (root, Linux, ``pip install 'asyncoffload[mooncake]'`` and Debian's libibverbs1,
libnl-3-200 and libnl-route-3-200): ``.venv/bin/python benchmarks/mooncake.py``
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the master

from asyncoffload import make_offload_key
from asyncoffload.keys import OffloadKey
from asyncoffload.tiers.format import HEADER_BYTES, Namespace
from asyncoffload.tiers.mooncake import MooncakeBatch, MooncakeStore, MooncakeTier
from asyncoffload.transfer.base import CopyJob, HostRegion
from asyncoffload.transfer.completion import CompletionBridge, CopyLane
from tests.mooncake_probe import loopback_up, rerun_in_netns, start_master, unshadow

MASTER_PORT = 50161
#: How long one timed pass (or the helper's setup) may take before the run fails.
WAIT_S = 60.0
#: The master's lease on objects read (ms): short, so that nothing is held long.
LEASE_MS = 200
PATHS = ("raw", "raw-2span", "tier", "tier-2span")
#: The tier paths: the room before each host slot.
TIER_ROOM = {"tier": HEADER_BYTES, "tier-2span": 0}


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class Slots:
    """``2 * blocks`` slots of ``block`` bytes in ``buf``, ``room`` bytes free before each
    (the CPU backend's layout with ``shared_host``: a block's header goes there): [0,
    blocks) the source of the writes, [blocks, 2 * blocks) the destination of the reads."""

    def __init__(self, buf: mmap.mmap, blocks: int, block: int, room: int = 0) -> None:
        self.buf = buf
        self.blocks = blocks
        self.block = block
        self.room = room
        self.stride = room + block
        self.base = _address(buf)

    @staticmethod
    def size(blocks: int, block: int, room: int = 0) -> int:
        return 2 * blocks * (room + block)

    def _at(self, slot: int) -> int:
        """Slot ``slot``'s offset in ``buf``."""
        return self.room + slot * self.stride

    def src(self, i: int) -> int:
        return self.base + self._at(i)

    def dst(self, i: int) -> int:
        return self.base + self._at(self.blocks + i)

    def fill(self, rep: int) -> None:
        """New source bytes for repetition ``rep``: its number and the block's index over
        the first 16 bytes of each block (the rest stays random)."""
        for i in range(self.blocks):
            at = self._at(i)
            stamp = rep.to_bytes(8, "little", signed=True) + i.to_bytes(8, "little")
            self.buf[at : at + 16] = stamp

    def clear(self) -> None:
        """Zero the destination, so that a read that wrote nothing shows."""
        zero = bytes(self.block)
        for i in range(self.blocks):
            at = self._at(self.blocks + i)
            self.buf[at : at + self.block] = zero

    def check(self, what: str) -> None:
        """``RuntimeError`` unless every destination slot equals its source."""
        size = self.block
        for i in range(self.blocks):
            src, dst = self._at(i), self._at(self.blocks + i)
            if self.buf[dst : dst + size] != self.buf[src : src + size]:
                raise RuntimeError(f"{what}: block {i} read back differs from what was written")


#: A timed pass: (seconds, a result per block).
Pass = tuple[float, list[int]]


class Raw:
    """Mooncake's client in this process, called directly, ``batch`` blocks per call.
    ``spans`` 1: each object is the payload (``batch_put_from`` / ``batch_get_into``);
    2: a 4096-byte header (from / into a registered buffer of this process, its bytes
    not written or checked) then the payload, as the tier's helper sends them
    (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``)."""

    def __init__(self, store: Any, blocks: int, block: int, batch: int) -> None:
        self.store = store
        self.buf = mmap.mmap(-1, Slots.size(blocks, block))
        self.buf[:] = os.urandom(len(self.buf))  # faults the pages in, too
        self.slots = Slots(self.buf, blocks, block)
        self.headers = mmap.mmap(-1, batch * HEADER_BYTES)
        self.headers_at = _address(self.headers)
        for at, size in ((self.slots.base, len(self.buf)), (self.headers_at, len(self.headers))):
            code = store.register_buffer(at, size)
            if code != 0:
                raise RuntimeError(f"raw client: register_buffer failed with {code}")
        self.batch = batch

    def _run(self, spans: int, write: bool, names: list[str]) -> Pass:
        size, batch, store = self.slots.block, self.batch, self.store
        where = self.slots.src if write else self.slots.dst
        addrs = [where(i) for i in range(len(names))]
        heads = [self.headers_at + k * HEADER_BYTES for k in range(batch)]
        results: list[int] = []
        start = time.perf_counter()
        for at in range(0, len(names), batch):
            part = names[at : at + batch]
            mine = addrs[at : at + batch]
            if spans == 1:
                call = store.batch_put_from if write else store.batch_get_into
                results += call(part, mine, [size] * len(part))
            else:
                multi = (
                    store.batch_put_from_multi_buffers
                    if write
                    else store.batch_get_into_multi_buffers
                )
                ptrs = [[h, a] for h, a in zip(heads, mine)]
                results += multi(part, ptrs, [[HEADER_BYTES, size]] * len(part))
        return time.perf_counter() - start, results

    async def write(self, spans: int, names: list[str]) -> Pass:
        return self._run(spans, True, names)

    async def read(self, spans: int, names: list[str]) -> Pass:
        return self._run(spans, False, names)

    def close(self) -> None:
        self.buf.close()
        self.headers.close()


class Tier:
    """asyncoffload's Mooncake tier, its host slots in a memfd, woken through a
    completion bridge as the engine's are; ``room`` bytes before each slot (4096: the CPU
    backend's layout, header and payload one span; 0: vLLM's pool files, two spans)."""

    def __init__(
        self,
        master: str,
        segment: int,
        blocks: int,
        block: int,
        batch: int,
        room: int,
        **settings: Any,
    ) -> None:
        size = Slots.size(blocks, block, room)
        self.memfd = os.memfd_create("mooncake-bench", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.memfd, size)
            self.buf = mmap.mmap(self.memfd, size)
        except BaseException:
            os.close(self.memfd)
            raise
        self.buf[:] = os.urandom(size)
        self.slots = Slots(self.buf, blocks, block, room)
        # A namespace per layout: each tier path puts objects of its own names.
        namespace = Namespace(
            model=f"bench-room{room}", kv_dtype="uint8", layout="x", block_bytes=block
        )
        config = MooncakeTier(
            master=master, segment_bytes=segment, batch_blocks=batch, timeout_s=WAIT_S, **settings
        )
        try:
            self.store: MooncakeStore = config.open(namespace, "mooncake0")
        except BaseException:
            self.buf.close()
            os.close(self.memfd)
            raise
        self.store.attach_host([HostRegion(self.memfd, self.slots.base, size, room)])
        self.bridge: CompletionBridge | None = None
        self.lane: CopyLane | None = None

    async def start(self) -> None:
        """The completion bridge on this loop, and the helper's client set up."""
        loop = asyncio.get_running_loop()
        self.bridge = CompletionBridge(loop, "eventfd")
        self.lane = self.bridge.lane("mooncake")
        self.store.bind(self.bridge.wake_fd)
        await asyncio.wait_for(self.store.connect(), WAIT_S)

    async def _run(self, write: bool, keys: list[OffloadKey]) -> Pass:
        assert self.bridge is not None and self.lane is not None
        n = len(keys)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def ended(_job: CopyJob) -> None:
            if not done.done():
                done.set_result(None)

        start = time.perf_counter()
        if write:
            job = self.store.submit_write(keys, range(n), [self.slots.src(i) for i in range(n)])
        else:
            job = self.store.submit_read(
                keys, range(n, 2 * n), [self.slots.dst(i) for i in range(n)]
            )
        self.bridge.watch(self.lane, job, ended)
        try:
            await asyncio.wait_for(done, WAIT_S)
        except asyncio.TimeoutError:
            what = "write" if write else "read"
            raise RuntimeError(
                f"tier: a {what} of {n} blocks not done within {WAIT_S:g} s"
            ) from None
        took = time.perf_counter() - start
        assert isinstance(job, MooncakeBatch)
        return took, list(job.results)

    async def write(self, keys: list[OffloadKey]) -> Pass:
        return await self._run(True, keys)

    async def read(self, keys: list[OffloadKey]) -> Pass:
        return await self._run(False, keys)

    def close(self) -> None:
        self.store.close()
        if self.bridge is not None:
            self.bridge.close()
        self.buf.close()
        os.close(self.memfd)


def _check(what: str, results: list[int], want: int) -> None:
    bad = [(i, r) for i, r in enumerate(results) if r != want]
    if bad:
        raise RuntimeError(
            f"{what}: {len(bad)} of {len(results)} blocks failed (first: block {bad[0][0]} "
            f"-> {bad[0][1]}, want {want})"
        )


#: Seconds per repetition, by (direction, path).
Times = dict[tuple[str, str], list[float]]


async def measure(args: argparse.Namespace, master: str) -> Times:
    """Warm-up and timed repetitions of every path in ``args.paths``."""
    from mooncake.store import MooncakeDistributedStore

    n, block = args.blocks, args.block_bytes
    paths: list[str] = args.paths
    times: Times = {(d, p): [] for d in ("write", "read") for p in paths}
    client: Any = None
    raw: Raw | None = None
    tiers: dict[str, Tier] = {}
    try:
        for path in paths:
            if path in TIER_ROOM:
                room = TIER_ROOM[path]
                tiers[path] = Tier(
                    master,
                    args.segment_bytes,
                    n,
                    block,
                    args.batch,
                    room,
                    in_flight=args.in_flight,
                    check_threads=args.check_threads,
                )
        client = MooncakeDistributedStore()
        code = client.setup(
            "127.0.0.1", "P2PHANDSHAKE", args.segment_bytes, 16 << 20, "tcp", "", master
        )
        if code != 0:
            raise RuntimeError(f"raw client: setup failed with {code}")
        raw = Raw(client, n, block, args.batch)
        for tier in tiers.values():
            await tier.start()
        for rep in range(-args.warmup, args.reps):
            keys = [make_offload_key(f"{rep}:{i}".encode().ljust(32, b".")) for i in range(n)]
            names = {p: [f"{p}:{rep}:{i}" for i in range(n)] for p in paths}
            for tier in tiers.values():
                tier.slots.fill(rep)
            raw.slots.fill(rep)
            order = paths[rep % len(paths) :] + paths[: rep % len(paths)]
            took: dict[tuple[str, str], float] = {}
            for direction in ("write", "read"):
                for path in order:
                    what = f"rep {rep}: {path} {direction}"
                    if path in tiers:
                        tier = tiers[path]
                        if direction == "read":
                            tier.slots.clear()
                        call = tier.write if direction == "write" else tier.read
                        seconds, results = await call(keys)
                        want = block
                    else:
                        spans = 1 if path == "raw" else 2
                        if direction == "read":
                            raw.slots.clear()
                        raw_call = raw.write if direction == "write" else raw.read
                        seconds, results = await raw_call(spans, names[path])
                        want = 0 if direction == "write" else block + (spans - 1) * HEADER_BYTES
                    _check(what, results, want)
                    if direction == "read":
                        slots = tiers[path].slots if path in tiers else raw.slots
                        slots.check(what)
                    took[direction, path] = seconds
            removed = client.remove_all(True)
            if removed != len(paths) * n:
                print(f"rep {rep}: remove_all removed {removed} objects, not {len(paths) * n}")
            line = ", ".join(
                f"{d} {p} {n * block / s / 1e9:.2f} GB/s" for (d, p), s in took.items()
            )
            print(f"{'warm-up' if rep < 0 else f'rep {rep}'}: {line}", flush=True)
            if rep >= 0:
                for k, s in took.items():
                    times[k].append(s)
    finally:
        for tier in tiers.values():
            tier.close()
        if client is not None:
            client.close()  # before its registered buffers go
        if raw is not None:
            raw.close()
    return times


def table(times: Times, nbytes: int) -> str:
    lines = [
        "| direction | path | GB/s median | GB/s min - max | ratio to raw (medians) |",
        "|---|---|---|---|---|",
    ]
    for direction in ("write", "read"):
        paths = [p for d, p in times if d == direction]
        base = statistics.median(nbytes / s / 1e9 for s in times[direction, paths[0]])
        for path in paths:
            rates = [nbytes / s / 1e9 for s in times[direction, path]]
            median = statistics.median(rates)
            lines.append(
                f"| {direction} | {path} | {median:.2f} | {min(rates):.2f} - {max(rates):.2f} "
                f"| {median / base:.2f} |"
            )
    return "\n".join(lines)


def run_on(loop_name: str, coro: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(coro())
    return asyncio.run(coro())


def main(argv: list[str] | None = None) -> int:
    unshadow(Path(__file__).resolve().parent)  # this file is named as Mooncake's package is
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--block-bytes", type=int, default=256 << 10)
    parser.add_argument("--blocks", type=int, default=512, help="blocks per pass")
    parser.add_argument("--batch", type=int, default=64, help="blocks per store call")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="repetitions not reported")
    parser.add_argument("--segment-bytes", type=int, default=512 << 20, help="per client")
    parser.add_argument("--paths", default=",".join(PATHS), help="raw first; of " + ",".join(PATHS))
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    defaults = MooncakeTier()
    parser.add_argument(
        "--in-flight", type=int, default=defaults.in_flight, help="the tier's in_flight"
    )
    parser.add_argument(
        "--check-threads",
        type=int,
        default=defaults.check_threads,
        help="the tier's check_threads (at most the CPUs)",
    )
    parser.add_argument("--in-netns", action="store_true", help="already in a private netns")
    args = parser.parse_args(argv)
    n, block = args.blocks, args.block_bytes
    if args.reps < 1 or n < 1 or block < 1 or args.warmup < 0 or not 1 <= args.batch <= 512:
        parser.error("--reps, --blocks, --block-bytes >= 1, --warmup >= 0, --batch 1 to 512")
    args.paths = [p for p in args.paths.split(",") if p]
    if not args.paths or args.paths[0] != "raw" or not set(args.paths) <= set(PATHS):
        parser.error(f"--paths: raw, then any of {', '.join(PATHS[1:])}")
    # Every repetition's objects are in the pool at once (removed after it): keep them
    # well under the two segments, or Mooncake evicts or fails puts for want of space.
    held = n * block + (len(args.paths) - 1) * n * (block + HEADER_BYTES)
    segments = 1 + sum(p in TIER_ROOM for p in args.paths)  # this process's, each tier's
    if held > 0.8 * segments * args.segment_bytes:
        parser.error(
            f"a repetition holds {held >> 20} MiB: give --segment-bytes of at least "
            f"{int(held / 0.8 / segments) >> 20} MiB"
        )
    if not args.in_netns:
        return rerun_in_netns(__file__, argv or sys.argv[1:])
    loopback_up()
    from importlib.metadata import PackageNotFoundError, version

    try:
        mc_version = version("mooncake-transfer-engine-non-cuda")
    except PackageNotFoundError:
        mc_version = version("mooncake-transfer-engine")
    print(
        f"{platform.node()} | {os.cpu_count()} CPUs | python {platform.python_version()} | "
        f"mooncake {mc_version} | loop {args.loop}",
        flush=True,
    )
    print(
        f"block {block} B | {n} blocks per pass ({n * block / (1 << 20):.0f} MiB of payload) "
        f"| batch {args.batch} | {args.reps} reps (+{args.warmup} warm-up) | segment "
        f"{args.segment_bytes >> 20} MiB per client | tier: in_flight {args.in_flight}, "
        f"check_threads {min(args.check_threads, os.cpu_count() or 1)} | raw-2span and "
        "tier objects carry a "
        f"{HEADER_BYTES}-byte header too (GB/s count the payload only)",
        flush=True,
    )
    master_proc = start_master(MASTER_PORT, lease_ms=LEASE_MS)
    try:
        times: Times = run_on(args.loop, lambda: measure(args, f"127.0.0.1:{MASTER_PORT}"))
    finally:
        master_proc.terminate()
        try:
            master_proc.wait(10)
        except subprocess.TimeoutExpired:
            master_proc.kill()
            master_proc.wait()
    print()
    print(table(times, n * block))
    print()
    for direction in ("write", "read"):
        for path in args.paths[1:]:
            ratios = zip(times[direction, "raw"], times[direction, path])
            each = ", ".join(f"{raw_s / s:.2f}" for raw_s, s in ratios)
            print(f"{direction}: {path} / raw per rep: {each}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
