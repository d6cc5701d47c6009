"""No import circles in the library: no module imports one that imports it back.

import-linter (``make lint``) checks the layers, which forbid imports upward between
layers; a circle inside one layer, or through a package's ``__init__``, is left to this
test. Every import counts: at module level, inside functions (lazy imports) and under
``TYPE_CHECKING`` (a circle there still ties two modules together).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "asyncoffload"


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Each module of the package under ``package_dir`` and the package's modules it
    imports (for each name imported, the deepest module it names; a package's parents
    are not counted, as Python runs them once for every submodule)."""
    name = package_dir.name
    files: dict[str, tuple[Path, bool]] = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_package else parts)] = (path, is_package)

    def known(dotted: str) -> str | None:
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {module: set() for module in files}
    for module, (path, is_package) in files.items():
        here = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = here
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    source = f"{base}.{source}" if source else base
                # from x import y: the module x.y if there is one, else x itself
                named = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in files else source
                    for alias in node.names
                ]
            else:
                continue
            for dotted in named:
                if dotted == name or dotted.startswith(name + "."):
                    target = known(dotted)
                    if target is not None and target != module:
                        graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules, the first repeated at the end), or
    None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_no_module_of_the_library_imports_one_that_imports_it_back() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 90 and graph["asyncoffload.engine"]  # the whole library was read
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_check_finds_a_circle_through_a_lazy_or_type_checking_import(
    tmp_path: Path,
) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n"
    )
    (package / "c.py").write_text("def f():\n    import pkg.a\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (package / "c.py").write_text("def f():\n    import json\n")
    assert find_cycle(import_graph(package)) is None
