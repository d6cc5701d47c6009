"""Pages stored by one SGLang host pool's backend, found by another process's: run by
tests/sglang/test_processes.py. Each command prints one JSON object of what it saw;
nothing here decides anything, the test asserts.

    python -m tests.sglang.scenarios load JOBS_JSON
    unshare --net python -m tests.sglang.scenarios mooncake PORT

:func:`store` fills PAGES pages with KV seeded by SEED and stores them; ``load`` runs
:func:`load` for each job ``[tiers, layout, seed, pages]`` (each a fresh pool and a fresh
backend): it counts and loads them and gives each page's digest. ``mooncake`` runs
inside a private network namespace: a ``mooncake_master`` and a storage node on
127.0.0.1, then :func:`store` here in two layouts (each backend closes), then ``load``
in another process.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.sglang.harness import PAGE, attach, config, extra, fill, mha_pool, page_keys, pages_bytes  # noqa: E402

#: Each wait, at most.
WAIT_S = 60.0


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _pool(layout: str) -> Any:
    """An MHA host pool in ``layout``; "page_first+shm": in SGLang's shared-memory
    allocator (``"allocator": "shm"``), which a Mooncake tier maps in place."""
    if layout.endswith("+shm"):
        return mha_pool(layout.removesuffix("+shm"), allocator="shm")
    return mha_pool(layout)


def _more(layout: str) -> dict[str, Any]:
    return {"allocator": "shm"} if layout.endswith("+shm") else {}


def store(tiers: list[dict[str, Any]], layout: str, seed: int, pages: int) -> dict[str, Any]:
    pool = _pool(layout)
    backend = attach(config(extra(tiers, **_more(layout))), pool)
    try:
        indices = pool.alloc(pages * PAGE)
        data = fill(pool, indices, seed)
        ok = backend.batch_set_v1(page_keys(pages, f"seed {seed}"), indices)
        staged = getattr(backend, "staging", None) is not None
    finally:
        backend.close()
    return {"stored": ok, "want": [digest(d) for d in data], "staged": staged}


def load(tiers: list[dict[str, Any]], layout: str, seed: int, pages: int) -> dict[str, Any]:
    pool = _pool(layout)
    backend = attach(config(extra(tiers, **_more(layout))), pool)
    try:
        keys = page_keys(pages, f"seed {seed}")
        found = backend.batch_exists(keys)
        back = pool.alloc(pages * PAGE)
        ok = backend.batch_get_v1(keys, back)
        got = [digest(d) for d in pages_bytes(pool, back)]
        other = backend.batch_exists(page_keys(pages, "never stored"))
    finally:
        backend.close()
    return {"found": found, "loaded": ok, "got": got, "other": other}


#: One store or load: the tiers, the layout, the seed, the pages.
Job = tuple[list[dict[str, Any]], str, int, int]


def run(*args: str, timeout: float = WAIT_S * 2) -> Any:
    """This script's command ``args`` in another process; what it printed."""
    cmd = [sys.executable, "-m", "tests.sglang.scenarios", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(lines[-1])


#: The Mooncake scenario's layouts: pages in place (SGLang's shared-memory allocator),
#: and through the staging area.
LAYOUTS = ("page_first+shm", "layer_first")


def mooncake(port: int) -> dict[str, Any]:
    from tests.mooncake_probe import loopback_up, start_master

    loopback_up()
    master = start_master(port, 60_000)
    node = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "mooncake_engines.py"), str(port), "storage"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert node.stdout is not None
        ready = node.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"the Mooncake storage node said {ready!r}")
        tiers = [
            {
                "kind": "mooncake",
                "master": f"127.0.0.1:{port}",
                "segment_bytes": 0,
                "timeout_s": 10.0,
            }
        ]
        jobs: list[Job] = [(tiers, layout, seed, 6) for seed, layout in enumerate(LAYOUTS, 7)]
        first = [store(*job) for job in jobs]
        return {"first": first, "second": run("load", json.dumps(jobs))}
    finally:
        if node.stdin is not None:
            node.stdin.close()
        try:
            node.wait(10)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait(10)
        master.kill()
        master.wait(10)


def main(argv: list[str]) -> int:
    out: Any
    if argv[0] == "mooncake":
        out = mooncake(int(argv[1]))
    else:
        out = [load(*job) for job in json.loads(argv[1])]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
