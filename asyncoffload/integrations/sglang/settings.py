"""Settings of :class:`~asyncoffload.integrations.sglang.AsyncOffloadStorage`, read from
SGLang's ``--hicache-storage-backend-extra-config`` and validated once, when SGLang
builds the backend.

This module does not import SGLang. Every key SGLang itself reads from that mapping is
accepted too; any other key is an error naming it, so a misspelt setting never passes
silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from asyncoffload.manager.quotas import check_quota_table
from asyncoffload.tiers.specs import TIER_KINDS, TierSpec, lent_tier_specs
from asyncoffload.validators import not_bool

__all__ = ["SETTING", "SglangStorageSettings"]

#: How errors name the setting (SGLang's command-line flag).
SETTING = "--hicache-storage-backend-extra-config"


class SglangStorageSettings(BaseModel):
    """What ``--hicache-storage-backend-extra-config`` may set for asyncoffload inside
    SGLang. Build it with :meth:`from_extra_config`, which names the offending key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # SGLang's own keys for a dynamically loaded backend.
    backend_name: str
    module_path: str
    class_name: str
    interface_v1: Literal[1] = Field(
        description="1: SGLang calls batch_get_v1 / batch_set_v1 with host pool indices "
        "(zero copy); the only interface this backend serves."
    )
    allocator: Literal["default", "shm"] = Field(
        "default",
        description="SGLang's host pool allocator; 'shm' puts the pool in a memfd, which a "
        "Mooncake tier then maps (zero copy) instead of staging the pages.",
    )
    file_storage_path: str | None = Field(
        None, description="SGLang adds it from --hicache-file-storage-path; not used here."
    )
    # Ours.
    tiers: list[TierSpec] = Field(
        min_length=1,
        description="The tiers, highest first, as the vLLM integration's `tiers`: "
        '[{"kind": "disk", "path": ..., "capacity": "64GiB", "mode": "files", ...}, '
        '{"kind": "remote", "url": "redis://host:6379/0", ...}, {"kind": "mooncake", '
        '"master": "host:50051", ...}].',
    )
    tenant: str = Field("", description="This deployment's tenant, part of every page's identity.")
    staging_pages: int = Field(
        32,
        gt=0,
        description="Pages of the staging area (a memfd) that the layer_first layout, and "
        "a Mooncake tier over a pool not in shared memory, copy pages through.",
    )

    @field_validator("staging_pages", "interface_v1", mode="before")
    @classmethod
    def _no_bool_counts(cls, value: object) -> object:
        return not_bool(value, "a number")  # JSON's true is not a count

    @field_validator("tiers", mode="before")
    @classmethod
    def _tiers_list(cls, value: object) -> object:
        return lent_tier_specs(value)

    @model_validator(mode="after")
    def _quota_tables(self) -> SglangStorageSettings:
        # The deployment stores for its one tenant: a quota caps what it writes to a tier.
        known = [self.tenant] if self.tenant else []
        for i, tier in enumerate(self.tiers):
            check_quota_table(tier.quotas, known, f"tiers[{i}].quotas")
        return self

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any] | None) -> SglangStorageSettings:
        """Validate SGLang's extra config; ``ValueError`` naming each bad key."""
        if extra_config is None:
            raise ValueError(f"{SETTING} is not set: it must name the tiers (see docs/sglang.md)")
        if not isinstance(extra_config, Mapping):
            raise ValueError(
                f"{SETTING}: expected a JSON object, got {type(extra_config).__name__}"
            )
        try:
            return cls.model_validate(dict(extra_config))
        except ValidationError as exc:
            problems: list[str] = []
            for error in exc.errors():
                loc = list(error["loc"])
                if loc[:1] == ["tiers"] and len(loc) > 2 and loc[2] in TIER_KINDS:
                    del loc[2]  # the kind pydantic picked the model by: the user wrote none
                key = "".join(f"[{part!r}]" for part in loc) or "[?]"
                msg = str(error["msg"]).removeprefix("Value error, ")
                if error["type"] == "extra_forbidden":
                    msg = "unknown key (a typo?)"
                elif error["type"] == "missing":
                    msg = "missing"
                elif error["type"] == "union_tag_invalid":
                    tag = error.get("ctx", {}).get("tag")
                    msg = f"unknown tier kind {tag!r}; known: {', '.join(TIER_KINDS)}"
                problems.append(f"{SETTING}{key}: {msg}")
            raise ValueError("; ".join(problems)) from None
