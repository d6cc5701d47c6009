"""Settings of :class:`~asyncoffload.integrations.vllm.AsyncOffloadSpec`, read from vLLM's
``kv_connector_extra_config`` and validated once, when the spec is built.

This module does not import vLLM: the settings can be checked (and documented) anywhere.
Every key vLLM itself reads from that mapping is accepted too; any other key is an
error naming it, so a misspelt setting never passes silently.
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

from asyncoffload.config import LOAD_DEADLINE_FACTOR, LOAD_DEADLINE_FLOOR_S, LOAD_PROBE_EVERY_S
from asyncoffload.manager.quotas import check_quota_table
from asyncoffload.manager.retention import check_pin_budget
from asyncoffload.tiers.settings import known_admission, known_policy
from asyncoffload.tiers.specs import TIER_KINDS, TierSpec, tier_specs
from asyncoffload.validators import not_bool

__all__ = ["VLLM_KEYS", "VllmOffloadSettings"]

#: Keys of ``kv_connector_extra_config`` that vLLM reads itself (the spec factory, the
#: offloading config and the spec base class), accepted and passed through.
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "offload_prompt_only",
        "self_describing_kv_events",
        "canonical_layout",
        "sync_load_budget_bytes",
    }
)


class VllmOffloadSettings(BaseModel):
    """What ``kv_connector_extra_config`` may set for asyncoffload inside vLLM.

    Build it with :meth:`from_extra_config`, which names the offending key in its
    errors.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_bytes_to_use: int = Field(
        gt=0,
        description="Host memory for offloaded KV across all workers of this engine, as "
        "vLLM's CPU spec: each worker holds num_chunks slots of its share of a chunk.",
    )
    policy: str = Field("lru", description="Cache policy: lru, arc, kv, s3fifo or sieve.")
    eviction_policy: str | None = Field(
        None, description="vLLM's CPU spec name for `policy`; accepted when they agree."
    )
    admission: str | None = Field(
        None, description="Admission filter ('ghost', 'adaptive') or None."
    )
    store_threshold: int = Field(
        0, ge=0, description="Store a chunk only from its n-th offer (0 or 1: always)."
    )
    max_tracker_size: int = Field(
        64_000, gt=0, description="Chunks whose offers store_threshold remembers."
    )
    copy_engine: Literal["auto", "native", "threads"] = Field(
        "auto",
        description="CPU platform: 'native' copy lanes (compiled on first use, never take "
        "the GIL), 'threads' (torch copies), 'auto' (native where it builds).",
    )
    pin_memory: bool = Field(True, description="CUDA: pin the host pool.")
    host_chunk_bytes: int = Field(
        1 << 30, gt=0, description="CUDA: the host pool is pinned in chunks of this."
    )
    staging_bytes: int = Field(
        256 << 20,
        gt=0,
        description="CUDA: device memory per direction for staged copies (a Triton gather "
        "into rows laid out like host slots, then one DMA per run), allocated on first use.",
    )
    tiers: list[TierSpec] = Field(
        default_factory=list,
        description="Tiers below the CPU tier, highest first, as EngineConfig.tiers: "
        '[{"kind": "disk", "path": ..., "capacity": "64GiB", "mode": "slab", ...}, '
        '{"kind": "remote", "url": "redis://host:6379/0", ...}, {"kind": "mooncake", '
        '"master": "host:50051", ...}] (a tier without its kind: remote if it has a url, '
        "mooncake if it has a master, else disk). The worker's host pool then lives in a "
        "shared-memory file that the scheduler maps (see docs/vllm.md, Tiers under "
        "vLLM). With tensor parallelism, a block there holds every rank's slice.",
    )
    host_pool_dir: str = Field(
        "/dev/shm",
        description="With tiers: the directory of the shared host pool files (a tmpfs).",
    )
    tenant: str = Field(
        "", description="With tiers: this engine's tenant, part of the blocks' identity."
    )
    pin_budget: float | None = Field(
        None,
        description="Retention on: the largest share of the CPU tier, in (0, 1], that "
        "requests' retention pins (kv_transfer_params' asyncoffload_retention) may hold "
        "(each lower tier has its own, in its spec). Runs the Python manager. None: "
        "retention off, hints refused and counted.",
    )
    tenants: list[str] = Field(
        default_factory=list,
        description="The tenants that quota tables may name: requests' cache_salt values "
        "(AsyncOffloadConnector gives the manager each request's salt).",
    )
    quotas: dict[str, int | str] = Field(
        default_factory=dict,
        description="Tenant quotas of the CPU tier, {cache_salt: quota}: chunks (an int), "
        "a share ('25%') or bytes ('512MiB'); each tier of tiers takes its own.",
    )
    # vLLM's own keys, accepted so that strictness stays useful.
    spec_name: str | None = None
    spec_module_path: str | None = None
    block_size: int | None = None
    blocks_per_chunk: int | None = None
    offload_prompt_only: bool = True
    self_describing_kv_events: bool = False
    load_or_recompute: bool = Field(
        True,
        description="With tiers: promote blocks from a lower tier only when reading them "
        "is expected to beat recomputing them, and recompute those whose read overruns "
        "a deadline derived from the recompute time (docs/vllm.md, Load or recompute).",
    )
    recompute_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="vLLM's prefill throughput (tokens per second) for load_or_recompute; "
        "None: measured from the scheduler's own steps.",
    )
    load_deadline_factor: float = LOAD_DEADLINE_FACTOR
    load_deadline_floor_s: float = LOAD_DEADLINE_FLOOR_S
    load_probe_every_s: float = LOAD_PROBE_EVERY_S
    sync_load_budget_bytes: int = Field(
        0,
        ge=0,
        description="vLLM 0.33+'s: KV bytes per step (per worker) that may be loaded "
        "synchronously, within the step that computes the request (expedited loads); "
        "0: every load is asynchronous.",
    )
    canonical_layout: bool = Field(
        False,
        description="vLLM's parallelism-free host layout; asyncoffload keeps a per-worker "
        "layout, so True is refused.",
    )

    @field_validator("pin_budget", mode="before")
    @classmethod
    def _pin_budget(cls, value: object) -> float | None:
        return None if value is None else check_pin_budget(value, "pin_budget")

    @field_validator(
        "cpu_bytes_to_use",
        "store_threshold",
        "max_tracker_size",
        "host_chunk_bytes",
        "staging_bytes",
        "block_size",
        "blocks_per_chunk",
        "sync_load_budget_bytes",
        mode="before",
    )
    @classmethod
    def _no_bool_counts(cls, value: object) -> object:
        return not_bool(value, "a number")  # JSON's true is not a count

    @field_validator("policy", "eviction_policy")
    @classmethod
    def _known_policy(cls, value: str | None) -> str | None:
        return None if value is None else known_policy(value)

    @field_validator("admission", mode="before")
    @classmethod
    def _known_admission(cls, value: object) -> object:
        return known_admission(value)

    @field_validator("tiers", mode="before")
    @classmethod
    def _tiers_list(cls, value: object) -> object:
        return tier_specs(value)  # a JSON list, as EngineConfig takes from the environment

    @model_validator(mode="after")
    def _quota_tables(self) -> VllmOffloadSettings:
        check_quota_table(self.quotas, self.tenants, "quotas")
        for i, tier in enumerate(self.tiers):
            check_quota_table(tier.quotas, self.tenants, f"tiers[{i}].quotas")
        return self

    @field_validator("canonical_layout")
    @classmethod
    def _no_canonical(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "asyncoffload keeps each worker's own page layout; canonical_layout=True "
                "is not supported"
            )
        return value

    @property
    def cache_policy(self) -> str:
        """The policy in effect (``policy``, or ``eviction_policy`` when only it is set)."""
        return self.eviction_policy or self.policy

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any]) -> VllmOffloadSettings:
        """Validate ``kv_connector_extra_config``; ``ValueError`` naming each bad key."""
        values = dict(extra_config)
        problems: list[str] = []
        try:
            settings = cls.model_validate(values)
        except ValidationError as exc:
            for error in exc.errors():
                loc = list(error["loc"])
                if loc[:1] == ["tiers"] and len(loc) > 2 and loc[2] in TIER_KINDS:
                    del loc[2]  # the kind pydantic picked the model by: the user wrote none
                key = ".".join(str(part) for part in loc) or "?"
                msg = str(error["msg"]).removeprefix("Value error, ")
                if error["type"] == "extra_forbidden":
                    msg = "unknown key (a typo?)"
                elif error["type"] == "union_tag_invalid":
                    tag = error.get("ctx", {}).get("tag")
                    msg = f"unknown tier kind {tag!r}; known: {', '.join(TIER_KINDS)}"
                problems.append(f"kv_connector_extra_config[{key!r}]: {msg}")
            raise ValueError("; ".join(problems)) from None
        if (
            settings.eviction_policy is not None
            and "policy" in values
            and settings.eviction_policy != settings.policy
        ):
            raise ValueError(
                "kv_connector_extra_config['eviction_policy'] "
                f"({settings.eviction_policy!r}) contradicts ['policy'] ({settings.policy!r})"
            )
        if settings.admission is not None and settings.store_threshold >= 2:
            raise ValueError(
                "kv_connector_extra_config: set either 'store_threshold' or 'admission', not both"
            )
        return settings
