"""Every async test runs on asyncio's default loop and, where installed, on uvloop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator, Mapping

import pytest


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    try:
        import uvloop
    except ImportError:  # Windows: no uvloop
        return factories
    factories["uvloop"] = uvloop.new_event_loop
    return factories


#: The widest line the run's summary may print (a skip reason is cut to fit).
SUMMARY_COLUMNS = 100


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Skips are summarized in lines of at most ``SUMMARY_COLUMNS``: the docs' marked
    blocks on one line (each marker in the docs gives its reason), other reasons cut."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if not (report.skipped and isinstance(report.longrepr, tuple)):
        return
    path, given_line, reason = report.longrepr
    lineno: int | None = given_line
    if item.path.name == "test_docs.py":
        path, lineno = "tests/test_docs.py", None
        reason = "code blocks the docs mark skip (each marker says why)"
    head = f"SKIPPED [999] {path}:{lineno}: " if lineno is not None else f"SKIPPED [999] {path}: "
    room = SUMMARY_COLUMNS - len(head)
    if len(reason) > room:  # keep both ends: a path's tail says as much as its head
        keep = max(room - 3, 20)
        reason = reason[: keep // 2] + "..." + reason[len(reason) - (keep - keep // 2) :]
    report.longrepr = (path, lineno, reason)  # type: ignore[assignment]


# Real Redis / Valkey servers for the shared tier (issue 14), started by the fixtures
# (tests/servers.py says what each gives).
from tests import servers as _servers  # noqa: E402

valkey_server = _servers.valkey_server
make_valkey = _servers.make_valkey
redis_server = _servers.redis_server
server_kind = _servers.server_kind
make_server = _servers.make_server
any_server = _servers.any_server
valkey_cluster = _servers.valkey_cluster


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard",
        default=None,
        metavar="K/N",
        help="run the K-th of N shares of the collected tests (0 <= K < N): the tests in "
        "node-id order, every N-th from the K-th. CI runs one share of `make test-long` "
        "per submission (.ci/run); `make test-long` alone runs them all.",
    )


def shard_of(nodeids: list[str], k: int, n: int) -> set[str]:
    """The K-th of N shares of ``nodeids``: every N-th in sorted order from the K-th."""
    return {nodeid for rank, nodeid in enumerate(sorted(nodeids)) if rank % n == k}


def _shard(value: str) -> tuple[int, int]:
    try:
        k, n = (int(part) for part in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard {value!r}: expected K/N, two integers") from None
    if not (n >= 1 and 0 <= k < n):
        raise pytest.UsageError(f"--shard {value!r}: needs N >= 1 and 0 <= K < N")
    return k, n


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    value = config.getoption("--shard")
    if value is None:
        return
    k, n = _shard(value)
    chosen = shard_of([item.nodeid for item in items], k, n)
    kept = [item for item in items if item.nodeid in chosen]
    left = [item for item in items if item.nodeid not in chosen]
    config.hook.pytest_deselected(items=left)
    items[:] = kept
    config.stash[_SHARD_KEY] = f"shard {k}/{n}: {len(kept)} of {len(kept) + len(left)} tests"


_SHARD_KEY = pytest.StashKey[str]()


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    return config.stash.get(_SHARD_KEY, None)


def pytest_configure(config: pytest.Config) -> None:
    # A run started in the background by a non-interactive shell (`make test &`, nohup)
    # inherits SIGINT ignored, and so would every process it starts: the tests of what a
    # Ctrl-C does would see none. Take Python's own handler, as a terminal's process has
    # (the processes it starts then get the default disposition, and Python's handler).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Every skip for a missing redis-server on one summary line.
    config.pluginmanager.register(_servers.FoldMissingRedisSkips(), "tests.servers.skips")
