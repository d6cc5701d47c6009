"""Small native helpers, compiled on first use with the system C compiler.

Nothing here is required: every user falls back to a pure-Python path when
:func:`load_copy_engine` returns ``None`` (no compiler, or ``ASYNCOFFLOAD_NO_NATIVE=1``),
and says which path is active.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

__all__ = ["load_copy_engine", "native_disabled"]

log = logging.getLogger("asyncoffload.native")

_SOURCE = Path(__file__).with_name("copy_engine.c")


def native_disabled() -> bool:
    return os.environ.get("ASYNCOFFLOAD_NO_NATIVE", "") not in ("", "0")


def _cache_dir() -> Path:
    root = os.environ.get("ASYNCOFFLOAD_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "asyncoffload"


def _compile(source: Path, out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler found (set CC)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, "-O2", "-shared", "-fPIC", "-pthread", str(source), "-o", tmp]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)  # atomic: concurrent first uses race harmlessly
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def load_copy_engine() -> ctypes.CDLL | None:
    """The native copy-lane library, compiled on first use; ``None`` if unavailable."""
    if native_disabled() or not sys.platform.startswith(("linux", "darwin", "freebsd")):
        return None
    src = _SOURCE.read_bytes()
    digest = hashlib.sha256(src + sys.platform.encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"copy_engine-{digest}.so"
    try:
        if not lib_path.exists():
            _compile(_SOURCE, lib_path)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native copy engine unavailable, using Python copy threads: %s", exc)
        return None
    lib.ao_lane_create.argtypes = [ctypes.c_int]
    lib.ao_lane_create.restype = ctypes.c_void_p
    lib.ao_lane_set_wake_fd.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.ao_lane_set_wake_fd.restype = None
    lib.ao_lane_submit.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.ao_lane_submit.restype = ctypes.c_int
    lib.ao_status_load.argtypes = [ctypes.c_void_p]
    lib.ao_status_load.restype = ctypes.c_int64
    lib.ao_lane_destroy.argtypes = [ctypes.c_void_p]
    lib.ao_lane_destroy.restype = None
    return lib
