"""Load or recompute in real vLLM (CPU build): TTFT with a fast disk tier, the same tier
slowed, and a Valkey tier paused, each against no offloading in the same vLLM run.

The workload is ``tests/vllm/test_cost_vllm.py``'s, with more requests: ``--requests``
prompts of 16 blocks of 32 tokens per case, all stored (written through to a disk tier
and a Valkey tier) in round 0; then per case, after vLLM's prefix cache and our CPU tier
are reset (the lower tiers keep their blocks), one request at a time, alternating a
prompt never seen (no offloading: every block computed) and a stored one (ours):

- ``fast_disk``: the stored prompts load from the disk tier;
- ``slow_disk``: each read of the disk tier lasts at least ``--slow-read-s`` (a fault
  hook in the scheduler, ``tests/vllm/fault_spec.py``), far longer than prefilling;
- ``valkey_paused``: the stored prompts load from Valkey, stopped (SIGSTOP) for the case.

Each configuration is one vLLM run: ``on`` (``load_or_recompute``, the default) and, with
``--compare-off``, ``off`` (every promotion taken under the tier's own deadline: the
behaviour before issue 41). Reported per case: median and p90 TTFT of ours and of no
offloading, their ratio, the worst TTFT, outputs identical to round 0's, and the
decisions (vLLM's ``asyncoffload_tier_*`` counters over the case).

    .venv-vllm/bin/python benchmarks/vllm_cost.py [--requests 20] [--compare-off [--off-first]]
        [--layers 4 --hidden 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.servers import ValkeyServer
from tests.vllm import test_cost_vllm as workload
from tests.vllm.harness import BLOCK_SIZE, generation_diff, run_llm
from tests.vllm.tiny_model import TinyLlamaConfig, write_tiny_llama


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(
    result: dict[str, Any], where: dict[str, list[tuple[int, str]]], n: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    by_round = {r["round"]: r for r in result["requests"]}
    refs = [r for r in result["requests"] if r["round"] == 0]
    for case, rounds in where.items():
        ours = workload.ttfts(result, rounds, "ours")
        base = workload.ttfts(result, rounds, "base")
        served = [by_round[i] for i, w in rounds if w == "ours"]
        same = sum(
            generation_diff(r, refs[workload.CASES.index(case) * n + i])[0]
            for i, r in enumerate(served)
        )
        out[case] = {
            "ours_median_s": statistics.median(ours),
            "base_median_s": statistics.median(base),
            "ratio_median": statistics.median(ours) / statistics.median(base),
            "ours_p90_s": _quantile(ours, 0.9),
            "base_p90_s": _quantile(base, 0.9),
            "ratio_p90": _quantile(ours, 0.9) / _quantile(base, 0.9),
            "ours_max_s": max(ours),
            "base_max_s": max(base),
            "identical_outputs": f"{same}/{len(served)}",
            "decisions": workload.decisions(result, rounds[-1][0], rounds[0][0]),
        }
    return out


def run_once(
    model: Path, block_bytes: int, n: int, slow_s: float, on: bool, work: Path
) -> dict[str, Any]:
    workload.SLOW_READ_S = slow_s
    with ValkeyServer(work) as server:
        server.start()
        assert server.pid is not None
        delay_file = work / "read-delay"
        rounds, actions, where = workload.plan(delay_file, server.pid, n=n)
        config = workload.kv_config(
            work, server.url, delay_file, n=n, block_bytes=block_bytes, load_or_recompute=on
        )
        args = {
            "model": str(model),
            "rounds": rounds,
            "kv_transfer_config": config,
            "num_gpu_blocks": 4 * workload.PROMPT_BLOCKS,
            "block_size": BLOCK_SIZE,
            "max_tokens": 8,
            "logprobs": 5,
            "round_actions": actions,
            "settle_s": 60,
            "kv_events": False,
        }
        try:
            result = run_llm(args, work, name="on" if on else "off", timeout=1800)
        finally:
            if server.proc is not None:
                server.proc.send_signal(signal.SIGCONT)
    return {"settled": result["rounds"][0].get("settled"), **summarize(result, where, n)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="requests per case, each side")
    parser.add_argument("--slow-read-s", type=float, default=workload.SLOW_READ_S)
    parser.add_argument("--compare-off", action="store_true", help="also load_or_recompute off")
    parser.add_argument(
        "--off-first", action="store_true", help="with --compare-off: off runs first"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cfg = TinyLlamaConfig(
        num_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden
    )
    block_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * BLOCK_SIZE * 4
    report: dict[str, Any] = {"machine": platform.platform(), "requests": args.requests}
    with tempfile.TemporaryDirectory(prefix="vllm-cost-") as tmp:
        model = write_tiny_llama(Path(tmp) / "model", cfg)
        order = (False, True) if args.off_first else (True, False)
        for on in order if args.compare_off else (True,):
            work = Path(tmp) / ("on" if on else "off")
            work.mkdir()
            name = "load_or_recompute on" if on else "load_or_recompute off"
            report[name] = run_once(model, block_bytes, args.requests, args.slow_read_s, on, work)
            print(f"\n{name} (settled: {report[name]['settled']})")
            print(
                f"{'case':15} {'ours p50':>9} {'none p50':>9} {'ratio':>6} {'ours p90':>9} "
                f"{'none p90':>9} {'ratio':>6} {'ours max':>9} {'same':>6}  decisions"
            )
            for case in workload.CASES:
                c = report[name][case]
                d = {k.removeprefix("tier_"): int(v) for k, v in c["decisions"].items() if v}
                print(
                    f"{case:15} {c['ours_median_s'] * 1e3:8.1f}ms "
                    f"{c['base_median_s'] * 1e3:8.1f}ms "
                    f"{c['ratio_median']:6.2f} {c['ours_p90_s'] * 1e3:8.1f}ms "
                    f"{c['base_p90_s'] * 1e3:8.1f}ms {c['ratio_p90']:6.2f} "
                    f"{c['ours_max_s'] * 1e3:8.1f}ms {c['identical_outputs']:>6}  {d}"
                )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
