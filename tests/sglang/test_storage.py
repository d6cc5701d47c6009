"""asyncoffload as SGLang 0.5.23's HiCache L3 storage, against SGLang's own classes on a
CPU: its host memory pools (MHA, MLA; every layout we serve) and its storage backend
factory loading ``AsyncOffloadStorage`` by module path, called as its cache controller
calls it (``batch_exists``, ``batch_get_v1``, ``batch_set_v1``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from asyncoffload.integrations.sglang import AsyncOffloadStorage
from asyncoffload.tiers.format import HEADER_BYTES
from tests.servers import Server, make_valkey, valkey_server  # noqa: F401  (fixtures)
from tests.sglang.harness import (
    PAGE,
    attach,
    clear,
    config,
    disk,
    extra,
    fill,
    mha_pool,
    mla_pool,
    page_keys,
    pages_bytes,
    remote,
)

LAYOUTS = ["page_first", "layer_first", "page_first_direct", "page_head"]


@pytest.fixture
def opened() -> Iterator[list[HiCacheStorage]]:
    """Backends the test attached, closed at its end."""
    backends: list[HiCacheStorage] = []
    yield backends
    for backend in backends:
        backend.close()


def open_backend(
    opened: list[HiCacheStorage], tiers: list[dict[str, Any]], pool: Any, **cfg: Any
) -> AsyncOffloadStorage:
    more = cfg.pop("more", {})
    backend = attach(config(extra(tiers, **more), **cfg), pool)
    opened.append(backend)
    assert isinstance(backend, AsyncOffloadStorage)
    return backend


def store_pages(
    backend: HiCacheStorage, pool: Any, n: int, seed: int, keys: list[str]
) -> tuple[torch.Tensor, list[bytes]]:
    indices = pool.alloc(n * PAGE)
    assert indices is not None
    data = fill(pool, indices, seed)
    assert backend.batch_set_v1(keys, indices) == [True] * n
    return indices, data


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_byte_exact_in_every_layout(
    layout: str, tmp_path: Path, opened: list[HiCacheStorage]
) -> None:
    pool = mha_pool(layout)
    backend = open_backend(opened, [disk(tmp_path / "kv")], pool, page_first=layout == "page_first")
    assert (backend.staging is None) == (layout != "layer_first")  # in place but layer_first
    keys = page_keys(6)
    indices, data = store_pages(backend, pool, 6, 1, keys)
    clear(pool, indices)
    assert backend.batch_exists(keys) == 6
    back = pool.alloc(6 * PAGE)
    assert backend.batch_get_v1(keys, back) == [True] * 6
    assert pages_bytes(pool, back) == data
    assert backend.batch_exists(page_keys(3, "another prompt")) == 0


@pytest.mark.parametrize(
    "writer,reader", [("page_first", "layer_first"), ("layer_first", "page_first")]
)
def test_layer_first_and_page_first_load_the_same_kv(
    writer: str, reader: str, tmp_path: Path, opened: list[HiCacheStorage]
) -> None:
    keys = page_keys(4)
    pool_w = mha_pool(writer)
    first = open_backend(opened, [disk(tmp_path / "kv")], pool_w)
    _, data = store_pages(first, pool_w, 4, 2, keys)
    first.close()
    pool_r = mha_pool(reader)
    second = open_backend(opened, [disk(tmp_path / "kv")], pool_r)
    assert second.batch_exists(keys) == 4
    back = pool_r.alloc(4 * PAGE)
    assert second.batch_get_v1(keys, back) == [True] * 4
    assert pages_bytes(pool_r, back) == data  # the same K and V per token and layer


def test_another_byte_order_never_reads_these_pages(
    tmp_path: Path, opened: list[HiCacheStorage]
) -> None:
    """page_first_direct stores its pages in another byte order: it misses them."""
    keys = page_keys(3)
    pool = mha_pool("page_first")
    store_pages(open_backend(opened, [disk(tmp_path / "kv")], pool), pool, 3, 3, keys)
    other = mha_pool("page_first_direct")
    reader = open_backend(opened, [disk(tmp_path / "kv")], other)
    assert reader.batch_exists(keys) == 0
    back = other.alloc(3 * PAGE)
    assert reader.batch_get_v1(keys, back) == [False] * 3
    assert all(b == bytes(len(b)) for b in pages_bytes(other, back))


def test_a_fresh_instance_is_served_what_an_earlier_one_stored(
    tmp_path: Path, opened: list[HiCacheStorage]
) -> None:
    keys = page_keys(5)
    pool = mha_pool("page_first")
    first = open_backend(opened, [disk(tmp_path / "kv")], pool)
    _, data = store_pages(first, pool, 5, 4, keys)
    first.close()
    pool2 = mha_pool("page_first")
    second = open_backend(opened, [disk(tmp_path / "kv")], pool2)
    assert second.batch_exists(keys) == 5
    back = pool2.alloc(5 * PAGE)
    assert second.batch_get_v1(keys, back) == [True] * 5
    assert pages_bytes(pool2, back) == data


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix != ".json")


def test_tp_ranks_keep_their_own_pages_and_a_refused_page_stops_every_count(
    tmp_path: Path, opened: list[HiCacheStorage]
) -> None:
    """TP 2: each rank stores its own part under its own namespace; when rank 1 refuses
    its damaged part of page 2, its count stops before page 2, and SGLang's MIN over
    the ranks' counts makes pages 2.. a miss on both."""
    keys = page_keys(4)
    pools = [mha_pool("page_first"), mha_pool("page_first")]
    ranks = [
        open_backend(opened, [disk(tmp_path / "kv")], pools[r], tp_rank=r, tp_size=2)
        for r in range(2)
    ]
    assert ranks[0].namespace != ranks[1].namespace
    data = [store_pages(ranks[r], pools[r], 4, 10 + r, keys)[1] for r in range(2)]
    assert data[0] != data[1]
    dirs = sorted(p for p in (tmp_path / "kv").iterdir() if p.is_dir())
    assert len(dirs) == 2 and all(len(_files(d)) == 4 for d in dirs)  # per-rank pages
    # Damage rank 1's part of page 2 (a byte of its payload).
    rank1 = next(d for d in dirs if "_r1_" in d.name)
    victim = next(f for f in _files(rank1) if keys[2] in f.name or keys[2].encode().hex() in f.name)
    raw = bytearray(victim.read_bytes())
    raw[HEADER_BYTES + 10] ^= 0xFF
    victim.write_bytes(bytes(raw))
    got = []
    for r in range(2):
        back = pools[r].alloc(4 * PAGE)
        got.append(ranks[r].batch_get_v1(keys, back))
    assert got[0] == [True] * 4
    assert got[1] == [True, True, False, True]  # its bytes failed the check: a miss
    counts = [ranks[r].batch_exists(keys) for r in range(2)]
    assert counts == [4, 2]
    assert min(counts) == 2  # SGLang's all-reduce


def test_mla_rank_0_writes_and_rank_1_finds_its_pages_on_a_shared_tier(
    valkey_server: Server,  # noqa: F811
    opened: list[HiCacheStorage],
) -> None:
    """MLA: every rank holds the same KV; rank 0 alone writes (SGLang's
    is_storage_writer), rank 1 writes nothing and finds rank 0's pages, which it asks
    the shared tier about."""
    keys = page_keys(3)
    tiers = [remote(valkey_server)]
    pools = [mla_pool("page_first"), mla_pool("page_first")]
    ranks = [
        open_backend(opened, tiers, pools[r], tp_rank=r, tp_size=2, mla=True) for r in range(2)
    ]
    assert [b.writer for b in ranks] == [True, False]
    assert ranks[0].namespace == ranks[1].namespace
    idx1 = pools[1].alloc(3 * PAGE)
    fill(pools[1], idx1, 99)
    assert ranks[1].batch_set_v1(page_keys(3, "rank 1 only"), idx1) == [True] * 3
    assert ranks[0].batch_exists(page_keys(3, "rank 1 only")) == 0  # rank 1 wrote nothing
    _, data = store_pages(ranks[0], pools[0], 3, 20, keys)
    assert ranks[1].batch_exists(keys) == 3
    back = pools[1].alloc(3 * PAGE)
    assert ranks[1].batch_get_v1(keys, back) == [True] * 3
    assert pages_bytes(pools[1], back) == data


def test_mla_rank_1_finds_on_disk_what_rank_0_stored_before_it_opened(
    tmp_path: Path, opened: list[HiCacheStorage]
) -> None:
    """A disk tier's index knows the blocks present when it opens and those it writes
    (another process's later writes it does not see: see docs/sglang.md)."""
    keys = page_keys(3)
    pool0 = mla_pool("page_first")
    rank0 = open_backend(opened, [disk(tmp_path / "kv")], pool0, tp_rank=0, tp_size=2, mla=True)
    _, data = store_pages(rank0, pool0, 3, 21, keys)
    pool1 = mla_pool("page_first")
    rank1 = open_backend(opened, [disk(tmp_path / "kv")], pool1, tp_rank=1, tp_size=2, mla=True)
    assert rank1.batch_exists(keys) == 3
    back = pool1.alloc(3 * PAGE)
    assert rank1.batch_get_v1(keys, back) == [True] * 3
    assert pages_bytes(pool1, back) == data


@pytest.mark.parametrize("damage", ["flipped", "short", "foreign"])
def test_damaged_short_and_foreign_values_are_misses(
    damage: str, tmp_path: Path, opened: list[HiCacheStorage]
) -> None:
    keys = page_keys(3)
    pool = mha_pool("page_first")
    backend = open_backend(opened, [disk(tmp_path / "kv")], pool)
    store_pages(backend, pool, 3, 30, keys)
    files = _files(tmp_path / "kv")
    target = next(f for f in files if keys[1] in f.name or keys[1].encode().hex() in f.name)
    raw = target.read_bytes()
    if damage == "flipped":
        target.write_bytes(
            raw[: HEADER_BYTES + 9] + bytes([raw[HEADER_BYTES + 9] ^ 1]) + raw[HEADER_BYTES + 10 :]
        )
    elif damage == "short":
        target.write_bytes(raw[: len(raw) // 2])
    else:  # another page's whole file under this page's name
        other = next(f for f in files if f != target)
        target.write_bytes(other.read_bytes())
    back = pool.alloc(3 * PAGE)
    clear(pool, back)
    assert backend.batch_get_v1(keys, back) == [True, False, True]
    assert pages_bytes(pool, back)[1] == bytes(len(pages_bytes(pool, back)[1]))  # untouched
    assert backend.batch_exists(keys) == 1
    removed = [e for e in backend.take_events() if e.removed]
    assert any(keys[1].encode() in e.keys for e in removed)


def test_bad_host_indices_and_keys_are_misses_not_exceptions(
    tmp_path: Path, opened: list[HiCacheStorage]
) -> None:
    pool = mha_pool("page_first")
    backend = open_backend(opened, [disk(tmp_path / "kv")], pool)
    keys = page_keys(2)
    indices, _ = store_pages(backend, pool, 2, 40, keys)
    assert backend.batch_get_v1(keys, indices[:-1]) == [False, False]  # a short page
    assert backend.batch_get_v1(keys, indices + 1) == [False, False]  # not on a page
    assert backend.batch_get_v1(keys, torch.full_like(indices, 10**6)) == [False, False]
    assert backend.batch_get_v1([keys[0], keys[0]], indices) == [False, False]  # twice
    assert backend.batch_exists([]) == 0


def test_the_factory_builds_it_by_module_path_and_bad_settings_name_the_key(tmp_path: Path) -> None:
    pool = mha_pool("page_first")
    cases = {
        "tiers": {k: v for k, v in extra([disk(tmp_path)]).items() if k != "tiers"},
        "tierz": extra([disk(tmp_path)], tierz=1),
        "interface_v1": extra([disk(tmp_path)], interface_v1=0),
        "'tape'": extra([{"kind": "tape", "path": str(tmp_path)}]),
        "staging_pages": extra([disk(tmp_path)], staging_pages=0),
    }
    for needle, bad in cases.items():
        with pytest.raises(ValueError, match=r"--hicache-storage-backend-extra-config.*" + needle):
            attach(config(bad), pool)
    with pytest.raises(ValueError, match="extra-config is not set"):
        AsyncOffloadStorage(config(None))


def test_an_unwritable_path_fails_the_attach_naming_the_tiers(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "file").write_text("a file, not a directory")
    pool = mha_pool("page_first")
    with pytest.raises(ValueError, match=r"extra-config\['tiers'\].*file"):
        attach(config(extra([disk(locked / "file" / "kv")])), pool)
    if os.geteuid() != 0:  # root writes anywhere
        locked.chmod(0o500)
        with pytest.raises(ValueError, match=r"extra-config\['tiers'\]"):
            attach(config(extra([disk(locked / "kv")])), pool)


def test_authenticated_pages_are_found_only_with_the_same_mac_key(
    tmp_path: Path, opened: list[HiCacheStorage]
) -> None:
    """A tier with a ``mac_key``: pages carry a keyed MAC. The same key reads them back
    byte-exact; no key, or another key, finds none of them (never their bytes)."""
    keys = page_keys(4)
    key_a, key_b = "a" * 32, "b" * 32
    pool = mha_pool("page_first")
    writer = open_backend(opened, [disk(tmp_path / "kv", mac_key=key_a)], pool)
    _, data = store_pages(writer, pool, 4, 11, keys)
    writer.close()
    for mac_key, found in ((key_a, 4), (None, 0), (key_b, 0)):
        tier = disk(tmp_path / "kv") if mac_key is None else disk(tmp_path / "kv", mac_key=mac_key)
        reader_pool = mha_pool("page_first")
        reader = open_backend(opened, [tier], reader_pool)
        assert reader.batch_exists(keys) == found, f"mac_key {mac_key!r}"
        back = reader_pool.alloc(4 * PAGE)
        got = reader.batch_get_v1(keys, back)
        assert got == [found == 4] * 4
        if found:
            assert pages_bytes(reader_pool, back) == data
        reader.close()
