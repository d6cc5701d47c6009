"""PageLayout.plan checks small transfers on Python lists and large ones with torch
(issue 25): both ways accept and refuse the same transfers, with the same messages."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncoffload.transfer import paged
from asyncoffload.transfer.paged import PageLayout


def _layout() -> PageLayout:
    tensors = [torch.zeros((16, 64), dtype=torch.uint8) for _ in range(3)]
    # Groups 0 and 1 share tensor 0: a load must not write one of its blocks twice.
    return PageLayout(tensors, [64, 64, 64], [[(0, 64), (1, 64)], [(0, 32)], [(2, 64)]], 2)


CASES: list[tuple[list[int], list[int], list[int], list[int], bool]] = [
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


Case = tuple[list[int], list[int], list[int], list[int], bool]


def _outcome(layout: PageLayout, case: Case) -> tuple[str, object]:
    gpu, sizes, starts, slots, store = case
    try:
        plan = layout.plan(gpu, sizes, starts, slots, num_slots=8, store=bool(store))
    except (TypeError, ValueError, IndexError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", (plan.gpu_ids.tolist(), plan.slot_ids.tolist(), plan.spans)


@pytest.mark.parametrize("case", CASES)
def test_list_and_torch_checks_agree(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
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


@pytest.fixture(scope="module")
def ids_check(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int, int, bool], int]:
    """``ao_ids_check`` from cuda_helpers.c, compiled here (it needs no CUDA to run)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = Path(paged.__file__).parents[1] / "_native" / "cuda_helpers.c"
    out = tmp_path_factory.mktemp("native") / "libcheck.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src), "-ldl"], check=True)
    fn = ctypes.CDLL(str(out)).ao_ids_check
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    fn.restype = ctypes.c_int64
    return fn


def test_the_native_check_of_one_group(ids_check: Callable[[int, int, int, bool], int]) -> None:
    t = torch.tensor([5, 1, 7], dtype=torch.int64)
    assert ids_check(t.data_ptr(), 3, 8, True) == -1
    assert ids_check(t.data_ptr(), 3, 7, True) == 2  # 7 is out of range
    r = torch.tensor([5, 1, 5], dtype=torch.int64)
    assert ids_check(r.data_ptr(), 3, 8, True) == -2 - 2  # the repeat at index 2
    assert ids_check(r.data_ptr(), 3, 8, False) == -1
    big = torch.arange(40000, dtype=torch.int64)  # a bitmap beyond the stack's
    assert ids_check(big.data_ptr(), 40000, 1 << 20, True) == -1
    layout = PageLayout([torch.zeros((16, 64), dtype=torch.uint8)], [64], [[(0, 64)]], 2)
    cases: list[Case] = [
        ([1, 2, 3], [3], [0], [0, 1], True),
        ([1, 2, 3], [3], [1], [0, 0], True),  # a slot written twice
        ([1, 2, 1], [3], [0], [0, 1], False),  # a block written twice
        ([1, 2, 1], [3], [0], [0, 1], True),  # read twice: fine
        ([1, 16, 3], [3], [0], [0, 1], True),
        ([1, 2, 3], [3], [0], [0, 8], False),
        ([1, 2, 3], [3], [0], [-1, 1], False),
    ]
    for case in cases:
        layout.native_check = None
        want = _outcome(layout, case)
        layout.native_check = ids_check
        assert _outcome(layout, case) == want, case
