"""``asyncoffload replay``: check the settings, load the workload, replay it, print the table.

The command line (:mod:`asyncoffload.cli`) parses the options into :class:`ReplayOptions`
and calls :func:`run_command`. Settings that cannot run raise :class:`ReplayUsageError`
before anything is loaded or allocated (an output path that could not be written at the
end, a workload too large for memory); a trace that cannot be read or parsed raises
:class:`ReplayInputError`. Both messages name the option (or ``TRACE``) they are about.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TextIO

from asyncoffload.replay.bound import BELADY
from asyncoffload.replay.manager import DISK_ADMISSION, parse_disk_admission
from asyncoffload.replay.matrix import expand_specs, parse_spec, replay_matrix
from asyncoffload.replay.report import (
    engine_mismatches,
    format_caption,
    format_costs,
    format_engine_check,
    format_headline,
    format_json,
    format_table,
    plot,
)
from asyncoffload.replay.sources import FAMILY_REQUESTS, is_family_source, parse_family_source
from asyncoffload.workloads import Request

__all__ = [
    "PLOT_FORMATS",
    "ReplayInputError",
    "ReplayOptions",
    "ReplayUsageError",
    "run_command",
]

#: File name suffixes ``--plot`` writes (formats every matplotlib backend saves).
PLOT_FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".eps", ".ps")
#: What a generated request holds in memory at least (its object, ids, keys tuple).
REQUEST_BYTES_AT_LEAST = 300
#: Requests of ``synthetic`` without a count.
SYNTHETIC_REQUESTS = 20_000


class ReplayUsageError(ValueError):
    """A setting the replay cannot run with; the message starts with the option."""


class ReplayInputError(ValueError):
    """The trace cannot be read or parsed; the message names the file (and line)."""


@dataclass(frozen=True)
class ReplayOptions:
    """The settings of ``asyncoffload replay``, as the options give them."""

    #: A Mooncake-format JSONL file, ``synthetic[:N]`` or ``family:NAME[:N][:PARAM=VALUE]...``.
    trace: str
    #: CPU tier capacities, shares of the workload's unique blocks.
    shares: Sequence[float]
    #: ``--policy`` values: specs, comma-separated, ``all`` (``None``: all).
    policies: Sequence[str] | None = None
    #: Whether the offline bound (Belady's MIN) runs too.
    bound: bool = True
    #: Through the async engine with real bytes, not the manager alone.
    engine: bool = False
    block_size: int = 512
    #: Replay only the first N requests.
    limit: int | None = None
    metric: Literal["block", "token"] = "block"
    #: Disk tier capacities, shares of the unique blocks (``None``: no disk tier).
    disk_shares: Sequence[float] | None = None
    #: The disk tier's policy and admission (``None``: lru, :data:`DISK_ADMISSION`).
    disk_policy: str | None = None
    disk_admission: str | None = None
    #: Where to write the plot and the JSON (``None``: not written).
    plot: str | None = None
    json: str | None = None
    #: Seed of ``synthetic`` and of family sources that name none.
    seed: int = 0
    #: The progress bar on stderr: when it is a terminal, always or never.
    progress: Literal["auto", "always", "never"] = "auto"


def run_command(options: ReplayOptions, *, prog: str = "asyncoffload replay") -> int:
    """Run the replay of ``options`` and print its table (and the lines around it) on
    stdout; write the JSON and the plot asked for. The exit status: 0 when all went
    well, 1 when the engine loaded wrong bytes or an output could not be written at the
    end (one line on stderr, starting with ``prog``), 130 on Ctrl-C during the replay
    (``interrupted`` on stderr). :class:`ReplayUsageError` or :class:`ReplayInputError`
    before anything runs."""
    disk_policy, disk_admission = _disk_settings(options)
    specs = _specs(options)
    if options.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ReplayUsageError(
                "--plot needs matplotlib: pip install 'asyncoffload[replay]'"
            ) from None
        _check_output("--plot", options.plot, PLOT_FORMATS)
    if options.json:
        _check_output("--json", options.json)
    requests = _load_workload(options)
    if not requests:
        raise ReplayUsageError(f"TRACE: {options.trace!r} holds no requests")
    disk = options.disk_shares is not None
    show = options.progress == "always" or (options.progress == "auto" and sys.stderr.isatty())
    bar = _ProgressBar(sys.stderr) if show else None
    try:
        results = replay_matrix(
            requests,
            sorted(set(options.shares)),
            specs,
            progress=bar,
            engine=options.engine,
            disk_shares=None if not disk else [None, *sorted(set(options.disk_shares or ()))],
            disk_policy=disk_policy,
            disk_admission=disk_admission,
        )
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(format_headline(options.trace, requests, options.metric) + "\n")
    caption = format_caption(
        options.metric,
        disk_policy=disk_policy if disk else None,
        disk_admission=disk_admission,
        bound=options.bound,
    )
    print(caption + "\n")
    print(format_table(results, options.metric))
    costs = format_costs(results, options.engine)
    if costs is not None:
        print("\n" + costs)
    if options.engine:
        print("\n" + format_engine_check(results))
        if engine_mismatches(results):
            return 1
    status = 0
    if options.json:
        try:
            with open(options.json, "w") as fh:
                fh.write(format_json(options.trace, results, disk))
        except OSError as exc:
            status = _write_failed(prog, "--json", options.json, exc)
    if options.plot:
        name = options.trace.rsplit("/", 1)[-1]
        try:
            plot(
                [r for r in results if not r.has_disk],
                options.plot,
                title=f"{name}: hit rate and blocks written vs capacity",
                metric=options.metric,
            )
        except OSError as exc:
            status = _write_failed(prog, "--plot", options.plot, exc)
        else:
            print(f"\nplot: {options.plot}")
    return status


# --- the settings, checked ---------------------------------------------------------------


def _disk_settings(options: ReplayOptions) -> tuple[str, str | None]:
    """The disk tier's policy and admission (``None``: every block), checked; the
    defaults without a disk tier."""
    from asyncoffload.manager.policies import get_policy_cls

    if options.disk_shares is None:
        return "lru", DISK_ADMISSION
    policy = options.disk_policy if options.disk_policy is not None else "lru"
    try:
        if policy == BELADY:
            raise ValueError("the offline bound is no policy a disk tier can run")
        get_policy_cls(policy)
    except ValueError as exc:
        raise ReplayUsageError(f"--disk-policy: {exc}") from None
    admission = options.disk_admission if options.disk_admission is not None else DISK_ADMISSION
    try:
        parse_disk_admission(admission)
    except ValueError as exc:
        raise ReplayUsageError(f"--disk-admission: {exc}") from None
    return policy, None if admission == "none" else admission


def _specs(options: ReplayOptions) -> list[str]:
    """The specs to replay, checked, the offline bound last unless left out."""
    specs = expand_specs(options.policies)
    if options.bound and BELADY not in specs:
        specs.append(BELADY)
    try:
        for spec in specs:
            parse_spec(spec)
    except ValueError as exc:
        raise ReplayUsageError(f"--policy: {exc}") from None
    return specs


def _check_output(option: str, path: str, suffixes: tuple[str, ...] | None = None) -> None:
    """Refuse, before any work, an output path the run could not write at its end."""
    if os.path.isdir(path):
        raise ReplayUsageError(f"{option} {path}: is a directory")
    if suffixes is not None and os.path.splitext(path)[1].lower() not in suffixes:
        raise ReplayUsageError(f"{option} {path}: name a {', '.join(suffixes)} file")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ReplayUsageError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ReplayUsageError(f"{option} {path}: the folder {folder} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ReplayUsageError(f"{option} {path}: the file is not writable")
    # os.access answers for permissions only (root passes on /proc): open it for real,
    # without truncating a file that is there, and remove one that was not.
    existed = os.path.exists(path)
    try:
        with open(path, "ab" if existed else "xb"):
            pass
    except OSError as exc:
        raise ReplayUsageError(
            f"{option} {path}: cannot be written: {exc.strerror or exc}"
        ) from None
    if not existed:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _write_failed(prog: str, option: str, path: str, exc: OSError) -> int:
    """One line on stderr for an output the run could not write at its end; status 1."""
    sys.stdout.flush()
    print(
        f"{prog}: error: {option} {path}: writing it failed: {exc.strerror or exc} "
        "(the table above has the results)",
        file=sys.stderr,
    )
    return 1


# --- the workload --------------------------------------------------------------------------


def _check_generated(trace: str, n: int) -> None:
    """Refuse, before generating them, ``n`` requests that cannot fit in memory."""
    from asyncoffload.hostmem import available_host_bytes, format_bytes

    need = n * REQUEST_BYTES_AT_LEAST
    available = available_host_bytes()
    if available is not None and need > available:
        raise ReplayUsageError(
            f"TRACE: {trace!r}: {n:,} requests need at least "
            f"{format_bytes(min(need, 1 << 60))} of host memory; this machine has "
            f"{format_bytes(available)} available (ask for fewer, or use --limit)"
        )


def _load_workload(options: ReplayOptions) -> list[Request]:
    """The requests ``options.trace`` names: a trace family's, ``synthetic``'s or a
    Mooncake-format file's."""
    # Looked up when called (tests replace the generators).
    from asyncoffload.workloads import TraceFormatError, load_mooncake, synthetic_sessions

    trace, limit = options.trace, options.limit
    if is_family_source(trace):
        try:
            source = parse_family_source(trace)
        except ValueError as exc:
            raise ReplayUsageError(f"TRACE: {exc}") from None
        n = FAMILY_REQUESTS if source.num_requests is None else source.num_requests
        _check_generated(trace, n if limit is None else min(n, limit))
        try:
            return source.requests(seed=options.seed, block_size=options.block_size, limit=limit)
        except ValueError as exc:
            raise ReplayUsageError(f"TRACE: {exc}") from None
    if trace == "synthetic" or trace.startswith("synthetic:"):
        _, _, count = trace.partition(":")
        bad = f"TRACE: expected synthetic:N with N a positive integer, got {trace!r}"
        try:
            n = int(count) if count else SYNTHETIC_REQUESTS
        except ValueError:
            raise ReplayUsageError(bad) from None
        if n <= 0:
            raise ReplayUsageError(bad)
        if limit is not None:
            n = min(n, limit)
        _check_generated(trace, n)
        return synthetic_sessions(n, block_size=options.block_size, seed=options.seed)
    try:
        return load_mooncake(trace, block_size=options.block_size, limit=limit)
    except OSError as exc:
        raise ReplayInputError(f"cannot read the trace {trace!r}: {exc.strerror or exc}") from None
    except TraceFormatError as exc:
        raise ReplayInputError(str(exc)) from None


class _ProgressBar:
    """A one-line progress bar on a stream."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.started = time.monotonic()
        self._last = -1.0

    def __call__(self, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 1.0
        fill = int(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        elapsed = now - self.started
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        self.stream.write(f"\r[{bar}] {frac:6.1%}  {label:<24} eta {eta:5.0f}s ")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
