"""Engine configuration: validated once, at the boundary, never per call."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncoffload.manager.admission import available_admissions
from asyncoffload.manager.policies import available_policies

__all__ = ["EngineConfig", "known_admission", "known_policy"]

CompletionMode = Literal["auto", "eventfd", "poll"]


def known_policy(value: str) -> str:
    """``value`` if it names a registered cache policy, else ``ValueError`` listing them
    (a pydantic field validator for every settings model with a policy)."""
    known = available_policies()
    if value not in known:
        raise ValueError(f"unknown cache policy {value!r}; known: {', '.join(known)}")
    return value


def known_admission(value: object) -> object:
    """``None`` for no filter (``None``, ``""``, ``"none"``), ``value`` if it names a
    registered admission filter, else ``ValueError`` listing them; a value that is not a
    string is left to the field's type check."""
    if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
        return None
    if not isinstance(value, str):
        return value
    known = available_admissions()
    if value not in known:
        raise ValueError(f"unknown admission filter {value!r}; known: {', '.join(known)}")
    return value


class EngineConfig(BaseModel):
    """Settings of an :class:`~asyncoffload.AsyncOffloadEngine`.

    Every field can also come from the environment through :meth:`from_env`
    (``ASYNCOFFLOAD_CPU_BLOCKS=4096`` and so on).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_blocks: int = Field(1024, gt=0, description="Slots of the CPU tier, one KV block each.")
    policy: str = Field(
        "lru", description="Registered cache policy name: 'lru', 'arc', 'kv', 's3fifo', ..."
    )
    admission: str | None = Field(
        None,
        description="Registered admission filter ('ghost', 'adaptive') or None: store "
        "every offered block (store_threshold aside).",
    )
    store_threshold: int = Field(
        0, ge=0, description="Store a key only from its n-th offer (0 or 1: always store)."
    )
    event_buffer: int = Field(
        4096, gt=0, description="Default per-subscription event buffer (events, not keys)."
    )
    completion: CompletionMode = Field(
        "auto",
        description="How the loop learns of finished copies: 'eventfd' wake-ups (a pipe "
        "where eventfd is missing), 'poll' on a timer, or 'auto' (eventfd where the loop "
        "supports add_reader, else poll).",
    )
    poll_interval_s: float = Field(
        0.001, gt=0, le=1.0, description="Timer period of the 'poll' completion mode."
    )
    copy_engine: Literal["auto", "native", "threads"] = Field(
        "auto",
        description="CPU backend copy engine: 'native' lanes (compiled on first use, never "
        "take the GIL), 'threads' (Python threads), or 'auto' (native where it builds).",
    )
    copy_method: Literal["auto", "batch", "kernel", "staged", "gather"] = Field(
        "auto",
        description="CUDA backend copy method: 'kernel' (Triton SM copy through UVA), "
        "'batch' (cuMemcpyBatchAsync per fragment), 'staged' (kernel gather into device "
        "staging, then one DMA per block), 'gather' (torch gather + per-block copies), or "
        "'auto' (chosen per transfer by fragment size and count).",
    )
    pin_memory: bool = Field(True, description="Pin the CUDA backend's host pool.")
    staging_bytes: int = Field(
        192 << 20,
        gt=0,
        description="CUDA backend: device staging per buffer for the 'staged' and 'gather' "
        "methods, allocated on first use (staged: two buffers per direction, so 768 MiB "
        "of GPU memory at the default; 64 MiB buffers lost 6 points of two-direction "
        "bandwidth on an H100).",
    )
    host_chunk_bytes: int = Field(
        1 << 30, gt=0, description="The CUDA backend allocates its host pool in chunks of this."
    )
    touch_on_load: bool = Field(
        True, description="prepare_load marks the loaded keys recently used."
    )
    max_tracker_size: int = Field(
        64_000, gt=0, description="Keys whose offers store_threshold remembers."
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        return known_policy(value)

    @field_validator(
        "cpu_blocks",
        "store_threshold",
        "event_buffer",
        "staging_bytes",
        "host_chunk_bytes",
        "max_tracker_size",
        mode="before",
    )
    @classmethod
    def _not_a_bool(cls, value: object) -> object:
        # pydantic reads True as 1; a count given as a bool is a mistake, not a count.
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        return value

    @field_validator("admission", mode="before")
    @classmethod
    def _known_admission(cls, value: object) -> object:
        return known_admission(value)

    @model_validator(mode="after")
    def _one_admission_rule(self) -> EngineConfig:
        if self.admission is not None and self.store_threshold >= 2:
            raise ValueError("set either store_threshold or admission, not both")
        return self

    @classmethod
    def from_env(cls, prefix: str = "ASYNCOFFLOAD_", **overrides: Any) -> EngineConfig:
        """Fields from ``{prefix}{FIELD}`` environment variables, then ``overrides``."""
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = os.environ.get(prefix + name.upper())
            if raw is not None:
                values[name] = raw
        values.update(overrides)
        return cls.model_validate(values)
