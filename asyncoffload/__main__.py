"""``python -m asyncoffload``: the command line (see :mod:`asyncoffload.cli`)."""

from __future__ import annotations

import warnings

# torch warns at import when numpy is missing; asyncoffload never needs numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from asyncoffload.cli import main  # noqa: E402

raise SystemExit(main())
