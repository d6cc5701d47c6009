"""Size limits of the library's code, enforced by ``make lint``.

    python scripts/check_sizes.py [ROOT]

A library module (``asyncoffload/**/*.py``) may not pass 1,000 lines, a class 600, a
function or method 100, and the facade stays thin: ``asyncoffload/engine.py`` under 600
lines, ``AsyncOffloadEngine`` under 400. Issue 23 ended with no module over 1,000 lines
and no class over 600; the hot-path work then grew ``transfer/cuda.py`` to 1,559 lines
and nothing in the build noticed (issue 38). A piece of code may pass its limit only
where :data:`EXCEPTIONS` names it with a reason; an exception no longer needed is an
error too, so the list only shrinks.

A class or function counts from its ``def`` / ``class`` line (decorators included) to
its last line; a function's nested functions count in it. Names are ``path:Qualname``
(``asyncoffload/engine.py:AsyncOffloadEngine.__init__``). Exit 1 with one line per
breach.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

#: Limits in lines, by kind.
MODULE_LINES = 1000
CLASS_LINES = 600
FUNCTION_LINES = 100

#: Tighter limits for named pieces: the facade stays thin.
SPECIFIC: dict[str, int] = {
    "asyncoffload/engine.py": 600,
    "asyncoffload/engine.py:AsyncOffloadEngine": 400,
}

#: Pieces allowed past their limit, each with the reason. Keep it short.
EXCEPTIONS: dict[str, str] = {}


@dataclass(frozen=True)
class Piece:
    """A module, class or function, and its size in lines."""

    name: str
    kind: str
    lines: int


@dataclass(frozen=True)
class Breach:
    piece: Piece
    limit: int

    def __str__(self) -> str:
        return (
            f"{self.piece.name}: {self.piece.kind} of {self.piece.lines} lines, over its "
            f"limit of {self.limit} (split it, or name it in EXCEPTIONS with a reason)"
        )


def pieces(path: Path, name: str) -> Iterator[Piece]:
    """``path``'s module, classes and functions (``name``: its path as reported)."""
    source = path.read_text(encoding="utf-8")
    yield Piece(name, "module", len(source.splitlines()))
    tree = ast.parse(source, filename=str(path))

    def walk(node: ast.AST, prefix: str) -> Iterator[Piece]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                end = child.end_lineno or child.lineno
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                yield Piece(f"{name}:{qualname}", kind, end - first + 1)
                yield from walk(child, f"{qualname}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def limit_of(piece: Piece) -> int:
    if piece.name in SPECIFIC:
        return SPECIFIC[piece.name]
    return {"module": MODULE_LINES, "class": CLASS_LINES}.get(piece.kind, FUNCTION_LINES)


def check(
    root: Path, package: str = "asyncoffload", exceptions: Mapping[str, str] | None = None
) -> list[str]:
    """Every breach under ``root/package``, and every exception that names nothing over
    its limit (stale) or has no reason; empty when the code keeps its limits."""
    allowed = EXCEPTIONS if exceptions is None else exceptions
    errors: list[str] = []
    over: set[str] = set()
    base = root / package
    if not base.is_dir():
        raise FileNotFoundError(f"no package folder {base}")
    for path in sorted(base.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        for piece in pieces(path, name):
            limit = limit_of(piece)
            if piece.lines <= limit:
                continue
            over.add(piece.name)
            if piece.name not in allowed:
                errors.append(str(Breach(piece, limit)))
    for name, reason in allowed.items():
        if not reason.strip():
            errors.append(f"{name}: an exception must give its reason")
        if name not in over:
            errors.append(f"{name}: named in EXCEPTIONS but within its limit: remove it")
    return errors


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    errors = check(root)
    for line in errors:
        print(line, file=sys.stderr)
    if errors:
        print(f"check_sizes: {len(errors)} size limit(s) broken", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
