"""Adapters from the engine to the serving ecosystem.

- :mod:`asyncoffload.integrations.kv_events`: vLLM-compatible KV events over ZMQ
  (``pip install 'asyncoffload[events]'``).
- :mod:`asyncoffload.integrations.prometheus`: Prometheus metrics
  (``pip install 'asyncoffload[prometheus]'``).

Each imports its third-party dependency only when imported itself.
"""

from __future__ import annotations

import re

__all__ = ["check_endpoint", "shift_tcp_port"]

_ENDPOINT = re.compile(r"^(tcp|ipc|inproc)://.+")


def check_endpoint(value: str) -> str:
    """``value`` if it names a ZMQ endpoint we bind to, else ``ValueError`` saying so."""
    if not _ENDPOINT.match(value):
        raise ValueError(
            f"endpoint {value!r} must be 'tcp://host:port', 'ipc://path' or 'inproc://name'"
        )
    return value


def shift_tcp_port(endpoint: str, by: int) -> str | None:
    """``endpoint`` with its port moved up by ``by``; ``None`` unless it is a tcp
    endpoint with a numeric port."""
    base, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit():
        return f"{base}:{int(port) + by}"
    return None
