"""Repeated-prefix serving through real vLLM (CPU build): an offloading connector vs none.

Workload: ``--prefixes`` long shared prefixes (``--prefix-blocks`` blocks of 32 tokens
each). Every round sends ``--requests`` requests at once; request ``i`` is prefix
``i % prefixes`` plus a fresh random suffix, so no request repeats but all share prefixes.
vLLM gets a GPU block budget (``--num-gpu-blocks``) of about two requests, so its own
prefix cache (on by default on both sides; ``--no-prefix-caching`` turns it off) loses the
prefixes between rounds, and only the connector can bring them back.

Both configurations run in one invocation, one vLLM process each, in turn (``--repeat``
alternates them). Reported, over the warm rounds (all but the first):

- prefill tokens computed: prompt tokens minus ``num_cached_tokens``, summed; and how many
  of the cached tokens vLLM counts as its own prefix cache vs external (the connector);
- time to first token (frontend arrival to first token; requests queue behind each other
  inside a round, as in a burst) and prefill time (engine-core scheduled to first token):
  median and p90;
- the ratios offloading / baseline;
- how many requests got the baseline's greedy tokens (all of them, for a correct connector).

    .venv-vllm/bin/python benchmarks/vllm_serving.py [--kv-transfer-config JSON]
        [--model DIR] [--requests 8] [--rounds 4] [--prefixes 2] [--prefix-blocks 8]

The default ``--kv-transfer-config`` targets ``asyncoffload.integrations.vllm``'s
``AsyncOffloadSpec``. The harness-check spec runs with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "ToyOffloadingSpec",
      "spec_module_path": "tests.vllm.toy_spec", "cpu_bytes_to_use": 268435456}}'

Without ``--model`` a random-weight Llama is written to a temporary directory
(``tests/vllm/tiny_model.py``; ``--layers``/``--hidden`` make it bigger, so prefill costs
more against vLLM's per-step overhead).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm.harness import (
    BLOCK_SIZE,
    asyncoffload_kv_transfer_config,
    random_prompt,
    run_llm,
)
from tests.vllm.tiny_model import TinyLlamaConfig, write_tiny_llama

DEFAULT_KV_TRANSFER_CONFIG = asyncoffload_kv_transfer_config(cpu_bytes_to_use=256 << 20)


def build_rounds(
    *, seed: int, rounds: int, requests: int, prefixes: int, prefix_len: int, suffix_len: int
) -> list[list[list[int]]]:
    rng = random.Random(seed)
    shared = [random_prompt(rng, prefix_len) for _ in range(prefixes)]
    return [
        [shared[i % prefixes] + random_prompt(rng, suffix_len) for i in range(requests)]
        for _ in range(rounds)
    ]


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(result: dict[str, Any], first_round: int) -> dict[str, Any]:
    reqs = [r for r in result["requests"] if r["round"] >= first_round]
    prompt = sum(r["prompt_len"] for r in reqs)
    cached = sum(r["num_cached_tokens"] or 0 for r in reqs)
    ttft = [r["metrics"]["ttft_s"] for r in reqs if r["metrics"]]
    prefill = [r["metrics"].get("prefill_s", float("nan")) for r in reqs if r["metrics"]]
    metrics = result.get("metrics", {})
    return {
        "requests": len(reqs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens_computed": prompt - cached,
        # vLLM's counters cover every round (and the warm-up request).
        "all_rounds_local_prefix_cache_hits": metrics.get("vllm:prefix_cache_hits"),
        "all_rounds_external_prefix_cache_hits": metrics.get("vllm:external_prefix_cache_hits"),
        "ttft_median_s": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p90_s": _quantile(ttft, 0.9),
        "prefill_median_s": statistics.median(prefill) if prefill else float("nan"),
        "prefill_p90_s": _quantile(prefill, 0.9),
        "round_wall_s": [round(r["wall_s"], 4) for r in result["rounds"]],
        "startup_s": result.get("startup_s"),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--kv-transfer-config",
        default=json.dumps(DEFAULT_KV_TRANSFER_CONFIG),
        help="JSON for vLLM's KVTransferConfig (default: AsyncOffloadSpec, 256 MiB, lru)",
    )
    p.add_argument("--model", help="checkpoint directory (default: a random tiny Llama)")
    p.add_argument("--layers", type=int, default=4, help="generated model's layers")
    p.add_argument("--hidden", type=int, default=256, help="generated model's hidden size")
    p.add_argument("--requests", type=int, default=8, help="requests per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prefixes", type=int, default=4, help="distinct shared prefixes")
    p.add_argument("--prefix-blocks", type=int, default=8, help="prefix length in blocks of 32")
    p.add_argument("--suffix-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=0,
        help="vLLM's KV block budget (default: two requests' worth plus the null block)",
    )
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's own prefix cache, on both sides (default: on)",
    )
    p.add_argument("--repeat", type=int, default=1, help="alternate baseline/offload N times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per vLLM run, seconds")
    p.add_argument("--workdir", help="keep runner args, outputs and logs here")
    p.add_argument("--json", help="write the summary here")
    a = p.parse_args(argv)

    kv_transfer_config = json.loads(a.kv_transfer_config)
    prefix_len = a.prefix_blocks * BLOCK_SIZE
    request_len = prefix_len + a.suffix_tokens + a.max_tokens
    blocks_per_request = -(-request_len // BLOCK_SIZE)
    num_gpu_blocks = a.num_gpu_blocks or 2 * blocks_per_request + 1
    rounds = build_rounds(
        seed=a.seed,
        rounds=a.rounds,
        requests=a.requests,
        prefixes=a.prefixes,
        prefix_len=prefix_len,
        suffix_len=a.suffix_tokens,
    )

    with tempfile.TemporaryDirectory(prefix="vllm-serving-") as tmp:
        workdir = Path(a.workdir) if a.workdir else Path(tmp)
        if a.model:
            model = a.model
        else:
            heads = max(2, a.hidden // 64)
            cfg = TinyLlamaConfig(
                num_layers=a.layers,
                hidden_size=a.hidden,
                intermediate_size=2 * a.hidden,
                num_heads=heads,
                num_kv_heads=max(1, heads // 2),
            )
            model = str(write_tiny_llama(workdir / "model", cfg))
        base_args: dict[str, Any] = {
            "model": model,
            "rounds": rounds,
            "max_tokens": a.max_tokens,
            "logprobs": 1,
            "num_gpu_blocks": num_gpu_blocks,
            "max_model_len": (num_gpu_blocks - 1) * BLOCK_SIZE,
            "block_size": BLOCK_SIZE,
            "kv_events": False,
            "llm_kwargs": {"enable_prefix_caching": a.prefix_caching},
        }
        runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "offload": []}
        tokens: dict[str, dict[tuple[int, int], list[int]]] = {}
        for rep in range(a.repeat):
            for name, kvt in (("baseline", None), ("offload", kv_transfer_config)):
                print(f"[{name} #{rep}] starting vLLM ...", file=sys.stderr, flush=True)
                result = run_llm(
                    {**base_args, "kv_transfer_config": kvt},
                    workdir,
                    name=f"{name}-{rep}",
                    timeout=a.timeout,
                )
                runs[name].append(summarize(result, first_round=1))
                tokens.setdefault(
                    name, {(r["round"], r["index"]): r["token_ids"] for r in result["requests"]}
                )

    # A connector that loads wrong bytes shows here: greedy tokens that differ.
    same = sum(tokens["offload"][k] == v for k, v in tokens["baseline"].items())

    def best(name: str) -> dict[str, Any]:  # the repeat with the lowest median TTFT
        return min(runs[name], key=lambda s: float(s["ttft_median_s"]))

    base, off = best("baseline"), best("offload")
    ratios = {
        "prefill_tokens_computed": _ratio(
            off["prefill_tokens_computed"], base["prefill_tokens_computed"]
        ),
        "ttft_median": _ratio(off["ttft_median_s"], base["ttft_median_s"]),
        "ttft_p90": _ratio(off["ttft_p90_s"], base["ttft_p90_s"]),
        "prefill_median": _ratio(off["prefill_median_s"], base["prefill_median_s"]),
    }
    summary = {
        "platform": platform.platform(),
        "workload": {
            "rounds": a.rounds,
            "requests_per_round": a.requests,
            "prefixes": a.prefixes,
            "prefix_tokens": prefix_len,
            "suffix_tokens": a.suffix_tokens,
            "max_tokens": a.max_tokens,
            "num_gpu_blocks": num_gpu_blocks,
            "prefix_caching": a.prefix_caching,
            "model": model if a.model else f"random llama {a.layers}x{a.hidden}",
        },
        "kv_transfer_config": kv_transfer_config,
        "baseline": base,
        "offload": off,
        "ratios_offload_over_baseline": ratios,
        "requests_with_identical_greedy_tokens": [same, len(tokens["baseline"])],
        "all_repeats": runs,
    }

    print(f"warm rounds 1..{a.rounds - 1}, {a.requests} requests each, best of {a.repeat}")
    print(f"{'':28}{'baseline':>12}{'offload':>12}{'ratio':>8}")
    rows = [
        ("prefill tokens computed", "prefill_tokens_computed", "{:d}", "prefill_tokens_computed"),
        ("cached tokens", "cached_tokens", "{:d}", None),
        ("TTFT median (ms)", "ttft_median_s", "ms", "ttft_median"),
        ("TTFT p90 (ms)", "ttft_p90_s", "ms", "ttft_p90"),
        ("prefill median (ms)", "prefill_median_s", "ms", "prefill_median"),
    ]
    for label, key, fmt, ratio_key in rows:

        def cell(s: dict[str, Any], key: str = key, fmt: str = fmt) -> str:
            return f"{s[key] * 1e3:.1f}" if fmt == "ms" else fmt.format(s[key])

        ratio = f"{ratios[ratio_key]:.2f}" if ratio_key else ""
        print(f"{label:28}{cell(base):>12}{cell(off):>12}{ratio:>8}")
    print(
        "external (connector) prefix-cache hits, all rounds: "
        f"baseline {base['all_rounds_external_prefix_cache_hits']}, "
        f"offload {off['all_rounds_external_prefix_cache_hits']}"
    )
    print(f"requests with the baseline's greedy tokens: {same}/{len(tokens['baseline'])}")
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
