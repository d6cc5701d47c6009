"""Building and loading the native helpers: damaged cache files, compilers that fail,
hang or take arguments, and builds asked for on an event loop (issue 11, defects 2 and
14); libraries installed with the package, a cache shared across architectures or not
writable, no compiler at all (issue 12). Every test uses its own cache directory
(``ASYNCOFFLOAD_CACHE_DIR``)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import platform
import shutil
import signal
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncoffload import _native
from tests.processes import describe, run_python

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = [
    pytest.mark.skipif(CC is None, reason="no C compiler"),
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="native helpers are built on Linux here"
    ),
]

# A process that loads what an engine and a KV policy need, and says what it got.
USE_NATIVE = """
import torch
import asyncoffload as ao
from asyncoffload.manager.policies.kv import KVPolicy
kv = [torch.zeros((4, 4, 16), dtype=torch.bfloat16)]
backend = ao.CpuCopyBackend(kv, ao.KVLayout.infer(kv), 4, copy_engine="native")
job = backend.submit_store([0, 1], [0, 1])
while not job.query():
    pass
backend.close()
KVPolicy(16, native=True)
print("native engine and kv policy ok")
"""


def _library(cache: Path, name: str) -> Path:
    (path,) = [p for p in cache.glob(f"{name}-*") if not p.name.endswith(".sha256")]
    return path


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding every native library, built once for the module."""
    cache = tmp_path_factory.mktemp("native-cache")
    proc = run_python(
        """
        from asyncoffload import _native
        assert _native.load_copy_engine() is not None
        assert _native.load_kvcore() is not None
        _native.load_cuda_helpers()
        """,
        env={"ASYNCOFFLOAD_CACHE_DIR": str(cache)},
    )
    assert proc.returncode == 0, describe(proc)
    return cache


@pytest.fixture
def cache(built_cache: Path, tmp_path: Path) -> Path:
    """A copy of the built cache that the test may damage."""
    return Path(shutil.copytree(built_cache, tmp_path / "cache"))


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """``load_copy_engine`` forgetting what it loaded, over an empty cache in tmp_path;
    it forgets again afterwards, so later tests load from the usual cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ASYNCOFFLOAD_CACHE_DIR", str(cache))
    monkeypatch.delenv("ASYNCOFFLOAD_NO_NATIVE", raising=False)
    # No library installed with the package, whatever this checkout holds.
    monkeypatch.setattr(_native, "_INSTALL_DIR", tmp_path / "installed", raising=False)
    _native.load_copy_engine.cache_clear()
    yield cache
    _native.load_copy_engine.wait_for_build(120)
    _native.load_copy_engine.cache_clear()


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# --- defect 2: damaged cache files -----------------------------------------------------


@pytest.mark.parametrize("fraction", [0.3, 0.6])
@pytest.mark.parametrize("name", ["copy_engine", "kvcore"])
def test_a_truncated_cached_library_is_rebuilt_instead_of_loaded(
    cache: Path, name: str, fraction: float
) -> None:
    path = _library(cache, name)
    os.truncate(path, int(path.stat().st_size * fraction))
    proc = run_python(USE_NATIVE, env={"ASYNCOFFLOAD_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, describe(proc)
    assert "native engine and kv policy ok" in proc.stdout
    assert str(path) in proc.stderr and "rebuilding" in proc.stderr, proc.stderr


@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_a_truncated_cached_library_is_replaced_in_the_cache(cache: Path, fraction: float) -> None:
    path = _library(cache, "copy_engine")
    size = path.stat().st_size
    os.truncate(path, int(size * fraction))
    proc = run_python(USE_NATIVE, env={"ASYNCOFFLOAD_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, describe(proc)
    assert _native._check_digest(path) is None
    assert path.stat().st_size == size


@pytest.mark.parametrize("with_digests", [True, False], ids=["digests-swapped", "files-only"])
def test_a_cached_library_of_the_wrong_kind_is_rebuilt_with_a_warning(
    cache: Path, with_digests: bool
) -> None:
    copy_engine, cuda_helpers = _library(cache, "copy_engine"), _library(cache, "cuda_helpers")
    pairs = [(copy_engine, cuda_helpers)]
    if with_digests and copy_engine.with_name(copy_engine.name + ".sha256").exists():
        pairs.append(
            (
                copy_engine.with_name(copy_engine.name + ".sha256"),
                cuda_helpers.with_name(cuda_helpers.name + ".sha256"),
            )
        )
    for a, b in pairs:
        swap = a.with_name("swap")
        a.rename(swap)
        b.rename(a)
        swap.rename(b)
    proc = run_python(
        """
        from asyncoffload import _native
        lib = _native.load_copy_engine()
        print("copy engine", lib is not None and hasattr(lib, "ao_lane_create"))
        _native.load_cuda_helpers()  # its file holds the copy engine now
        print("loaded")
        """,
        env={"ASYNCOFFLOAD_CACHE_DIR": str(cache)},
    )
    assert proc.returncode == 0, describe(proc)
    assert "copy engine True" in proc.stdout and "loaded" in proc.stdout
    assert f"cached native library {copy_engine} is unusable" in proc.stderr, proc.stderr
    assert f"cached native library {cuda_helpers} is unusable" in proc.stderr, proc.stderr


# --- defect 14: the compiler -----------------------------------------------------------


def test_cc_is_split_like_a_shell_command_line(
    fresh_loader: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = tmp_path / "args"
    fake = _script(tmp_path / "fake-cc", f'echo "$@" > {args}\nexec {CC} "$@"\n')
    monkeypatch.setenv("CC", f"{fake} -O0 -DAO_FROM_CC=1")
    assert _native.load_copy_engine() is not None
    assert args.read_text().startswith("-O0 -DAO_FROM_CC=1 ")


def test_the_compiler_inherits_none_of_our_settings(
    fresh_loader: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ASYNCOFFLOAD_TIERS may hold a MAC key or a password; a child's environment is
    readable in /proc (issue 37, D10)."""
    seen = tmp_path / "env"
    fake = _script(tmp_path / "fake-cc", f'env > {seen}\nexec {CC} "$@"\n')
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("ASYNCOFFLOAD_TIERS", '[{"kind": "remote", "password": "s3cret-pw"}]')
    monkeypatch.setenv("KEEP_THIS", "1")
    assert _native.load_copy_engine() is not None
    env = seen.read_text()
    assert "s3cret-pw" not in env and "ASYNCOFFLOAD_" not in env
    assert "KEEP_THIS=1" in env


def test_a_failing_compiler_falls_back_and_logs_what_it_said(
    fresh_loader: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = _script(tmp_path / "fake-cc", 'echo "fake-cc: no such header" >&2\nexit 1\n')
    monkeypatch.setenv("CC", str(fake))
    with caplog.at_level(logging.WARNING, logger="asyncoffload.native"):
        assert _native.load_copy_engine() is None
    assert "fake-cc: no such header" in caplog.text


def test_a_compiler_that_fails_silently_is_said_to_have_printed_nothing(
    fresh_loader: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="asyncoffload.native"):
        assert _native.load_copy_engine() is None
    assert "compiler '/bin/false' failed (exit status 1): it printed nothing" in caplog.text


def test_a_compiler_that_hangs_is_killed_at_the_timeout(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    # The driver waits for a child, as a real one waits for cc1 or ld.
    fake = _script(tmp_path / "fake-cc", f"sleep 600 &\necho $! > {pidfile}\nwait\n")
    env = {
        "ASYNCOFFLOAD_CACHE_DIR": str(tmp_path / "cache"),
        "ASYNCOFFLOAD_COMPILE_TIMEOUT": "1",
        "CC": str(fake),
    }
    try:
        proc = run_python(
            """
            from asyncoffload import _native
            print("copy engine", _native.load_copy_engine())
            """,
            env=env,
            timeout=90,
        )
        assert proc.returncode == 0, describe(proc)
        assert "copy engine None" in proc.stdout
        assert "did not finish within 1 s" in proc.stderr, proc.stderr
        sleeper = int(pidfile.read_text())
        assert not _alive(sleeper), "the compiler's child outlived the timeout"
    finally:
        if pidfile.exists() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_build_asked_for_on_an_event_loop_runs_in_the_background(
    fresh_loader: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    started, release, gave_up = tmp_path / "started", tmp_path / "release", tmp_path / "gave-up"
    # Compiles only once released (giving up after about 30 s, so that a loader that
    # blocked the loop fails this test instead of hanging it).
    fake = _script(
        tmp_path / "fake-cc",
        f"touch {started}\n"
        f"i=0\nwhile [ ! -e {release} ]; do\n"
        f"  i=$((i + 1)); if [ $i -gt 600 ]; then touch {gave_up}; exit 1; fi\n"
        f'  sleep 0.05\ndone\nexec {CC} "$@"\n',
    )
    monkeypatch.setenv("CC", str(fake))
    loader = _native.load_copy_engine
    with caplog.at_level(logging.WARNING, logger="asyncoffload.native"):
        assert loader() is None  # the Python fallback serves meanwhile
        assert loader() is None
        await asyncio.to_thread(_wait_for_file, started)  # the compiler runs meanwhile
        assert not gave_up.exists()
        assert loader.building
        release.touch()
        assert await asyncio.to_thread(loader.wait_for_build, 120)
    lib = loader()
    assert lib is not None and hasattr(lib, "ao_lane_create")
    announced = [r for r in caplog.records if "background thread" in r.getMessage()]
    assert len(announced) == 1


def _wait_for_file(path: Path) -> None:
    while not path.exists():
        time.sleep(0.01)


def test_build_all_builds_every_library_with_its_digest(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ASYNCOFFLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ASYNCOFFLOAD_NO_NATIVE", raising=False)
    built = _native.build_all(timeout=120)
    assert set(built) == {"copy_engine", "cuda_helpers", "disk_io", "kvcore", "mgrcore"}
    for name, path in built.items():
        assert path is not None, name
        assert path.parent == tmp_path
        assert _native._check_digest(path) is None, name


def test_an_invalid_compile_timeout_falls_back_to_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCOFFLOAD_COMPILE_TIMEOUT", "soon")
    assert _native.compile_timeout_s() == _native.DEFAULT_COMPILE_TIMEOUT_S
    monkeypatch.setenv("ASYNCOFFLOAD_COMPILE_TIMEOUT", "2.5")
    assert _native.compile_timeout_s() == 2.5


def test_the_command_line_builds_before_its_loop_so_a_first_run_copies_natively(
    tmp_path: Path,
) -> None:
    """On a fresh machine the demo's engine is made on the event loop, where nothing is
    compiled: the command line builds first, so the first run is not a fallback run."""
    proc = run_python(
        """
        from asyncoffload.cli import main
        raise SystemExit(main(["demo", "--requests", "4", "--no-progress"]))
        """,
        env={"ASYNCOFFLOAD_CACHE_DIR": str(tmp_path / "fresh")},
        timeout=200,
    )
    assert proc.returncode == 0, describe(proc)
    assert "cpu-native" in proc.stdout, describe(proc)


# --- issue 12: installing like a normal package ----------------------------------------


def _digest_line(data: bytes, source: Path | None = None) -> str:
    line = f"{hashlib.sha256(data).hexdigest()} {len(data)}"
    if source is not None:
        line += " " + hashlib.sha256(source.read_bytes()).hexdigest()
    return line + "\n"


@pytest.mark.parametrize("name", ["copy_engine", "kvcore"])
def test_the_cache_key_holds_the_machine_architecture(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    monkeypatch.setenv("ASYNCOFFLOAD_CACHE_DIR", str(tmp_path))
    loader = _native.load_copy_engine if name == "copy_engine" else _native.load_kvcore
    here, _ = loader.library.target()
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    there, _ = loader.library.target()
    assert here != there
    assert here.name.startswith(f"{name}-{platform.uname().machine}-"), here.name
    assert there.name.startswith(f"{name}-riscv64-"), there.name


def test_a_cache_shared_across_architectures_holds_a_build_for_each(
    fresh_loader: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A home directory shared by an x86-64 and a RISC-V machine: each loads its own
    build and leaves the other's alone (no rebuild, no warning, no ping-pong)."""
    with monkeypatch.context() as m:
        m.setattr(platform, "machine", lambda: "riscv64")
        foreign, _ = _native.load_copy_engine.library.target()
    foreign.parent.mkdir(parents=True)
    data = b"\x7fELF" + bytes(8188)  # the other machine's build, unloadable here
    foreign.write_bytes(data)
    foreign.with_name(foreign.name + ".sha256").write_text(_digest_line(data))
    with caplog.at_level(logging.WARNING, logger="asyncoffload.native"):
        assert _native.load_copy_engine() is not None
    assert "unusable" not in caplog.text, caplog.text
    assert foreign.read_bytes() == data


@pytest.mark.parametrize("tmp_folder", ["absent", "other-users"])
def test_an_unwritable_cache_builds_into_a_private_folder_with_one_warning(
    tmp_path: Path, tmp_folder: str
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a cache under a file cannot be created, not even by root
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    per_user = tmp / f"asyncoffload-{os.getuid()}"
    if tmp_folder == "other-users":  # open to all: not to be trusted, nor used
        per_user.mkdir(mode=0o777)
        per_user.chmod(0o777)
    env = {"ASYNCOFFLOAD_CACHE_DIR": str(blocker / "cache"), "TMPDIR": str(tmp)}
    code = """
        from asyncoffload import _native
        for loader in (_native.load_copy_engine, _native.load_kvcore):
            lib = loader()
            print(loader.what, "native" if lib is not None else "python")
        """
    proc = run_python(code, env=env)
    assert proc.returncode == 0, describe(proc)
    assert "python" not in proc.stdout, describe(proc)
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and "cannot be written" in said[0], proc.stderr
    assert str(blocker / "cache") in said[0]
    if tmp_folder == "other-users":
        assert not list(per_user.iterdir())
        return
    assert _library(per_user, "copy_engine").exists()
    assert per_user.stat().st_mode & 0o777 == 0o700
    # A later process finds those builds: it compiles nothing (its compiler would fail).
    proc = run_python(code, env={**env, "CC": "/bin/false"})
    assert proc.returncode == 0, describe(proc)
    assert "python" not in proc.stdout, describe(proc)
    assert "failed" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "cc", ["", "/nonexistent/bin/cc", "gcc '-O2"], ids=["none-on-path", "missing", "unsplittable"]
)
def test_no_compiler_is_said_in_one_warning_line(tmp_path: Path, cc: str) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = run_python(
        """
        from asyncoffload import _native
        for loader in _native._LOADERS:
            print(loader.what, loader())
        print(_native.build_all())
        """,
        env={"ASYNCOFFLOAD_CACHE_DIR": str(tmp_path / "cache"), "PATH": str(empty), "CC": cc},
    )
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout.count("None") == 10, proc.stdout
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(said) == 1, proc.stderr
    assert said[0].startswith("no C compiler") and "Python fallbacks" in said[0], said[0]


def _install(built_cache: Path, folder: Path, name: str, *, as_name: str | None = None) -> Path:
    """Put the cache's build of ``as_name`` (default ``name``) where an installed package
    keeps ``name``, with the digest file ``setup.py`` writes."""
    folder.mkdir(exist_ok=True)
    library = _native.load_copy_engine.library
    assert library.name == name
    path = folder / f"lib{name}.so"
    data = _library(built_cache, as_name or name).read_bytes()
    path.write_bytes(data)
    path.with_name(path.name + ".sha256").write_text(_digest_line(data, library.source))
    return path


def test_an_installed_library_is_loaded_before_the_cache(
    fresh_loader: Path, built_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = _install(built_cache, tmp_path / "installed", "copy_engine")
    monkeypatch.setenv("CC", "/bin/false")  # nothing is compiled
    lib = _native.load_copy_engine()
    assert lib is not None and Path(lib._name) == installed
    assert not fresh_loader.exists()
    assert _native.build_all(timeout=30)["copy_engine"] == installed


@pytest.mark.parametrize("damage", ["truncated", "stale", "no-digest", "wrong-kind"])
def test_an_unusable_installed_library_is_passed_over_with_one_warning(
    fresh_loader: Path,
    built_cache: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    as_name = "cuda_helpers" if damage == "wrong-kind" else None
    installed = _install(built_cache, tmp_path / "installed", "copy_engine", as_name=as_name)
    digest = installed.with_name(installed.name + ".sha256")
    if damage == "truncated":
        os.truncate(installed, installed.stat().st_size // 2)
    elif damage == "stale":  # built from another version of copy_engine.c
        sha, size, _ = digest.read_text().split()
        digest.write_text(f"{sha} {size} {'0' * 64}\n")
    elif damage == "no-digest":
        digest.unlink()
    with caplog.at_level(logging.WARNING, logger="asyncoffload.native"):
        lib = _native.load_copy_engine()
    assert lib is not None and hasattr(lib, "ao_lane_create")
    assert Path(lib._name).parent == fresh_loader  # built into the cache
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(f"installed native library {installed}"), said
