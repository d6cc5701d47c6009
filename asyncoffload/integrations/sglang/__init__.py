"""asyncoffload inside SGLang: a HiCache L3 storage backend over our tiers.

Turn it on with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "asyncoffload",
      "module_path": "asyncoffload.integrations.sglang", "class_name": "AsyncOffloadStorage",
      "interface_v1": 1,
      "tiers": [{"kind": "disk", "path": "/nvme/kv", "capacity": "512GiB", "mode": "files"}]}'

``AsyncOffloadStorage`` imports SGLang (0.5.23) when first used;
:mod:`~asyncoffload.integrations.sglang.settings` does not. docs/sglang.md lists the
settings and what was and was not run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncoffload.integrations.sglang.settings import SglangStorageSettings
    from asyncoffload.integrations.sglang.storage import AsyncOffloadStorage

__all__ = ["AsyncOffloadStorage", "SglangStorageSettings"]

_WHERE = {"AsyncOffloadStorage": "storage", "SglangStorageSettings": "settings"}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{where}"), name)
