"""The ``asyncoffload`` command line: ``asyncoffload demo [options]``.

Each subcommand is a function that adds its parser and one that runs it, registered in
:data:`COMMANDS`; ``main`` parses and dispatches. Bad options are argparse errors (exit
status 2); a run returns 0 when all went well, 1 when it found a problem.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

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

    grp = parser.add_argument_group("run")
    _add_loop_option(grp)
    shown = grp.add_mutually_exclusive_group()
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


def _run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from asyncoffload.demo import DemoConfig, DemoConfigError, run_demo
    from asyncoffload.loops import run

    use_uvloop = _check_loop(args, parser)
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
        )
    except ValidationError as exc:
        parser.error("; ".join(str(e["msg"]) for e in exc.errors()))
    try:
        report = run(run_demo(cfg, progress=args.progress), use_uvloop=use_uvloop)
    except DemoConfigError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(
        f"asyncoffload demo: {cfg.requests} chat requests ({cfg.turns} turns per session, "
        f"{cfg.system_prompts} system prompts), seed {cfg.seed}\n"
    )
    print(report.format_table())
    if not report.ok:
        print(
            f"asyncoffload demo: FAILED: {report.mismatches} blocks loaded with wrong bytes, "
            f"{report.failed_requests} requests failed",
            file=sys.stderr,
        )
        return 1
    return 0


#: The subcommands, in help order. Later commands (replay, bench) register here.
COMMANDS: list[Command] = [
    Command(
        "demo",
        "simulated serving loop on the CPU backend: a multi-turn chat workload, real "
        "bytes, a report",
        _add_demo,
        _run_demo,
    ),
]


def build_parser() -> argparse.ArgumentParser:
    from asyncoffload import __version__

    parser = argparse.ArgumentParser(
        prog="asyncoffload",
        description="asyncio-native KV-cache offload engine for LLM serving",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add(p)
        p.set_defaults(_command=cmd, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status. Option errors raise ``SystemExit(2)``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cmd: Command = args._command
    sub_parser: argparse.ArgumentParser = args._parser
    return cmd.run(args, sub_parser)
