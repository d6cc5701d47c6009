"""docs/api.md and the package's exports agree (it says it lists every exported name)."""

from __future__ import annotations

import re

import asyncoffload as ao
from tests.processes import REPO

DOC = (REPO / "docs" / "api.md").read_text()


def test_every_exported_name_is_documented() -> None:
    mentioned = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", DOC))
    missing = sorted(name for name in ao.__all__ if name not in mentioned)
    assert not missing, f"exported but not in docs/api.md: {missing}"


def test_every_name_the_docs_present_is_exported() -> None:
    """Section headings (``### `Name``) and class bullets (``- `Name(``) are presented
    as ``asyncoffload.Name``; each must be exported (or written with its module path)."""
    presented = set(re.findall(r"^### `([A-Za-z_][A-Za-z0-9_]*)", DOC, re.M))
    presented |= set(re.findall(r"^- `([A-Z][A-Za-z0-9_]*)[`(]", DOC, re.M))
    functions = {"available_admissions", "register_admission", "available_policies"}
    presented |= {name for name in functions if f"`{name}(" in DOC}
    not_exported = sorted(name for name in presented if name not in ao.__all__)
    assert not not_exported, f"docs/api.md presents names not exported: {not_exported}"


def test_every_exported_name_resolves() -> None:
    for name in ao.__all__:
        assert hasattr(ao, name), name
