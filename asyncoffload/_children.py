"""What a process this package starts (the Mooncake tier's helper, a compiler) inherits:
the environment without this package's own settings.

``ASYNCOFFLOAD_*`` variables configure the engine, and ``ASYNCOFFLOAD_TIERS`` may carry a
tier's ``mac_key`` or a server's password; a child's environment is readable in
``/proc/<pid>/environ`` (by its user, and by whoever may ptrace it), and no child needs
them. Settings a child needs go through a pipe or socket instead, never its arguments.
"""

from __future__ import annotations

import os

__all__ = ["PREFIX", "child_env"]

#: The prefix of this package's environment settings.
PREFIX = "ASYNCOFFLOAD_"


def child_env(keep: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment without the ``ASYNCOFFLOAD_*`` variables (but those
    named in ``keep``), for a child process."""
    return {k: v for k, v in os.environ.items() if not k.startswith(PREFIX) or k in keep}
