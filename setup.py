"""Builds the native helpers (asyncoffload/_native/*.c) when the package is built, so that
a wheel carries them compiled; the metadata is in pyproject.toml.

Three of them are plain C shared libraries that asyncoffload loads with ctypes
(``lib<name>.so``: no Python API, no ``PyInit_``), two are CPython extension modules
(``<name><EXT_SUFFIX>``). All five are optional: where a compile fails (no compiler, no
Python headers) the build goes on without that library, and asyncoffload compiles it at
first use instead, or takes its Python fallback (the disk tier has none). Beside each library goes a digest file
(``<file>.sha256``: its SHA-256, its size and the SHA-256 of the C source it was built
from) that the loader checks before it maps the file (asyncoffload/_native/__init__.py).

An editable install (``pip install -e``) builds none of them: its sources are meant to
change, and the first-use build cache is keyed by them, so an edited ``.c`` file never
meets a stale library.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = Path("asyncoffload", "_native")


class SharedLibrary(Extension):
    """A plain C shared library (loaded with ctypes), built like an extension module."""


def _library(name: str, *, libraries: tuple[str, ...] = ()) -> SharedLibrary:
    return SharedLibrary(
        f"asyncoffload._native.{name}",
        [str(NATIVE / f"{name}.c")],
        libraries=list(libraries),
        extra_compile_args=["-O2", "-g0", "-pthread"],
        extra_link_args=["-pthread"],
        optional=True,
    )


def _extension(name: str) -> Extension:
    return Extension(
        f"asyncoffload._native.{name}",
        [str(NATIVE / f"{name}.c")],
        extra_compile_args=["-O2", "-g0", "-fno-strict-aliasing"],
        optional=True,
    )


class BuildNative(build_ext):
    """``build_ext`` that names plain libraries ``lib<name>.so``, exports no ``PyInit_``
    from them, writes each library's digest file, and builds nothing in place."""

    def run(self) -> None:
        if self.inplace or getattr(self, "editable_mode", False):
            self.announce(
                "asyncoffload: editable install, the native helpers are compiled at first "
                "use (asyncoffload._native.build_all() builds them now)",
                level=2,
            )
            return
        super().run()

    def get_ext_filename(self, fullname: str) -> str:
        ext = self.ext_map.get(fullname)
        if isinstance(ext, SharedLibrary):
            *package, name = fullname.split(".")
            return os.path.join(*package, f"lib{name}.so")
        filename: str = super().get_ext_filename(fullname)
        return filename

    def get_export_symbols(self, ext: Extension) -> list[str]:
        if isinstance(ext, SharedLibrary):
            return list(ext.export_symbols or [])
        symbols: list[str] = super().get_export_symbols(ext)
        return symbols

    def build_extension(self, ext: Extension) -> None:
        super().build_extension(ext)
        path = Path(self.get_ext_fullpath(ext.name))
        data = path.read_bytes()
        source = hashlib.sha256(Path(ext.sources[0]).read_bytes()).hexdigest()
        digest = path.with_name(path.name + ".sha256")
        digest.write_text(f"{hashlib.sha256(data).hexdigest()} {len(data)} {source}\n")

    def get_outputs(self) -> list[str]:
        outputs: list[str] = super().get_outputs()
        return outputs + [f + ".sha256" for f in outputs if os.path.exists(f + ".sha256")]


def _ext_modules() -> list[Any]:
    if os.environ.get("ASYNCOFFLOAD_NO_NATIVE", "") not in ("", "0"):
        return []
    if not sys.platform.startswith(("linux", "darwin", "freebsd")):
        return []  # the native helpers are POSIX-only; the Python paths serve elsewhere
    return [
        _library("copy_engine"),
        _library("cuda_helpers", libraries=("dl",)),
        _library("disk_io"),
        _extension("kvcore"),
        _extension("mgrcore"),
    ]


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": BuildNative})
