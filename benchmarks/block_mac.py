"""What authenticated blocks cost: packing and checking a block with CRC32C only
(``mac_key=None``) against CRC32C plus the keyed BLAKE2b-256 MAC (``mac_key`` set).

One thread, the native functions the lanes run (``ao_pack_block``: header, payload copied
behind it with its CRC32C and MAC taken 64 KiB at a time; ``ao_unpack_block``: checked,
then copied out), called through ctypes on blocks of 256 KiB and 2 MiB. The blocks cycle
through a working set of ``--working-set`` bytes (default 256 MiB) so that they come from
memory, as host slots do, not from cache. For reference the same run times ``memcpy``,
the CRC32C alone, the native BLAKE2b alone and ``hashlib.blake2b`` (CPython's BLAKE2).

The cases take turns, one pass of the working set each, for about ``--budget`` seconds
per case after a warm-up (so that other work on a shared machine slows them alike); the
figure is the median rate over a case's passes, in GB/s of payload (10^9 bytes). Results:
docs/benchmarks.md ("Authenticated blocks").

    .venv/bin/python benchmarks/block_mac.py [--budget 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from asyncoffload.tiers import _io

SIZES = (256 << 10, 2 << 20)
KEY = bytes(range(32))
IDENTITY = bytes(16)
BLOCK_KEY = b"0123456789abcdef0123456789abcdef\x00\x00\x00\x00"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def timed(
    cases: dict[str, Callable[[int], object]], count: int, nbytes: int, budget: float
) -> dict[str, float]:
    """The median GB/s of each case over passes of ``run(i)`` for i in range(count). The
    cases take turns, pass by pass, for about ``budget`` seconds each: on a shared
    machine whatever else runs slows them alike, and their ratios hold."""
    for run in cases.values():  # warm-up: touch every page once
        for i in range(count):
            run(i)
    rates: dict[str, list[float]] = {name: [] for name in cases}
    end = time.perf_counter() + budget * len(cases)
    while time.perf_counter() < end or min(len(r) for r in rates.values()) < 5:
        for name, run in cases.items():
            start = time.perf_counter_ns()
            for i in range(count):
                run(i)
            rates[name].append(count * nbytes / (time.perf_counter_ns() - start))
    return {name: statistics.median(r) for name, r in rates.items()}


def measure(size: int, working_set: int, budget: float) -> dict[str, float]:
    lib = _io._library()
    count = max(2, working_set // size)
    whole = _io.HEADER_BYTES + size
    srcs = [ctypes.create_string_buffer(bytes([i % 251]) * size) for i in range(count)]
    dsts = [ctypes.create_string_buffer(size) for _ in range(count)]
    values = [ctypes.create_string_buffer(whole) for _ in range(count)]
    klen = len(BLOCK_KEY)

    def pack(mac: bytes | None) -> Callable[[int], None]:
        n = len(mac or b"")

        def run(i: int) -> None:
            lib.ao_pack_block(
                values[i], srcs[i], size, IDENTITY, BLOCK_KEY, klen, 1, None, mac, n
            )  # fmt: skip

        return run

    def unpack(mac: bytes | None) -> Callable[[int], None]:
        n = len(mac or b"")

        def run(i: int) -> None:
            rc = lib.ao_unpack_block(
                values[i], whole, dsts[i], size, IDENTITY, BLOCK_KEY, klen, 1, None, mac, n
            )
            if rc != 0:
                raise RuntimeError(f"unpack failed: {rc}")

        return run

    digest = ctypes.create_string_buffer(32)
    views = [memoryview(s).cast("B")[:size] for s in srcs]
    cases: dict[str, Callable[[int], object]] = {
        # each unpack checks what the pack before it in the same pass made
        "pack crc": pack(None),
        "unpack crc": unpack(None),
        "pack crc+mac": pack(KEY),
        "unpack crc+mac": unpack(KEY),
        "memcpy": lambda i: ctypes.memmove(dsts[i], srcs[i], size),
        "crc32c alone": lambda i: lib.ao_crc32c(0, srcs[i], size),
        "blake2b (native) alone": lambda i: lib.ao_blake2b(digest, 32, KEY, 32, srcs[i], size),
        "hashlib.blake2b alone": lambda i: hashlib.blake2b(
            views[i], key=KEY, digest_size=32
        ).digest(),
    }
    out = timed(cases, count, size, budget)
    for name in ("crc", "crc+mac"):
        # pack + unpack of the same bytes: 1 / (1/a + 1/b)
        a, b = out[f"pack {name}"], out[f"unpack {name}"]
        out[f"pack+unpack {name}"] = 1 / (1 / a + 1 / b)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per case")
    parser.add_argument("--working-set", type=int, default=256 << 20, help="bytes of blocks")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    _io.require("the benchmark")
    lib = _io._library()
    info = {
        "cpu": cpu_model(),
        "python": sys.version.split()[0],
        "crc32c_hardware": bool(lib.ao_crc32c_hardware()),
    }
    load = os.getloadavg()[0]
    info["load_average_1m"] = load
    print(
        f"# {info['cpu']}, {os.cpu_count()} CPUs; CRC32C in hardware: "
        f"{info['crc32c_hardware']}; one thread; load average {load:.2f}"
    )
    results: dict[str, Any] = {"machine": info, "sizes": {}}
    for size in SIZES:
        fig = measure(size, args.working_set, args.budget)
        results["sizes"][str(size)] = fig
        print(f"\n## blocks of {size >> 10} KiB (GB/s of payload)")
        for name, rate in fig.items():
            print(f"{name:28s} {rate:7.2f}")
        for op in ("pack", "unpack", "pack+unpack"):
            ratio = fig[f"{op} crc"] / fig[f"{op} crc+mac"]
            extra = 1 / fig[f"{op} crc+mac"] - 1 / fig[f"{op} crc"]  # ns per byte
            print(f"{op} with the MAC: {ratio:.2f}x the time, +{extra:.2f} s per GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
