"""The size limits ``make lint`` enforces (scripts/check_sizes.py), on made-up packages."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_sizes", ROOT / "scripts/check_sizes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_sizes"] = module
    spec.loader.exec_module(module)
    return module


sizes = _checker()


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}() -> None:\n{body}"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "asyncoffload" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_code_within_its_limits_passes(tmp_path: Path) -> None:
    root = _package(tmp_path, {"a.py": _function("f", 99), "sub/b.py": "X = 1\n"})
    assert sizes.check(root, exceptions={}) == []


def test_a_function_a_class_and_a_module_over_their_limits_are_named(tmp_path: Path) -> None:
    method = _function("big", 100, indent="    ")  # 101 lines with its def
    cls = "class C:\n" + method + "".join(f"    y{i} = {i}\n" for i in range(500))
    module = cls + "".join(f"z{i} = {i}\n" for i in range(400))
    root = _package(tmp_path, {"m.py": module})
    errors = sizes.check(root, exceptions={})
    assert len(errors) == 3, errors
    assert errors[0].startswith("asyncoffload/m.py: module of 1002 lines, over its limit of 1000")
    assert errors[1].startswith("asyncoffload/m.py:C: class of 602 lines, over its limit of 600")
    assert errors[2].startswith("asyncoffload/m.py:C.big: function of 101 lines")


def test_decorators_and_nested_functions_count_in_their_function(tmp_path: Path) -> None:
    inner = _function("inner", 96, indent="    ")
    outer = "@staticmethod\n@property\ndef outer() -> None:\n" + inner + "    return None\n"
    root = _package(tmp_path, {"n.py": outer})
    (error,) = sizes.check(root, exceptions={})
    assert error.startswith("asyncoffload/n.py:outer: function of 101 lines")


def test_the_facade_has_its_own_tighter_limits(tmp_path: Path) -> None:
    cls = "class AsyncOffloadEngine:\n" + "".join(f"    a{i} = {i}\n" for i in range(400))
    root = _package(tmp_path, {"engine.py": cls})
    (error,) = sizes.check(root, exceptions={})
    assert "engine.py:AsyncOffloadEngine: class of 401 lines, over its limit of 400" in error


def test_an_exception_with_a_reason_lets_a_piece_pass(tmp_path: Path) -> None:
    root = _package(tmp_path, {"a.py": _function("f", 120)})
    assert sizes.check(root, exceptions={"asyncoffload/a.py:f": "a state table"}) == []


def test_an_exception_needs_a_reason_and_goes_once_it_is_not_needed(tmp_path: Path) -> None:
    root = _package(tmp_path, {"a.py": _function("f", 120), "b.py": _function("g", 10)})
    errors = sizes.check(root, exceptions={"asyncoffload/a.py:f": " ", "asyncoffload/b.py:g": "x"})
    assert errors == [
        "asyncoffload/a.py:f: an exception must give its reason",
        "asyncoffload/b.py:g: named in EXCEPTIONS but within its limit: remove it",
    ]


def test_the_command_exits_1_naming_each_breach(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sizes, "EXCEPTIONS", {})
    root = _package(tmp_path, {"a.py": _function("f", 120)})
    assert sizes.main([str(root)]) == 1
    err = capsys.readouterr().err
    assert "asyncoffload/a.py:f: function of 121 lines" in err
    assert "1 size limit(s) broken" in err
    with pytest.raises(FileNotFoundError, match="no package folder"):
        sizes.check(tmp_path / "nowhere")
