from __future__ import annotations

from typing import Any

import pytest
import torch

import asyncoffload as ao
from asyncoffload import (
    BlockTokens,
    get_offload_block_hash,
    keys_for_tokens,
    make_offload_key,
)


def test_offload_key_is_hash_plus_big_endian_group() -> None:
    key = ao.make_offload_key(b"\xab\xcd", 258)
    assert key == b"\xab\xcd\x00\x00\x01\x02"
    assert ao.get_offload_block_hash(key) == b"\xab\xcd"
    assert ao.get_offload_group_idx(key) == 258


@pytest.mark.parametrize(
    ("block_hash", "group", "exc"),
    [
        ("abc", 0, TypeError),
        (b"", 0, ValueError),
        (b"h", -1, ValueError),
        (b"h", 2**32, ValueError),
        (b"h", 1.0, TypeError),
    ],
)
def test_make_offload_key_rejects_bad_input(
    block_hash: object, group: object, exc: type[Exception]
) -> None:
    with pytest.raises(exc):
        ao.make_offload_key(block_hash, group)  # type: ignore[arg-type]


def test_chained_hashes_share_prefixes_and_diverge_after() -> None:
    a = ao.hash_token_blocks(list(range(40)), 16)
    b = ao.hash_token_blocks([*range(20), 99, *range(21, 40)], 16)
    assert len(a) == 2  # the partial third block has no hash
    assert a[0] == b[0] and a[1] != b[1]
    # A block's hash depends on its parent, not only its tokens.
    c = ao.hash_token_blocks([*range(1, 17), *range(16, 32)], 16)
    assert c[1] != a[1]


def test_parent_continues_a_chain_and_salt_separates_namespaces() -> None:
    tokens = list(range(64))
    whole = ao.hash_token_blocks(tokens, 16)
    tail = ao.hash_token_blocks(tokens[32:], 16, parent=whole[1])
    assert tail == whole[2:]
    salted = ao.hash_token_blocks(tokens, 16, salt=b"lora-1")
    assert not set(salted) & set(whole)


def test_keys_for_tokens_packs_group() -> None:
    keys = ao.keys_for_tokens(list(range(32)), 16, group_idx=3)
    assert [ao.get_offload_group_idx(k) for k in keys] == [3, 3]
    assert [ao.get_offload_block_hash(k) for k in keys] == ao.hash_token_blocks(list(range(32)), 16)
    with pytest.raises(ValueError, match="block_size"):
        ao.hash_token_blocks([1, 2], 0)


# --- BlockTokens -----------------------------------------------------------------------


def test_block_tokens_describe_a_chain() -> None:
    tokens = list(range(10))
    bt = BlockTokens.from_tokens(tokens, 4, 3, parent=b"p" * 32, lora_name="a", lora_id=2)
    assert bt.keys == tuple(keys_for_tokens(tokens, 4, 3, parent=b"p" * 32))
    assert len(bt) == 2 and bt.token_ids == tuple(range(8))  # the partial block is dropped
    assert bt.index(bt.keys[1]) == 1 and bt.index(make_offload_key(b"x")) is None
    assert bt.parent_of(0) == b"p" * 32
    assert bt.parent_of(1) == get_offload_block_hash(bt.keys[0])
    assert bt.tokens_of(1, 2) == (4, 5, 6, 7)
    assert (bt.lora_name, bt.lora_id, bt.block_size) == ("a", 2, 4)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((2, list(range(7)), 4), {}, ValueError, "need 8 token ids"),
        ((2, list(range(12)), 4), {}, ValueError, "up to 11"),
        ((1, [1, 2, "3", 4], 4), {}, TypeError, r"token_ids\[2\] is a str"),
        ((1, [1, 2, 3, 4], 0), {}, ValueError, "block_size must be a positive int"),
        ((1, [1, 2, 3, 4], 4, "parent"), {}, TypeError, "parent_block_hash must be bytes"),
        ((1, [1, 2, 3, 4], 4), {"lora_id": "x"}, TypeError, "lora_id"),
        ((1, [1, 2, 3, 4], 4), {"lora_name": 3}, TypeError, "lora_name"),
    ],
)
def test_block_tokens_reject_what_does_not_fit(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    n, *rest = args
    keys = [make_offload_key(bytes([i + 1]) * 8) for i in range(n)]
    with pytest.raises(error, match=message):
        BlockTokens(keys, *rest, **kwargs)


def test_block_tokens_reject_bad_keys() -> None:
    key = make_offload_key(b"k" * 8)
    with pytest.raises(ValueError, match="more than once"):
        BlockTokens([key, key], list(range(8)), 4)
    with pytest.raises(TypeError, match=r"keys\[0\] is not an OffloadKey"):
        BlockTokens([b"ab"], list(range(4)), 4)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="not one key"):
        BlockTokens(key, list(range(4)), 4)  # type: ignore[arg-type]


# --- token ids of every kind a server holds them in (issue 12) --------------------------


def test_numpy_and_torch_token_ids_hash_like_lists() -> None:
    np = pytest.importorskip("numpy")
    tokens = list(range(100, 164))
    expected = ao.keys_for_tokens(tokens, 16)
    for given in (
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.int32),
        torch.tensor(tokens),
        torch.tensor(tokens, dtype=torch.int32),
        [np.int64(t) for t in tokens],
    ):
        assert ao.keys_for_tokens(given, 16) == expected
        described = ao.BlockTokens.from_tokens(given, 16)
        assert described.keys == tuple(expected)
        assert described.token_ids == tuple(tokens)
        assert all(type(t) is int for t in described.token_ids)


@pytest.mark.parametrize(
    ("tokens", "error", "message"),
    [
        (
            "hello world, this is a prompt..",
            TypeError,
            r"token_ids must be a sequence of ints, not str",
        ),
        ([1, 2, 3.5, 4], TypeError, r"token_ids\[2\] is a float"),
        ([1, 2, 2**63, 4], ValueError, r"token_ids\[2\] = 9223372036854775808 does not fit"),
        ([1, -(2**63) - 1], ValueError, r"token_ids\[1\]"),
        ([1, True], TypeError, r"token_ids\[1\] is a bool"),
        (torch.ones(4), TypeError, r"token_ids has dtype torch.float32"),
        (torch.ones((2, 2), dtype=torch.int64), ValueError, r"one-dimensional"),
    ],
)
def test_bad_token_ids_are_named_with_their_index(
    tokens: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        ao.keys_for_tokens(tokens, 2)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        ao.BlockTokens.from_tokens(tokens, 2)  # type: ignore[arg-type]


def test_a_salt_or_parent_that_is_not_bytes_is_named() -> None:
    with pytest.raises(TypeError, match="salt must be bytes or None, got str"):
        ao.keys_for_tokens([1, 2], 2, salt="tenant-a")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="parent must be bytes or None, got int"):
        ao.keys_for_tokens([1, 2], 2, parent=7)  # type: ignore[arg-type]
