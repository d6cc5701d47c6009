"""Moving bytes between the KV tensors and the host tier. Knows nothing of keys or policies."""

from __future__ import annotations

from asyncoffload.transfer.base import CopyJob, FailedJob, TransferBackend
from asyncoffload.transfer.completion import CompletionBridge, CopyLane
from asyncoffload.transfer.cpu import CpuCopyBackend
from asyncoffload.transfer.faults import Fault, FaultPlan, InjectedFault

__all__ = [
    "CompletionBridge",
    "CopyJob",
    "CopyLane",
    "CpuCopyBackend",
    "FailedJob",
    "Fault",
    "FaultPlan",
    "InjectedFault",
    "TransferBackend",
]
