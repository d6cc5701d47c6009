from __future__ import annotations

import pytest

import asyncoffload as ao


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
