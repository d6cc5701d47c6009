"""The Mooncake tier (issue 26) under real vLLM on CPU: a second vLLM process is served
the blocks the first stored in Mooncake Store, with the first's tokens and logprobs.

The master and Mooncake's clients listen on every interface, so the cluster (a master and
a storage client giving the pool 256 MiB: tests/mooncake_probe.py's ``hold`` mode) runs in
a private network namespace (``unshare --net``, as root: CI runs as root), and each vLLM
process joins it (``nsenter --net``). The vLLM processes give the pool no memory of their
own (``segment_bytes: 0``): objects live in the storage client's segment, so they outlive
the process that put them, as in a deployment with storage nodes. Without the package, or
without ``unshare`` / ``nsenter`` and root, the module skips with one line.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.conftest import RunVLLM
from tests.vllm.harness import (
    BLOCK_SIZE,
    LOGPROB_ATOL,
    asyncoffload_kv_transfer_config,
    generation_diff,
    requests_of,
    reuse_rounds,
)


def _why_not() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"needs asyncoffload[mooncake] and its Debian libraries ({exc})"
    if shutil.which("unshare") is None or shutil.which("nsenter") is None or os.geteuid():
        return "needs unshare and nsenter as root (its servers listen on every interface)"
    return None


WHY_NOT = _why_not()
if WHY_NOT is not None:
    pytest.skip(f"Mooncake Store: {WHY_NOT}", allow_module_level=True)

PROBE = Path(__file__).resolve().parents[1] / "mooncake_probe.py"
PORT = 50181
#: Seconds the cluster may take to start.
START_S = 60.0
#: The tiny model's KV per 32-token block: 4 layers x (K, V) x 2 heads x 64 x 4 bytes.
E2E_BLOCK_BYTES = 4 * 2 * 2 * 64 * BLOCK_SIZE * 4
E2E_A_BLOCKS = 6


@pytest.fixture
def cluster() -> Iterator[list[str]]:
    """A master and a storage client in a network namespace of their own; the command
    prefix that runs a process in it."""
    proc = subprocess.Popen(
        ["unshare", "--net", sys.executable, str(PROBE), str(PORT), "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], START_S)
        line = proc.stdout.readline() if ready else b""
        assert line.strip() == b"ready", f"no Mooncake cluster within {START_S:g} s: {line!r}"
        yield ["nsenter", f"--net=/proc/{proc.pid}/ns/net"]
    finally:
        proc.stdin.close()  # the holder ends its client and its master
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.long  # two vLLM runs: about 150 s on the 2-vCPU VM
@pytest.mark.timeout(900)
def test_a_second_vllm_is_served_the_blocks_the_first_stored_in_mooncake(
    run_vllm: RunVLLM, cluster: list[str]
) -> None:
    """The first vLLM computes prompt A and writes its blocks through to Mooncake; the
    second, started after the first ended, asks the store about A's blocks, promotes and
    loads them, and must give the first's greedy tokens and logprobs."""
    # Every promotion taken, under a deadline of 30 s: what is tested is the sharing.
    # With both CPUs kept busy beside vLLM (its engine core spinning while A's load is
    # pending), the helper's read of A's 6 blocks outlived the tier's own deadline
    # (timeout_s, 5 s, plus 1 s of grace; no recompute rate was known yet) in 2 of 4
    # runs: rounds of 8.7-9.4 s against 2.6 s, A recomputed, as that deadline means it
    # to be (tests/test_mooncake_tier.py); load_or_recompute, whose deadlines are
    # tested in test_cost_vllm.py, is off.
    tier = {
        "kind": "mooncake",
        "master": f"127.0.0.1:{PORT}",
        "segment_bytes": 0,
        "timeout_s": 30.0,
    }
    config = asyncoffload_kv_transfer_config(
        cpu_bytes_to_use=24 * E2E_BLOCK_BYTES, tiers=[tier], load_or_recompute=False
    )
    only_a = reuse_rounds()[0]  # one round: prompt A (6 full blocks and a tail)
    # Then sub-block requests (nothing to store) until A's blocks are written: their
    # steps let the scheduler take the helper's replies. (A single such request was
    # once the wait: with both CPUs busy the helper's first writes took longer, some
    # waited in the core behind backpressure, and 1-3 of 6 were written by then.)
    written = {"vllm:asyncoffload_tier_blocks_written": E2E_A_BLOCKS}
    first = run_vllm(
        [only_a],
        name="mooncake-first",
        kv_transfer_config=config,
        wrap=cluster,
        settle_s=60,
        settle_until=written,
    )
    assert first["rounds"][0]["settled"], f"A's blocks not written in 60 s: {first['rounds']}"
    (computed,) = requests_of(first, 0)
    assert computed["num_cached_tokens"] == 0
    assert first["metrics"]["vllm:asyncoffload_tier_blocks_written"] >= E2E_A_BLOCKS

    second = run_vllm([only_a], name="mooncake-second", kv_transfer_config=config, wrap=cluster)
    (served,) = requests_of(second, 0)
    metrics = second["metrics"]
    ours = {k: v for k, v in metrics.items() if "asyncoffload" in k}
    assert served["num_cached_tokens"] == E2E_A_BLOCKS * BLOCK_SIZE, ours
    assert metrics["vllm:asyncoffload_tier_blocks_read"] >= E2E_A_BLOCKS
    assert metrics.get("vllm:asyncoffload_tier_read_failures", 0) == 0
    same, lp_diff = generation_diff(served, computed)
    assert same, "the tokens differ from the run that computed the prompt"
    assert lp_diff < LOGPROB_ATOL
