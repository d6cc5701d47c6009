"""What a real Mooncake Store does with the calls the Mooncake tier (issue 26) is built on:
run by tests/test_mooncake_store.py inside a private network namespace (``unshare
--net``), since ``mooncake_master`` and the client listen on every interface.

It starts ``mooncake_master`` on 127.0.0.1 (a short ``--default_kv_lease_ttl`` when asked),
sets up one client over TCP with ``P2PHANDSHAKE`` metadata, drives the calls, and prints
one JSON object of what each returned. Nothing here decides anything: the test asserts.

Run: ``unshare --net python tests/mooncake_probe.py PORT`` (root).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def start_master(port: int, lease_ms: int) -> subprocess.Popen[bytes]:
    import mooncake

    binary = Path(mooncake.__file__).with_name("mooncake_master")
    proc = subprocess.Popen(
        [
            str(binary),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={port}",
            "--enable_http_metadata_server=false",
            f"--metrics_port={port + 1}",
            f"--default_kv_lease_ttl={lease_ms}",
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


def main() -> int:
    port = int(sys.argv[1])
    subprocess.call(["ip", "link", "set", "lo", "up"], stderr=subprocess.DEVNULL)
    from mooncake.store import MooncakeDistributedStore

    master = start_master(port, lease_ms=200)
    out: dict[str, Any] = {}
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
        # Put again: what a second writer of the same block sees.
        out["put_again"] = store.batch_put_from(["a"], [s], [block])
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
