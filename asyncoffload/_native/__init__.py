"""Small native helpers, compiled on first use with the system C compiler.

Nothing here is required: every user falls back to a pure-Python path when
:func:`load_copy_engine` returns ``None`` (no compiler, or ``ASYNCOFFLOAD_NO_NATIVE=1``),
and says which path is active.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from functools import cache
from pathlib import Path
from types import ModuleType

__all__ = [
    "load_copy_engine",
    "load_cuda_helpers",
    "load_kvcore",
    "load_mgrcore",
    "native_disabled",
]

log = logging.getLogger("asyncoffload.native")

_HERE = Path(__file__).parent


def native_disabled() -> bool:
    return os.environ.get("ASYNCOFFLOAD_NO_NATIVE", "") not in ("", "0")


def _cache_dir() -> Path:
    root = os.environ.get("ASYNCOFFLOAD_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "asyncoffload"


def _compile(source: Path, out: Path, libs: tuple[str, ...]) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler found (set CC)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, "-O2", "-shared", "-fPIC", "-pthread", str(source), "-o", tmp, *libs]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)  # atomic: concurrent first uses race harmlessly
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _supported() -> bool:
    return not native_disabled() and sys.platform.startswith(("linux", "darwin", "freebsd"))


def _built(name: str, suffix: str, flags: tuple[str, ...], tag: bytes = b"") -> Path:
    """``{name}.c`` compiled into the cache (once per source version and ``tag``)."""
    source = _HERE / f"{name}.c"
    digest = hashlib.sha256(source.read_bytes() + sys.platform.encode() + tag).hexdigest()[:16]
    path = _cache_dir() / f"{name}-{digest}{suffix}"
    if not path.exists():
        _compile(source, path, flags)
    return path


def _load(name: str, libs: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """Compile ``{name}.c`` (once per source version) and load it; ``None`` on failure."""
    if not _supported():
        return None
    try:
        return ctypes.CDLL(str(_built(name, ".so", libs)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native helper %s unavailable: %s", name, exc)
        return None


def _load_extension(name: str, what: str) -> ModuleType | None:
    """``{name}.c`` built as a CPython extension (once per source, Python and headers) and
    imported; ``None`` (logged) where it cannot be."""
    if not _supported():
        return None
    include = sysconfig.get_paths()["include"]
    flags = ["-I" + include, "-fno-strict-aliasing"]
    if sys.platform == "darwin":
        flags += ["-undefined", "dynamic_lookup"]
    try:
        if not (Path(include) / "Python.h").exists():
            raise OSError(f"no Python.h under {include} (install the Python headers)")
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        path = _built(name, suffix, tuple(flags), (sys.version + include).encode())
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise OSError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
        log.warning("%s unavailable, using Python: %s", what, exc)
        return None


@cache
def load_kvcore() -> ModuleType | None:
    """The KV policy's C core (a CPython extension compiled on first use); ``None`` if it
    cannot be built (no compiler or Python headers, or ``ASYNCOFFLOAD_NO_NATIVE=1``)."""
    return _load_extension("kvcore", "native KV policy core")


@cache
def load_mgrcore() -> ModuleType | None:
    """The request-scoped manager's C core (asyncoffload.manager.native), compiled on first
    use like :func:`load_kvcore`; ``None`` where it cannot be built."""
    return _load_extension("mgrcore", "native manager core")


@cache
def load_copy_engine() -> ctypes.CDLL | None:
    """The native copy-lane library, compiled on first use; ``None`` if unavailable."""
    lib = _load("copy_engine")
    if lib is None:
        return None
    lib.ao_lane_create.argtypes = [ctypes.c_int]
    lib.ao_lane_create.restype = ctypes.c_void_p
    lib.ao_lane_set_wake_fd.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.ao_lane_set_wake_fd.restype = None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    # handle, direction, n, kv_ids, host_ids, nfrag, kv_base, kv_stride, host_base,
    # block_bytes, frag_bytes, status
    lib.ao_lane_submit.argtypes = [
        ptr,
        ctypes.c_int,
        i64,
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        ptr,
    ]
    lib.ao_lane_submit.restype = ctypes.c_int
    lib.ao_status_load.argtypes = [ctypes.c_void_p]
    lib.ao_status_load.restype = ctypes.c_int64
    # handle, n, srcs, dsts, sizes, status (three int64 words)
    lib.ao_lane_submit_copies.argtypes = [ptr, i64, ptr, ptr, ptr, ptr]
    lib.ao_lane_submit_copies.restype = ctypes.c_int
    # handle, status, timeout in ns (< 0: none) -> the job's state, 0 if the time ran out
    lib.ao_lane_wait.argtypes = [ptr, ptr, i64]
    lib.ao_lane_wait.restype = ctypes.c_int64
    lib.ao_lane_destroy.argtypes = [ctypes.c_void_p]
    lib.ao_lane_destroy.restype = None
    return lib


@cache
def load_cuda_helpers() -> tuple[ctypes.CDLL, int] | None:
    """The CUDA helper library and its feature bits (1: host-function wake-ups, 2: batched
    memcpy, 4: driver-API host registration, 8: the completion spinner, 16: one
    ``cuMemcpyAsync`` per descriptor), or ``None`` where it can't be built or libcuda is
    missing."""
    lib = _load("cuda_helpers", ("-ldl",))
    if lib is None:
        return None
    lib.ao_cuda_init.argtypes = []
    lib.ao_cuda_init.restype = ctypes.c_int
    lib.ao_cuda_launch_wake.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ao_cuda_launch_wake.restype = ctypes.c_int
    lib.ao_cuda_slot_done.argtypes = [ctypes.c_void_p]
    lib.ao_cuda_slot_done.restype = ctypes.c_int64
    lib.ao_cuda_memcpy_batch.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_uint,
    ]
    lib.ao_cuda_memcpy_batch.restype = ctypes.c_int
    # stream, dsts, srcs, sizes, count
    lib.ao_cuda_memcpy_each.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
    ]
    lib.ao_cuda_memcpy_each.restype = ctypes.c_int
    lib.ao_cuda_host_register.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.ao_cuda_host_register.restype = ctypes.c_int
    lib.ao_cuda_host_unregister.argtypes = [ctypes.c_void_p]
    lib.ao_cuda_host_unregister.restype = ctypes.c_int
    lib.ao_cuda_host_device_pointer.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ao_cuda_host_device_pointer.restype = ctypes.c_int
    lib.ao_cuda_slot_released.argtypes = [ctypes.c_void_p]
    lib.ao_cuda_slot_released.restype = ctypes.c_int64
    lib.ao_cuda_spinner_init.argtypes = []
    lib.ao_cuda_spinner_init.restype = ctypes.c_int
    lib.ao_cuda_spin_watch.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
    ]
    lib.ao_cuda_spin_watch.restype = ctypes.c_int
    features = lib.ao_cuda_init()
    if features < 0:
        return None
    if lib.ao_cuda_spinner_init() == 0:
        features |= 8
    return lib, features
