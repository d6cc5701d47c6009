"""``python -m asyncoffload``: the command line (see :mod:`asyncoffload.cli`)."""

from __future__ import annotations

from asyncoffload.cli import main

raise SystemExit(main())
