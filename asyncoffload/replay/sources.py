"""Workload sources a replay names besides trace files: the seeded trace families of
:mod:`asyncoffload.workloads` as ``family:NAME[:N][:PARAM=VALUE]...``
(:func:`parse_family_source`)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncoffload.workloads import Request, families, trace_family

__all__ = [
    "FAMILY_REQUESTS",
    "FAMILY_SOURCE",
    "FamilySource",
    "is_family_source",
    "parse_family_source",
]

#: How a replay source names a trace family (:func:`parse_family_source`).
FAMILY_SOURCE = "family:NAME[:N][:PARAM=VALUE]..."
#: Requests of a family source that names no count (as ``synthetic``'s).
FAMILY_REQUESTS = 20_000

Param = int | float | str


@dataclass(frozen=True)
class FamilySource:
    """A trace family (:func:`asyncoffload.workloads.families`) as a replay source names
    it: ``family:rag:50000:seed=3:zipf_s=1.2`` is the ``rag`` family's first 50,000
    requests at seed 3 with ``zipf_s=1.2``. ``str()`` gives that text back."""

    family: str
    #: Requests to generate (``None``: :data:`FAMILY_REQUESTS`).
    num_requests: int | None = None
    #: The seed (``None``: the caller's, the replay's ``--seed``).
    seed: int | None = None
    #: The generator parameters the source sets, in its order.
    params: tuple[tuple[str, Param], ...] = ()

    def __str__(self) -> str:
        parts = ["family", self.family]
        if self.num_requests is not None:
            parts.append(str(self.num_requests))
        if self.seed is not None:
            parts.append(f"seed={self.seed}")
        parts += [f"{name}={value}" for name, value in self.params]
        return ":".join(parts)

    def requests(
        self, *, seed: int = 0, block_size: int = 512, limit: int | None = None
    ) -> list[Request]:
        """The workload: the source's requests (at most ``limit``), at its seed or else
        ``seed``, with blocks of ``block_size`` tokens."""
        n = FAMILY_REQUESTS if self.num_requests is None else self.num_requests
        if limit is not None:
            n = min(n, limit)
        return trace_family(self.family).generate(
            n,
            seed=seed if self.seed is None else self.seed,
            block_size=block_size,
            **dict(self.params),
        )


def is_family_source(text: str) -> bool:
    """Whether ``text`` means a trace family (``family`` or ``family:...``), not a file."""
    return text == "family" or text.startswith("family:")


def parse_family_source(text: str) -> FamilySource:
    """``family:NAME[:N][:PARAM=VALUE]...`` as a :class:`FamilySource`.

    ``NAME`` is a trace family (``chat``, ``agent``, ``rag``, ``scan``, ``diurnal``,
    ``mixed``), ``N``
    (right after it) the number of requests, each ``PARAM=VALUE`` the seed (``seed=3``)
    or one of the family's generator parameters (``zipf_s=1.2``, ``order=id``: the
    types of their defaults). The parameters are checked at once, by generating no
    requests. ``ValueError`` naming the source and the bad part otherwise; the block
    size is the caller's (the replay's ``--block-size``), never the source's.
    """
    head, _, rest = text.partition(":")
    names = ", ".join(families())
    if head != "family" or not rest:
        raise ValueError(f"{text!r}: expected {FAMILY_SOURCE} with NAME one of {names}")
    name, *parts = rest.split(":")
    try:
        family = trace_family(name)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    defaults = family.parameters()
    num_requests: int | None = None
    seed: int | None = None
    params: dict[str, Param] = {}
    for i, part in enumerate(parts):
        key, eq, value = part.partition("=")
        if not eq:
            if i == 0 and part.isdecimal() and int(part) > 0:
                num_requests = int(part)
                continue
            where = "N (a positive number of requests) or " if i == 0 else ""
            raise ValueError(f"{text!r}: expected {where}PARAM=VALUE, got {part!r}")
        if key == "seed":
            if seed is not None:
                raise ValueError(f"{text!r}: seed is given twice")
            try:
                seed = int(value)
            except ValueError:
                raise ValueError(f"{text!r}: seed takes an integer, got {value!r}") from None
            continue
        if key == "block_size":
            raise ValueError(f"{text!r}: the block size is the replay's (--block-size)")
        if key not in defaults:
            raise ValueError(
                f"{text!r}: the {name} family has no parameter {key!r} (its parameters: "
                f"{', '.join(defaults)}, and seed)"
            )
        if key in params:
            raise ValueError(f"{text!r}: {key} is given twice")
        params[key] = _param_value(text, key, value, defaults[key])
    source = FamilySource(name, num_requests, seed, tuple(params.items()))
    try:
        family.generate(0, seed=seed or 0, block_size=512, **params)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    return source


def _param_value(text: str, key: str, value: str, default: object) -> Param:
    """``value`` as the type of the parameter's ``default``."""
    if isinstance(default, str):
        return value
    kind, convert = ("an integer", int) if isinstance(default, int) else ("a number", float)
    try:
        return convert(value)
    except ValueError:
        raise ValueError(f"{text!r}: {key} takes {kind}, got {value!r}") from None
