"""What the settings of the tiers below the CPU tier share, and the checks of the
registered policy and admission names that every settings model uses.

:class:`TierSettings` is the base of :class:`~asyncoffload.tiers.disk.DiskTier` and
:class:`~asyncoffload.tiers.remote.RemoteTier`: their model config (frozen, strict,
errors that never show their input), positional arguments, and the checks of the fields
both have (``mac_key``, ``policy``, ``admission``). Each declares its own fields, in its
own order and with its own defaults.

:func:`known_policy` and :func:`known_admission` live here, the lowest place that may
see the manager's registries (:mod:`asyncoffload.validators`, below, may not); the
engine's and vLLM's settings use them too (``asyncoffload.config`` re-exports them).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, SecretBytes, field_validator

from asyncoffload.manager.admission import available_admissions
from asyncoffload.manager.policies import available_policies
from asyncoffload.manager.quotas import parse_quota
from asyncoffload.manager.retention import DEFAULT_PIN_BUDGET, check_pin_budget
from asyncoffload.tiers.format import check_mac_key
from asyncoffload.validators import known_name, optional_name

__all__ = [
    "READ_GUARD_HELP",
    "SHARED_READ_GUARD",
    "WRITE_PRIORITY_HELP",
    "TierSettings",
    "known_admission",
    "known_policy",
]

#: Every tier's ``read_guard`` setting, described (each tier adds its default's reason).
READ_GUARD_HELP = (
    "While loads from the tier come, bound the blocks its writes have in flight by how "
    "fast its loads stay: a load slower than 1.25 times the tier's idle loads (or than "
    "their own spread) halves the bound, each load within it adds a block, while the "
    "tier's writes lag 1/200 of write_lag_s. It costs write rate while it acts, and hit "
    "rate where the tier would have absorbed the writes (docs/tiers.md); "
    "backpressure=False turns it off too."
)
#: The shared tiers' (Redis / Valkey, Mooncake) ``read_guard`` reason for being on.
SHARED_READ_GUARD = (
    " On by default for a shared tier: while write-through saturated it, its loads' p99 "
    "stayed within 2x of idle in 22 of 30 runs with it and 5 of 30 without, on two "
    "machines; a disk's did in 5 of 5 without it on a 16-core host (docs/benchmarks.md)."
)


def known_policy(value: str) -> str:
    """``value`` if it names a registered cache policy, else ``ValueError`` listing them
    (a pydantic field validator for every settings model with a policy)."""
    return known_name(value, available_policies(), "cache policy")


def known_admission(value: object) -> object:
    """``None`` for no filter (``None``, ``""``, ``"none"``), ``value`` if it names a
    registered admission filter, else ``ValueError`` listing them; a value that is not a
    string is left to the field's type check."""
    return optional_name(value, available_admissions, "admission filter")


class TierSettings(BaseModel):
    """Base of a lower tier's settings. A subclass declares the fields (``policy``,
    ``admission`` and ``mac_key`` among them), names those it takes positionally in
    ``_positional`` (worded for errors in ``_positional_words``), and defines an
    ``__init__`` that calls this one: mypy's pydantic plugin gives a model without its
    own ``__init__`` one that takes keywords only."""

    # Validation errors never show their input: it may be a password or the MAC key.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    #: Every tier's: the most of it that retention pins may hold (docs/policies.md).
    pin_budget: float = Field(
        DEFAULT_PIN_BUDGET,
        description="The largest share of the tier, in (0, 1], that retention pins may "
        "hold at once; a pin past it is refused and counted.",
    )

    #: Every tier's: backpressure on its write-through (docs/tiers.md, "Backpressure").
    write_lag_s: float = Field(
        1.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="A tier whose writes take longer than this (an EMA of a write's time "
        "in flight) lags: its write-through sheds first offers until the EMA falls below "
        "half of it.",
    )
    write_pin_share: float = Field(
        0.1,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="The share of the CPU tier's slots, in (0, 1], that the tier's writes "
        "may pin in flight once they lag 1/200 of write_lag_s (the rest waits, unpinned), "
        "and that its queued writes may reach while the CPU tier misses slots before "
        "first offers are shed; at twice it, every new block is shed.",
    )
    backpressure: bool = Field(
        True,
        description="Shed, and hold back, write-through while the tier's writes lag "
        "(False: never).",
    )
    read_guard: bool = Field(False, description=READ_GUARD_HELP + " Off by default for a disk.")

    #: Fields the constructor takes positionally, in order.
    _positional: ClassVar[tuple[str, ...]] = ()
    #: How a TypeError words them: ``"{cls} takes {words} positionally"``.
    _positional_words: ClassVar[str] = "no value"

    def __init__(self, *args: Any, **data: Any) -> None:
        """The fields of ``_positional`` by position or by name, the others by name. An
        explicit ``None`` for any of them is an error, not its default."""
        cls = type(self).__name__
        if len(args) > len(self._positional):
            raise TypeError(
                f"{cls} takes {self._positional_words} positionally, got {len(args)} values"
            )
        for name, value in zip(self._positional, args):
            if name in data:
                raise TypeError(f"{cls} got {name} twice")
            data[name] = value
        super().__init__(**data)

    # check_fields=False: the fields are the subclasses'.
    @field_validator("mac_key", check_fields=False)
    @classmethod
    def _mac_key(cls, value: SecretBytes | None) -> SecretBytes | None:
        if value is not None:
            check_mac_key(value.get_secret_value())
        return value

    @field_validator("pin_budget", mode="before")
    @classmethod
    def _pin_budget(cls, value: object) -> float:
        return check_pin_budget(value, f"{cls.__name__}.pin_budget")

    @field_validator("quotas", check_fields=False)
    @classmethod
    def _quotas(cls, value: dict[str, int | str]) -> dict[str, int | str]:
        for tenant, quota in value.items():
            parse_quota(quota, f"quotas[{tenant!r}]")
        return value

    @field_validator("policy", check_fields=False)
    @classmethod
    def _policy(cls, value: str) -> str:
        return known_policy(value)

    @field_validator("admission", mode="before", check_fields=False)
    @classmethod
    def _admission(cls, value: object) -> object:
        if isinstance(value, str) and value == "frequency":
            return value
        return known_admission(value)


#: The disk and remote tiers' ``write_priority`` setting, described.
WRITE_PRIORITY_HELP = (
    '"idle": write lanes of their own at SCHED_IDLE (Linux), on the CPU time the rest of '
    "the machine leaves; while they starve for CPU, a write that waited 20 ms is taken by "
    'a free read lane (docs/tiers.md). "normal": lanes that take reads first, then writes.'
)
