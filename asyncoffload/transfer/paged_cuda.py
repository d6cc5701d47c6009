"""The paged worker's CUDA engine, under its earlier import path: it lives in
:mod:`asyncoffload.transfer.cuda.paged`."""

from __future__ import annotations

from asyncoffload.transfer.cuda.paged import CudaPagedEngine

__all__ = ["CudaPagedEngine"]
