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
- how many requests got the baseline's greedy tokens (all of them, for a correct connector);
- with ``--repeat N``, each repeat's ratios (its two runs side by side in time).

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

Tensor parallelism and lower tiers (issue 21)::

    .venv-vllm/bin/python benchmarks/vllm_serving.py --tp 2 --disk /tmp/kv [--cpu-blocks 16]

``--tp N`` runs both configurations with ``tensor_parallel_size=N``; on vLLM's CPU build
each worker is bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND``, the first N
cores this process may use). ``--disk DIR`` gives the offloading configuration a disk tier
(``--disk-mode`` files by default, admission null) under a CPU tier of ``--cpu-blocks``
blocks (default: two prefixes' worth, fewer than the workload's prefix blocks), so the
shared prefixes are pushed out of the CPU tier between rounds and come back from disk;
each offloading run gets a fresh subdirectory of DIR, and the host pools live in a
temporary directory (in /dev/shm where there is one). ``--tiers JSON`` takes any list of
lower tiers instead (``EngineConfig.tiers`` settings). With tiers it also reports the
tiers' counters from vLLM's metrics (``vllm:asyncoffload_tier_*``, every round), the
CPU-tier loads that did not come from a lower tier, and the layout: one value per block
holding every rank's slice (1 write or read operation per block), of 4096 header bytes +
N x the per-rank chunk bytes (computed from the model's config and checked against the
disk tier's files after the run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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
#: Every lower-tier value starts with a 4096-byte header (asyncoffload/tiers/format.py).
VALUE_HEADER_BYTES = 4096
#: vLLM's metrics for the lower tiers, summed over them (docs/vllm.md, "Tiers under vLLM").
TIER_METRICS = {
    "tier_blocks_written": "vllm:asyncoffload_tier_blocks_written",
    "tier_blocks_read": "vllm:asyncoffload_tier_blocks_read",
    "tier_write_failures": "vllm:asyncoffload_tier_write_failures",
    "tier_read_failures": "vllm:asyncoffload_tier_read_failures",
    "tier_skipped": "vllm:asyncoffload_tier_skipped",
    "tier_ready_blocks": "vllm:asyncoffload_tier_ready_blocks",
    "cpu_blocks_loaded": "vllm:asyncoffload_blocks_loaded",
    "cpu_blocks_stored": "vllm:asyncoffload_blocks_stored",
    "cpu_blocks_evicted": "vllm:asyncoffload_blocks_evicted",
}


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


def tp_args(world: int) -> dict[str, Any]:
    """Runner args for ``tensor_parallel_size=world``. vLLM's CPU build binds each TP
    worker to a core of its own (without it: "Not enough allowed NUMA nodes"): the first
    ``world`` cores this process may use (as tests/vllm/test_tp_vllm.py does)."""
    if world <= 1:
        return {"llm_kwargs": {}, "env": {}}
    cpus = sorted(os.sched_getaffinity(0))
    bind = "|".join(str(cpus[i % len(cpus)]) for i in range(world))
    return {
        "llm_kwargs": {"tensor_parallel_size": world},
        "env": {"VLLM_CPU_OMP_THREADS_BIND": bind},
    }


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float": 4, "half": 2}


def kv_bytes_per_block(model_dir: str, *, world: int, block_size: int, dtype: str) -> int:
    """One rank's KV bytes of one block: layers x (K, V) x kv_heads / world x head_dim x
    block_size x dtype bytes, from the checkpoint's config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    if kv_heads % world:
        raise SystemExit(f"{kv_heads} KV heads do not split over tensor_parallel_size {world}")
    per_rank_heads = kv_heads // world
    layers = int(cfg["num_hidden_layers"])
    return layers * 2 * per_rank_heads * head_dim * block_size * _DTYPE_BYTES[dtype]


def disk_tier(path: Path, mode: str) -> dict[str, Any]:
    """A disk tier that takes every block (admission null) and holds the workload."""
    return {"kind": "disk", "path": str(path), "mode": mode, "capacity": "4GiB", "admission": None}


def block_files(tiers: list[dict[str, Any]]) -> list[int]:
    """Sizes of the block files (``*.kv``, files mode) of the disk tiers after a run."""
    sizes: list[int] = []
    for tier in tiers:
        if tier.get("kind", "remote" if "url" in tier else "disk") != "disk":
            continue
        root = Path(tier["path"])
        if root.is_dir():
            sizes.extend(f.stat().st_size for f in root.rglob("*.kv") if f.is_file())
    return sizes


def tier_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """The tiers' counters from vLLM's metrics (every round and the warm-up): blocks
    written to and read (promoted) from the lower tiers, failures, skips, and the CPU
    tier's loads; ``cpu_loads_not_from_tier`` = loads minus promotions, the blocks vLLM
    loaded that were still in the CPU tier (at least: a promoted block may be evicted
    before it is loaded). None: the run reported no tier metrics at all."""
    metrics = result.get("metrics", {})
    out: dict[str, float | None] = {k: metrics.get(v) for k, v in TIER_METRICS.items()}
    if out["tier_ready_blocks"] is not None:
        # The tiers report: a counter that never moved is not in vLLM's registry.
        out = {k: 0.0 if v is None else v for k, v in out.items()}
    loaded, read = out["cpu_blocks_loaded"], out["tier_blocks_read"]
    out["cpu_loads_not_from_tier"] = (
        max(0.0, loaded - read) if loaded is not None and read is not None else None
    )
    return out


@contextmanager
def host_pool_dir() -> Iterator[str]:
    """A temporary directory for the host pool files, on tmpfs where there is one."""
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(
        prefix="vllm-serving-pools-", dir=str(shm) if shm.is_dir() else None
    ) as d:
        yield d


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
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of both runs")
    p.add_argument(
        "--disk",
        help="give the offloading run a disk tier here (a fresh subdirectory per run)",
    )
    p.add_argument("--disk-mode", choices=("files", "slab"), default="files")
    p.add_argument(
        "--tiers",
        help="JSON list of lower tiers for the offloading run (EngineConfig.tiers settings)",
    )
    p.add_argument(
        "--cpu-blocks",
        type=int,
        default=0,
        help="with tiers: the CPU tier's blocks (default: two prefixes' worth)",
    )
    p.add_argument(
        "--cpu-bytes",
        type=int,
        default=0,
        help="with tiers: cpu_bytes_to_use, all ranks (default: from --cpu-blocks)",
    )
    p.add_argument("--repeat", type=int, default=1, help="alternate baseline/offload N times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per vLLM run, seconds")
    p.add_argument("--workdir", help="keep runner args, outputs and logs here")
    p.add_argument("--json", help="write the summary here")
    a = p.parse_args(argv)

    kv_transfer_config = json.loads(a.kv_transfer_config)
    if a.disk and a.tiers:
        p.error("--disk and --tiers: give one")
    user_tiers: list[dict[str, Any]] | None = json.loads(a.tiers) if a.tiers else None
    with_tiers = bool(a.disk or user_tiers)
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
        parallel = tp_args(a.tp)
        dtype = "float32"  # the runner's default
        rank_bytes = kv_bytes_per_block(model, world=a.tp, block_size=BLOCK_SIZE, dtype=dtype)
        value_bytes = VALUE_HEADER_BYTES + a.tp * rank_bytes
        cpu_blocks = a.cpu_blocks or 2 * a.prefix_blocks
        cpu_bytes = a.cpu_bytes or cpu_blocks * a.tp * rank_bytes
        if with_tiers:
            cpu_blocks = cpu_bytes // (a.tp * rank_bytes)
            if cpu_blocks >= a.prefixes * a.prefix_blocks:
                print(
                    f"note: the CPU tier ({cpu_blocks} blocks) holds every prefix "
                    f"({a.prefixes} x {a.prefix_blocks} blocks): the lower tiers will "
                    "hardly be read",
                    file=sys.stderr,
                )
        base_args: dict[str, Any] = {
            "model": model,
            "rounds": rounds,
            "max_tokens": a.max_tokens,
            "logprobs": 1,
            "num_gpu_blocks": num_gpu_blocks,
            "max_model_len": (num_gpu_blocks - 1) * BLOCK_SIZE,
            "block_size": BLOCK_SIZE,
            "kv_events": False,
            "llm_kwargs": {"enable_prefix_caching": a.prefix_caching, **parallel["llm_kwargs"]},
            "env": parallel["env"],
        }
        runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "offload": []}
        tokens: dict[str, dict[tuple[int, int], list[int]]] = {}
        file_sizes: list[int] = []
        with host_pool_dir() as pools:
            for rep in range(a.repeat):
                tiers: list[dict[str, Any]] = []
                if a.disk:
                    # A fresh directory per run: files mode keeps blocks across restarts.
                    tiers = [disk_tier(Path(a.disk) / f"offload-{rep}", a.disk_mode)]
                elif user_tiers:
                    tiers = user_tiers
                offload_config = kv_transfer_config
                if tiers:
                    extra = dict(kv_transfer_config.get("kv_connector_extra_config", {}))
                    extra.update(cpu_bytes_to_use=cpu_bytes, tiers=tiers, host_pool_dir=pools)
                    offload_config = {**kv_transfer_config, "kv_connector_extra_config": extra}
                for name, kvt in (("baseline", None), ("offload", offload_config)):
                    print(f"[{name} #{rep}] starting vLLM ...", file=sys.stderr, flush=True)
                    result = run_llm(
                        {**base_args, "kv_transfer_config": kvt},
                        workdir,
                        name=f"{name}-{rep}",
                        timeout=a.timeout,
                    )
                    summary_run = summarize(result, first_round=1)
                    if name == "offload" and with_tiers:
                        summary_run["tiers"] = tier_figures(result)
                        sizes = block_files(tiers)
                        summary_run["block_files"] = len(sizes)
                        file_sizes.extend(sizes)
                    runs[name].append(summary_run)
                    tokens.setdefault(
                        name,
                        {(r["round"], r["index"]): r["token_ids"] for r in result["requests"]},
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
    # Each repeat's offload / baseline, the two runs side by side in time.
    paired = {
        key: [
            _ratio(o[f"{key}_s"], b[f"{key}_s"]) for b, o in zip(runs["baseline"], runs["offload"])
        ]
        for key in ("ttft_median", "ttft_p90", "prefill_median")
    }
    layout: dict[str, Any] | None = None
    if with_tiers:
        layout = {
            "world_size": a.tp,
            "rank_chunk_bytes": rank_bytes,
            "values_per_block": 1,
            "write_ops_per_block": 1,
            "read_ops_per_block": 1,
            "value_bytes_computed": value_bytes,
            "block_files_per_run": [r.get("block_files") for r in runs["offload"]],
            "block_file_sizes": sorted(set(file_sizes)),
            "header_share": VALUE_HEADER_BYTES / value_bytes,
            "cpu_tier_blocks": cpu_blocks,
            "cpu_bytes_to_use": cpu_bytes,
            "workload_prefix_blocks": a.prefixes * a.prefix_blocks,
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
            "tensor_parallel_size": a.tp,
            "cpu_threads_bind": parallel["env"].get("VLLM_CPU_OMP_THREADS_BIND"),
        },
        "layout": layout,
        "kv_transfer_config": kv_transfer_config,
        "baseline": base,
        "offload": off,
        "ratios_offload_over_baseline": ratios,
        "paired_ratios_per_repeat": paired,
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
    if a.repeat > 1:
        print(
            "each repeat's offload / baseline: "
            + "; ".join(
                f"{key} " + " ".join(f"{v:.2f}" for v in values) for key, values in paired.items()
            )
        )
    if layout is not None:
        t = off["tiers"]

        def num(key: str) -> str:
            v = t.get(key)
            return "n/a" if v is None else f"{v:.0f}"

        print(
            f"lower tiers (offload run, all rounds): blocks written {num('tier_blocks_written')}, "
            f"read {num('tier_blocks_read')}, write failures {num('tier_write_failures')}, "
            f"read failures {num('tier_read_failures')}, skipped {num('tier_skipped')}, "
            f"ready at the end {num('tier_ready_blocks')}"
        )
        print(
            f"CPU tier ({cpu_blocks} blocks for {layout['workload_prefix_blocks']} prefix "
            f"blocks): blocks loaded into vLLM {num('cpu_blocks_loaded')}, of which "
            f"promoted from the lower tiers {num('tier_blocks_read')} and still in the CPU "
            f"tier {num('cpu_loads_not_from_tier')}; stored {num('cpu_blocks_stored')}, "
            f"evicted {num('cpu_blocks_evicted')}"
        )
        sizes = layout["block_file_sizes"]
        print(
            f"layout: TP {a.tp}, one value per block holding every rank's slice: 1 write op "
            f"and 1 read op per block; {value_bytes} B per value = {VALUE_HEADER_BYTES} "
            f"header + {a.tp} x {rank_bytes} B per rank (header {layout['header_share']:.1%}); "
            f"block files on disk per run: {layout['block_files_per_run']}, sizes {sizes}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
