"""A request's retention hint: keep its blocks for a while, and how much they are worth.

A :class:`Retention` rides on :class:`~asyncoffload.manager.ReqContext` (``retention``)
or, under vLLM, in the request's ``kv_transfer_params`` (docs/vllm.md). Its ``ttl_s``
pins the blocks the request stores or hits, in every tier, for that many seconds from
the last hit (see :mod:`asyncoffload.manager.pins`); its ``retention_class`` ranks the
blocks no pin holds: among idle blocks, a lower class is evicted first.

A foundation of the manager: it imports nothing of the package, so that
the manager's records, the settings models and the adapters can all use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_PIN_BUDGET",
    "MAX_TTL_S",
    "RETENTION_CLASSES",
    "RETENTION_PARAM",
    "Retention",
    "check_pin_budget",
    "check_ttl",
    "class_rank",
    "retention_from_params",
]

#: The longest pin a hint may ask for: a day. A longer one is a mistake (milliseconds
#: given as seconds, say), and a block pinned that long is no longer a cache's.
MAX_TTL_S = 86_400.0
#: The classes of blocks, lowest first; blocks of no hinted request are ``"normal"``.
RETENTION_CLASSES = ("low", "normal", "high")
#: The share of a tier that pins may hold, unless configured.
DEFAULT_PIN_BUDGET = 0.5
_RANKS = {name: rank for rank, name in enumerate(RETENTION_CLASSES)}
#: The rank of ``"normal"``.
NORMAL = _RANKS["normal"]


def class_rank(name: object, what: str = "retention_class") -> int:
    """The rank of a retention class (0 lowest); ``ValueError`` naming ``what`` and the
    known classes for anything else."""
    rank = _RANKS.get(name) if isinstance(name, str) else None
    if rank is None:
        known = ", ".join(RETENTION_CLASSES)
        raise ValueError(f"{what} must be one of {known}, got {name!r}")
    return rank


def check_ttl(value: object, what: str = "ttl_s") -> float:
    """``value`` as seconds if it is a number in (0, :data:`MAX_TTL_S`], else
    ``ValueError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}")
    ttl = float(value)
    if not math.isfinite(ttl) or ttl <= 0:
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {value!r}")
    if ttl > MAX_TTL_S:
        raise ValueError(
            f"{what} must be at most {MAX_TTL_S:g} s (a day), got {value!r}: a longer pin is "
            "no cache's (milliseconds given as seconds?)"
        )
    return ttl


def check_pin_budget(value: object, what: str = "pin_budget") -> float:
    """``value`` if it is a share in (0, 1], else ``ValueError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a share of the tier in (0, 1], got {value!r}")
    share = float(value)
    if not (0.0 < share <= 1.0):  # NaN fails too
        raise ValueError(f"{what} must be a share of the tier in (0, 1], got {value!r}")
    return share


@dataclass(frozen=True, slots=True)
class Retention:
    """Keep a request's blocks: ``ttl_s`` seconds from their store or last hit (``None``:
    no pin, the class alone), ranked ``retention_class`` among unpinned blocks.

    ``ttl_s`` must be in (0, :data:`MAX_TTL_S`] (a day) and ``retention_class`` one of
    :data:`RETENTION_CLASSES`; anything else is a ``ValueError`` naming it."""

    ttl_s: float | None = None
    retention_class: str = "normal"

    def __post_init__(self) -> None:
        if self.ttl_s is not None:
            object.__setattr__(self, "ttl_s", check_ttl(self.ttl_s, "Retention.ttl_s"))
        class_rank(self.retention_class, "Retention.retention_class")

    @property
    def rank(self) -> int:
        return _RANKS[self.retention_class]

    @classmethod
    def parse(cls, value: object, what: str) -> Retention:
        """A hint from its JSON form (``{"ttl_s": 30, "retention_class": "high"}``; both
        optional, nothing else allowed), or ``ValueError`` naming ``what``."""
        if isinstance(value, Retention):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"{what} must be an object with ttl_s and/or retention_class, got {value!r}"
            )
        data: dict[str, Any] = value
        unknown = sorted(set(map(str, data)) - {"ttl_s", "retention_class"})
        if unknown:
            raise ValueError(f"{what}: unknown field(s) {', '.join(unknown)}")
        if not data:
            raise ValueError(f"{what} names neither ttl_s nor retention_class")
        ttl = data.get("ttl_s")
        klass = data.get("retention_class", "normal")
        return cls(
            None if ttl is None else check_ttl(ttl, f"{what}.ttl_s"),
            RETENTION_CLASSES[class_rank(klass, f"{what}.retention_class")],
        )


#: The key of a request's ``kv_transfer_params`` (vLLM) that carries its hint, as
#: :meth:`Retention.parse` reads it: ``{"asyncoffload_retention": {"ttl_s": 30}}``.
RETENTION_PARAM = "asyncoffload_retention"


def retention_from_params(params: object) -> Retention | None:
    """The hint in a request's ``kv_transfer_params`` (:data:`RETENTION_PARAM`), or
    ``None`` if it has none; ``ValueError`` naming the key for a malformed one."""
    if not isinstance(params, dict) or params.get(RETENTION_PARAM) is None:
        return None
    return Retention.parse(params[RETENTION_PARAM], f"kv_transfer_params[{RETENTION_PARAM!r}]")
