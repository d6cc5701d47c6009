"""Helpers for the end-to-end vLLM tests and ``benchmarks/vllm_serving.py``.

Nothing here imports vLLM: every vLLM run happens in a subprocess
(``python -m tests.vllm.llm_runner``), which this module starts, times out and reads back.

The reuse workload (:func:`reuse_rounds`) is the one the connector tests use::

    round 0: [A]          A = 6 full blocks of 32 tokens + 8 more (200 tokens)
    round 1: [F1, F2]     two unrelated 200-token prompts: with 16 GPU blocks (15 usable)
                          they overwrite A's GPU blocks (prefix caching is off anyway)
    round 2: [A]          only an offloading connector can serve A's 192 block tokens

With an offloading connector that really copies, round 2's A reports
``num_cached_tokens == 192`` and the baseline's greedy tokens; its logprobs differ from
the baseline's by about 1e-5 (the prefill is split differently), so compare them with
:data:`LOGPROB_ATOL`. A connector that reports loads done without copying gets different
tokens (``toy_mode="skip_load"`` in ``tests/vllm/toy_spec.py`` proves it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "BLOCK_SIZE",
    "LOGPROB_ATOL",
    "REPO_ROOT",
    "REUSE_NUM_GPU_BLOCKS",
    "VLLM_INSTALLED",
    "LLMRunError",
    "asyncoffload_kv_transfer_config",
    "generation_diff",
    "offloading_kv_transfer_config",
    "random_prompt",
    "requests_of",
    "reuse_rounds",
    "root_cause",
    "run_llm",
    "summarize_events",
    "toy_kv_transfer_config",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None

#: vLLM's CPU attention backend accepts only multiples of 32.
BLOCK_SIZE = 32
#: 16 blocks of 32 tokens; one is vLLM's null block, so 15 are usable (max_model_len 480).
REUSE_NUM_GPU_BLOCKS = 16
#: Greedy logprobs of a connector-served request vs a recomputed one: float32 differs by
#: ~1e-5 (a different prefill split); a skipped or corrupt load differs by >0.1.
LOGPROB_ATOL = 1e-3
#: Token ids the prompts draw from (the tiny model's vocabulary is 1024; 0-2 are special).
VOCAB = range(3, 1024)


class LLMRunError(RuntimeError):
    """The runner subprocess failed or timed out; the message carries its log tail."""


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(length)]


def reuse_rounds(
    seed: int = 0, *, prefix_blocks: int = 6, tail: int = 8, fillers: int = 2
) -> list[list[list[int]]]:
    """``[[A], [F1, ..., Fn], [A]]``; see the module docstring."""
    rng = random.Random(seed)
    length = prefix_blocks * BLOCK_SIZE + tail
    a = random_prompt(rng, length)
    return [[a], [random_prompt(rng, length) for _ in range(fillers)], [a]]


def offloading_kv_transfer_config(
    spec_name: str, spec_module_path: str, **extra: Any
) -> dict[str, Any]:
    """vLLM's OffloadingConnector with an out-of-tree spec."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": spec_name,
            "spec_module_path": spec_module_path,
            **extra,
        },
    }


def toy_kv_transfer_config(mode: str = "copy", **extra: Any) -> dict[str, Any]:
    """The harness-check spec (``tests/vllm/toy_spec.py``), 64 MiB of chunks by default."""
    extra.setdefault("cpu_bytes_to_use", 64 << 20)
    return offloading_kv_transfer_config(
        "ToyOffloadingSpec", "tests.vllm.toy_spec", toy_mode=mode, **extra
    )


def asyncoffload_kv_transfer_config(**extra: Any) -> dict[str, Any]:
    """The spec under test: ``asyncoffload.integrations.vllm.AsyncOffloadSpec``."""
    extra.setdefault("cpu_bytes_to_use", 64 << 20)
    extra.setdefault("policy", "lru")
    return offloading_kv_transfer_config(
        "AsyncOffloadSpec", "asyncoffload.integrations.vllm", **extra
    )


def requests_of(result: dict[str, Any], round_index: int) -> list[dict[str, Any]]:
    """The runner's per-request records of one round, in prompt order."""
    reqs = [r for r in result["requests"] if r["round"] == round_index]
    return sorted(reqs, key=lambda r: int(r["index"]))


def generation_diff(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, float]:
    """(same greedy tokens?, largest |logprob difference|) of two request records."""
    same = a["token_ids"] == b["token_ids"]
    diffs = [
        abs(x - y) if not (math.isnan(x) or math.isnan(y)) else math.inf
        for x, y in zip(a["logprobs"], b["logprobs"])
    ]
    return same, max(diffs, default=0.0)


_ROOT_CAUSE = re.compile(r"ERROR .*?\] ((?:[\w.]+Error|[\w.]*Exception)\b.*)$")


def root_cause(log_text: str) -> str | None:
    """The first exception vLLM's engine core or worker logged (``ERROR ... XError: ...``).

    The runner itself only sees "Engine core initialization failed" from the front end.
    """
    for line in log_text.splitlines():
        m = _ROOT_CAUSE.search(line)
        if m:
            return m.group(1).strip()
    return None


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _own_core() -> str:
    """The core a vLLM run of this pytest process computes on, alone: one OpenMP thread
    bound to the xdist worker's own core (gw0 the first this process may use, gw1 the
    next, ...). vLLM's default binding ran the model on every core, and two runs at once
    (two xdist workers) then summed in another order: a baseline and a run that loaded
    nothing differed by 2e-3 in a logprob. One thread sums in one order whatever else
    runs, and two workers never share a core. A run's own ``env`` (TP binds) still wins.
    """
    cores = sorted(os.sched_getaffinity(0))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return str(cores[(int(worker) if worker.isdigit() else 0) % len(cores)])


def run_llm(
    args: dict[str, Any],
    workdir: Path,
    *,
    name: str = "run",
    timeout: float = 300.0,
    python: str | None = None,
    wrap: Sequence[str] = (),
) -> dict[str, Any]:
    """Run ``tests.vllm.llm_runner`` on ``args`` in a subprocess and return its JSON.
    ``wrap``: a command that runs it (``nsenter --net=...``: in another network
    namespace).

    Writes ``{name}.args.json``, ``{name}.out.json`` and ``{name}.log`` (vLLM's stdout and
    stderr) into ``workdir``. On a non-zero exit, a missing result or a timeout it kills
    the runner's whole process group (vLLM's engine core and worker included) and raises
    :class:`LLMRunError` with the log's tail.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    args_path = workdir / f"{name}.args.json"
    out_path = workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    args_path.write_text(json.dumps(args))
    out_path.unlink(missing_ok=True)
    env = dict(os.environ)
    # vLLM spawns its engine core and worker; both import the spec by module path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = _own_core()
    cmd = [
        *wrap,
        python or sys.executable,
        "-m",
        "tests.vllm.llm_runner",
        str(args_path),
        str(out_path),
    ]
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise LLMRunError(
                f"llm_runner {name!r} timed out after {timeout:.0f}s; log {log_path}:\n"
                + _tail(log_path)
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
    # The engine core and worker normally exit with the runner; make sure of it.
    _kill_group(proc)
    result: dict[str, Any] = {}
    if out_path.exists():
        try:
            result = json.loads(out_path.read_text())
        except ValueError:
            result = {"error": "unreadable result file"}
    if rc != 0 or not result.get("ok"):
        cause = root_cause(log_path.read_text(errors="replace"))
        raise LLMRunError(
            f"llm_runner {name!r} exited {rc} after {time.monotonic() - t0:.0f}s: "
            f"{result.get('error', 'no result written')}"
            + (f"\nroot cause (vLLM log): {cause}" if cause else "")
            + f"\nlog {log_path}, last lines:\n"
            + _tail(log_path)
        )
    result["process_s"] = time.monotonic() - t0
    result["log_path"] = str(log_path)
    return result


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of the runner's session (it was started in its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def summarize_events(result: dict[str, Any]) -> dict[str, Any]:
    """Counts of KV events by (type, medium), and the set of stored/removed block hashes."""
    counts: dict[str, int] = {}
    stored: set[int] = set()
    removed: set[int] = set()
    for batch in result.get("kv_events", []):
        for ev in batch["events"]:
            key = f"{ev['type']}:{ev.get('medium')}"
            counts[key] = counts.get(key, 0) + len(ev.get("block_hashes", ()) or (1,))
            hashes: Sequence[int] = ev.get("block_hashes") or ()
            if ev["type"] == "BlockStored":
                stored.update(hashes)
            elif ev["type"] == "BlockRemoved":
                removed.update(hashes)
    return {"counts": counts, "stored": stored, "removed": removed}
