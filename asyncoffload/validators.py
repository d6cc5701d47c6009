"""Validators that several settings models share: byte sizes and registered names.

A foundation module: it imports nothing of the package, so that every settings model
(:class:`~asyncoffload.EngineConfig`, the tiers' settings, vLLM's, the demo's) can use
it without an import circle. What a check needs from higher up (the registered policy
names, say) is passed in: :mod:`asyncoffload.tiers.settings` binds the policy and
admission registries to :func:`known_name` and :func:`optional_name`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import BeforeValidator, ValidationInfo

__all__ = ["ByteSize", "byte_setting", "known_name", "not_bool", "optional_name", "parse_bytes"]

#: Units of a byte size: decimal (powers of 1000) and binary (powers of 1024), spelled out.
_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_BYTE_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def not_bool(value: object, expected: str) -> object:
    """``value``, unless it is a bool: ``ValueError`` ``"expected {expected}, got True"``.
    pydantic reads ``True`` as 1; a count or a size given as a bool is a mistake (JSON's
    ``true``, say), never what a user meant."""
    if isinstance(value, bool):
        raise ValueError(f"expected {expected}, got {value!r}")
    return value


def byte_setting(value: object, what: str) -> int:
    """:func:`parse_bytes` for a settings field (``what``), refusing booleans (an ``int``
    to Python, never a byte size a user meant)."""
    return parse_bytes(not_bool(value, "a byte size"), what)


def _byte_field(value: object, info: ValidationInfo) -> int:
    return byte_setting(value, info.field_name or "size")


#: An ``int`` field that also takes a byte size string (``"64GiB"``): :func:`byte_setting`
#: named after the field, before the field's own checks.
ByteSize = Annotated[int, BeforeValidator(_byte_field)]


def parse_bytes(value: object, what: str = "size") -> int:
    """A byte count from an int or a string: ``"16GiB"``, ``"16 GB"``, ``"512MiB"``,
    ``"1073741824"``. Units are explicit: ``KB``/``MB``/``GB``/``TB``/``PB`` are powers of
    1000, ``KiB``/``MiB``/``GiB``/``TiB``/``PiB`` powers of 1024 (case is ignored); a bare
    ``"16G"`` is ambiguous and rejected. ``ValueError`` naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(
            f"{what}: expected a byte count (an int, or a string like '16GiB' or '16 GB'), "
            f"got {value!r}"
        )
    if isinstance(value, int):
        n = value
    else:
        match = _BYTE_SIZE.match(value)
        if match is None:
            raise ValueError(
                f"{what}: {value!r} is not a byte size; write e.g. '16GiB', '16 GB', "
                "'512MiB' or a number of bytes"
            )
        number, unit = match.groups()
        factor = _BYTE_UNITS.get(unit.lower() or "b")
        if factor is None:
            hint = (
                f" ('{unit}B' for powers of 1000 or '{unit}iB' for powers of 1024)"
                if unit.lower() in ("k", "m", "g", "t", "p")
                else ""
            )
            units = ", ".join(u.upper().replace("I", "i") for u in _BYTE_UNITS)
            raise ValueError(
                f"{what}: unknown unit {unit!r} in {value!r}{hint}; use one of {units}"
            )
        try:
            n = int(Decimal(number) * factor)
        except InvalidOperation:  # pragma: no cover - the pattern admits only numbers
            raise ValueError(f"{what}: {value!r} is not a byte size") from None
    if n <= 0:
        raise ValueError(f"{what}: must be more than 0 bytes, got {value!r}")
    return n


def known_name(value: str, known: Sequence[str], what: str) -> str:
    """``value`` if it is one of the registered names ``known``, else ``ValueError``
    naming ``what`` (``"cache policy"``) and listing them."""
    if value not in known:
        raise ValueError(f"unknown {what} {value!r}; known: {', '.join(known)}")
    return value


def optional_name(value: object, known: Callable[[], Sequence[str]], what: str) -> object:
    """``None`` for none (``None``, ``""``, ``"none"``), else :func:`known_name` of
    ``value`` among ``known()``; a value that is not a string is left to the field's type
    check."""
    if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
        return None
    if not isinstance(value, str):
        return value
    return known_name(value, known(), what)
