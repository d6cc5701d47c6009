"""The SGLang tests run where SGLang 0.5.23's modules import (`make test-sglang`:
scripts/sglang_overlay.py over the vLLM CPU venv); elsewhere they skip, visibly, unless
ASYNCOFFLOAD_SGLANG=1 (which `make test-sglang` sets) says they must run."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SGLANG_INSTALLED:
        return
    if os.environ.get("ASYNCOFFLOAD_SGLANG") == "1":
        raise pytest.UsageError("SGLang is not importable: PYTHONPATH must hold the overlay")
    skip = pytest.mark.skip(reason="SGLang is not installed: run `make test-sglang`")
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(skip)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Without SGLang the modules that import it are not even imported."""
    if not SGLANG_INSTALLED and collection_path.name.startswith("test_"):
        return os.environ.get("ASYNCOFFLOAD_SGLANG") != "1"
    return None
