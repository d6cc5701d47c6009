"""Every fenced code block of README.md and docs/*.md runs as written.

The test finds each fenced block (```lang ... ```, indented ones in lists included) and:

- ``python``: runs it in a fresh subprocess (cwd a temporary directory, PYTHONPATH the
  repository, proxies pointed at a closed port so nothing reaches the network, a
  timeout). A block with top-level ``await`` / ``async with`` runs the way
  ``python -m asyncio`` (asyncio's REPL) runs it: as one coroutine on a new event loop.
- ``sh``, ``bash``, ``console``: runs it with ``bash -e`` in the same kind of temporary
  directory, where ``.venv``, ``examples``, ``benchmarks`` and ``scripts`` link to the
  repository's (``.venv`` to the virtual environment running the tests).
- ``text``: output samples, usage synopses, trees: not run. A block without a language
  fails the test (say ``text`` if it is not code).

A block opts out, or declares a stand-in, only through a marker that readers of the
Markdown see, an HTML comment right before the block (blank lines between allowed):

- ``<!-- docs-test: skip (REASON) -->``: not run, for REASON (needs the network, a GPU,
  vLLM, minutes of running...). The reason is required.
- ``<!-- docs-test: standin: PYTHON -->`` (python blocks; may span lines): PYTHON runs
  first, in the same module, defining the names the block takes as given
  (``kv_caches``, ``engine``...), small ones.
- ``<!-- docs-test: run: COMMAND -->`` (shell blocks): COMMAND runs in place of the block:
  the same commands with smaller arguments, or the lines that can run here.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.processes import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PYTHON = {"python"}
SHELL = {"sh", "bash", "console"}
TEXT = {"text"}
TIMEOUT_S = 60

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")
_MARKER = re.compile(
    r"<!--\s*docs-test:\s*(?P<kind>skip|standin|run)\s*(?::)?\s*(?P<arg>.*?)\s*-->\s*$",
    re.DOTALL,
)


@dataclass(frozen=True)
class Block:
    doc: str  # path relative to the repository
    line: int  # line of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # skip / standin / run
    arg: str  # the marker's reason / stand-in / command

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _marker_before(lines: list[str], fence: int) -> tuple[str | None, str]:
    i = fence - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    if i < 0 or not lines[i].rstrip().endswith("-->"):
        return None, ""
    end = i
    while i >= 0 and "<!--" not in lines[i]:
        i -= 1
    text = "\n".join(line.strip() for line in lines[i : end + 1])
    if "docs-test" not in text:
        return None, ""
    m = _MARKER.search(text)
    if m is None:
        raise ValueError(f"line {i + 1}: unreadable docs-test marker {text!r}")
    return m["kind"], m["arg"]


def find_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, start = len(m["indent"]), i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        marker, arg = _marker_before(lines, start)
        doc = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
        blocks.append(Block(doc, start + 1, m["lang"], "\n".join(body) + "\n", marker, arg))
        i += 1
    return blocks


ALL_BLOCKS = [b for doc in DOCS for b in find_blocks(doc)]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    closed = "http://127.0.0.1:9"  # nothing listens: no network
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = closed
    env["PIP_NO_INDEX"] = "1"
    env.pop("no_proxy", None)
    env.pop("NO_PROXY", None)
    return env


_DRIVER = """\
import ast, asyncio, sys
path = sys.argv[1]
code = compile(open(path).read(), path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
result = eval(code, {"__name__": "__main__", "__file__": path})
if asyncio.iscoroutine(result):
    asyncio.run(result)
"""


def _needs_top_level_await(source: str) -> bool:
    try:
        compile(source, "<block>", "exec")
    except SyntaxError:
        compile(source, "<block>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        return True
    return False


def _run(args: list[str], cwd: Path, block: Block) -> None:
    try:
        proc = subprocess.run(
            args,
            cwd=cwd,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.id}: still running after {TIMEOUT_S} s\n{e.stdout!r}\n{e.stderr!r}")
    if proc.returncode != 0:
        pytest.fail(
            f"{block.id} ({block.lang}) exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        )


def run_block(block: Block, tmp: Path) -> None:
    if block.lang in PYTHON:
        prelude = block.arg + "\n" if block.marker == "standin" else ""
        source = prelude + block.code
        script = tmp / "block.py"
        script.write_text(source, encoding="utf-8")
        if _needs_top_level_await(source):
            (tmp / "driver.py").write_text(_DRIVER, encoding="utf-8")
            _run([sys.executable, str(tmp / "driver.py"), str(script)], tmp, block)
        else:
            _run([sys.executable, str(script)], tmp, block)
    else:
        for name in ("examples", "benchmarks", "scripts"):
            (tmp / name).symlink_to(REPO / name)
        (tmp / ".venv").symlink_to(Path(sys.executable).parent.parent)
        command = block.arg if block.marker == "run" else block.code
        _run(["bash", "-e", "-o", "pipefail", "-c", command], tmp, block)


def test_there_are_blocks_and_every_one_is_classified() -> None:
    assert len(ALL_BLOCKS) >= 20
    for block in ALL_BLOCKS:
        assert block.lang in PYTHON | SHELL | TEXT, (
            f"{block.id}: fence language {block.lang!r}: say python, sh, bash, console or text"
        )
        if block.marker == "skip":
            assert re.fullmatch(r"\(.+\)", block.arg, re.DOTALL), (
                f"{block.id}: a skip says why: <!-- docs-test: skip (REASON) -->"
            )
        if block.marker == "standin":
            assert block.lang in PYTHON, f"{block.id}: standin is for python blocks"
        if block.marker == "run":
            assert block.lang in SHELL, f"{block.id}: run is for shell blocks"
        if block.lang in TEXT:
            assert block.marker is None, f"{block.id}: text blocks are never run"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang not in TEXT], ids=lambda b: b.id)
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if block.marker == "skip":
        pytest.skip(f"{block.id}: {block.arg}")
    run_block(block, tmp_path)


def test_the_marker_parser_reads_what_the_docstring_says(tmp_path: Path) -> None:
    doc = tmp_path / "probe.md"
    text = (
        "<!-- docs-test: skip (needs a GPU) -->\n```sh\nnvidia-smi\n```\n\n"
        "<!-- docs-test: standin:\nx = 1\n-->\n\n```python\nprint(x)\n```\n"
        "- item\n\n  ```python\n  y = 2\n  ```\n"
    )
    doc.write_text(text, encoding="utf-8")
    blocks = find_blocks(doc)
    assert [(b.lang, b.marker, b.arg, b.code) for b in blocks] == [
        ("sh", "skip", "(needs a GPU)", "nvidia-smi\n"),
        ("python", "standin", "x = 1", "print(x)\n"),
        ("python", None, "", "y = 2\n"),
    ]
