"""SGLang's real host pools and storage factory on a CPU, for the tests of
``asyncoffload.integrations.sglang``: build a host pool (MHA or MLA, any layout), load
our backend through ``StorageBackendFactory`` as SGLang does, fill pages, read them back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from tests.sglang.sglang_cpu import import_sglang

import_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import HostKVCache  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

LAYERS, HEADS, DIM, PAGE = 3, 2, 16, 4
#: Device tokens; the host pool holds twice as many (SGLang's host_to_device_ratio).
TOKENS = 128
MLA_DIM = 24
DTYPE = torch.bfloat16
#: Seconds any call of these tests may take (a busy machine included).
WAIT_S = 30.0


def mha_pool(layout: str, allocator: str = "default", tokens: int = TOKENS) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool over CPU "device" buffers, in ``layout``."""
    k = tuple(torch.zeros(tokens + PAGE, HEADS, DIM, dtype=DTYPE) for _ in range(LAYERS))
    v = tuple(torch.zeros(tokens + PAGE, HEADS, DIM, dtype=DTYPE) for _ in range(LAYERS))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k,
            v=v,
            k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
            v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
            layout=KVBufferLayout.NHD,
        ),
        page_size=PAGE,
        head_num=HEADS,
        head_dim=DIM,
        v_head_dim=DIM,
        dtype=DTYPE,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=LAYERS,
    )


def mla_pool(layout: str, tokens: int = TOKENS) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool (latent rows of ``MLA_DIM``), in ``layout``."""
    rows = tuple(torch.zeros(tokens + PAGE, 1, MLA_DIM, dtype=DTYPE) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=torch.tensor([t.data_ptr() for t in rows], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        page_size=PAGE,
        kv_lora_rank=MLA_DIM - 8,
        qk_rope_head_dim=8,
        kv_cache_dim=MLA_DIM,
        dtype=DTYPE,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
    )


def extra(tiers: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    """The extra config SGLang is given for our backend."""
    return {
        "backend_name": "asyncoffload",
        "module_path": "asyncoffload.integrations.sglang",
        "class_name": "AsyncOffloadStorage",
        "interface_v1": 1,
        "tiers": tiers,
        **more,
    }


def disk(path: Any, mode: str = "files", capacity: int = 8 << 20, **more: Any) -> dict[str, Any]:
    return {
        "kind": "disk",
        "path": str(path),
        "capacity": capacity,
        "mode": mode,  # no admission: none under SGLang unless set
        **more,
    }


def remote(server: Any) -> dict[str, Any]:
    return {"kind": "remote", "url": server.url, "timeout_s": 5.0, "admission": None}


def config(
    extra_config: dict[str, Any] | None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    page_first: bool = True,
    model: str = "tiny-llama",
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config=extra_config,
    )


def attach(cfg: HiCacheStorageConfig, pool: HostKVCache) -> HiCacheStorage:
    """Our backend as SGLang's controller attaches it: the factory builds it by module
    path ("dynamic"), then the pool is registered and the hook fired."""
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def page_keys(n: int, seed: str = "prompt") -> list[str]:
    """SHA-256 hex page hashes, chained as SGLang's are."""
    out, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "big")).hexdigest().encode()
        out.append(prev.decode())
    return out


def page_tensor(pool: HostKVCache, first: int) -> torch.Tensor:
    """Page ``first``'s KV in one order whatever the layout: [kv,] token, layer, rest."""
    kv: torch.Tensor = pool.kv_buffer
    ps: int = pool.page_size
    mha = kv.shape[0] == 2 and isinstance(pool, MHATokenToKVPoolHost)
    layout = pool.layout
    if mha:
        if layout == "page_first":
            return kv[:, first : first + ps]
        if layout == "layer_first":
            return kv[:, :, first : first + ps].permute(0, 2, 1, 3, 4)
        if layout == "page_first_direct":
            return kv[:, first // ps].permute(0, 2, 1, 3, 4)
        return kv[:, first // ps].permute(0, 2, 3, 1, 4)  # page_head (2, H, ps, L, D)
    if layout == "page_first":
        return kv[first : first + ps]
    if layout == "layer_first":
        return kv[:, first : first + ps].permute(1, 0, 2, 3)
    return kv[first // ps].permute(1, 0, 2, 3)


def fill(pool: HostKVCache, indices: torch.Tensor, seed: int) -> list[bytes]:
    """Random KV into the pages ``indices`` names; each page's bytes (``page_tensor``)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for first in indices[:: pool.page_size].tolist():
        view = page_tensor(pool, first)
        view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
        out.append(page_bytes(pool, first))
    return out


def page_bytes(pool: HostKVCache, first: int) -> bytes:
    return page_tensor(pool, first).contiguous().view(torch.uint8).numpy().tobytes()


def pages_bytes(pool: HostKVCache, indices: torch.Tensor) -> list[bytes]:
    return [page_bytes(pool, first) for first in indices[:: pool.page_size].tolist()]


def clear(pool: HostKVCache, indices: Sequence[int] | torch.Tensor) -> None:
    for first in torch.as_tensor(indices)[:: pool.page_size].tolist():
        page_tensor(pool, first).zero_()
