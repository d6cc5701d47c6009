"""SGLang 0.5.23's own classes on a CPU, as `make test-sglang` lays them out
(scripts/sglang_overlay.py): import this before anything of SGLang.

One thing differs from a serving install. ``sglang.srt.configs`` (which the host memory
pools import, through ``memory_pool``) imports two multimodal preprocessors at module
level that import ``torchvision.transforms``; torchvision has no CPU build on PyPI, and
its CUDA build does not load beside a CPU torch. :func:`import_sglang` puts a stand-in
``torchvision`` (whose every function raises) into ``sys.modules`` first, after
transformers has found out that torchvision is absent (so transformers takes its
torchvision-free paths, as it does on a machine without torchvision). Nothing the tests
run calls torchvision.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any


class _Absent:
    """An attribute of the stand-in: using it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Absent:
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is not installed (a stand-in)")


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def __getattr__(attr: str) -> _Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{name}.{attr}")

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = module
    return module


def import_sglang() -> None:
    """Make SGLang's modules importable here (idempotent)."""
    if "torchvision" in sys.modules:
        return
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():  # a real one: use it
        return
    top = _module("torchvision")
    top.__path__ = []
    transforms = _module("torchvision.transforms")
    transforms.__path__ = []
    top.transforms = transforms  # type: ignore[attr-defined]
    transforms.functional = _module("torchvision.transforms.functional")  # type: ignore[attr-defined]
