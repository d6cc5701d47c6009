"""The plugin that runs vLLM 0.34's own tiering tests against our tier
(``tests/vllm_upstream/tiering_plugin.py``) cleans up after each test: most of vLLM's
tests never shut their tier down, and each example tier of ours holds a slab on disk.
Before, they all stayed until the session ended: 7 GB of disk, measured, by the end of
test_tiering_offloading.py (a CI run ended with ENOSPC)."""

from __future__ import annotations

import os
from pathlib import Path
from unittest.mock import MagicMock

import numpy as np
import pytest

from tests.vllm_upstream import tiering_plugin as plugin


def test_a_tier_left_open_by_its_test_is_shut_down_and_removed_when_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugin, "_ROOT", [str(tmp_path)])
    monkeypatch.setattr(plugin, "_LIVE", [])
    example, _ = plugin._adapters()  # the classes, not put in vLLM's place here
    view = np.zeros((10, 16), dtype=np.int8).data
    tiers = [example(MagicMock(), view, "example") for _ in range(2)]
    tiers[1].shutdown()  # a test that shuts its tier down itself
    assert os.path.isdir(tiers[0]._dir) and not os.path.exists(tiers[1]._dir)
    assert tiers == plugin._LIVE

    # The hook wraps the test's own teardown: what it does runs after the yield.
    teardown = plugin.pytest_runtest_teardown(MagicMock(), None)
    next(teardown)
    assert os.path.isdir(tiers[0]._dir), "shut down before the test's own teardown ran"
    with pytest.raises(StopIteration):
        next(teardown)

    assert not os.path.exists(tiers[0]._dir)
    assert all(tier._tiers._closed for tier in tiers)
    assert plugin._LIVE == [] and os.listdir(tmp_path) == []
