"""``python -m asyncoffload``: the command line (see :mod:`asyncoffload.cli`).

Ctrl-C is already handled here: the package's ``__init__`` ran first and, this process
being the command line, made a SIGINT exit with ``interrupted`` and status 130 until
``main`` takes over (:mod:`asyncoffload._interrupt`).
"""

from __future__ import annotations

from asyncoffload.cli import main

raise SystemExit(main())
