"""The CUDA backend's host pool layout, checked without a GPU (pageable chunks)."""

from __future__ import annotations

import pytest
import torch

from asyncoffload.transfer.cuda import PinnedHostPool


def test_slots_are_block_major_within_page_aligned_chunks() -> None:
    pool = PinnedHostPool(10, 4096, chunk_bytes=3 * 4096, pin=False)
    assert len(pool.chunks) == 4  # 3 + 3 + 3 + 1 rows
    assert (pool.pinned_chunks, pool.pageable_chunks) == (0, 4)
    assert not pool.pinned
    for chunk in pool.chunks:
        assert chunk.data_ptr() % 4096 == 0
    for i in range(10):
        assert pool.block(i).data_ptr() == int(pool.block_address[i])
        assert pool.block(i).numel() == 4096
    # Rows of one chunk are contiguous; the next chunk starts elsewhere.
    assert int(pool.block_address[1]) - int(pool.block_address[0]) == 4096
    assert pool.device_block_address.tolist() == pool.block_address.tolist()
    pool.close()


@pytest.mark.parametrize(
    ("ids", "runs"),
    [
        ([0, 1, 2], [(0, 0, 3)]),
        ([2, 3, 4], [(0, 2, 1), (1, 3, 2)]),  # a run stops at a chunk boundary
        ([5, 4, 7, 8], [(0, 5, 1), (1, 4, 1), (2, 7, 2)]),
        ([], []),
    ],
)
def test_runs_are_consecutive_ids_within_one_chunk(
    ids: list[int], runs: list[tuple[int, int, int]]
) -> None:
    pool = PinnedHostPool(10, 64, chunk_bytes=3 * 64, pin=False)
    assert pool.runs(ids) == runs
    for pos, first, length in pool.runs(ids):
        view = pool.view(first, length)
        assert view.shape == (length, 64)
        assert view.data_ptr() == int(pool.block_address[first])
        assert ids[pos : pos + length] == list(range(first, first + length))
    pool.close()


def test_writes_through_a_view_land_in_the_slots() -> None:
    pool = PinnedHostPool(6, 16, chunk_bytes=4 * 16, pin=False)
    pool.view(2, 2).copy_(torch.arange(32, dtype=torch.uint8).view(2, 16))
    assert pool.block(2).tolist() == list(range(16))
    assert pool.block(3).tolist() == list(range(16, 32))
    assert pool.block(4).tolist() == [0] * 16  # the next chunk, untouched
    pool.close()
