"""The ``asyncoffload`` command line: ``asyncoffload demo [options]``.

It parses and dispatches, nothing more: each subcommand is a function that adds its
parser and one that turns the parsed options into its app's settings and calls the app
(:func:`asyncoffload.demo.command.run_command`,
:func:`asyncoffload.replay.command.run_command`), registered in :data:`COMMANDS`; ``main``
parses and dispatches. The apps check their settings, run, and print their reports; a
setting they refuse comes back here as an option error. Bad options are argparse errors
(exit status 2), and so are sizes the machine's memory cannot hold (checked before
anything is allocated), an output path that cannot be written (checked before the run)
and a trace that cannot be read or parsed (one line naming the file and line, no usage
text); a run returns 0 when all went well, 1 when it found a problem or could not write
an output at its end (one line on stderr). Ctrl-C at any point prints ``interrupted``
(one line on stderr) and exits with status 130; no path prints a traceback.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from pydantic import ValidationError

if TYPE_CHECKING:
    from asyncoffload.demo import DemoConfig

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

    d = DemoConfig()
    _add_demo_workload(parser, d)
    _add_demo_engine(parser, d)
    _add_demo_server(parser, d)
    _add_demo_integrations(parser)
    grp = parser.add_argument_group("run")
    _add_loop_option(grp)
    _add_progress_options(grp)


def _add_demo_workload(parser: argparse.ArgumentParser, d: DemoConfig) -> None:
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


def _add_demo_engine(parser: argparse.ArgumentParser, d: DemoConfig) -> None:
    from asyncoffload.manager import available_policies

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
    eng.add_argument(
        "--mooncake",
        metavar="HOST:PORT",
        help="add a shared tier on Mooncake Store, its mooncake_master at HOST:PORT "
        "(needs asyncoffload[mooncake]), below the other tiers: every stored block is "
        "written to it, and prompts are looked up there first. Mooncake's client listens "
        "on every interface: see docs/tiers.md",
    )


def _add_demo_server(parser: argparse.ArgumentParser, d: DemoConfig) -> None:
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
        "--settle",
        action="store_true",
        help="each request first waits for the copies and tier writes in flight: with "
        "--concurrency 1, hit rates that do not depend on the machine's speed",
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


def _add_demo_integrations(parser: argparse.ArgumentParser) -> None:
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
    from asyncoffload.demo import DemoConfig, DemoConfigError
    from asyncoffload.demo.command import run_command

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
    if args.mooncake is not None:
        disk["mooncake_master"] = args.mooncake
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
            settle=args.settle,
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
                {
                    "think_time_s": "think_time",
                    "disk_path": "disk",
                    "remote_url": "remote",
                    "mooncake_master": "mooncake",
                },
            )
        )
    try:
        return run_command(cfg, progress=args.progress, use_uvloop=use_uvloop)
    except DemoConfigError as exc:
        parser.error(str(exc))


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


def _run_replay(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from asyncoffload.replay.command import (
        ReplayInputError,
        ReplayOptions,
        ReplayUsageError,
        run_command,
    )

    try:
        shares = capacity_shares(",".join(args.capacity or [DEFAULT_SHARES]))
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--capacity: {exc}")
    disk_shares: list[float] | None = None
    if args.disk_shares is None:
        for option, value in (
            ("--disk-policy", args.disk_policy),
            ("--disk-admission", args.disk_admission),
        ):
            if value is not None:
                parser.error(f"{option}: needs --disk-shares (the disk tier's capacities)")
    else:
        try:
            disk_shares = capacity_shares(",".join(args.disk_shares), at_most_all=False)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--disk-shares: {exc}")
        if args.engine:
            parser.error("--disk-shares: not with --engine (the engine replay is the CPU tier's)")
    options = ReplayOptions(
        trace=args.trace,
        shares=shares,
        policies=args.policy,
        bound=not args.no_bound,
        engine=args.engine,
        block_size=args.block_size,
        limit=args.limit,
        metric=args.metric,
        disk_shares=disk_shares,
        disk_policy=args.disk_policy,
        disk_admission=args.disk_admission,
        plot=args.plot,
        json=args.json,
        seed=args.seed,
        progress=args.progress,
    )
    try:
        return run_command(options, prog=parser.prog)
    except ReplayUsageError as exc:
        parser.error(str(exc))
    except ReplayInputError as exc:
        # A trace that cannot be read is no usage error: one line, no usage text, exit 2.
        _fail(parser, str(exc))


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit with status 2 after one line on stderr: ``<prog>: error: <message>``."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


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
    from asyncoffload._version import __version__

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
