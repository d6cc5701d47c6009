"""What a real Mooncake Store does with the calls the Mooncake tier (issue 26) is built on:
run by tests/test_mooncake_store.py inside a private network namespace (``unshare
--net``), since ``mooncake_master`` and the client listen on every interface.

It starts ``mooncake_master`` on 127.0.0.1 (a short ``--default_kv_lease_ttl`` when asked),
sets up one client over TCP with ``P2PHANDSHAKE`` metadata, drives the calls, and prints
one JSON object of what each returned. Nothing here decides anything: the test asserts.

``lane`` mode drives :class:`asyncoffload.tiers._mooncake.MooncakeLane` (the helper
process) on an event loop with a completion bridge instead.

``hold`` mode keeps a master and a storage client running for processes that join its
network namespace (the vLLM test).

Run: ``unshare --net python tests/mooncake_probe.py PORT [store|lane|hold]`` (root).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def unshadow(folder: Path) -> None:
    """Take ``folder`` (a script's, first on ``sys.path``) off the path, and forget a
    ``mooncake`` imported from it: benchmarks/mooncake.py is named as Mooncake's package
    is, and would shadow it for every script of its folder. Call it before anything
    imports ``mooncake``."""
    folder = folder.resolve()
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != folder]
    module = sys.modules.get("mooncake")
    if (
        module is not None
        and Path(getattr(module, "__file__", "") or "").resolve().parent == folder
    ):
        del sys.modules["mooncake"]


def rerun_in_netns(script: str, argv: list[str]) -> int:
    """Run ``script`` again with ``--in-netns`` and ``argv`` inside a private network
    namespace (``unshare --net``: Mooncake listens on every interface); its exit status,
    or 2 where that cannot be done (no ``unshare``, not root)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        print(f"{Path(script).name} runs inside `unshare --net` (root)", file=sys.stderr)
        return 2
    cmd = [sys.executable, os.path.abspath(script), "--in-netns", *argv]
    return subprocess.call([unshare, "--net", *cmd])


def loopback_up() -> None:
    """Bring ``lo`` up in this (new, private) network namespace, with the ioctl that
    ``ip link set lo up`` makes: no iproute2 needed."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack_from("16sH", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up, b""))


def address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


#: The lease the tier tests' masters give a read (``--default_kv_lease_ttl``): short, so
#: that a damaged object's removal, refused while a read's lease holds it, comes soon.
#: Clusters that serve engines (``hold``, the vLLM tests) keep the master's own default
#: (10 s): on two busy vCPUs a get of 6 blocks outlived a 200 ms lease, and Mooncake's
#: client failed it (LEASE_EXPIRED: the bytes may have been replaced meanwhile).
TEST_LEASE_MS = 200


def start_master(port: int, lease_ms: int | None, *flags: str) -> subprocess.Popen[bytes]:
    """``mooncake_master`` on 127.0.0.1:``port`` (and ``flags``), once it listens; a read's
    lease ``lease_ms`` (None: the master's default)."""
    import mooncake

    binary = Path(mooncake.__file__).with_name("mooncake_master")
    proc = subprocess.Popen(
        [
            str(binary),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={port}",
            "--enable_http_metadata_server=false",
            f"--metrics_port={port + 1}",
            *([] if lease_ms is None else [f"--default_kv_lease_ttl={lease_ms}"]),
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("mooncake_master did not listen on 127.0.0.1 within 15 s")


def lane_settings(master: str) -> dict[str, object]:
    """``MooncakeLane``'s settings for a client of ``master`` over TCP on 127.0.0.1."""
    return {
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_bytes": 512 << 20,
        "local_buffer_bytes": 64 << 20,
        "protocol": "tcp",
        "device_name": "",
        "master": master,
    }


def lane_probe(port: int, masters: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    """The helper-process lane on an event loop: puts, existence checks and gets woken
    through a completion bridge; the master (``masters[-1]``) killed and restarted (the
    new one appended); then the helper killed."""
    import asyncio
    import errno
    import os
    import signal

    from asyncoffload.tiers._mooncake import (
        OP_EXISTS,
        OP_GET,
        OP_PUT,
        Block,
        MooncakeJob,
        MooncakeLane,
    )
    from asyncoffload.transfer.completion import CompletionBridge

    block = 8192
    size = 8 * block
    memfd = os.memfd_create("probe", os.MFD_CLOEXEC)
    os.ftruncate(memfd, size)
    region = mmap.mmap(memfd, size)
    region[: 2 * block] = os.urandom(2 * block)
    out: dict[str, Any] = {}
    lane = MooncakeLane(lane_settings(f"127.0.0.1:{port}"), identity=bytes(16), payload_len=block)

    def at(key: bytes, slot: int) -> Block:
        return Block(key, ((0, slot * block, block),))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        bridge = CompletionBridge(loop, "eventfd")
        queue = bridge.lane("mooncake")
        lane.bind(bridge.wake_fd)

        async def done(job: MooncakeJob) -> list[int]:
            fut: asyncio.Future[list[int]] = loop.create_future()
            bridge.watch(queue, job, lambda _j: fut.set_result(list(job.results)))
            return await asyncio.wait_for(fut, 20)

        out["map"] = await done(lane.map([(memfd, size)]))
        put = [at(b"k0", 0), at(b"k1", 1)]
        out["put"] = await done(lane.submit(OP_PUT, put))
        out["exists"] = await done(lane.submit(OP_EXISTS, [b"k0", b"k1", b"nope"]))
        get = [at(b"k0", 2), at(b"k1", 3), at(b"nope", 4)]
        out["get"] = await done(lane.submit(OP_GET, get))
        out["payload_equal"] = region[2 * block : 4 * block] == region[: 2 * block]
        # Pieces that do not make a block: refused by the helper, never sent.
        half = Block(b"k0", ((0, 5 * block, block // 2),))
        out["not_a_block"] = await done(lane.submit(OP_GET, [half]))
        try:
            lane.submit(OP_GET, [Block(b"k0", ((0, size - 10, block),))])
        except ValueError as exc:
            out["outside"] = str(exc)
        masters[-1].kill()
        masters[-1].wait(10)
        started = time.monotonic()
        out["master_down"] = await done(lane.submit(OP_GET, get[:1]))
        out["master_down_s"] = time.monotonic() - started
        masters.append(start_master(port, TEST_LEASE_MS))
        deadline = time.monotonic() + 20
        gets = []
        while time.monotonic() < deadline:  # the client reconnects
            gets.append((await done(lane.submit(OP_GET, get[:1])))[0])
            if gets[-1] != -errno.EHOSTDOWN:
                break
            await asyncio.sleep(0.2)
        out["restarted_gets"] = gets
        deadline = time.monotonic() + 20
        puts = []
        while time.monotonic() < deadline:  # the client mounts its segment again
            puts.append((await done(lane.submit(OP_PUT, put[:1])))[0])
            if puts[-1] == 0:
                break
            await asyncio.sleep(0.2)
        out["restarted_puts"] = puts
        os.kill(lane._proc.pid, signal.SIGKILL)
        lane._proc.wait(10)
        out["after_kill"] = await done(lane.submit(OP_GET, get[:1]))
        out["pending_after_kill"] = lane.pending
        bridge.close()

    try:
        asyncio.run(run())
    finally:
        lane.close()
        region.close()
        os.close(memfd)
    return out


def hold(port: int, master: subprocess.Popen[bytes]) -> int:
    """A cluster for other processes of this netns (``nsenter --net=/proc/PID/ns/net``):
    the master, and a client giving the pool 256 MiB (a storage node, so that objects
    outlive the engines that put them). Prints ``ready``, then runs until stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    try:
        code = store.setup(
            "127.0.0.1", "P2PHANDSHAKE", 256 << 20, 16 << 20, "tcp", "", f"127.0.0.1:{port}"
        )
        if code != 0:
            raise RuntimeError(f"the storage client's setup failed: {code}")
        print("ready", flush=True)
        sys.stdin.read()
    finally:
        store.close()
        master.terminate()
        master.wait(10)
    return 0


def main() -> int:
    port = int(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "store"
    loopback_up()
    from mooncake.store import MooncakeDistributedStore

    master = start_master(port, None if mode == "hold" else TEST_LEASE_MS)
    if mode == "hold":
        return hold(port, master)
    out: dict[str, Any] = {}
    if mode == "lane":
        masters = [master]
        try:
            out = lane_probe(port, masters)
        finally:
            for proc in masters:
                proc.terminate()
                proc.wait(10)
        print(json.dumps(out))
        return 0
    try:
        store = MooncakeDistributedStore()
        out["setup"] = store.setup(
            "127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", f"127.0.0.1:{port}"
        )
        block = 8192
        src = mmap.mmap(-1, 4 * block)
        src.write(bytes(range(256)) * (4 * block // 256))
        dst = mmap.mmap(-1, 4 * block)
        out["register"] = [
            store.register_buffer(address(src), len(src)),
            store.register_buffer(address(dst), len(dst)),
        ]
        s, d = address(src), address(dst)
        out["put"] = store.batch_put_from(["a", "b"], [s, s + block], [block, block])
        out["exists"] = store.batch_is_exist(["a", "b", "missing"])
        out["get"] = store.batch_get_into(
            ["a", "b", "missing"], [d, d + block, d + 2 * block], [block, block, block]
        )
        out["get_equal"] = dst[: 2 * block] == src[: 2 * block]
        # A header and a payload from two places, one object; read back into two places.
        out["multi_put"] = store.batch_put_from_multi_buffers(
            ["h"], [[s + 3 * block, s]], [[64, block]]
        )
        out["multi_size"] = store.get_size("h")
        dst.seek(0)
        dst.write(bytes(len(dst)))
        out["multi_get"] = store.batch_get_into_multi_buffers(
            ["h"], [[d + 3 * block, d]], [[64, block]]
        )
        out["multi_equal"] = (
            dst[3 * block : 3 * block + 64] == src[3 * block : 3 * block + 64]
            and dst[:block] == src[:block]
        )
        # A buffer shorter than the object.
        out["short_get"] = store.batch_get_into(["a"], [d], [block // 2])
        # An object shorter than the header and payload buffers it is read into (a value
        # cut short): the get fails with TRANSFER_FAIL before any transfer is submitted,
        # and its size says why.
        out["short_put"] = store.batch_put_from(["cut"], [s], [100])
        out["short_object_get"] = store.batch_get_into_multi_buffers(
            ["cut"], [[d + 3 * block, d]], [[64, block]]
        )
        out["short_object_size"] = store.get_size("cut")
        # Put again, other bytes: what a second writer of the same block sees, and
        # whether the first value stays.
        out["put_again"] = store.batch_put_from(["a"], [s + block], [block])
        out["get_again"] = store.batch_get_into(["a"], [d + block], [block])
        out["first_value_stays"] = dst[block : 2 * block] == src[:block]
        out["remove_now"] = store.remove("b")
        time.sleep(0.5)  # past the 200 ms lease
        out["remove_later"] = store.remove("b")
        out["exists_after_remove"] = store.is_exist("b")
        store.close()
    finally:
        master.terminate()
        master.wait(10)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
