"""A list of tiers below the CPU tier, as settings take it: ``EngineConfig.tiers`` and
vLLM's ``kv_connector_extra_config["tiers"]``.

A setting is ``list[TierSpec]``, validated after :func:`tier_specs` has read it: a JSON
string (from the environment, or a command line) becomes a list, and a tier given as a
mapping without its ``kind`` gets one (a disk tier has a path, a remote one a url, a
Mooncake one a master).
"""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import Field

from asyncoffload.tiers.disk import DiskTier
from asyncoffload.tiers.mooncake import MooncakeTier
from asyncoffload.tiers.remote import RemoteTier

__all__ = ["TIER_KINDS", "TierSpec", "lent_tier_specs", "tier_specs"]

#: The ``kind`` of each tier a list takes.
TIER_KINDS = ("disk", "remote", "mooncake")

#: One tier of a list: its settings model, picked by ``kind``.
TierSpec = Annotated[DiskTier | RemoteTier | MooncakeTier, Field(discriminator="kind")]


def _kind_of(tier: dict[object, object]) -> str:
    """The kind of a tier given without one: a url is a remote tier's, a master a
    Mooncake tier's, anything else a disk tier's."""
    return "remote" if "url" in tier else "mooncake" if "master" in tier else "disk"


def tier_specs(value: object, where: str = "") -> object:
    """``value`` (a tiers setting, before validation) with a JSON string read into a list
    and a kind given to each mapping without one; anything else is left to validation.
    ``ValueError`` (prefixed with ``where``) for a string that is not JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{where}expected a JSON list of tiers: {exc}") from None
        except RecursionError:  # json.loads recurses once per level: "[" * 100_000
            raise ValueError(
                f"{where}expected a JSON list of tiers: nested too deeply to read"
            ) from None
    if isinstance(value, list):
        value = [
            dict(t, kind=_kind_of(t)) if isinstance(t, dict) and "kind" not in t else t
            for t in value
        ]
    return value


def lent_tier_specs(value: object, where: str = "") -> object:
    """As :func:`tier_specs`, for tiers under a framework's own cache (vLLM 0.34's
    secondary tiers, SGLang's HiCache storage): a tier given without ``admission`` gets
    none. The framework above already decided what to store and offers each block once,
    so the disk tier's default (``frequency``: written from the second offer) would
    write almost nothing."""
    value = tier_specs(value, where)
    if isinstance(value, list):
        value = [
            dict(t, admission=None) if isinstance(t, dict) and "admission" not in t else t
            for t in value
        ]
    return value
