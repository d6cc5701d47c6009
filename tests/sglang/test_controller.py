"""asyncoffload under SGLang 0.5.23's own ``HiCacheController`` on a CPU: its backup
thread stores through ``batch_set_v1``, its prefetch thread counts hits with
``batch_exists`` and its prefetch I/O thread loads with ``batch_get_v1``, all three at
once; and under SGLang's own failure injector. Every byte that arrives is the byte that
was backed up; failures are misses."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from tests.sglang.harness import PAGE, disk, fill
from tests.sglang.rig import Rig, prompt


def test_backup_then_prefetch_through_the_controller_byte_exact(tmp_path: Path) -> None:
    rig = Rig([disk(tmp_path / "kv", capacity=64 << 20)])
    try:
        tokens = prompt(1, 150)  # two storage batches of SGLang's 128 pages
        indices = rig.alloc(len(tokens))
        data = fill(rig.pool, indices, 1)
        assert rig.backup(tokens, indices) == len(tokens)
        rig.free(indices)
        done, got, confirmed = rig.prefetch("r1", tokens)
        assert len(confirmed) == 150 and done == len(tokens)
        assert got == data
        assert rig.prefetch("r2", prompt(2, 4))[0] == 0  # never stored
    finally:
        rig.close()


def _hammer(rig: Rig, seconds: float, pages: int = 8) -> dict[str, int]:
    """Back up prompts and prefetch earlier ones, from two callers while the
    controller's three threads serve both, for ``seconds``; what was seen."""
    stored: dict[int, list[bytes]] = {}
    lock = threading.Lock()
    seen = {"prefetched": 0, "pages": 0, "wrong": 0, "confirmed_missed": 0, "backups": 0}
    stop = time.monotonic() + seconds

    def writer() -> None:
        seed = 100
        while time.monotonic() < stop:
            tokens = prompt(seed, pages)
            indices = rig.alloc(len(tokens))
            data = fill(rig.pool, indices, seed)
            if rig.backup(tokens, indices) == len(tokens):
                with lock:
                    stored[seed] = data
            rig.free(indices)
            seen["backups"] += 1
            seed += 1

    def reader() -> None:
        n = 0
        while time.monotonic() < stop:
            with lock:
                seeds = list(stored)
            if not seeds:
                time.sleep(0.01)
                continue
            seed = seeds[n % len(seeds)]
            n += 1
            done, got, confirmed = rig.prefetch(f"r{n}", prompt(seed, pages))
            seen["prefetched"] += 1
            seen["pages"] += len(got)
            seen["wrong"] += sum(a != b for a, b in zip(got, stored[seed]))
            seen["confirmed_missed"] += len(confirmed) - done // PAGE

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
        assert not t.is_alive(), "a caller did not finish"
    return seen


def test_three_controller_threads_at_once_no_exception_no_wrong_byte(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig([disk(tmp_path / "kv", capacity=64 << 20)])
    try:
        with caplog.at_level(logging.WARNING):
            seen = _hammer(rig, 3.0)
    finally:
        rig.close()
    assert seen["prefetched"] > 5 and seen["backups"] > 5, seen
    assert seen["wrong"] == 0, seen
    assert seen["confirmed_missed"] <= seen["pages"] // 20, seen  # few misses after a yes
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_under_sglangs_failure_injector_only_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    rig = Rig([disk(tmp_path / "kv", capacity=64 << 20)])
    try:
        assert type(rig.backend).__name__ == "HiCacheStorageFailureInjector"
        seen = _hammer(rig, 3.0)
    finally:
        rig.close()
    assert seen["prefetched"] > 3, seen
    assert seen["wrong"] == 0, seen
