"""PageLayout.plan checks small transfers on Python lists and large ones with torch
(issue 25): both ways accept and refuse the same transfers, with the same messages."""

from __future__ import annotations

import pytest
import torch

from asyncoffload.transfer import paged
from asyncoffload.transfer.paged import PageLayout


def _layout() -> PageLayout:
    tensors = [torch.zeros((16, 64), dtype=torch.uint8) for _ in range(3)]
    # Groups 0 and 1 share tensor 0: a load must not write one of its blocks twice.
    return PageLayout(tensors, [64, 64, 64], [[(0, 64), (1, 64)], [(0, 32)], [(2, 64)]], 2)


CASES = [
    # gpu_ids, group_sizes, block_indices, slot_ids, store
    ([1, 2, 3], [2, 1, 0], [0, 0, 0], [0, 1], True),
    ([1, 2, 3], [2, 1, 0], [1, 0, 0], [0, 1, 2], False),
    ([1, 2, 3], [2, 1, 0], [0, 0, 0], [0, 0], True),  # a slot written twice
    ([1, 2, 1], [2, 1, 0], [0, 0, 0], [0, 1], False),  # shared tensor: block 1 twice
    ([1, 2, 1], [2, 0, 1], [0, 0, 0], [0, 1], False),  # group 2 is apart: fine
    ([1, 16, 3], [2, 1, 0], [0, 0, 0], [0, 1], True),  # a block id out of range
    ([1, -2, 3], [2, 1, 0], [0, 0, 0], [0, 1], False),
    ([1, 2, 3], [2, 1, 0], [0, 0, 0], [0, 9], True),  # a slot id out of range
    ([1, 2, 3], [2, 1, 0], [0, 0, 0], [-1, 1], False),
]


def _outcome(layout: PageLayout, case: tuple[list[int], ...]) -> tuple[str, object]:
    gpu, sizes, starts, slots, store = case
    try:
        plan = layout.plan(gpu, sizes, starts, slots, num_slots=8, store=bool(store))
    except (TypeError, ValueError, IndexError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", (plan.gpu_ids.tolist(), plan.slot_ids.tolist(), plan.spans)


@pytest.mark.parametrize("case", CASES)
def test_list_and_torch_checks_agree(
    case: tuple[list[int], ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = _layout()
    on_lists = _outcome(layout, case)
    monkeypatch.setattr(paged, "_LIST_CHECKS", 0)  # every transfer checked with torch
    assert _outcome(layout, case) == on_lists


def test_small_transfers_are_checked_on_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = _layout()
    calls: list[str] = []
    real = paged._check_range

    def spy(*args: object) -> None:
        calls.append("torch")
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(paged, "_check_range", spy)
    layout.plan([1, 2, 3], [2, 1, 0], [0, 0, 0], [0, 1], num_slots=8, store=True)
    assert calls == []  # in range: no torch range check
    with pytest.raises(IndexError, match=r"slot_ids\[1\] = 9"):
        layout.plan([1, 2, 3], [2, 1, 0], [0, 0, 0], [0, 9], num_slots=8, store=True)
    assert calls == ["torch"]  # the message comes from the torch check
