"""Run real vLLM on token-id prompts in rounds and write what happened as JSON.

    python -m tests.vllm.llm_runner ARGS.json OUT.json

Run it as a subprocess: vLLM spawns an engine-core process (and on CPU a worker in it),
keeps global state, and cannot be started twice in one interpreter reliably.

ARGS.json (only ``model`` and ``rounds`` are required)::

    {
      "model": "/path/to/checkpoint",          # e.g. written by tests.vllm.tiny_model
      "rounds": [[[1, 2, 3, ...], ...], ...],  # rounds of prompts; a prompt is token ids,
                                               # or {"prompt_token_ids": [...],
                                               #     "cache_salt": "a"} (a tenant)
      "max_tokens": 8,                         # greedy (temperature 0, ignore_eos)
      "logprobs": 5,                           # top-k logprobs per generated token
      "num_gpu_blocks": 32,                    # num_gpu_blocks_override
      "max_model_len": 2048,
      "block_size": 32,                        # CPU attention needs a multiple of 32
      "kv_transfer_config": null,              # dict for vllm KVTransferConfig, or null
      "kv_events": true,                       # subscribe to vLLM's ZMQ KV events
      "warmup_prompt_len": 40,                 # untimed warm-up request first; 0: none
      "settle_s": 0,                           # > 0: after each round, settle (below)
      "settle_until": {},                      # ...until these counters reach these too
      "dtype": "float32", "enforce_eager": true,
      "llm_kwargs": {},                        # any other vllm.LLM keyword arguments
      "kv_transfer_params": null,              # every round's requests carry these
                                               # (a prompt dict's own override them)
      "round_actions": {"3": {"before": [...], "after": [...]}},  # see below
      "env": {}                                # env vars set before vllm is imported
    }

OUT.json::

    {
      "ok": true, "vllm_version": "0.32.0",
      "startup_s": 19.0,                       # vllm.LLM(...) construction
      "warmup_s": 2.7,
      "shutdown_s": 1.2,
      "rounds": [{"index": 0, "wall_s": 0.8, "num_requests": 2,
                  "settled": true, "settle_s": 0.3}, ...],  # settle keys with settle_s
      "requests": [{
          "round": 0, "index": 0, "request_id": "0",
          "prompt_len": 192, "token_ids": [...],
          "logprobs": [-0.12, ...],            # logprob of each generated token
          "top_logprobs": [{"17": -0.12, ...}, ...],  # top-k per position (ids as str)
          "num_cached_tokens": 160,            # prefix-cache or connector hits
          "finish_reason": "length",
          "metrics": {"ttft_s": 0.05,          # frontend arrival -> first token
                      "queued_ts": ..., "scheduled_ts": ..., "first_token_ts": ...,
                      "last_token_ts": ..., "prefill_s": ...}   # engine-core clock
      }, ...],
      "kv_events": [{"seq": 0, "ts": ..., "round": 0, "events": [
          {"type": "BlockStored", "block_hashes": ["ab12..."], "medium": "CPU",
           "parent_block_hash": null, "token_ids": [...], "block_size": 32, ...},
          {"type": "BlockRemoved", "block_hashes": [...], "medium": "CPU", ...}]}, ...],
      "kv_events_missing_seqs": [],            # gaps in the publisher's sequence numbers
      "metrics": {"vllm:prompt_tokens_total": 384.0, ...}   # counters and gauges
    }

Settling: with ``settle_s`` > 0, each round is followed by requests shorter than a block
(they store and look up nothing) until vLLM's gauge of the offloading CPU tier's slots
held by transfers in flight (``vllm:kv_offload_cpu_cache_usage_perc``: stores being
written, loads and lower-tier write-through pinning slots, promotions) reads 0, for at
most ``settle_s`` seconds, and until each metric of ``settle_until`` reads at least its
value (a lower tier's writes that backpressure holds back wait unpinned, outside the
gauge: ``{"vllm:asyncoffload_tier_blocks_written": 6}`` waits for them). Each request
steps the scheduler, which takes the transfers that ended, and refreshes the gauge. A
round's ``settled`` says whether it was reached; a test whose next round needs the tiers
at rest asserts it.

Round actions, in order, before or after a round (its index as a string):
``{"reset_prefix_cache": true}`` (vLLM's prefix cache and the connector's CPU tier;
lower tiers keep their blocks), ``{"write": PATH, "text": TEXT}``, ``{"signal": PID,
"name": "SIGSTOP"}``, ``{"metrics": true}`` (a snapshot into the round's ``metrics``).

On failure it writes ``{"ok": false, "error": ..., "traceback": ...}`` where it can, prints
the error to stderr and exits 1. Block hashes (bytes) are written as hex.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["main"]

#: Set before vLLM is imported unless ARGS.json's "env" or the environment says otherwise.
DEFAULT_ENV = {
    # The CPU backend sizes its KV cache from this (GiB); num_gpu_blocks_override then
    # caps the number of blocks. The default (0) would mean a share of all RAM.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # sha256 block hashes are reproducible anyway; keep everything else reproducible too.
    "PYTHONHASHSEED": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


class _EventSubscriber:
    """Collects vLLM's KV event batches on a thread.

    The SUB socket binds a free loopback port and vLLM's publisher connects to it (an
    endpoint without ``*`` makes ``ZmqEventPublisher`` connect), so there is no port race.
    """

    def __init__(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 50)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:0")
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._frames: list[tuple[int, bytes, float]] = []
        self._round = -1
        self._tagged: list[int] = []
        self._last_rx = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                _topic, seq_bytes, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            with self._lock:
                self._frames.append((int.from_bytes(seq_bytes, "big"), payload, time.time()))
                self._tagged.append(self._round)
                self._last_rx = time.monotonic()

    def set_round(self, round_index: int) -> None:
        with self._lock:
            self._round = round_index

    def drain(self, quiet_s: float = 0.5, max_wait_s: float = 5.0) -> None:
        """Wait until no batch has arrived for ``quiet_s`` (the publisher is a thread)."""
        deadline = time.monotonic() + max_wait_s
        while time.monotonic() < deadline:
            with self._lock:
                idle = time.monotonic() - self._last_rx
            if idle >= quiet_s:
                return
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._ctx.term()

    def decoded(self) -> tuple[list[dict[str, Any]], list[int]]:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        with self._lock:
            frames = list(zip(self._frames, self._tagged))
        batches: list[dict[str, Any]] = []
        for (seq, payload, rx_ts), round_index in frames:
            batch = decoder.decode(payload)
            batches.append(
                {
                    "seq": seq,
                    "ts": batch.ts,
                    "rx_ts": rx_ts,
                    "round": round_index,
                    "data_parallel_rank": batch.data_parallel_rank,
                    "events": [_event_to_json(e) for e in batch.events],
                }
            )
        seqs = sorted(b["seq"] for b in batches)
        missing: list[int] = []
        if seqs:
            present = set(seqs)
            missing = [s for s in range(seqs[0], seqs[-1] + 1) if s not in present]
            if seqs[0] != 0:
                missing = list(range(seqs[0])) + missing
        return batches, missing


def _tokens(prompt: Any) -> list[int]:
    """A prompt's token ids (a prompt is a list of them, or a dict with a cache salt)."""
    return list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _event_to_json(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        out[name] = _jsonable(getattr(event, name))
    return out


def _top_logprobs(position: Any) -> dict[str, float]:
    if position is None:
        return {}
    return {str(tok): float(lp.logprob) for tok, lp in dict(position).items()}


def _request_metrics(stats: Any) -> dict[str, float] | None:
    if stats is None:
        return None
    out = {
        "ttft_s": float(stats.first_token_latency),
        "arrival_time": float(stats.arrival_time),
        "queued_ts": float(stats.queued_ts),
        "scheduled_ts": float(stats.scheduled_ts),
        "first_token_ts": float(stats.first_token_ts),
        "last_token_ts": float(stats.last_token_ts),
        "num_preemptions": float(stats.num_preemptions),
    }
    if stats.first_token_ts and stats.scheduled_ts:
        out["prefill_s"] = float(stats.first_token_ts - stats.scheduled_ts)
    if stats.first_token_ts and stats.queued_ts:
        out["queued_to_first_token_s"] = float(stats.first_token_ts - stats.queued_ts)
    return out


def _metric_snapshot(llm: Any) -> dict[str, float]:
    """Counters and gauges (summed over label sets) from vLLM's Prometheus registry."""
    from vllm.v1.metrics.reader import Counter, Gauge

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, (Counter, Gauge)):
            out[metric.name] = out.get(metric.name, 0.0) + float(metric.value)
    return out


def _build_llm(args: dict[str, Any], events_endpoint: str | None) -> Any:
    from vllm import LLM
    from vllm.config import KVEventsConfig

    block_size = int(args.get("block_size", 32))
    num_blocks = int(args.get("num_gpu_blocks", 32))
    kwargs: dict[str, Any] = {
        "model": args["model"],
        "skip_tokenizer_init": True,
        "block_size": block_size,
        "enable_prefix_caching": False,
        "num_gpu_blocks_override": num_blocks,
        # vLLM refuses to start unless one request of max_model_len fits the KV cache,
        # and one block is vLLM's null block.
        "max_model_len": int(args.get("max_model_len", min(2048, (num_blocks - 1) * block_size))),
        # The CPU platform downcasts float32 checkpoints to bfloat16 under "auto".
        "dtype": args.get("dtype", "float32"),
        "enforce_eager": bool(args.get("enforce_eager", True)),
        "seed": 0,
        "disable_log_stats": False,  # fills RequestOutput.metrics (TTFT)
    }
    if args.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = args["kv_transfer_config"]
    if events_endpoint is not None:
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint
        )
    kwargs.update(args.get("llm_kwargs") or {})
    return LLM(**kwargs)


def _shutdown(llm: Any) -> None:
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


#: The gauge a settle waits on: the offloading CPU tier's slots held by transfers.
SETTLE_GAUGE = "vllm:kv_offload_cpu_cache_usage_perc"


def _settle(
    llm: Any, params: Any, max_s: float, until: dict[str, float] | None = None
) -> tuple[bool, float]:
    """Step the engine with sub-block requests until nothing of the offloading CPU tier
    is in flight (:data:`SETTLE_GAUGE` is 0) and each metric of ``until`` reads at least
    its value, at most ``max_s`` seconds: (settled, s)."""
    t = time.perf_counter()
    deadline = t + max_s
    while True:
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
        snapshot = _metric_snapshot(llm)
        gauge = snapshot.get(SETTLE_GAUGE)
        if gauge is None:
            raise RuntimeError(f"settle_s needs the gauge {SETTLE_GAUGE}, which vLLM lacks")
        done = gauge == 0 and all(snapshot.get(k, 0.0) >= v for k, v in (until or {}).items())
        now = time.perf_counter()
        if done or now >= deadline:
            return done, now - t
        time.sleep(0.05)


def _act(llm: Any, actions: list[dict[str, Any]], record: dict[str, Any]) -> None:
    """Run a round's actions (see the module docstring)."""
    import signal

    for action in actions:
        if action.get("reset_prefix_cache"):
            llm.reset_prefix_cache(reset_connector=True)
        if "write" in action:
            Path(action["write"]).write_text(str(action["text"]))
        if "signal" in action:
            os.kill(int(action["signal"]), getattr(signal, action["name"]))
        if action.get("metrics"):
            record["metrics"] = _metric_snapshot(llm)


def _params_of(prompt: Any, params: Any) -> Any:
    """A prompt's sampling parameters: ``params``, with its own kv_transfer_params."""
    own = prompt.get("kv_transfer_params") if isinstance(prompt, dict) else None
    if own is None:
        return params
    out = params.clone()
    out.extra_args = {**(params.extra_args or {}), "kv_transfer_params": own}
    return out


def run(args: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import SamplingParams

    result: dict[str, Any] = {"ok": False, "vllm_version": vllm.__version__}
    sub = _EventSubscriber() if args.get("kv_events", True) else None
    llm = None
    try:
        t0 = time.perf_counter()
        llm = _build_llm(args, sub.endpoint if sub else None)
        result["startup_s"] = time.perf_counter() - t0
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(args.get("max_tokens", 8)),
            logprobs=int(args.get("logprobs", 5)),
            ignore_eos=True,
            seed=0,
            extra_args=(
                {"kv_transfer_params": args["kv_transfer_params"]}
                if args.get("kv_transfer_params")
                else None
            ),
        )
        warmup_len = int(args.get("warmup_prompt_len", 40))
        if warmup_len > 0:
            # The first forward pass pays one-off kernel set-up (seconds on CPU); keep it
            # out of round 0's timings. Its KV events are tagged round -1.
            t = time.perf_counter()
            llm.generate(
                [{"prompt_token_ids": [(7 * i) % 997 + 3 for i in range(warmup_len)]}],
                SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                use_tqdm=False,
            )
            result["warmup_s"] = time.perf_counter() - t
            if sub is not None:
                sub.drain()
        settle_s = float(args.get("settle_s", 0))
        settle_until = {str(k): float(v) for k, v in (args.get("settle_until") or {}).items()}
        tick = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        rounds: list[dict[str, Any]] = []
        requests: list[dict[str, Any]] = []
        actions = args.get("round_actions") or {}
        for r, prompts in enumerate(args["rounds"]):
            if sub is not None:
                sub.set_round(r)
            record: dict[str, Any] = {"index": r, "num_requests": len(prompts)}
            _act(llm, actions.get(str(r), {}).get("before", []), record)
            t = time.perf_counter()
            outputs = llm.generate(
                [
                    {k: v for k, v in p.items() if k != "kv_transfer_params"}
                    if isinstance(p, dict)
                    else {"prompt_token_ids": list(p)}
                    for p in prompts
                ],
                [_params_of(p, params) for p in prompts],
                use_tqdm=False,
            )
            record["wall_s"] = time.perf_counter() - t
            _act(llm, actions.get(str(r), {}).get("after", []), record)
            rounds.append(record)
            for i, out in enumerate(outputs):
                comp = out.outputs[0]
                tops = [_top_logprobs(pos) for pos in (comp.logprobs or [])]
                chosen = [top.get(str(tok), float("nan")) for tok, top in zip(comp.token_ids, tops)]
                requests.append(
                    {
                        "round": r,
                        "index": i,
                        "request_id": out.request_id,
                        "prompt_len": len(_tokens(prompts[i])),
                        "token_ids": list(comp.token_ids),
                        "logprobs": chosen,
                        "top_logprobs": tops,
                        "num_cached_tokens": out.num_cached_tokens,
                        "finish_reason": comp.finish_reason,
                        "metrics": _request_metrics(out.metrics),
                    }
                )
            if settle_s > 0:
                rounds[-1]["settled"], rounds[-1]["settle_s"] = _settle(
                    llm, tick, settle_s, settle_until
                )
            if sub is not None:
                sub.drain()
        result["rounds"] = rounds
        result["requests"] = requests
        result["metrics"] = _metric_snapshot(llm)
    finally:
        if llm is not None:
            t = time.perf_counter()
            _shutdown(llm)
            result["shutdown_s"] = time.perf_counter() - t
        if sub is not None:
            sub.drain(quiet_s=0.2, max_wait_s=1.0)
            result["kv_events"], result["kv_events_missing_seqs"] = sub.decoded()
            sub.close()
    result["ok"] = True
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m tests.vllm.llm_runner ARGS.json OUT.json", file=sys.stderr)
        return 2
    args_path, out_path = Path(argv[0]), Path(argv[1])
    try:
        args = json.loads(args_path.read_text())
        for key, value in DEFAULT_ENV.items():
            os.environ.setdefault(key, value)
        for key, value in (args.get("env") or {}).items():
            os.environ[key] = str(value)
        result = run(args)
    except BaseException as exc:  # report KeyboardInterrupt and SystemExit too
        tb = traceback.format_exc()
        out_path.write_text(
            json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tb})
        )
        # The summary line last, so that a log's tail shows it.
        print(f"{tb}\nllm_runner: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
