"""Lay out SGLang's pure-Python modules over the vLLM CPU venv, for `make test-sglang`.

`pip install sglang` resolves to about 4.2 GB (CUDA torch 2.14, sglang-kernel, the CUDA
13 stack), and nothing of that runs here. What asyncoffload's SGLang backend plugs into
(``HiCacheStorage``, the storage backend factory, the host memory pools, the cache
controller) is pure Python and imports beside a CPU torch. So this script downloads
SGLang's wheel without its dependencies (``pip download --no-deps``, pip checks its
hash) and unpacks only what is not compiled (``*.py`` and the package data, the
dist-info) into DEST/site; then installs, without their dependencies, the four modules
those imports need that the vLLM venv lacks (``DEPS``) into DEST/deps. Everything else
they import (CPU torch 2.13, transformers, pydantic, pyzmq, aiohttp, numpy, ...) the
vLLM venv has. ``PYTHONPATH=DEST/site:DEST/deps`` then imports SGLang there.

Left out: the Rust extensions and the GPU kernels' sources (``*.so``, ``*.cu``, ``*.cuh``): nothing
the tests run needs them. ``tests/sglang/sglang_cpu.py`` says what else differs from a
serving install (torchvision has no CPU build on PyPI).

Nothing is downloaded when DEST already holds this layout (DEST/.complete).

    python scripts/sglang_overlay.py 0.5.23 .sglang-0.5.23
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

#: What SGLang's host pool and controller import that the vLLM venv lacks, pinned.
DEPS = ("orjson==3.13.0", "ipython==9.18.1", "traitlets==5.16.1", "gguf==0.19.0")
#: What of the wheel is unpacked: not the compiled extensions nor the GPU kernels' sources
#: (the C++ of SGLang's page hash stays: SGLang compiles it on first use).
SKIP_SUFFIXES = (".so", ".cu", ".cuh", ".hip", ".co")


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def fetch_wheel(version: str, work: Path) -> Path:
    pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(work), f"sglang=={version}")
    wheels = sorted(work.glob(f"sglang-{version}-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"sglang_overlay: expected one sglang {version} wheel, found {wheels}")
    return wheels[0]


def _wanted(name: str) -> bool:
    if ".dist-info/" in name:
        return name.endswith(("/METADATA", "/top_level.txt", "/entry_points.txt", "/WHEEL"))
    return not name.endswith(SKIP_SUFFIXES)


def unpack_python(wheel: Path, site: Path) -> int:
    """The Python modules of ``wheel`` and their data into ``site``; how many files."""
    count = 0
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            name = member.filename
            if member.is_dir() or not _wanted(name):
                continue
            target = (site / name).resolve()
            if site.resolve() not in target.parents:
                raise SystemExit(f"sglang_overlay: {name!r} would land outside {site}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the SGLang release, e.g. 0.5.23")
    parser.add_argument("dest", type=Path, help="where to lay it out (made anew)")
    args = parser.parse_args(argv)
    dest: Path = args.dest
    stamp = dest / ".complete"
    want = f"{args.version} {DEPS} {SKIP_SUFFIXES}\n"
    if stamp.exists() and stamp.read_text() == want:
        return 0
    if dest.exists():
        shutil.rmtree(dest)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sglang-overlay-") as tmp:
        files = unpack_python(fetch_wheel(args.version, Path(tmp)), dest / "site")
    print(f"sglang_overlay: SGLang {args.version}: {files} files in {dest / 'site'}")
    pip("install", "-q", "--no-deps", "--only-binary=:all:", "--target", str(dest / "deps"), *DEPS)
    print(f"sglang_overlay: {', '.join(DEPS)} in {dest / 'deps'}")
    stamp.write_text(want)
    print(f"sglang_overlay: laid out in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
