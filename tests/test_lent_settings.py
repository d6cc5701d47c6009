"""The tiers of the drivers under a framework's own cache (vLLM 0.34's secondary tiers,
SGLang's HiCache storage) write every block offered unless the user sets an admission:
the framework offers each block once, so the disk tier's usual default (written from
the second offer) would write almost nothing. These settings modules import neither
framework."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncoffload.integrations.sglang.settings import SglangStorageSettings
from asyncoffload.integrations.vllm.secondary_settings import SecondaryTierSettings
from asyncoffload.tiers.disk import DiskTier


def sglang(tier: dict[str, object]) -> SglangStorageSettings:
    return SglangStorageSettings.from_extra_config(
        {
            "backend_name": "asyncoffload",
            "module_path": "asyncoffload.integrations.sglang",
            "class_name": "AsyncOffloadStorage",
            "interface_v1": 1,
            "tiers": [tier],
        }
    )


def test_a_disk_tier_under_a_framework_admits_every_block_unless_told(tmp_path: Path) -> None:
    assert DiskTier(tmp_path, 1 << 20).admission == "frequency"  # the engine's default
    disk: dict[str, object] = {"kind": "disk", "path": str(tmp_path), "capacity": "1MiB"}
    vllm_tier = SecondaryTierSettings.from_config({"tier": disk}).tier
    sglang_tier = sglang(disk).tiers[0]
    assert vllm_tier.admission is None and sglang_tier.admission is None
    chosen = dict(disk, admission="frequency")
    assert SecondaryTierSettings.from_config({"tier": chosen}).tier.admission == "frequency"
    assert sglang(chosen).tiers[0].admission == "frequency"


def test_a_lent_tiers_quota_names_the_deployments_tenant(tmp_path: Path) -> None:
    disk: dict[str, object] = {"kind": "disk", "path": str(tmp_path), "capacity": "1MiB"}
    capped = {**disk, "quotas": {"team-a": "25%"}}
    tier = SecondaryTierSettings.from_config({"tier": capped, "tenant": "team-a"}).tier
    assert tier.quotas == {"team-a": "25%"}
    with pytest.raises(ValueError, match=r"tier\.quotas: 'team-a' is not a known tenant"):
        SecondaryTierSettings.from_config({"tier": capped, "tenant": "team-b"})
    with pytest.raises(ValueError, match=r"tiers\[0\]\.quotas: 'team-a' is not a known tenant"):
        sglang(capped)
    with pytest.raises(ValueError, match=r"a share must be above 0%"):
        sglang({**disk, "quotas": {"x": "0%"}})
