"""Settings of :class:`~asyncoffload.integrations.vllm.secondary.AsyncOffloadTier`, one
entry of vLLM 0.34's ``secondary_tiers``, validated once, when vLLM builds the tier.

vLLM's ``SecondaryTierFactory`` pops ``type``, ``module_path`` and ``backpressure`` from
the entry and passes every other key to the tier's constructor; these are those keys.
``tier`` is one tier in the shape of the ``tiers`` setting of
:class:`~asyncoffload.integrations.vllm.AsyncOffloadSpec` (and ``EngineConfig.tiers``):
a disk, remote (Redis / Valkey) or Mooncake tier's settings, its ``kind`` inferred when
absent. An error names the key, as ``secondary_tiers[AsyncOffloadTier]['tier.capacity']``.

This module does not import vLLM: the settings can be checked (and documented) anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from asyncoffload.config import LOAD_DEADLINE_FACTOR, LOAD_DEADLINE_FLOOR_S, LOAD_PROBE_EVERY_S
from asyncoffload.manager.quotas import check_quota_table
from asyncoffload.tiers.specs import TIER_KINDS, TierSpec, lent_tier_specs

__all__ = ["SecondaryTierSettings"]


class SecondaryTierSettings(BaseModel):
    """What one ``secondary_tiers`` entry of type ``AsyncOffloadTier`` may set.

    Build it with :meth:`from_config`, which names the offending key in its errors.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tier: TierSpec = Field(
        description='One of our tiers: {"kind": "disk", "path": ..., "capacity": "64GiB", '
        '"mode": "slab" | "files", ...}, {"kind": "remote", "url": "redis://host:6379/0", '
        '...} or {"kind": "mooncake", "master": "host:50051", ...}, as one entry of '
        "AsyncOffloadSpec's `tiers` (docs/tiers.md). One vLLM secondary tier each: list "
        "several entries for several tiers (vLLM's manager writes every one and loads "
        "from the first that holds a chunk)."
    )
    tenant: str = Field("", description="This engine's tenant, part of the blocks' identity.")
    name: str | None = Field(
        None,
        min_length=1,
        description="What the tier's KV events (their `ownership`) and metrics (their "
        "`tier` label) call it; by default its kind and where it is: 'disk:/nvme/kv', "
        "'remote:host:6379/0', 'mooncake:host:50051'.",
    )
    locality: Literal["LOCAL", "REMOTE"] | None = Field(
        None,
        description="vLLM's locality of the tier's storage, for its per-request tier "
        "filter (`kv_load_tiers`), its KV events and its backpressure defaults (read by "
        "vLLM from this key: set 'REMOTE' for network water marks); by default LOCAL for "
        "a disk tier, REMOTE for a remote or Mooncake one.",
    )

    load_or_recompute: bool = Field(
        True,
        description="With recompute_tokens_per_s: answer a chunk the tier holds as a miss "
        "when reading the request's run of chunks from the tier is expected to take longer "
        "than recomputing them, and fail a load (its chunks recomputed) that overruns a "
        "deadline derived from the recompute time (docs/vllm.md, Load or recompute).",
    )
    recompute_tokens_per_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="vLLM's prefill throughput (tokens per second), the recompute side of "
        "load_or_recompute. None: unknown, every chunk the tier holds is loaded, under the "
        "tier's own deadline (vLLM's tiering tells a secondary tier nothing of its steps).",
    )
    load_deadline_factor: float = LOAD_DEADLINE_FACTOR
    load_deadline_floor_s: float = LOAD_DEADLINE_FLOOR_S
    load_probe_every_s: float = LOAD_PROBE_EVERY_S

    @field_validator("tier", mode="before")
    @classmethod
    def _kind(cls, value: object) -> object:
        if isinstance(value, dict):
            (value,) = lent_tier_specs([value])  # type: ignore[misc]  # a list in, a list out
        return value

    @model_validator(mode="after")
    def _quota_table(self) -> SecondaryTierSettings:
        # This engine stores for its one tenant: a quota caps what it writes to the tier.
        check_quota_table(self.tier.quotas, [self.tenant] if self.tenant else [], "tier.quotas")
        return self

    @field_validator("locality", mode="before")
    @classmethod
    def _locality(cls, value: object) -> object:
        if value is not None and value not in ("LOCAL", "REMOTE"):
            raise ValueError(f"{value!r} is not a vLLM Locality: 'LOCAL' or 'REMOTE'")
        return value

    @property
    def kind(self) -> str:
        return self.tier.kind

    @property
    def tier_locality(self) -> Literal["LOCAL", "REMOTE"]:
        """``locality``, or the default of the tier's kind."""
        if self.locality is not None:
            return self.locality
        return "LOCAL" if self.tier.kind == "disk" else "REMOTE"

    @property
    def tier_name(self) -> str:
        """``name``, or the tier's kind and where it is (never a password)."""
        if self.name is not None:
            return self.name
        tier = self.tier
        if tier.kind == "disk":
            return f"disk:{tier.path}"
        if tier.kind == "remote":
            url = urlsplit(str(tier.url))
            host = url.hostname or ""
            port = f":{url.port}" if url.port else ""
            return f"remote:{host}{port}{url.path}"
        return f"mooncake:{tier.master}"

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], where: str = "AsyncOffloadTier"
    ) -> SecondaryTierSettings:
        """Validate the keys vLLM passed; one ``ValueError`` naming each bad key, as
        ``secondary_tiers[<where>]['<key>']: <why>``."""
        try:
            return cls.model_validate(dict(config))
        except ValidationError as exc:
            problems: list[str] = []
            for error in exc.errors():
                loc = list(error["loc"])
                if loc[:1] == ["tier"] and len(loc) > 1 and loc[1] in TIER_KINDS:
                    del loc[1]  # the kind pydantic picked the model by
                key = ".".join(str(part) for part in loc) or "?"
                msg = str(error["msg"]).removeprefix("Value error, ")
                if error["type"] == "extra_forbidden":
                    msg = "unknown key (a typo?)"
                elif error["type"] == "union_tag_invalid":
                    tag = error.get("ctx", {}).get("tag")
                    msg = f"unknown tier kind {tag!r}; known: {', '.join(TIER_KINDS)}"
                elif error["type"] == "missing":
                    msg = "missing"
                problems.append(f"secondary_tiers[{where}][{key!r}]: {msg}")
            raise ValueError("; ".join(problems)) from None
