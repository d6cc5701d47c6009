"""asyncoffload inside vLLM: an out-of-tree ``OffloadingSpec`` for vLLM's OffloadingConnector.

Turn it on with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "AsyncOffloadSpec",
                                    "spec_module_path": "asyncoffload.integrations.vllm",
                                    "cpu_bytes_to_use": 8589934592, "policy": "kv"}}'

The classes below import vLLM (0.32 or 0.33; ``pip install 'asyncoffload[vllm]'``) when
first used; :mod:`~asyncoffload.integrations.vllm.settings` does not. docs/vllm.md
lists the settings and what differs from vLLM's own CPU spec.

``AsyncOffloadConnector`` (``"kv_connector": "AsyncOffloadConnector",
"kv_connector_module_path": "asyncoffload.integrations.vllm"``) is vLLM's
``OffloadingConnector`` with failed loads recomputed instead of fatal (docs/vllm.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncoffload.integrations.vllm.connector import AsyncOffloadConnector
    from asyncoffload.integrations.vllm.manager import AsyncOffloadManager
    from asyncoffload.integrations.vllm.settings import VllmOffloadSettings
    from asyncoffload.integrations.vllm.spec import AsyncOffloadSpec
    from asyncoffload.integrations.vllm.worker import AsyncOffloadWorker

__all__ = [
    "AsyncOffloadConnector",
    "AsyncOffloadManager",
    "AsyncOffloadSpec",
    "AsyncOffloadWorker",
    "VllmOffloadSettings",
]

_WHERE = {
    "AsyncOffloadConnector": "connector",
    "AsyncOffloadManager": "manager",
    "AsyncOffloadSpec": "spec",
    "AsyncOffloadWorker": "worker",
    "VllmOffloadSettings": "settings",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{where}"), name)
