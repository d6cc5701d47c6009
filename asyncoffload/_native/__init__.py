"""Small native helpers: built when the package is installed, else on first use with the
system C compiler.

Nothing here is required: every user falls back to a pure-Python path when its loader
returns ``None`` (no compiler, a failed or unfinished build, or
``ASYNCOFFLOAD_NO_NATIVE=1``), and says which path is active.

**Where a library comes from.** First the copy built when the package was installed (a
wheel carries it, ``setup.py`` builds it: ``lib<name>.so`` or ``<name><EXT_SUFFIX>`` next
to this file, with a digest file that also names the source it was built from). It is used
when it matches its digest, was built from the ``.c`` file beside it, loads and has what
its loader expects; otherwise (one warning line) the cache serves, and failing that a
compile at first use. An editable install builds nothing at install time: its sources are
meant to change, and the cache is keyed by them.

**The cache.** Each library is built once per source version and platform (OS, machine
architecture, pointer width, C library; Python's ABI for the CPython extensions) into the
cache directory (``ASYNCOFFLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/asyncoffload``), so a
home directory shared by machines of several architectures holds one build for each. A
digest file sits beside each library (``<library>.sha256``: its SHA-256 and size). A
library is loaded only once it matches its digest: mapping a truncated file kills the
process (SIGBUS), so a damaged file, or one without a digest, is rebuilt instead; so is a
library that loads but lacks what its loader expects (a file of another kind). One rebuild
per process: if it fails too, the loader logs a warning naming the file and returns
``None``. A build goes to temporary files that are fsynced and moved into place with
``os.replace``, so that concurrent first uses race harmlessly and a crash never leaves a
half-written library that passes for whole. Where the cache directory cannot be written,
builds go to a folder of this user's under the temporary directory (mode 0700, checked to
be this user's; else a folder of this process's), with one warning line.

**The compiler.** ``CC``, split like a shell command line (``CC="ccache gcc -O0"``), else
``cc`` or ``gcc``. Without one, a single warning line says so (not one per library). A
compile running longer than ``ASYNCOFFLOAD_COMPILE_TIMEOUT`` seconds (default 60) is
killed, with every process it started, and counts as failed; a failed compile's warning
holds the end of what the compiler printed.

**Never on an event loop.** A loader called on a thread that is running an asyncio event
loop never compiles there. When the library is not built yet, it starts the build on a
background thread, logs that once, and returns ``None`` (the caller takes its fallback);
calls after the build has finished get the library. :func:`build_all` builds everything
synchronously, for install scripts, tests and warming a cache.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import itertools
import logging
import os
import platform
import shlex
import shutil
import signal
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

from asyncoffload._native.cuda_abi import CudaFeature

__all__ = [
    "DEFAULT_COMPILE_TIMEOUT_S",
    "CudaFeature",
    "NativeLoader",
    "NoCompilerError",
    "build_all",
    "compile_timeout_s",
    "holding_gil",
    "load_copy_engine",
    "load_cuda_helpers",
    "load_disk_io",
    "load_kvcore",
    "load_mgrcore",
    "native_disabled",
]

log = logging.getLogger("asyncoffload.native")

_HERE = Path(__file__).parent
#: Where an installed package keeps the libraries built at install time (``setup.py``).
_INSTALL_DIR = _HERE

#: Seconds a compile may take when ``ASYNCOFFLOAD_COMPILE_TIMEOUT`` does not say.
DEFAULT_COMPILE_TIMEOUT_S = 60.0

T = TypeVar("T")


def native_disabled() -> bool:
    return os.environ.get("ASYNCOFFLOAD_NO_NATIVE", "") not in ("", "0")


def compile_timeout_s() -> float:
    """How long one compile may run: ``ASYNCOFFLOAD_COMPILE_TIMEOUT`` (seconds, > 0) or
    :data:`DEFAULT_COMPILE_TIMEOUT_S`."""
    raw = os.environ.get("ASYNCOFFLOAD_COMPILE_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_COMPILE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        log.warning(
            "ASYNCOFFLOAD_COMPILE_TIMEOUT=%r is not a positive number of seconds: using %g",
            raw,
            DEFAULT_COMPILE_TIMEOUT_S,
        )
        return DEFAULT_COMPILE_TIMEOUT_S
    return value


def _cache_dir() -> Path:
    root = os.environ.get("ASYNCOFFLOAD_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "asyncoffload"


def _writable(folder: Path) -> bool:
    """Whether ``folder`` can be written, or created and then written."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def _private_tmp_dir(create: bool) -> Path | None:
    """This user's folder under the temporary directory, for builds when the cache cannot
    be written: ``None`` if it does not exist (and ``create`` is false) or is not safely
    this user's alone (a folder, not a link, owned by this user, mode 0700)."""
    path = Path(tempfile.gettempdir()) / f"asyncoffload-{os.getuid()}"
    if create:
        with contextlib.suppress(OSError):
            path.mkdir(mode=0o700)
    try:
        st = path.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


_fallback_lock = threading.Lock()
#: Cache folders found unwritable by this process, and where their builds go instead.
_fallbacks: dict[Path, Path] = {}


def _cache_fallback(cache: Path, why: OSError) -> Path:
    """The folder builds go to when ``cache`` cannot be written (``why``): this user's
    folder under the temporary directory, else one of this process's (removed at exit).
    Warns once per process (and cache folder)."""
    with _fallback_lock:
        if cache in _fallbacks:
            return _fallbacks[cache]
        folder = _private_tmp_dir(create=True)
        if folder is None:
            folder = Path(tempfile.mkdtemp(prefix="asyncoffload-"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
        log.warning(
            "native build cache %s cannot be written (%s): building into %s instead "
            "(ASYNCOFFLOAD_CACHE_DIR names a writable folder)",
            cache,
            why,
            folder,
        )
        _fallbacks[cache] = folder
        return folder


def _fallback_candidate(path: Path) -> Path | None:
    """Where a build of ``path``'s name lies if it went to the fallback folder (by this
    process or an earlier one); ``None`` if the cache itself is usable for it."""
    chosen = _fallbacks.get(path.parent)
    if chosen is None and (path.exists() or _writable(path.parent)):
        return None
    folder = chosen or _private_tmp_dir(create=False)
    if folder is None or not (folder / path.name).exists():
        return None
    return folder / path.name


def _platform_tag() -> str:
    """What a plain C library's build depends on beside its source: OS, machine, pointer
    width, C library (a home directory may be shared by machines of several kinds)."""
    target = sysconfig.get_config_var("MULTIARCH") or sysconfig.get_config_var("HOST_GNU_TYPE")
    return f"{sys.platform} {platform.machine()} {8 * struct.calcsize('P')} {target or ''}"


def _machine() -> str:
    """The machine's architecture as it appears in cache file names."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in platform.machine()) or "unknown"


def _supported() -> bool:
    return not native_disabled() and sys.platform.startswith(("linux", "darwin", "freebsd"))


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# --- compiling -----------------------------------------------------------------------------


class NoCompilerError(OSError):
    """No C compiler to run: ``CC`` names none that exists, or none is on ``PATH``."""


_no_compiler_warned = False


def _warn_no_compiler(what: str, exc: NoCompilerError) -> None:
    """One warning line per process for a missing compiler, not one per library."""
    global _no_compiler_warned
    if _no_compiler_warned:
        log.debug("%s unavailable, using Python: %s", what, exc)
        return
    _no_compiler_warned = True
    log.warning(
        "%s: the native helpers are not built and their Python fallbacks serve (copies "
        "10-30x slower); install a C compiler (Debian, Ubuntu: apt-get install gcc) or set "
        "CC, or install a wheel built for this platform",
        exc,
    )


def _compiler() -> list[str]:
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            argv = shlex.split(cc)
        except ValueError as exc:
            raise NoCompilerError(
                f"no C compiler: CC={cc!r} is not a command line ({exc})"
            ) from None
        if argv:
            if shutil.which(argv[0]) is None:
                raise NoCompilerError(
                    f"no C compiler: CC={cc!r}, and {argv[0]!r} is not a program on PATH"
                )
            return argv
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise NoCompilerError("no C compiler: neither cc nor gcc is on PATH, and CC is not set")
    return [found]


def _run_compiler(cmd: list[str], timeout: float) -> None:
    """Run ``cmd`` in its own process group; kill the whole group if it outlives
    ``timeout`` (a compiler's driver waits for its children, which would keep the pipes
    open)."""
    # Without this package's settings: ASYNCOFFLOAD_TIERS may hold a MAC key or a
    # password, and a child's environment is readable in /proc (asyncoffload._children;
    # this module imports nothing of the package, setup.py loads it alone).
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCOFFLOAD_")}
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:  # the timeout, or an interrupt: leave nothing behind
        _kill_group(proc)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise OSError(
                f"compiler {cmd[0]!r} did not finish within {timeout:g} s and was killed "
                "(ASYNCOFFLOAD_COMPILE_TIMEOUT sets the limit)"
            ) from None
        raise
    if proc.returncode != 0:
        said = (err or out).decode(errors="replace").strip()
        if len(said) > 2000:
            said = "..." + said[-2000:]
        raise OSError(
            f"compiler {cmd[0]!r} failed (exit status {proc.returncode}): "
            + (said or "it printed nothing")
        )
    if err.strip():
        log.debug("compiler %r said: %s", cmd[0], err.decode(errors="replace").strip()[-2000:])


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform opens directories
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _check_digest(path: Path, source: Path | None = None) -> str | None:
    """What is wrong with the library at ``path`` against its digest file; ``None`` if
    it matches. With ``source`` (an installed library), the digest file must also name
    that source's SHA-256 (a third field): a library built from other sources is stale."""
    try:
        fields = _digest_path(path).read_text().split()
    except FileNotFoundError:
        return "it has no digest file beside it"
    except OSError as exc:
        return f"its digest file cannot be read ({exc})"
    if len(fields) not in (2, 3) or not fields[1].isdigit():
        return "its digest file is malformed"
    if source is not None:
        if len(fields) != 3:
            return "its digest file does not name the source it was built from"
        try:
            current = hashlib.sha256(source.read_bytes()).hexdigest()
        except FileNotFoundError:  # no source beside it: nothing it could be stale against
            current = fields[2]
        except OSError as exc:
            return f"its source {source} cannot be read ({exc})"
        if fields[2] != current:
            return f"it was built from another version of {source.name}"
    expected, size = fields[0], int(fields[1])
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"it cannot be read ({exc})"
    if len(data) != size:
        return f"it is {len(data)} bytes where its digest says {size}"
    if hashlib.sha256(data).hexdigest() != expected:
        return "its SHA-256 does not match its digest"
    return None


class _UnwritableCache(OSError):
    """The folder a build should go to cannot be written."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def _write_build(source: Path, path: Path, flags: tuple[str, ...], timeout: float) -> None:
    """Compile ``source`` to ``path`` and write its digest file. Both appear whole or
    not at all: each is written to a temporary file, fsynced, then moved into place."""
    cmd = _compiler()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _UnwritableCache(exc) from None
    os.close(fd)
    tmp_digest = tmp + ".sha256"
    try:
        _run_compiler(
            [*cmd, "-O2", "-shared", "-fPIC", "-pthread", str(source), "-o", tmp, *flags], timeout
        )
        with open(tmp, "rb") as f:
            data = f.read()
            os.fsync(f.fileno())
        if not data:
            raise OSError(f"compiler {cmd[0]!r} wrote an empty library")
        with open(tmp_digest, "w") as f:
            f.write(f"{hashlib.sha256(data).hexdigest()} {len(data)}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        os.replace(tmp_digest, _digest_path(path))
        _fsync_dir(path.parent)
    finally:
        for leftover in (tmp, tmp_digest):
            if os.path.exists(leftover):
                os.unlink(leftover)


# --- the libraries -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Library:
    """One C source, built either as a plain shared library (loaded with ctypes) or as a
    CPython extension (imported)."""

    name: str
    extension: bool
    libs: tuple[str, ...] = ()

    @property
    def source(self) -> Path:
        return _HERE / f"{self.name}.c"

    def installed(self) -> Path:
        """Where the copy built at install time lies (``setup.py`` names it so)."""
        if self.extension:
            return _INSTALL_DIR / f"{self.name}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
        return _INSTALL_DIR / f"lib{self.name}.so"

    def installed_ok(self) -> bool:
        """Whether an installed copy is there and matches its digest and source (whether
        it loads is for its loader to find out)."""
        path = self.installed()
        return path.exists() and _check_digest(path, self.source) is None

    def target(self) -> tuple[Path, tuple[str, ...]]:
        """Where the cached build of the current source for this platform lives, and its
        extra compiler flags."""
        flags = self.libs
        suffix = ".so"
        tag = _platform_tag()
        if self.extension:
            include = sysconfig.get_paths()["include"]
            if not (Path(include) / "Python.h").exists():
                raise OSError(f"no Python.h under {include} (install the Python headers)")
            flags = ("-I" + include, "-fno-strict-aliasing")
            if sys.platform == "darwin":
                flags += ("-undefined", "dynamic_lookup")
            suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
            tag += f" {suffix} {sys.version} {include}"
        digest = hashlib.sha256(self.source.read_bytes() + tag.encode()).hexdigest()
        return _cache_dir() / f"{self.name}-{_machine()}-{digest[:16]}{suffix}", flags

    def build(self, timeout: float | None = None, *, force: bool = False) -> Path:
        """Build into the cache unless a build that matches its digest is there (or
        ``force``); where the cache cannot be written, into the fallback folder
        (:func:`_cache_fallback`). Returns where the build lies."""
        path, flags = self.target()
        timeout = timeout or compile_timeout_s()
        if not force and _check_digest(path) is None:
            return path
        fallback = _fallbacks.get(path.parent)
        if fallback is None:
            try:
                _write_build(self.source, path, flags, timeout)
                return path
            except _UnwritableCache as exc:
                fallback = _cache_fallback(path.parent, exc.cause)
        alt = fallback / path.name
        if force or _check_digest(alt) is not None:
            _write_build(self.source, alt, flags, timeout)
        return alt

    def open(self, path: Path) -> Any:
        if not self.extension:
            return ctypes.CDLL(str(path))
        spec = importlib.util.spec_from_file_location(self.name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


_link_serial = itertools.count()


class NativeLoader(Generic[T]):
    """Loads one native library, once per process: calling the loader returns what it
    gives (the library, configured) or ``None`` where it is unavailable. Thread-safe.

    ``configure`` turns the loaded library into the value (setting ctypes signatures,
    checking the module's contents); an ``AttributeError`` from it means the file is not
    the library it should be (it is rebuilt), and a ``None`` result that it is fine but
    unusable here (no CUDA driver, say).
    """

    def __init__(self, library: _Library, what: str, configure: Callable[[Any], T | None]) -> None:
        self.library = library
        self.what = what
        self._configure = configure
        self._lock = threading.Lock()  # the fields below; never held over a compile
        self._build_lock = threading.Lock()  # one build at a time
        self._done = False
        self._value: T | None = None
        self._background: threading.Thread | None = None
        self._failed_paths: set[Path] = set()  # dlopen'ed here but unusable
        self._installed_checked = False  # the installed copy was looked at (and unusable)

    def __call__(self) -> T | None:
        if self._done:
            return self._value
        if not _supported():
            return self._finish(None)
        if _on_event_loop():
            return self._resolve_on_loop()
        return self._resolve()

    def cache_clear(self) -> None:
        """Forget the outcome: the next call looks again (tests, a changed environment)."""
        with self._lock:
            self._done = False
            self._value = None
            self._installed_checked = False

    @property
    def building(self) -> bool:
        """Whether a background build started by a call on an event loop is running."""
        thread = self._background
        return thread is not None and thread.is_alive()

    def wait_for_build(self, timeout: float | None = None) -> bool:
        """Wait for a background build (if any) to end; False if it is still running."""
        thread = self._background
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _finish(self, value: T | None) -> T | None:
        self._value = value
        self._done = True
        return value

    def _settle_locked(self) -> tuple[bool, T | None, Path]:
        """Under ``_lock``: ``(True, value, _)`` when the answer is known without a build
        (done already, an installed copy, a cached build, or no cache path at all);
        else ``(False, None, path)``, the cache path a build would write."""
        if self._done:
            return True, self._value, Path()
        found, value = self._from_installed()
        if found:
            return True, self._finish(value), Path()
        try:
            path, _ = self.library.target()
        except OSError as exc:
            log.warning("%s unavailable, using Python: %s", self.what, exc)
            return True, self._finish(None), Path()
        found, value = self._from_caches(path)
        if found:
            return True, self._finish(value), path
        return False, None, path

    def _resolve_on_loop(self) -> T | None:
        """A loop's thread: load a finished build, else build in the background."""
        with self._lock:
            settled, value, _path = self._settle_locked()
            if settled:
                return value
            if not self.building:
                log.warning(
                    "%s is not built yet: building it on a background thread (never on the "
                    "event loop); until it is done, the Python fallback serves "
                    "(asyncoffload._native.build_all() builds ahead of time)",
                    self.what,
                )
                self._background = threading.Thread(
                    target=self._resolve,
                    name=f"asyncoffload-build-{self.library.name}",
                    daemon=True,
                )
                self._background.start()
            return None

    def _resolve(self) -> T | None:
        """Load the cached build, or build (once) and load that."""
        with self._build_lock:
            with self._lock:
                settled, value, path = self._settle_locked()
                if settled:
                    return value
            try:
                alt = _fallback_candidate(path)
                built = self.library.build(
                    force=path in self._failed_paths or alt in self._failed_paths
                )
            except NoCompilerError as exc:
                _warn_no_compiler(self.what, exc)
                with self._lock:
                    return self._finish(None)
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("%s unavailable, using Python: %s", self.what, exc)
                with self._lock:
                    return self._finish(None)
            with self._lock:
                if self._done:
                    return self._value
                _found, value = self._from_cache(built, rebuilt=True)
                return self._finish(value)

    def _from_installed(self) -> tuple[bool, T | None]:
        """(True, value) when the copy built at install time matches its digest and
        source and loads; (False, None) when there is none or it is unusable (logged
        once, naming the file and what is wrong)."""
        if self._installed_checked:
            return False, None
        self._installed_checked = True
        path = self.library.installed()
        if not path.exists():
            return False, None
        problem = _check_digest(path, self.library.source)
        if problem is None:
            try:
                return True, self._configure(self.library.open(path))
            except (OSError, ImportError, AttributeError) as exc:
                problem = f"it does not load as {self.what} ({exc})"
        log.warning(
            "installed native library %s is unusable (%s): using a build of the cache instead",
            path,
            problem,
        )
        return False, None

    def _from_caches(self, path: Path) -> tuple[bool, T | None]:
        """:meth:`_from_cache` of ``path``, then of its copy in the fallback folder where
        the cache cannot be written."""
        found, value = self._from_cache(path)
        if not found:
            alt = _fallback_candidate(path)
            if alt is not None:
                found, value = self._from_cache(alt)
        return found, value

    def _from_cache(self, path: Path, rebuilt: bool = False) -> tuple[bool, T | None]:
        """(True, value) when the build at ``path`` matches its digest and loads;
        (False, None) when there is none, or it is damaged or of the wrong kind (logged,
        naming the file; ``rebuilt``: it was just built, so this is final)."""
        if not rebuilt and not path.exists():
            return False, None
        problem = _check_digest(path)
        if problem is None:
            try:
                return True, self._configure(self._open(path))
            except (OSError, ImportError, AttributeError) as exc:
                self._failed_paths.add(path)
                problem = f"it does not load as {self.what} ({exc})"
        if rebuilt:
            log.warning(
                "native library %s is unusable even after a rebuild (%s): %s unavailable, "
                "using Python",
                path,
                problem,
                self.what,
            )
        else:
            log.warning("cached native library %s is unusable (%s): rebuilding it", path, problem)
        return rebuilt, None

    def _open(self, path: Path) -> Any:
        if path not in self._failed_paths:
            return self.library.open(path)
        # The dynamic loader would hand back the unusable library opened at this name
        # before: open the rebuilt file through a name of its own.
        link = path.with_name(f".{path.name}.{os.getpid()}-{next(_link_serial)}")
        try:
            os.link(path, link)
        except OSError:
            shutil.copyfile(path, link)
        try:
            return self.library.open(link)
        finally:
            link.unlink()


def holding_gil(fn: Any) -> Callable[..., Any]:
    """``fn``, a function of a ``ctypes.CDLL`` with its ``argtypes`` and ``restype`` set,
    called without releasing the GIL: for short calls on the event loop's thread, which
    would otherwise let another thread take the GIL and keep it for up to a switch
    interval (5 ms) before the call can return."""
    proto = ctypes.PYFUNCTYPE(fn.restype, *fn.argtypes)
    address = ctypes.cast(fn, ctypes.c_void_p).value
    if address is None:
        raise ValueError(f"{fn!r} has no address")
    return proto(address)


# --- what each library gives -----------------------------------------------------------------


def _configure_copy_engine(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.ao_lane_create.argtypes = [ctypes.c_int]
    lib.ao_lane_create.restype = ctypes.c_void_p
    lib.ao_lane_set_wake_fd.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.ao_lane_set_wake_fd.restype = None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    # handle, fragment tables (eight words), direction, n, ids (n KV then n host), status
    lib.ao_lane_submit.argtypes = [ptr, ptr, ctypes.c_int, i64, ptr, ptr]
    lib.ao_lane_submit.restype = ctypes.c_int
    # fragment tables, direction, n, ids: ao_lane_submit's copy, on the calling thread
    lib.ao_copy_blocks.argtypes = [ptr, ctypes.c_int, i64, ptr]
    lib.ao_copy_blocks.restype = ctypes.c_int
    lib.ao_status_load.argtypes = [ctypes.c_void_p]
    lib.ao_status_load.restype = ctypes.c_int64
    # handle, n, srcs, dsts, sizes, status (three int64 words)
    lib.ao_lane_submit_copies.argtypes = [ptr, i64, ptr, ptr, ptr, ptr]
    lib.ao_lane_submit_copies.restype = ctypes.c_int
    # handle, status, timeout in ns (< 0: none) -> the job's state, 0 if the time ran out
    lib.ao_lane_wait.argtypes = [ptr, ptr, i64]
    lib.ao_lane_wait.restype = ctypes.c_int64
    # handle -> how many queued jobs were discarded
    lib.ao_lane_cancel.argtypes = [ptr]
    lib.ao_lane_cancel.restype = ctypes.c_int64
    lib.ao_lane_destroy.argtypes = [ctypes.c_void_p]
    lib.ao_lane_destroy.restype = None
    return lib


def _configure_disk_io(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    # lanes per direction, wake fd, payload_len, identity (16 bytes), flags (1: O_DIRECT
    # files, 2: write lanes at SCHED_IDLE)
    lib.ao_io_create.argtypes = [cint, cint, i64, ptr, cint]
    lib.ao_io_create.restype = ptr
    lib.ao_io_set_wake_fd.argtypes = [ptr, cint]
    lib.ao_io_set_wake_fd.restype = None
    # pool, write, n, ops (ao_io_op[n]), deadline ns (0: none), status (3 words), results
    lib.ao_io_submit.argtypes = [ptr, cint, i64, ptr, i64, ptr, ptr]
    lib.ao_io_submit.restype = cint
    lib.ao_io_status_load.argtypes = [ptr]
    lib.ao_io_status_load.restype = i64
    lib.ao_io_cancel.argtypes = [ptr]
    lib.ao_io_cancel.restype = i64
    lib.ao_io_destroy.argtypes = [ptr]
    lib.ao_io_destroy.restype = None
    lib.ao_io_set_fault.argtypes = [ptr, cint, i64, cint]
    lib.ao_io_set_fault.restype = None
    lib.ao_io_set_delay.argtypes = [ptr, i64]
    lib.ao_io_set_delay.restype = None
    lib.ao_io_set_gate.argtypes = [ptr, cint]
    lib.ao_io_set_gate.restype = cint
    lib.ao_io_pause_writers.argtypes = [ptr, cint]
    lib.ao_io_pause_writers.restype = None
    # pool, out (2 words: write ops read lanes took, write lanes without SCHED_IDLE)
    lib.ao_io_lanes_info.argtypes = [ptr, ptr]
    lib.ao_io_lanes_info.restype = None
    lib.ao_crc32c.argtypes = [ctypes.c_uint32, ptr, ctypes.c_size_t]
    lib.ao_crc32c.restype = ctypes.c_uint32
    lib.ao_crc32c_soft.argtypes = [ctypes.c_uint32, ptr, ctypes.c_size_t]
    lib.ao_crc32c_soft.restype = ctypes.c_uint32
    lib.ao_crc32c_hardware.argtypes = []
    lib.ao_crc32c_hardware.restype = cint
    # value, source, payload_len, identity, key, key_len
    lib.ao_pack_value.argtypes = [ptr, ptr, i64, ptr, ptr, cint]
    lib.ao_pack_value.restype = None
    # value, value_len, destination, payload_len, identity, key, key_len
    lib.ao_unpack_value.argtypes = [ptr, i64, ptr, i64, ptr, ptr, cint]
    lib.ao_unpack_value.restype = i64
    # ... then nseg, deltas (int64[nseg]): a payload in slices (see ao_segs)
    lib.ao_pack_value_segs.argtypes = [ptr, ptr, i64, ptr, ptr, cint, cint, ptr]
    lib.ao_pack_value_segs.restype = i64
    lib.ao_unpack_value_segs.argtypes = [ptr, i64, ptr, i64, ptr, ptr, cint, cint, ptr]
    lib.ao_unpack_value_segs.restype = i64
    # pool, nseg, deltas (int64[nseg])
    lib.ao_io_set_segments.argtypes = [ptr, cint, ptr]
    lib.ao_io_set_segments.restype = cint
    # pool, MAC key, its length (0: none)
    lib.ao_io_set_mac.argtypes = [ptr, ptr, ctypes.c_int32]
    lib.ao_io_set_mac.restype = cint
    # as ao_pack_value_segs / ao_unpack_value_segs, then the MAC key and its length
    lib.ao_pack_block.argtypes = [ptr, ptr, i64, ptr, ptr, cint, cint, ptr, ptr, ctypes.c_int32]
    lib.ao_pack_block.restype = i64
    lib.ao_unpack_block.argtypes = [
        ptr, i64, ptr, i64, ptr, ptr, cint, cint, ptr, ptr, ctypes.c_int32
    ]  # fmt: skip
    lib.ao_unpack_block.restype = i64
    # header addresses (u64), n, piece addresses (u64), piece lengths, first piece of each
    # block (n + 1), keys, where each key starts, key lengths (i32), identity, payload_len,
    # MAC key, its length, the threads to spread the blocks over
    lib.ao_seal_blocks.argtypes = [
        ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ctypes.c_int32, ctypes.c_int32
    ]  # fmt: skip
    lib.ao_seal_blocks.restype = i64
    # ... threads; ao_check_blocks: the results (int64[n]), checked in place, then threads
    lib.ao_check_blocks.argtypes = [
        ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ctypes.c_int32, ptr, ctypes.c_int32
    ]  # fmt: skip
    lib.ao_check_blocks.restype = i64
    # out, outlen, key, keylen, data, len
    size = ctypes.c_size_t
    lib.ao_blake2b.argtypes = [ptr, size, ptr, size, ptr, size]
    lib.ao_blake2b.restype = cint
    return lib


def _configure_cuda_helpers(lib: ctypes.CDLL) -> tuple[ctypes.CDLL, CudaFeature] | None:
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
    found = lib.ao_cuda_init()
    if found < 0:
        return None
    features = CudaFeature(found)
    if lib.ao_cuda_spinner_init() == 0:
        features |= CudaFeature.SPINNER
    return lib, features


def _module_with(*names: str) -> Callable[[ModuleType], ModuleType]:
    def configure(module: ModuleType) -> ModuleType:
        for name in names:
            getattr(module, name)  # AttributeError: not this library
        return module

    return configure


#: The native copy-lane library; ``None`` if unavailable.
load_copy_engine: NativeLoader[ctypes.CDLL] = NativeLoader(
    _Library("copy_engine", extension=False), "native copy engine", _configure_copy_engine
)

#: The native disk I/O lanes (pread/pwrite of CRC32C-checked blocks, asyncoffload.tiers);
#: ``None`` if unavailable.
load_disk_io: NativeLoader[ctypes.CDLL] = NativeLoader(
    _Library("disk_io", extension=False), "native disk I/O lanes", _configure_disk_io
)

#: The CUDA helper library and its feature bits (1: host-function wake-ups, 2: batched
#: memcpy, 4: driver-API host registration, 8: the completion spinner, 16: one
#: ``cuMemcpyAsync`` per descriptor), or ``None`` where it can't be built or libcuda is
#: missing.
load_cuda_helpers: NativeLoader[tuple[ctypes.CDLL, CudaFeature]] = NativeLoader(
    _Library("cuda_helpers", extension=False, libs=("-ldl",)),
    "native CUDA helpers",
    _configure_cuda_helpers,
)

#: The KV policy's C core (a CPython extension); ``None`` if it cannot be built (no
#: compiler or Python headers, or ``ASYNCOFFLOAD_NO_NATIVE=1``).
load_kvcore: NativeLoader[ModuleType] = NativeLoader(
    _Library("kvcore", extension=True), "native KV policy core", _module_with("Core")
)

#: The request-scoped manager's C core (asyncoffload.manager.native), built like
#: :data:`load_kvcore`; ``None`` where it cannot be built.
load_mgrcore: NativeLoader[ModuleType] = NativeLoader(
    _Library("mgrcore", extension=True), "native manager core", _module_with("Manager", "POLICIES")
)

_LOADERS: tuple[NativeLoader[Any], ...] = (
    load_copy_engine,
    load_cuda_helpers,
    load_disk_io,
    load_kvcore,
    load_mgrcore,
)


def build_all(timeout: float | None = None) -> dict[str, Path | None]:
    """Build every native library into the cache now, synchronously (those already
    built and intact are kept, and so is a copy installed with the package that matches
    its digest and source: its path is returned). ``timeout``: seconds per compile
    (default: :func:`compile_timeout_s`). Returns each library's path, or ``None`` where
    it could not be built (the reason is logged; a missing compiler once). Loaders that
    found nothing before look again."""
    out: dict[str, Path | None] = {}
    for loader in _LOADERS:
        name = loader.library.name
        if loader.library.installed_ok():
            out[name] = loader.library.installed()
            continue
        with loader._build_lock:
            try:
                out[name] = loader.library.build(timeout)
            except NoCompilerError as exc:
                _warn_no_compiler(loader.what, exc)
                out[name] = None
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("%s could not be built: %s", loader.what, exc)
                out[name] = None
        if out[name] is not None and loader._done and loader._value is None:
            loader.cache_clear()
    return out
