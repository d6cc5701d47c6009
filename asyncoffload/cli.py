"""The ``asyncoffload`` command line: ``asyncoffload demo [options]``.

Each subcommand is a function that adds its parser and one that runs it, registered in
:data:`COMMANDS`; ``main`` parses and dispatches. Bad options are argparse errors (exit
status 2), and so are sizes the machine's memory cannot hold (checked before anything
is allocated), an output path that cannot be written (checked before the run) and a
trace that cannot be read or parsed (one line naming the file and line, no usage text);
a run returns 0 when all went well, 1 when it found a problem or could not write an
output at its end (one line on stderr). Ctrl-C at any point prints ``interrupted`` (one
line on stderr) and exits with status 130; no path prints a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

from pydantic import ValidationError

__all__ = ["COMMANDS", "Command", "build_parser", "main"]


# --- option types ----------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _float(text: str, what: str, ok: Callable[[float], bool]) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    return _float(text, "a positive number", lambda v: v > 0)


def non_negative_float(text: str) -> float:
    return _float(text, "a non-negative number", lambda v: v >= 0)


# --- commands --------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """A subcommand: ``add`` fills its parser, ``run`` executes the parsed options."""

    name: str
    help: str
    add: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]


def _add_loop_option(parser: argparse._ActionsContainer) -> None:
    from asyncoffload.loops import uvloop_available

    default = "uvloop" if uvloop_available() else "asyncio"
    parser.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default=default,
        help=f"event loop to run on (default: {default})",
    )


def _add_progress_options(parser: argparse._ActionsContainer) -> None:
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument(
        "--no-progress",
        dest="progress",
        action="store_const",
        const="never",
        default="auto",
        help="no progress bar (default: one on stderr when it is a terminal)",
    )
    shown.add_argument(
        "--progress",
        dest="progress",
        action="store_const",
        const="always",
        help="a progress bar on stderr even when it is not a terminal",
    )


def _check_loop(args: argparse.Namespace, parser: argparse.ArgumentParser) -> bool:
    from asyncoffload.loops import uvloop_available

    if args.loop == "uvloop" and not uvloop_available():
        parser.error("--loop uvloop: uvloop is not installed (pip install uvloop)")
    return bool(args.loop == "uvloop")


def _add_demo(parser: argparse.ArgumentParser) -> None:
    from asyncoffload.demo import DemoConfig
    from asyncoffload.manager import available_policies

    d = DemoConfig()
    work = parser.add_argument_group("workload (a synthetic multi-turn chat)")
    work.add_argument(
        "--requests", type=positive_int, default=d.requests, help="requests (%(default)s)"
    )
    work.add_argument(
        "--system-prompts",
        type=positive_int,
        default=d.system_prompts,
        help="distinct system prompts shared by the sessions (%(default)s)",
    )
    work.add_argument(
        "--system-prompt-blocks",
        type=non_negative_int,
        default=d.system_prompt_blocks,
        help="blocks of each system prompt (%(default)s)",
    )
    work.add_argument(
        "--turns", type=positive_int, default=d.turns, help="turns per session (%(default)s)"
    )
    work.add_argument(
        "--blocks-per-turn",
        type=positive_float,
        default=d.blocks_per_turn,
        help="mean user message, in blocks (%(default)s)",
    )
    work.add_argument(
        "--arrival-rate",
        type=positive_float,
        default=d.arrival_rate,
        help="requests per workload second (%(default)s)",
    )
    work.add_argument(
        "--think-time",
        type=non_negative_float,
        default=d.think_time_s,
        help="mean seconds between the turns of a session (%(default)s)",
    )
    work.add_argument("--seed", type=int, default=d.seed, help="random seed (%(default)s)")

    eng = parser.add_argument_group("engine")
    eng.add_argument(
        "--cpu-blocks",
        type=positive_int,
        default=d.cpu_blocks,
        help="capacity of the CPU tier, in blocks (%(default)s)",
    )
    eng.add_argument(
        "--policy",
        choices=available_policies(),
        default=d.policy,
        help="cache policy of the CPU tier (%(default)s)",
    )
    eng.add_argument(
        "--completion",
        choices=("auto", "eventfd", "poll"),
        default=d.completion,
        help="how the loop learns that copies finished (%(default)s)",
    )
    eng.add_argument(
        "--disk",
        metavar="PATH",
        help="add a disk tier below the CPU tier, its slab in this directory (every "
        "stored block is written to it; blocks evicted from the CPU tier come back from it)",
    )
    eng.add_argument(
        "--disk-bytes",
        metavar="SIZE",
        help=f"capacity of the disk tier, e.g. 64MiB or 1GB (default: {d.disk_bytes >> 20}MiB)",
    )
    eng.add_argument(
        "--remote",
        metavar="URL",
        help="add a shared tier on Redis / Valkey at this URL, e.g. redis://127.0.0.1:6390/0, "
        "below the CPU tier (and the disk tier): every stored block is written to it, and "
        "prompts are looked up there first, so a second demo process with the same --seed "
        "loads what the first stored",
    )

    srv = parser.add_argument_group("simulated server")
    srv.add_argument(
        "--gpu-blocks",
        type=positive_int,
        default=None,
        help="blocks of the simulated GPU KV cache (default: concurrency x largest request)",
    )
    srv.add_argument(
        "--concurrency",
        type=positive_int,
        default=d.concurrency,
        help="requests served at once (%(default)s)",
    )
    srv.add_argument(
        "--layers", type=positive_int, default=d.layers, help="KV layers (%(default)s)"
    )
    srv.add_argument(
        "--time-scale",
        type=non_negative_float,
        default=d.time_scale,
        help="wall seconds per workload second; 0 runs as fast as possible (%(default)s)",
    )

    out = parser.add_argument_group("integrations")
    out.add_argument(
        "--publish",
        metavar="ENDPOINT",
        help="publish vLLM-compatible KV events on this ZMQ endpoint, e.g. "
        "tcp://127.0.0.1:5557 (needs asyncoffload[events])",
    )
    out.add_argument(
        "--publish-replay",
        metavar="ENDPOINT",
        help="replay (ROUTER) endpoint (default: the --publish port + 1)",
    )
    out.add_argument("--publish-topic", default="", help="topic of the published batches")
    out.add_argument(
        "--metrics-port",
        type=non_negative_int,
        metavar="PORT",
        help="serve Prometheus metrics on 127.0.0.1:PORT (0: any free port; needs "
        "asyncoffload[prometheus])",
    )

    grp = parser.add_argument_group("run")
    _add_loop_option(grp)
    _add_progress_options(grp)


def _options_message(
    exc: ValidationError, parser: argparse.ArgumentParser, dests: dict[str, str] | None = None
) -> str:
    """A pydantic error as the user typed it: each problem after the option that caused
    it (``--metrics-port 70000: ...``), without pydantic's "Value error," prefix."""
    options = {
        action.dest: action.option_strings[-1]
        for action in parser._actions
        if action.option_strings
    }
    parts = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        dest = (dests or {}).get(field, field)
        message = str(error["msg"]).removeprefix("Value error, ").replace("Input should", "should")
        option = options.get(dest)
        if option is None:
            parts.append(message)
            continue
        given = error.get("input")
        parts.append(
            f"{option} {given}: {message}" if given is not None else f"{option}: {message}"
        )
    return "; ".join(parts)


def _run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from asyncoffload.demo import DemoConfig, DemoConfigError, run_demo
    from asyncoffload.loops import run

    use_uvloop = _check_loop(args, parser)
    if args.disk_bytes is not None and args.disk is None:
        parser.error("--disk-bytes: needs --disk (the disk tier's directory)")
    disk: dict[str, object] = {}
    if args.disk is not None:
        disk["disk_path"] = args.disk
        if args.disk_bytes is not None:
            disk["disk_bytes"] = args.disk_bytes
    if args.remote is not None:
        disk["remote_url"] = args.remote
    try:
        cfg = DemoConfig(
            requests=args.requests,
            system_prompts=args.system_prompts,
            system_prompt_blocks=args.system_prompt_blocks,
            turns=args.turns,
            blocks_per_turn=args.blocks_per_turn,
            arrival_rate=args.arrival_rate,
            think_time_s=args.think_time,
            seed=args.seed,
            cpu_blocks=args.cpu_blocks,
            policy=args.policy,
            completion=args.completion,
            gpu_blocks=args.gpu_blocks,
            concurrency=args.concurrency,
            layers=args.layers,
            time_scale=args.time_scale,
            publish=args.publish,
            publish_replay=args.publish_replay,
            publish_topic=args.publish_topic,
            metrics_port=args.metrics_port,
            **disk,
        )
    except ValidationError as exc:
        parser.error(
            _options_message(
                exc,
                parser,
                {"think_time_s": "think_time", "disk_path": "disk", "remote_url": "remote"},
            )
        )
    try:
        report = run(run_demo(cfg, progress=args.progress), use_uvloop=use_uvloop)
    except DemoConfigError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    from asyncoffload._term import terminal_columns

    headline = (
        f"asyncoffload demo: {cfg.requests} chat requests ({cfg.turns} turns per session, "
        f"{cfg.system_prompts} system prompts), seed {cfg.seed}"
    )
    print(textwrap.fill(headline, terminal_columns() - 1, subsequent_indent="  ") + "\n")
    print(report.format_table())
    if not report.ok:
        print(
            f"asyncoffload demo: FAILED: {report.mismatches} blocks loaded with wrong bytes, "
            f"{report.failed_requests} requests failed",
            file=sys.stderr,
        )
        return 1
    return 0


# --- replay ----------------------------------------------------------------------------

DEFAULT_SHARES = "1%,5%,10%,20%,50%"


def capacity_shares(text: str, *, at_most_all: bool = True) -> list[float]:
    """``"1%,5%"`` or ``"0.01,0.05"`` -> ``[0.01, 0.05]``; above 100% only where
    ``at_most_all`` is false (a disk tier may hold more than the workload's blocks)."""
    shares: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = float(part[:-1]) / 100 if part.endswith("%") else float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected capacities like 5% or 0.05, got {part!r}"
            ) from None
        if at_most_all and (not 0 < value <= 1 or value != value):
            raise argparse.ArgumentTypeError(
                f"a capacity is a share of the unique blocks in (0, 100%], got {part!r}"
            )
        if not at_most_all and (not 0 < value < float("inf") or value != value):
            raise argparse.ArgumentTypeError(
                f"a capacity is a positive share of the unique blocks, got {part!r}"
            )
        shares.append(value)
    if not shares:
        raise argparse.ArgumentTypeError("no capacity given")
    return shares


def _add_replay(parser: argparse.ArgumentParser) -> None:
    from asyncoffload.replay import FAMILY_REQUESTS, FAMILY_SOURCE
    from asyncoffload.workloads import families

    parser.add_argument(
        "trace",
        metavar="TRACE",
        help="a Mooncake-format JSONL trace (one request a line with hash_ids), "
        "'synthetic[:N]' for N requests of the built-in multi-turn generator, or "
        f"'{FAMILY_SOURCE}' for N requests of a seeded trace family (below)",
    )
    # The epilog lists the families one a line: keep its layout, fill the description.
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    if parser.description:
        parser.description = textwrap.fill(parser.description, 78)
    listed = "\n".join(f"  {name:<8} {f.summary}" for name, f in families().items())
    parser.epilog = (
        f"trace families (TRACE {FAMILY_SOURCE}; N defaults to {FAMILY_REQUESTS:,}):\n"
        f"{listed}\n"
        "PARAM=VALUE sets the seed (seed=3, else --seed) or a generator parameter\n"
        "(family:rag:50000:zipf_s=1.2:order=id); docs/policies.md lists them."
    )
    parser.add_argument(
        "--capacity",
        nargs="+",
        action="extend",
        metavar="SHARE",
        help=f"tier capacities as shares of the trace's unique blocks, comma-separated or "
        f"repeated (default: {DEFAULT_SHARES.replace('%', '%%')})",
    )
    parser.add_argument(
        "--policy",
        nargs="+",
        action="extend",
        metavar="SPEC",
        help="policies to compare: 'all' (default), or names like lru, kv, lru+ghost "
        "(a policy with an admission filter), comma-separated or repeated",
    )
    parser.add_argument(
        "--no-bound", action="store_true", help="leave out Belady's MIN (the offline bound)"
    )
    parser.add_argument(
        "--engine",
        action="store_true",
        help="run the policies through the async engine on the CPU backend, moving and "
        "checking real bytes (slower; the hits are the same)",
    )
    parser.add_argument(
        "--block-size",
        type=positive_int,
        default=512,
        help="tokens per block of the trace's hash_ids (%(default)s)",
    )
    parser.add_argument(
        "--limit", type=positive_int, default=None, help="replay only the first N requests"
    )
    parser.add_argument(
        "--metric",
        choices=("block", "token"),
        default="block",
        help="hit rate shown in the table: prefix hits in blocks or tokens (%(default)s)",
    )
    parser.add_argument(
        "--disk-shares",
        nargs="+",
        action="extend",
        metavar="SHARE",
        help="model a disk tier below the CPU tier (write-through, promotion on a disk "
        "hit) at these capacities, shares of the unique blocks (may exceed 100%%: 0.5,1,2); "
        "the table then shows hit rate CPU / disk / total and GB written to disk for "
        "every CPU x disk capacity",
    )
    parser.add_argument(
        "--disk-policy",
        metavar="NAME",
        default=None,
        help="the disk tier's eviction policy (default: lru)",
    )
    parser.add_argument(
        "--disk-admission",
        metavar="RULE",
        default=None,
        help="which blocks the disk tier writes: frequency2 (default: a block's second "
        "offer), frequencyN, none (every block), or a filter (ghost, adaptive)",
    )
    parser.add_argument("--plot", metavar="PNG", help="write a plot of hit rate vs capacity")
    parser.add_argument("--json", metavar="PATH", help="write every result as JSON")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of 'synthetic' and of 'family:' sources that name none (%(default)s)",
    )
    _add_progress_options(parser)


def _disk_options(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[list[float] | None, str, str | None]:
    """``--disk-shares`` / ``--disk-policy`` / ``--disk-admission``, checked: the disk
    shares (``None``: no disk tier), the disk policy and admission."""
    from asyncoffload.manager.policies import get_policy_cls
    from asyncoffload.replay import BELADY, DISK_ADMISSION, parse_disk_admission

    if args.disk_shares is None:
        for option, value in (
            ("--disk-policy", args.disk_policy),
            ("--disk-admission", args.disk_admission),
        ):
            if value is not None:
                parser.error(f"{option}: needs --disk-shares (the disk tier's capacities)")
        return None, "lru", DISK_ADMISSION
    try:
        disk = sorted(set(capacity_shares(",".join(args.disk_shares), at_most_all=False)))
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--disk-shares: {exc}")
    if args.engine:
        parser.error("--disk-shares: not with --engine (the engine replay is the CPU tier's)")
    policy = args.disk_policy if args.disk_policy is not None else "lru"
    try:
        if policy == BELADY:
            raise ValueError("the offline bound is no policy a disk tier can run")
        get_policy_cls(policy)
    except ValueError as exc:
        parser.error(f"--disk-policy: {exc}")
    admission = args.disk_admission if args.disk_admission is not None else DISK_ADMISSION
    try:
        parse_disk_admission(admission)
    except ValueError as exc:
        parser.error(f"--disk-admission: {exc}")
    return disk, policy, None if admission == "none" else admission


ALL_SPECS_EXTRA = ("lru+ghost", "lru+adaptive", "kv+adaptive")


def _policy_specs(values: list[str] | None) -> list[str]:
    from asyncoffload.manager import available_policies

    specs: list[str] = []
    for value in values or ["all"]:
        for part in value.split(","):
            part = part.strip()
            if part == "all":
                specs.extend(available_policies())
                specs.extend(ALL_SPECS_EXTRA)
            elif part:
                specs.append(part)
    return list(dict.fromkeys(specs))


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


#: What a generated request holds in memory at least (its object, ids, keys tuple).
REQUEST_BYTES_AT_LEAST = 300


def _check_generated(parser: argparse.ArgumentParser, trace: str, n: int) -> None:
    """Refuse, before generating them, ``n`` requests that cannot fit in memory."""
    from asyncoffload.hostmem import available_host_bytes, format_bytes

    need = n * REQUEST_BYTES_AT_LEAST
    available = available_host_bytes()
    if available is not None and need > available:
        parser.error(
            f"TRACE: {trace!r}: {n:,} requests need at least "
            f"{format_bytes(min(need, 1 << 60))} of host memory; this machine has "
            f"{format_bytes(available)} available (ask for fewer, or use --limit)"
        )


def _load_workload(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Any]:
    from asyncoffload.replay import FAMILY_REQUESTS, is_family_source, parse_family_source
    from asyncoffload.workloads import TraceFormatError, load_mooncake, synthetic_sessions

    trace: str = args.trace
    if is_family_source(trace):
        try:
            source = parse_family_source(trace)
        except ValueError as exc:
            parser.error(f"TRACE: {exc}")
        n = FAMILY_REQUESTS if source.num_requests is None else source.num_requests
        _check_generated(parser, trace, n if args.limit is None else min(n, args.limit))
        try:
            return source.requests(seed=args.seed, block_size=args.block_size, limit=args.limit)
        except ValueError as exc:
            parser.error(f"TRACE: {exc}")
    if trace == "synthetic" or trace.startswith("synthetic:"):
        _, _, count = trace.partition(":")
        try:
            n = int(count) if count else 20_000
        except ValueError:
            parser.error(f"TRACE: expected synthetic:N with N a positive integer, got {trace!r}")
        if n <= 0:
            parser.error(f"TRACE: expected synthetic:N with N a positive integer, got {trace!r}")
        if args.limit is not None:
            n = min(n, args.limit)
        _check_generated(parser, trace, n)
        return synthetic_sessions(n, block_size=args.block_size, seed=args.seed)
    # A trace that cannot be read is no usage error: one line, no usage text, exit 2.
    try:
        return load_mooncake(trace, block_size=args.block_size, limit=args.limit)
    except OSError as exc:
        _fail(parser, f"cannot read the trace {trace!r}: {exc.strerror or exc}")
    except TraceFormatError as exc:
        _fail(parser, str(exc))


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit with status 2 after one line on stderr: ``<prog>: error: <message>``."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


#: File name suffixes ``--plot`` writes (formats every matplotlib backend saves).
PLOT_FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".eps", ".ps")


def _check_output(
    parser: argparse.ArgumentParser,
    option: str,
    path: str,
    suffixes: tuple[str, ...] | None = None,
) -> None:
    """Refuse, before any work, an output path the run could not write at its end."""
    import os

    if os.path.isdir(path):
        parser.error(f"{option} {path}: is a directory")
    if suffixes is not None and os.path.splitext(path)[1].lower() not in suffixes:
        parser.error(f"{option} {path}: name a {', '.join(suffixes)} file")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        parser.error(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"{option} {path}: the folder {folder} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        parser.error(f"{option} {path}: the file is not writable")
    # os.access answers for permissions only (root passes on /proc): open it for real,
    # without truncating a file that is there, and remove one that was not.
    existed = os.path.exists(path)
    try:
        with open(path, "ab" if existed else "xb"):
            pass
    except OSError as exc:
        parser.error(f"{option} {path}: cannot be written: {exc.strerror or exc}")
    if not existed:
        with contextlib.suppress(OSError):
            os.unlink(path)


#: What --json writes of a result with a disk tier, besides its fields.
_TIER_RATES = (
    "cpu_hit_blocks",
    "cpu_hit_tokens",
    "cpu_block_hit_rate",
    "cpu_token_hit_rate",
    "disk_block_hit_rate",
    "disk_token_hit_rate",
)


def _json_row(result: Any, disk: bool) -> dict[str, Any]:
    """A result for --json: its fields and rates; the disk tier's only with ``disk``."""
    import dataclasses

    row = {
        **result.__dict__,
        "label": result.label,
        "block_hit_rate": result.block_hit_rate,
        "token_hit_rate": result.token_hit_rate,
    }
    defaults = {f.name for f in dataclasses.fields(result) if f.name.startswith("disk_")}
    defaults.add("promoted")
    if not disk:
        for name in defaults:
            del row[name]
    else:
        row.update({name: getattr(result, name) for name in _TIER_RATES})
    return row


def _run_replay(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import json

    from asyncoffload.replay import (
        BELADY,
        LLAMA3_8B_BYTES_PER_TOKEN,
        format_table,
        infinite_tier_hit_rate,
        parse_spec,
        plot,
        replay_matrix,
    )
    from asyncoffload.workloads import summarize

    try:
        shares = sorted(set(capacity_shares(",".join(args.capacity or [DEFAULT_SHARES]))))
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--capacity: {exc}")
    disk_shares, disk_policy, disk_admission = _disk_options(args, parser)
    specs = _policy_specs(args.policy)
    if not args.no_bound and BELADY not in specs:
        specs.append(BELADY)
    try:
        for spec in specs:
            parse_spec(spec)
    except ValueError as exc:
        parser.error(f"--policy: {exc}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'asyncoffload[replay]'")
        _check_output(parser, "--plot", args.plot, PLOT_FORMATS)
    if args.json:
        _check_output(parser, "--json", args.json)
    requests = _load_workload(args, parser)
    if not requests:
        parser.error(f"TRACE: {args.trace!r} holds no requests")
    summary = summarize(requests)
    show = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())
    bar = _ProgressBar(sys.stderr) if show else None
    try:
        results = replay_matrix(
            requests,
            shares,
            specs,
            progress=bar,
            engine=args.engine,
            disk_shares=None if disk_shares is None else [None, *disk_shares],
            disk_policy=disk_policy,
            disk_admission=disk_admission,
        )
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    from asyncoffload._term import terminal_columns

    headline = (
        f"asyncoffload replay: {args.trace}: {summary.requests:,} requests, "
        f"{summary.total_blocks:,} blocks, {summary.unique_blocks:,} unique "
        f"(an infinite tier would hit {infinite_tier_hit_rate(requests, args.metric):.3f} "
        f"of the {args.metric}s)"
    )
    print(textwrap.fill(headline, terminal_columns() - 1, subsequent_indent="  ") + "\n")
    if disk_shares is None:
        print(f"prefix hit rate ({args.metric}s) / blocks written, by tier capacity:\n")
    else:
        what = (
            f"prefix hit rate ({args.metric}s) served from the CPU tier / disk / both, and "
            f"GB written to disk (10^9 bytes, at {LLAMA3_8B_BYTES_PER_TOKEN:,} bytes a "
            f"token), by CPU x disk capacity (disk: {disk_policy}, admission "
            f"{disk_admission or 'none: every block'}; disk none: no disk tier"
            f"{'; belady: the bound of the CPU tier alone' if not args.no_bound else ''}):"
        )
        print(textwrap.fill(what, terminal_columns() - 1) + "\n")
    print(format_table(results, args.metric))
    costs: dict[str, list[float]] = {}
    for r in results:
        if r.policy != BELADY and not r.has_disk:
            costs.setdefault(r.label, []).append(r.us_per_block)
    if "lru" in costs:
        base = sum(costs["lru"]) / len(costs["lru"])
        what = "engine time per block, copies awaited" if args.engine else "manager time per block"
        print(f"\n{what} (mean over capacities), against lru:")
        for label, values in costs.items():
            mean = sum(values) / len(values)
            print(f"  {label:<14} {mean:6.2f} us  x{mean / base:.2f}")
    if args.engine:
        bad = sum(int(r.extra.get("mismatches", 0)) for r in results)
        loaded = sum(r.loaded for r in results if r.policy != BELADY)
        print(f"\nthrough the engine: {loaded:,} loaded blocks checked, {bad} with wrong bytes")
        too_large = sum(int(r.extra.get("too_large", 0)) for r in results)
        if too_large:
            what = (
                f"{too_large:,} stores had more new blocks than the CPU tier holds: not "
                "stored, counted as refused (as without --engine)"
            )
            print(textwrap.fill(what, terminal_columns() - 1))
        if bad:
            return 1
    status = 0
    if args.json:
        rows = [_json_row(r, disk_shares is not None) for r in results]
        text = json.dumps({"trace": args.trace, "results": rows}, indent=1)
        try:
            with open(args.json, "w") as fh:
                fh.write(text)
        except OSError as exc:
            status = _write_failed(parser, "--json", args.json, exc)
    if args.plot:
        try:
            plot(
                [r for r in results if not r.has_disk],
                args.plot,
                title=f"{args.trace.rsplit('/', 1)[-1]}: hit rate and blocks written vs capacity",
                metric=args.metric,
            )
        except OSError as exc:
            status = _write_failed(parser, "--plot", args.plot, exc)
        else:
            print(f"\nplot: {args.plot}")
    return status


def _write_failed(parser: argparse.ArgumentParser, option: str, path: str, exc: OSError) -> int:
    """One line on stderr for an output the run could not write at its end; status 1."""
    sys.stdout.flush()
    print(
        f"{parser.prog}: error: {option} {path}: writing it failed: {exc.strerror or exc} "
        "(the table above has the results)",
        file=sys.stderr,
    )
    return 1


#: The subcommands, in help order.
COMMANDS: list[Command] = [
    Command(
        "demo",
        "simulated serving loop on the CPU backend: a multi-turn chat workload, real "
        "bytes, a report",
        _add_demo,
        _run_demo,
    ),
    Command(
        "replay",
        "replay a request trace through the CPU tier's manager: hit rate and blocks "
        "written per policy and capacity, next to the offline optimum",
        _add_replay,
        _run_replay,
    ),
]


def build_parser() -> argparse.ArgumentParser:
    from asyncoffload import __version__

    parser = argparse.ArgumentParser(
        prog="asyncoffload",
        description="asyncio-native KV-cache offload engine for LLM serving",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    noise = common.add_argument_group("logging (to stderr; ASYNCOFFLOAD_LOG_LEVEL sets the base)")
    noise.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log lines (-vv: debug)"
    )
    noise.add_argument("-q", "--quiet", action="count", default=0, help="fewer log lines")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, parents=[common])
        cmd.add(p)
        p.set_defaults(_command=cmd, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status. Option errors raise ``SystemExit(2)``.

    Ctrl-C anywhere in it prints ``interrupted`` (one line on stderr) and returns 130.
    In ``python -m asyncoffload`` and the ``asyncoffload`` script, SIGINT exits at once
    with both before ``main`` runs and after it returns (see :mod:`asyncoffload._interrupt`).
    """
    from asyncoffload import _interrupt

    guarded = False
    try:
        guarded = _interrupt.release()
        return _main(argv)
    except KeyboardInterrupt:
        if guarded:
            _interrupt.hold()
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if guarded:
            _interrupt.hold()


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cmd: Command = args._command
    sub_parser: argparse.ArgumentParser = args._parser
    from asyncoffload.logs import configure_cli

    try:
        restore_logging = configure_cli(args.verbose, args.quiet)
    except ValueError as exc:  # a bad ASYNCOFFLOAD_LOG_LEVEL
        _fail(sub_parser, str(exc))
    try:
        return _dispatch(cmd, args, sub_parser)
    finally:
        restore_logging()


def _dispatch(cmd: Command, args: argparse.Namespace, sub_parser: argparse.ArgumentParser) -> int:
    # Native helpers are never compiled on an event loop's thread (a loader there takes
    # the Python fallback while a background build runs): build them here, before any
    # loop starts, so that a first run on a fresh machine already copies natively.
    from asyncoffload import _native

    if not _native.native_disabled():
        _native.build_all()
    return cmd.run(args, sub_parser)
