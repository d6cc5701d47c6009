"""The baseline of tests/vllm_upstream: vLLM's own classes under the same tests, offline,
on the same platform; no class replaced."""

from __future__ import annotations

import pytest

from upstream_plugin import _check_offline, _platform


def pytest_configure(config: pytest.Config) -> None:
    _check_offline()
    _platform()
