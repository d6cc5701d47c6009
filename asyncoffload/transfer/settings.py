"""The copy paths' settings from the environment: one validated model, read by the CUDA
copy stack (:mod:`asyncoffload.transfer.cuda`) and the Triton kernels.

=================================== ========= ===============================================
variable                            default   meaning
=================================== ========= ===============================================
``ASYNCOFFLOAD_NATIVE_COPY``        ``1``     ``0``: the native copy path is off (the Python
                                              and Triton paths run)
``ASYNCOFFLOAD_NATIVE_PROGRAMS``    ``4``     thread blocks per multiprocessor of a native
                                              copy launch (1-64)
``ASYNCOFFLOAD_NATIVE_SMALL``       ``kernel`` how the engine's small native jobs copy:
                                              ``kernel`` (through UVA) or ``staged`` (a
                                              gather into device staging, one DMA a block)
``ASYNCOFFLOAD_NATIVE_KERNEL``      ``plain`` the native kernel's variant: ``plain`` or
                                              ``l2`` (an L2 prefetch hint)
``ASYNCOFFLOAD_KERNEL_TILE_WORDS``  ``4096``  the engine's Triton kernel: words a program
                                              moves per step (a power of two)
``ASYNCOFFLOAD_KERNEL_WARPS``       ``8``     ... and its warps per program
``ASYNCOFFLOAD_PAGED_TILE``         ``4096``  the paged Triton kernel's tile (a power of two)
``ASYNCOFFLOAD_PAGED_WARPS``        ``8``     ... and its warps per program
=================================== ========= ===============================================

A bad value raises ``ValueError`` naming the variable and the value; so does
:meth:`~asyncoffload.EngineConfig.from_env`, which checks them with its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["ENV_PREFIX", "TransferSettings"]

ENV_PREFIX = "ASYNCOFFLOAD_"

Warps = Literal[1, 2, 4, 8, 16, 32]


def _power_of_two(value: int) -> int:
    if value & (value - 1):
        raise ValueError(f"must be a power of two, got {value}")
    return value


class TransferSettings(BaseModel):
    """The copy paths' knobs (see the module's table); ``from_env`` reads them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    native_copy: bool = True
    native_programs: int = Field(4, ge=1, le=64)
    native_small: Literal["kernel", "staged"] = "kernel"
    native_kernel: Literal["plain", "l2"] = "plain"
    kernel_tile_words: int = Field(4096, ge=256, le=1 << 16)
    kernel_warps: Warps = 8
    paged_tile: int = Field(4096, ge=256, le=1 << 16)
    paged_warps: Warps = 8

    @field_validator("kernel_tile_words", "paged_tile")
    @classmethod
    def _tiles(cls, value: int) -> int:
        return _power_of_two(value)

    @field_validator("kernel_warps", "paged_warps", mode="before")
    @classmethod
    def _warps_from_text(cls, value: object) -> object:
        # The environment gives text; the Literal wants the int.
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        return value

    @classmethod
    def env_names(cls) -> tuple[str, ...]:
        """The variables read, with the prefix."""
        return tuple(ENV_PREFIX + name.upper() for name in cls.model_fields)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TransferSettings:
        """The settings the environment (``environ``, else ``os.environ``) gives; an unset
        or empty variable keeps its default. ``ValueError`` names each bad variable and
        its value."""
        env = os.environ if environ is None else environ
        values: dict[str, str] = {}
        origin: dict[str, str] = {}
        for name in cls.model_fields:
            var = ENV_PREFIX + name.upper()
            raw = env.get(var, "").strip()
            if raw:
                values[name] = raw
                origin[name] = f"{var}={raw!r}"
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            lines = [
                f"{origin.get(str(err['loc'][0]), str(err['loc'][0]))}: {err['msg']}"
                for err in exc.errors()
            ]
            raise ValueError("invalid copy setting: " + "; ".join(lines)) from None
