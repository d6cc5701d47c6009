"""``asyncoffload demo``: run the demo on a new event loop and print its report.

The command line (:mod:`asyncoffload.cli`) parses the options into a
:class:`~asyncoffload.demo.DemoConfig` and calls :func:`run_command`.
"""

from __future__ import annotations

import sys

from asyncoffload.demo.progress import ProgressMode
from asyncoffload.demo.run import run_demo
from asyncoffload.demo.settings import DemoConfig

__all__ = ["run_command"]


def run_command(
    cfg: DemoConfig, *, progress: ProgressMode = "auto", use_uvloop: bool = False
) -> int:
    """Run the demo on a new loop (uvloop's with ``use_uvloop``), print the headline and
    the report's table on stdout; the exit status: 0 when all went well, 1 when a load
    had wrong bytes or a request failed (one line on stderr), 130 on Ctrl-C
    (``interrupted`` on stderr). :class:`~asyncoffload.demo.DemoConfigError` when the
    settings don't fit the workload or the machine (nothing printed)."""
    from asyncoffload.loops import run

    try:
        report = run(run_demo(cfg, progress=progress), use_uvloop=use_uvloop)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(report.headline() + "\n")
    print(report.format_table())
    failure = report.failure()
    if failure is not None:
        print(failure, file=sys.stderr)
        return 1
    return 0
