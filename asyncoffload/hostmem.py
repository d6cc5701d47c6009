"""How much host memory this process may still take, checked before a large allocation.

A tier too large for the machine should fail at once with a message that names the
setting and both sizes, not late with the allocator's raw "you tried to allocate N
bytes" (or an OOM kill). The figure is the smaller of the kernel's ``MemAvailable`` and
what the cgroup (a container's memory limit) still allows.
"""

from __future__ import annotations

import os
from pathlib import Path

from asyncoffload.errors import HostMemoryError

__all__ = ["available_host_bytes", "check_host_bytes", "format_bytes"]

_CGROUP = Path("/sys/fs/cgroup")


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``'1.5 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_headroom() -> int | None:
    """cgroup v2: ``memory.max - memory.current`` of this process's group."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().splitlines()[0].split(":", 2)[2]
        group = _CGROUP / rel.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError, IndexError):
        return None


def available_host_bytes() -> int | None:
    """Bytes of host memory this process can still take, or ``None`` if unknown."""
    figures = [f for f in (_meminfo_available(), _cgroup_headroom()) if f is not None]
    return min(figures) if figures else None


def check_host_bytes(nbytes: int, what: str) -> None:
    """Raise :class:`~asyncoffload.HostMemoryError` when ``nbytes`` more than the host
    has available: ``what`` names the setting that asked for it."""
    available = available_host_bytes()
    if available is not None and nbytes > available:
        raise HostMemoryError(
            f"{what} needs {format_bytes(nbytes)} of host memory; this machine has "
            f"{format_bytes(available)} available"
        )
