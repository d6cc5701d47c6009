"""Tokens recomputed after failed loads: vLLM 0.34's own failure policy against ours, under
the same faults, through vLLM's real scheduler.

vLLM's ``Scheduler`` and offloading connector run in this process (the scheduler side and
the worker side, as vLLM's own connector tests drive them), over our ``AsyncOffloadSpec``:
our manager, and our worker copying between CPU KV tensors and its host slots. No model
runs: each step the worker side starts the step's loads and stores, waits for them, and
reports what vLLM's model runner reports (finished loads, failed requests, the blocks that
failed to load); the scheduler then takes the step's output. Every count below is what
vLLM's scheduler scheduled.

The workload: ``--requests`` prompts of ``--blocks`` blocks of 16 tokens and 8 more, each
run once
(its blocks stored into our CPU tier), then again (prefix caching off: their blocks come
back from our tier). The second round runs under one fault, drawn by a ``FaultPlan`` on
the worker, the same for both connectors:

- ``none``: no fault (the baseline: what the second round computes when every load lands);
- ``job``: every load job fails, on both copy paths (a persistent device error);
- ``slot``: the host slot holding block ``--blocks // 2`` of each prompt is damaged (every
  copy touching it fails, on every path); the prompt's other slots copy;
- ``sync``: as ``slot``, with the loads made synchronous (``sync_load_budget_bytes``: vLLM
  waits for them within the step that computes the request).

For each connector, ``vLLM's`` (``OffloadingConnector``, ``kv_load_failure_policy``
``recompute``) and ours (``AsyncOffloadConnector``, the same policy), it reports the
prompt tokens the second round computed beyond the baseline's (recomputed because of the
fault), and whether the engine survived (a ``RuntimeError`` out of the connector ends
vLLM's engine). Needs vLLM 0.34's modules::

    make .vllm-0.34/.complete   # (make test-vllm does it)
    PYTHONPATH=.vllm-0.34/site .venv-vllm/bin/python benchmarks/vllm_failures.py
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import asyncoffload as ao
from asyncoffload.integrations.vllm import AsyncOffloadConnector, AsyncOffloadWorker
from asyncoffload.integrations.vllm.versions import installed_api

BLOCK = 16
#: Tokens after a prompt's last full block.
TAIL = 8
HEADS, HEAD_SIZE = 2, 16
FAULTS = ("none", "job", "slot", "sync")
EOS = 2


def tiny_llama(folder: Path) -> str:
    """The config of a small Llama (no weights: no model runs here)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HEADS * HEAD_SIZE,
        "intermediate_size": 64,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "num_hidden_layers": 1,
        "vocab_size": 1024,
        "max_position_embeddings": 8192,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": EOS,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


class Engine:
    """vLLM's scheduler and a worker-side connector of ``connector`` over our spec."""

    def __init__(self, model: str, connector: str, num_gpu_blocks: int, sync_budget: int) -> None:
        extra: dict[str, Any] = {
            "spec_name": "AsyncOffloadSpec",
            "spec_module_path": "asyncoffload.integrations.vllm",
            "cpu_bytes_to_use": 64 << 20,
            "sync_load_budget_bytes": sync_budget,
        }
        transfer = KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=(
                "asyncoffload.integrations.vllm" if connector != "OffloadingConnector" else None
            ),
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
        model_config = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32")
        scheduler_config = SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=8192,
            max_model_len=8192,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        )
        cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
        cache.kv_cache_layout = "LBNHC"
        self.config = VllmConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache,
            kv_transfer_config=transfer,
        )
        self.config.cache_config.num_gpu_blocks = num_gpu_blocks
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
        )
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(1)]
        kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=spec.page_size_bytes * num_gpu_blocks,
                    layers=layers,
                    layer_stride=spec.page_size_bytes * num_gpu_blocks,
                    block_stride=spec.page_size_bytes,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        )
        block_size, hash_size = resolve_kv_cache_block_sizes(kv_cache_config, self.config)
        with set_current_vllm_config(self.config):
            self.scheduler = Scheduler(
                vllm_config=self.config,
                kv_cache_config=kv_cache_config,
                log_stats=False,
                structured_output_manager=StructuredOutputManager(self.config),
                block_size=block_size,
                hash_block_size=hash_size,
            )
            cls = (
                OffloadingConnector if connector == "OffloadingConnector" else AsyncOffloadConnector
            )
            self.worker = cls(self.config, KVConnectorRole.WORKER, kv_cache_config)
            kv_caches = {
                name: torch.randn(num_gpu_blocks, 2, BLOCK, HEADS, HEAD_SIZE) for name in layers
            }
            self.worker.register_kv_caches(kv_caches)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self.computed: Counter[str] = Counter()

    @property
    def offload_worker(self) -> AsyncOffloadWorker:
        side = self.worker.connector_worker
        assert side is not None and isinstance(side.worker, AsyncOffloadWorker)
        return side.worker

    def add(self, req_id: str, tokens: list[int]) -> None:
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, EOS)
        self.scheduler.add_request(
            Request(
                request_id=req_id,
                prompt_token_ids=tokens,
                sampling_params=params,
                pooling_params=None,
                block_hasher=self.hasher,
            )
        )

    def run(self, max_steps: int = 10_000) -> None:
        """Step until every request finished and every transfer ended."""
        worker = self.worker
        connector = self.scheduler.connector
        for _ in range(max_steps):
            jobs = getattr(getattr(connector, "connector_scheduler", None), "_jobs", {})
            if not self.scheduler.requests and not self.scheduler.finished_req_ids and not jobs:
                return
            out = self.scheduler.schedule()
            for req_id, n in out.num_scheduled_tokens.items():
                self.computed[req_id] += n
            meta = out.kv_connector_metadata
            assert meta is not None
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(self.context)
            worker.wait_for_save()
            results = worker.get_transfer_results(out.finished_req_ids)
            invalid = worker.get_block_ids_with_load_errors()
            worker_meta = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            # Every request that ran a step samples EOS: one token, then it ends.
            running = [
                r for r in self.scheduler.running if r.request_id in out.num_scheduled_tokens
            ]
            output = ModelRunnerOutput(
                req_ids=[r.request_id for r in running],
                sampled_token_ids=[[EOS] for _ in running],
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=None,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=results.finished_sending,
                    finished_recving=results.finished_recving,
                    invalid_block_ids=invalid,
                    kv_connector_worker_meta=worker_meta,
                    failed_recving=results.failed_recving or set(),
                ),
            )
            self.scheduler.update_from_output(out, output)
            # A sampled token of a prompt not yet fully computed is dropped by vLLM; the
            # request goes on. Nothing else to do here.
        raise RuntimeError(f"the engine did not settle in {max_steps} steps")


def scenario(model: str, connector: str, fault: str, requests: int, blocks: int) -> dict[str, Any]:
    """One connector under one fault: the second round's computed prompt tokens."""
    sync_budget = 1 << 30 if fault == "sync" else 0
    engine = Engine(
        model, connector, num_gpu_blocks=requests * blocks + 64, sync_budget=sync_budget
    )
    gen = torch.Generator().manual_seed(7)
    # A partial last block: every full block can load, and a tail is left to compute.
    prompts = [
        (torch.randint(3, 1000, (blocks * BLOCK + TAIL,), generator=gen)).tolist()
        for _ in range(requests)
    ]
    for i, tokens in enumerate(prompts):
        engine.add(f"warm-{i}", tokens)
    engine.run()
    worker = engine.offload_worker
    if fault == "job":
        worker.inject_faults(ao.FaultPlan(ao.Fault.copy_error(rate=1.0, direction="load")))
    elif fault in ("slot", "sync"):
        # The worker's slots go to stores in order, one block each, none evicted here:
        # prompt i's block b sits in slot i * blocks + b. Its middle block's is damaged.
        slots = [i * blocks + blocks // 2 for i in range(requests)]
        worker.inject_faults(ao.FaultPlan(ao.Fault.slot_error(slots, direction="load")))
    died = ""
    for i, tokens in enumerate(prompts):
        engine.add(f"again-{i}", tokens)
    try:
        engine.run()
    except RuntimeError as exc:
        died = str(exc)
    computed = sum(n for req, n in engine.computed.items() if req.startswith("again-"))
    stats = worker.stats()
    return {
        "connector": connector,
        "fault": fault,
        "computed": computed,
        "died": died,
        "load_failures": stats.load.failures + stats.expedited.failures,
        "expedited": stats.expedited.jobs + stats.expedited.failures,
    }


def cpu_platform() -> None:
    """vLLM's CUDA build finds no platform on a machine without a GPU; no kernel runs here,
    so it gets the CPU device its config asks for (as in tests/vllm_upstream)."""
    from vllm.platforms import current_platform

    if type(current_platform).__name__ == "UnspecifiedPlatform":
        current_platform.device_type = "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    api = installed_api()
    if not api.failed_jobs:
        raise SystemExit(f"needs vLLM 0.34's modules (found {api.version}); see the docstring")
    logging.disable(logging.WARNING)
    cpu_platform()
    prompt = args.blocks * BLOCK + TAIL
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_llama(Path(tmp))
        for connector in ("OffloadingConnector", "AsyncOffloadConnector"):
            base = None
            for fault in FAULTS:
                row = scenario(model, connector, fault, args.requests, args.blocks)
                if fault == "none":
                    base = row["computed"]
                assert base is not None
                row["recomputed"] = row["computed"] - base
                row["recomputed_share"] = row["recomputed"] / (args.requests * args.blocks * BLOCK)
                rows.append(row)
    print(
        f"vLLM {api.version}, {args.requests} prompts of {args.blocks} blocks "
        f"({prompt} tokens), {platform.node()} ({platform.processor() or platform.machine()})"
    )
    print(
        f"{'connector':24} {'fault':6} {'computed':>9} {'recomputed':>11} {'share':>6} "
        f"{'sync':>5}  engine"
    )
    for row in rows:
        print(
            f"{row['connector']:24} {row['fault']:6} {row['computed']:9d} "
            f"{row['recomputed'] if not row['died'] else '-':>11} "
            f"{row['recomputed_share'] if not row['died'] else 0:6.1%} {row['expedited']:5d}  "
            f"{'died: ' + row['died'][:60] if row['died'] else 'served'}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
