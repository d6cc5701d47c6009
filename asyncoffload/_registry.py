"""A registry of named classes: cache policies and admission filters use one each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar, cast

__all__ = ["Registry"]

_T = TypeVar("_T")
_C = TypeVar("_C", bound=type)


class Registry(Generic[_T]):
    """Subclasses of ``base`` by name. ``what`` / ``plural`` / ``article`` word the errors:
    ``"cache policy"``, ``"policies"``, ``"a"``."""

    def __init__(self, base: type, what: str, plural: str, article: str = "a") -> None:
        self._base = base
        self._what = what
        self._plural = plural
        self._article = article
        self._classes: dict[str, type[_T]] = {}

    def register(self, name: str) -> Callable[[_C], _C]:
        """Class decorator: make ``cls`` available under ``name`` and set ``cls.name``."""

        def deco(cls: _C) -> _C:
            klass: object = cls
            if not (isinstance(klass, type) and issubclass(klass, self._base)):
                raise TypeError(
                    f"{cls!r} is not {self._base_article()} {self._base.__name__} subclass"
                )
            known = self._classes.get(name)
            if known is not None and known is not klass:
                raise ValueError(
                    f"{self._article} {self._what} named {name!r} is already registered"
                )
            setattr(klass, "name", name)  # noqa: B010 - every registered class has it
            self._classes[name] = cast("type[_T]", klass)
            return cls

        return deco

    def _base_article(self) -> str:
        return "an" if self._base.__name__[:1] in "AEIOU" else "a"

    def get(self, name: str) -> type[_T]:
        """The class registered as ``name``; ``ValueError`` naming the known ones if none."""
        try:
            return self._classes[name]
        except KeyError:
            known = ", ".join(sorted(self._classes))
            raise ValueError(
                f"unknown {self._what} {name!r}; known {self._plural}: {known}"
            ) from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._classes)

    def as_dict(self) -> dict[str, type[_T]]:
        """Name -> class, a copy."""
        return dict(self._classes)

    def copy(self) -> Registry[_T]:
        """An independent registry with the same classes (tests register into one)."""
        other: Registry[_T] = Registry(self._base, self._what, self._plural, self._article)
        other._classes = dict(self._classes)
        return other
