"""A tiny random-weight Llama checkpoint that vLLM's CPU backend can load, made offline.

vLLM's ``load_format="dummy"`` draws weights in ±1e-3, which makes every attention output
nearly the same whatever the KV cache holds: a connector that copies nothing would still
produce the baseline's tokens. These weights are drawn from a fixed-seed normal large enough
that each generated token depends on the KV of the prompt (``tests/vllm/test_harness.py``
checks it). There is no tokenizer; run vLLM with ``skip_tokenizer_init=True`` and token-id
prompts.

    python -m tests.vllm.tiny_model DIR
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["TinyLlamaConfig", "write_tiny_llama"]


@dataclass(frozen=True)
class TinyLlamaConfig:
    num_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 512
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    # float32 keeps runs bit-identical and leaves no near-ties between greedy candidates
    # that a different prefill split (connector load vs full recompute) could flip.
    dtype: str = "float32"
    seed: int = 1234
    std: float = 0.3
    # q/k are drawn smaller so attention scores have a std of about 2.5 rather than 20:
    # attention then mixes many positions instead of picking one, and an early prompt
    # token still reaches the last position.
    qk_std: float = 0.1


def _hf_config(cfg: TinyLlamaConfig) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": cfg.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def _weights(cfg: TinyLlamaConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).to(dtype).contiguous()

    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal((cfg.vocab_size, h), cfg.std),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": normal((cfg.vocab_size, h), cfg.std),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "self_attn.q_proj.weight"] = normal((q_out, h), cfg.qk_std)
        w[p + "self_attn.k_proj.weight"] = normal((kv_out, h), cfg.qk_std)
        w[p + "self_attn.v_proj.weight"] = normal((kv_out, h), cfg.std)
        w[p + "self_attn.o_proj.weight"] = normal((h, q_out), cfg.std)
        w[p + "mlp.gate_proj.weight"] = normal((inter, h), cfg.std)
        w[p + "mlp.up_proj.weight"] = normal((inter, h), cfg.std)
        w[p + "mlp.down_proj.weight"] = normal((h, inter), cfg.std)
    return w


def write_tiny_llama(directory: str | Path, cfg: TinyLlamaConfig | None = None) -> Path:
    """Write config.json, generation_config.json and model.safetensors into ``directory``."""
    from safetensors.torch import save_file  # vLLM's dependency; absent from the plain venv

    cfg = cfg or TinyLlamaConfig()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_hf_config(cfg), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    )
    (out / "tiny_model.json").write_text(json.dumps(asdict(cfg), indent=2))
    save_file(_weights(cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.vllm.tiny_model DIR")
    print(write_tiny_llama(sys.argv[1]))
