"""Where a page of SGLang's host pool lies, and in which byte order it is stored.

SGLang's host pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) keeps one
tensor, ``kv_buffer``, whose shape depends on its layout. A stored page is the page's
bytes in one byte order, its *order*, which names the axes from the outermost:

=================== ======================== =====================================
layout              MHA order                MLA order
=================== ======================== =====================================
page_first          kv,token,layer,head,dim  token,layer,latent
layer_first         kv,token,layer,head,dim  token,layer,latent  (gathered)
page_first_direct   kv,layer,token,head,dim  layer,token,latent
page_head           kv,head,token,layer,dim  (no MLA page_head)
=================== ======================== =====================================

The order is part of the namespace (``Namespace.layout``): pools whose pages are stored
in the same order share them, the others never read them. ``layer_first`` keeps no page
together: its pages are gathered into (and scattered from) page_first's order through a
staging area, so a ``layer_first`` instance loads what a ``page_first`` one stored, as
the same KV. The page-first layouts are addressed in place (*direct*): an MHA page is
two equal runs, K then V at a fixed distance (the tiers' slices, ``set_segments``), an
MLA page one run.

This module imports torch, not SGLang.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["PageMap", "Staging", "page_map"]

#: Layout -> (MHA order, MLA order); None: not served.
_ORDERS: dict[str, tuple[str, str | None]] = {
    "page_first": ("kv,token,layer,head,dim", "token,layer,latent"),
    "layer_first": ("kv,token,layer,head,dim", "token,layer,latent"),
    "page_first_direct": ("kv,layer,token,head,dim", "layer,token,latent"),
    "page_head": ("kv,head,token,layer,dim", None),
}
LAYOUTS = tuple(_ORDERS)


@dataclass(frozen=True)
class PageMap:
    """How pages of one host pool are stored: ``view(first)`` is the page whose first
    token is host index ``first``, as a view of the pool in ``order`` (axes permuted,
    no copy); ``page_bytes`` its size. ``direct``: the page lies in place as the slices
    ``deltas`` (bytes from its first one, each ``page_bytes / len(deltas)``), page ``p``
    at ``base + p * stride``."""

    kind: str
    layout: str
    order: str
    page_size: int
    pages: int
    page_bytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    view: Callable[[int], torch.Tensor]
    direct: bool
    base: int = 0
    stride: int = 0
    deltas: tuple[int, ...] = (0,)

    def address(self, page: int) -> int:
        """The host address of pool page ``page`` (direct maps only)."""
        if not 0 <= page < self.pages:
            raise IndexError(f"page {page} is outside the pool's {self.pages}")
        return self.base + page * self.stride

    def describe(self) -> str:
        """What goes into the namespace: the pool kind, the byte order and the shape."""
        return f"sglang-{self.kind}:{self.order}:{'x'.join(map(str, self.shape))}"

    def pages_of(self, host_indices: torch.Tensor, n: int) -> list[int]:
        """The pool pages that ``host_indices`` (``n`` pages of tokens, as SGLang
        passes them) name; ``ValueError`` unless they are ``n`` whole pages."""
        ps = self.page_size
        if host_indices.dim() != 1 or host_indices.numel() != n * ps:
            raise ValueError(f"{host_indices.numel()} host indices for {n} pages of {ps} tokens")
        if n == 0:
            return []
        rows = host_indices.reshape(n, ps).to(torch.int64)
        firsts = rows[:, 0]
        if ps > 1 and not bool((rows - firsts[:, None] == torch.arange(ps)).all()):
            raise ValueError("host indices of a page are not one run of tokens")
        if bool((firsts % ps != 0).any()) or bool((firsts < 0).any()):
            raise ValueError("a page's host indices do not start on a page")
        pages = (firsts // ps).tolist()
        if max(pages) >= self.pages:
            raise ValueError(f"a host index is outside the pool's {self.pages} pages")
        return pages


def _mha_view(kv: torch.Tensor, layout: str, ps: int) -> Callable[[int], torch.Tensor]:
    if layout == "page_first":  # (2, size, L, H, D)
        return lambda t: kv[:, t : t + ps]
    if layout == "layer_first":  # (2, L, size, H, D)
        return lambda t: kv[:, :, t : t + ps].permute(0, 2, 1, 3, 4)
    return lambda t: kv[:, t // ps]  # page_first_direct (2, P, L, ps, H, D), page_head


def _mla_view(kv: torch.Tensor, layout: str, ps: int) -> Callable[[int], torch.Tensor]:
    if layout == "page_first":  # (size, L, 1, C)
        return lambda t: kv[t : t + ps]
    if layout == "layer_first":  # (L, size, 1, C)
        return lambda t: kv[:, t : t + ps].permute(1, 0, 2, 3)
    return lambda t: kv[t // ps]  # page_first_direct (P, L, ps, 1, C)


def page_map(kv: torch.Tensor, kind: str, layout: str, page_size: int, size: int) -> PageMap:
    """The page map of a host pool of ``kind`` ("mha", "mla") whose ``kv_buffer`` is
    ``kv`` in ``layout``, ``size`` tokens in pages of ``page_size``. ``ValueError`` for
    a layout this backend does not serve."""
    orders = _ORDERS.get(layout)
    order = None if orders is None else orders[0 if kind == "mha" else 1]
    if order is None:
        served = [name for name, o in _ORDERS.items() if o[0 if kind == "mha" else 1]]
        raise ValueError(
            f"the {kind.upper()} host pool's layout {layout!r} is not served; use one of "
            f"{', '.join(served)} (--hicache-mem-layout)"
        )
    if kv.device.type != "cpu":
        raise ValueError(f"the host pool is on {kv.device}, not in host memory")
    view = (_mha_view if kind == "mha" else _mla_view)(kv, layout, page_size)
    pages = size // page_size
    first = view(0)
    page_bytes = first.numel() * first.element_size()
    parts = [first[0], first[1]] if kind == "mha" else [first]
    direct = layout != "layer_first" and all(p.is_contiguous() for p in parts)
    if not direct or pages < 2:
        return PageMap(
            kind,
            layout,
            order,
            page_size,
            pages,
            page_bytes,
            kv.dtype,
            tuple(first.shape),
            view,
            direct=False,
        )
    base = parts[0].data_ptr()
    deltas = tuple(p.data_ptr() - base for p in parts)
    second = view(page_size)
    stride = (second[0] if kind == "mha" else second).data_ptr() - base
    return PageMap(
        kind,
        layout,
        order,
        page_size,
        pages,
        page_bytes,
        kv.dtype,
        tuple(first.shape),
        view,
        direct=True,
        base=base,
        stride=stride,
        deltas=deltas,
    )


class Staging:
    """``pages`` page-sized slots in a memfd (which a Mooncake tier's helper maps too),
    lent to one call at a time: :meth:`take` some, copy pages in or out through
    :meth:`slot`, :meth:`give` them back once no tier I/O can touch them."""

    def __init__(self, pages: int, page_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]):
        self.pages, self.page_bytes = pages, page_bytes
        self.size = pages * page_bytes
        self.fd = os.memfd_create("asyncoffload-sglang-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self._mm = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._slots = self._buf.view(dtype).view(pages, *shape)
        self.base = self._buf.data_ptr()
        self._free = list(range(pages))
        #: Slots lent to I/O that outlived its wait: back once its ``released`` is set.
        self._held: list[tuple[threading.Event, list[int]]] = []
        self._cond = threading.Condition()

    def address(self, slot: int) -> int:
        if not 0 <= slot < self.pages:
            raise IndexError(f"staging slot {slot} is outside the {self.pages}")
        return self.base + slot * self.page_bytes

    def slot(self, slot: int) -> torch.Tensor:
        return self._slots[slot]

    def take(self, want: int, timeout_s: float) -> list[int]:
        """Up to ``want`` free slots, waiting at most ``timeout_s`` for one; [] if none."""
        with self._cond:
            if not self._cond.wait_for(self._any_free, timeout_s):
                return []
            got, self._free = self._free[:want], self._free[want:]
            return got

    def _any_free(self) -> bool:
        if not self._free and self._held:
            back = [slots for released, slots in self._held if released.is_set()]
            self._held = [(r, s) for r, s in self._held if not r.is_set()]
            for slots in back:
                self._free.extend(slots)
        return bool(self._free)

    def give(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def give_when(self, released: threading.Event, slots: list[int]) -> None:
        """``slots`` come back once ``released`` is set (I/O that outlived its wait)."""
        with self._cond:
            self._held.append((released, slots))

    def close(self) -> None:
        """Unmap (after every slot came back: the caller drained the tiers)."""
        self._slots = self._buf = torch.empty(0)
        with contextlib.suppress(BufferError):  # a view still exported: unmapped with it
            self._mm.close()
        os.close(self.fd)
