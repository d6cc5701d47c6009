"""HARNESS CHECK ONLY: a throwaway OffloadingSpec that lets the e2e harness exercise vLLM's
OffloadingConnector on the CPU platform before ``asyncoffload.integrations.vllm`` exists.

It is not asyncoffload. The scheduler side is vLLM's own ``CPUOffloadingManager`` (inherited
from ``CPUOffloadingSpec``, LRU over ``cpu_bytes_to_use`` worth of chunks); the worker side,
which ``CPUOffloadingSpec`` refuses to build off CUDA/XPU, is replaced by
:class:`ToyOffloadingWorker`: synchronous ``torch`` copies between vLLM's canonical KV
tensors and a dict of per-chunk CPU tensors.

``kv_connector_extra_config`` keys::

    "spec_name": "ToyOffloadingSpec", "spec_module_path": "tests.vllm.toy_spec",
    "cpu_bytes_to_use": 67108864,     # required (CPUOffloadingSpec): sizes the chunk pool
    "blocks_per_chunk": 2,            # or "block_size": 64 (tokens); one of the two
    "offload_prompt_only": true,      # vLLM default; false also offloads decode blocks
    "toy_mode": "copy"                # "copy" | "skip_load" | "corrupt_load"

``skip_load`` reports loads done without copying (the GPU blocks keep whatever they held)
and ``corrupt_load`` fills them with random bytes. Both exist to prove the harness catches
a spec that does not move bytes: their outputs must differ from the baseline.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

__all__ = ["TOY_MODES", "ToyOffloadingSpec", "ToyOffloadingWorker"]

TOY_MODES = ("copy", "skip_load", "corrupt_load")


class ToyOffloadingWorker(OffloadingWorker):
    """Copies whole canonical block rows, synchronously, in ``submit_*``.

    Chunk ``c`` is stored as ``self.chunks[c]``: an int8 tensor of shape
    ``(num_tensors, blocks_per_chunk, page_size_bytes)``.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, mode: str) -> None:
        if mode not in TOY_MODES:
            raise ValueError(f"toy_mode must be one of {TOY_MODES}, not {mode!r}")
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self.group_tensors = [
            sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs
        ]
        self.blocks_per_chunk = blocks_per_chunk
        self.mode = mode
        self.chunks: dict[int, torch.Tensor] = {}
        self._finished: list[TransferResult] = []
        self._gen = torch.Generator().manual_seed(0)
        # Counters the tests can read from the log line printed at shutdown.
        self.blocks_stored = 0
        self.blocks_loaded = 0

    def _chunk(self, chunk_id: int) -> torch.Tensor:
        buf = self.chunks.get(chunk_id)
        if buf is None:
            row = max(t.shape[1] for t in self.tensors)
            buf = torch.zeros((len(self.tensors), self.blocks_per_chunk, row), dtype=torch.int8)
            self.chunks[chunk_id] = buf
        return buf

    def _pairs(
        self, gpu: GPULoadStoreSpec, other: LoadStoreSpec
    ) -> list[tuple[int, int, int, int]]:
        """(group, gpu_block_id, chunk_id, sub_block) for every block of the job."""
        assert isinstance(other, BlockIDsLoadStoreSpec)
        bpc = self.blocks_per_chunk
        out: list[tuple[int, int, int, int]] = []
        g_off = c_off = 0
        for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            if size == 0:
                continue
            skip = first % bpc
            n_chunks = -(-(size + skip) // bpc)
            gpu_ids = gpu.block_ids[g_off : g_off + size]
            chunk_ids = other.block_ids[c_off : c_off + n_chunks]
            for j, gid in enumerate(gpu_ids):
                pos = j + skip
                out.append((g, int(gid), int(chunk_ids[pos // bpc]), pos % bpc))
            g_off += size
            c_off += n_chunks
        assert g_off == len(gpu.block_ids) and c_off == len(other.block_ids)
        return out

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        t0 = time.perf_counter()
        nbytes = 0
        for g, gid, cid, sub in self._pairs(src_spec, dst_spec):
            buf = self._chunk(cid)
            for t in self.group_tensors[g]:
                row = self.tensors[t][gid]
                buf[t, sub, : row.shape[0]].copy_(row)
                nbytes += row.numel()
            self.blocks_stored += 1
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        t0 = time.perf_counter()
        nbytes = 0
        for g, gid, cid, sub in self._pairs(dst_spec, src_spec):
            for t in self.group_tensors[g]:
                row = self.tensors[t][gid]
                if self.mode == "copy":
                    row.copy_(self.chunks[cid][t, sub, : row.shape[0]])
                elif self.mode == "corrupt_load":
                    row.copy_(
                        torch.randint(-128, 128, row.shape, dtype=torch.int8, generator=self._gen)
                    )
                nbytes += row.numel()
            self.blocks_loaded += 1
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished inside submit_*

    def shutdown(self) -> None:
        print(
            f"ToyOffloadingWorker: blocks_stored={self.blocks_stored} "
            f"blocks_loaded={self.blocks_loaded} chunks={len(self.chunks)} mode={self.mode}",
            flush=True,
        )


class ToyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU spec with :class:`ToyOffloadingWorker` as its worker (works on CPU)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._toy_worker: ToyOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._toy_worker is None:
            self._toy_worker = ToyOffloadingWorker(
                kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                mode=str(self.extra_config.get("toy_mode", "copy")),
            )
        return self._toy_worker
