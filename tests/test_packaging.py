"""Installing like a normal package (issue 12): ``python -m build`` makes an sdist that
holds what the tests need (examples, benchmarks, the LICENSE) and a platform wheel that
carries the native helpers compiled; the wheel installs into a clean venv and loads them
with no compiler; where no compiler exists at build time the package still builds and
installs, and the Python fallbacks serve.

No download: the build runs without isolation (setuptools and ``build`` from this venv),
the wheel installs with ``--no-index --no-deps``, and the clean venv borrows this venv's
packages (torch, pydantic) through a path entry placed after its own site-packages (a
path entry only: this venv's ``.pth`` files, the editable install among them, are not
read there)."""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.processes import REPO

pytest.importorskip("build", reason="needs the 'build' package (in the test extra)")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the native helpers are built on Linux here"
)

EXT_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
NATIVE_FILES = [
    "libcopy_engine.so",
    "libcuda_helpers.so",
    "libdisk_io.so",
    f"kvcore{EXT_SUFFIX}",
    f"mgrcore{EXT_SUFFIX}",
]
# Not part of a source tree: version control, venvs, build outputs, caches.
_TOP_LEVEL_SKIP = {
    ".git",
    ".venv",
    ".venv-vllm",
    ".whl",
    ".hypothesis",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "build",
    "dist",
    "out",
}


def _ignore(folder: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".so", ".egg-info"))}
    if Path(folder) == REPO:
        skip |= _TOP_LEVEL_SKIP & set(names)
    return skip


def _run(
    cmd: list[str],
    *,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    out = f"{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build`` of a copy of this tree (the shared tree gets no build outputs):
    the sdist, then the wheel built from that sdist."""
    root = tmp_path_factory.mktemp("packaging")
    src = Path(shutil.copytree(REPO, root / "src", ignore=_ignore))
    out = root / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)])
    return out


def _wheel(folder: Path) -> Path:
    (wheel,) = folder.glob("*.whl")
    return wheel


def _venv_with(wheel: Path, where: Path) -> Path:
    """A new venv holding ``wheel``, and this venv's packages behind it; its python."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(where)])
    python = where / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    _run([*pip, "install", "-q", "--no-deps", "--no-index", str(wheel)])
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site.split()[0]) / "zz-deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CC")}
    env.pop("ASYNCOFFLOAD_NO_NATIVE", None)
    return {**env, **extra}


def test_python_m_build_makes_a_platform_wheel_with_the_native_helpers(dist: Path) -> None:
    wheel = _wheel(dist)
    assert not wheel.name.endswith("-none-any.whl"), wheel.name
    assert f"-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}" in wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for name in NATIVE_FILES:
            path = f"asyncoffload/_native/{name}"
            assert path in names and f"{path}.sha256" in names, sorted(names)
            sha, size, source = z.read(f"{path}.sha256").decode().split()
            data = z.read(path)
            assert (sha, int(size)) == (hashlib.sha256(data).hexdigest(), len(data))
            c_file = "asyncoffload/_native/" + name.removeprefix("lib").split(".")[0] + ".c"
            assert source == hashlib.sha256(z.read(c_file)).hexdigest()
        (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert "Apache License" in z.read(license_file).decode()
        metadata = z.read(license_file.replace("licenses/LICENSE", "METADATA")).decode()
        assert "License-Expression: Apache-2.0" in metadata


def test_the_sdist_holds_the_license_and_what_the_tests_import(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    needed = {"LICENSE", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "Makefile"}
    for folder in ("tests", "examples", "benchmarks", "asyncoffload/_native"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".c") and "__pycache__" not in path.parts:
                needed.add(path.relative_to(REPO).as_posix())
    assert "examples/kv_index.py" in needed
    assert not needed - names, sorted(needed - names)
    assert not [n for n in names if n.endswith((".so", ".sha256", ".pyc"))]


USE_INSTALLED = """
import sys
from pathlib import Path
import torch
import asyncoffload as ao
from asyncoffload import _native
from asyncoffload.manager.policies.kv import KVPolicy

here = Path(ao.__file__).parent / "_native"
assert Path(sys.prefix) in here.parents, (ao.__file__, sys.prefix)
lib = _native.load_copy_engine()
assert lib is not None and Path(lib._name) == here / "libcopy_engine.so", lib
for loader in (_native.load_kvcore, _native.load_mgrcore):
    module = loader()
    assert module is not None and Path(module.__file__).parent == here, module
_native.load_cuda_helpers()  # loads; None without libcuda
built = _native.build_all()
assert all(path is not None and path.parent == here for path in built.values()), built
kv = [torch.arange(4 * 4 * 16, dtype=torch.float32).reshape(4, 4, 16)]
backend = ao.CpuCopyBackend(kv, ao.KVLayout.infer(kv), 4, copy_engine="native")
job = backend.submit_store([0, 1], [0, 1])
while not job.query():
    pass
backend.close()
KVPolicy(16, native=True)
print("installed native helpers ok")
"""


def test_the_wheel_installs_into_a_clean_venv_and_loads_its_native_helpers(
    dist: Path, tmp_path: Path
) -> None:
    """With no compiler at all (``CC`` names none) and an empty cache: every library
    comes from the wheel, nothing is compiled, nothing is written to the cache."""
    python = _venv_with(_wheel(dist), tmp_path / "venv")
    cache = tmp_path / "cache"
    out = _run(
        [str(python), "-c", textwrap.dedent(USE_INSTALLED)],
        env=_env(ASYNCOFFLOAD_CACHE_DIR=str(cache), CC=str(tmp_path / "no-such-cc")),
        cwd=tmp_path,
        timeout=120,
    )
    assert "installed native helpers ok" in out
    assert "unusable" not in out and "compiler" not in out, out
    assert not cache.exists()


USE_FALLBACK = """
import torch
import asyncoffload as ao
from asyncoffload import _native

assert _native.load_copy_engine() is None
assert _native.load_kvcore() is None and _native.load_mgrcore() is None
kv = [torch.arange(4 * 4 * 16, dtype=torch.float32).reshape(4, 4, 16)]
backend = ao.CpuCopyBackend(kv, ao.KVLayout.infer(kv), 4, copy_engine="auto")
job = backend.submit_store([0, 1], [0, 1])
while not job.query():
    pass
backend.close()
print("fallback ok,", backend.name)
"""


@pytest.mark.long  # `make test-long` (issue 37: `make test` within its budget)
def test_without_a_compiler_the_sdist_still_builds_and_installs(dist: Path, tmp_path: Path) -> None:
    """``pip wheel`` of the sdist where ``CC`` names no program: the optional extensions
    are left out, the wheel installs, and at run time one warning line says that no
    compiler exists while the Python fallbacks serve."""
    (sdist,) = dist.glob("*.tar.gz")
    no_cc = str(tmp_path / "no-such-cc")
    out = tmp_path / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index"]
    _run([*pip_wheel, "--no-build-isolation", "-w", str(out), str(sdist)], env=_env(CC=no_cc))
    wheel = _wheel(out)
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if n.endswith((".so", ".sha256"))]
    python = _venv_with(wheel, tmp_path / "venv")
    proc = subprocess.run(
        [str(python), "-c", textwrap.dedent(USE_FALLBACK)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(ASYNCOFFLOAD_CACHE_DIR=str(tmp_path / "cache"), CC=no_cc),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "fallback ok" in proc.stdout
    said = [line for line in proc.stderr.splitlines() if "compiler" in line or "native" in line]
    assert len(said) == 1 and "no C compiler" in said[0], proc.stderr
