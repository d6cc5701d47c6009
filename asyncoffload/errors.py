"""Exceptions raised by asyncoffload. Each says what was wrong; a rejected call changes nothing."""

from __future__ import annotations

__all__ = [
    "AsyncOffloadError",
    "BlockIdError",
    "CapacityError",
    "DuplicateKeyError",
    "EngineClosedError",
    "HostMemoryError",
    "KeyNotReadyError",
    "LengthMismatchError",
    "PromotionError",
    "TransferError",
    "UnknownKeyError",
]


class AsyncOffloadError(Exception):
    """Base class of every asyncoffload exception."""


class EngineClosedError(AsyncOffloadError, RuntimeError):
    """The engine is closing or closed; it takes no new work."""


class HostMemoryError(AsyncOffloadError, MemoryError):
    """An allocation would take more host memory than the machine has available
    (checked before allocating; the message names the setting and both sizes)."""


class TransferError(AsyncOffloadError):
    """A copy failed. Its slots were freed and no stored event was published."""


class _KeyErrorMessage(AsyncOffloadError, KeyError):
    # KeyError.__str__ quotes its argument, which hides the message behind repr().
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownKeyError(_KeyErrorMessage):
    """A key is not stored in the tier."""


class KeyNotReadyError(_KeyErrorMessage):
    """A key is stored but its copy has not completed, so it cannot be loaded yet."""


class DuplicateKeyError(AsyncOffloadError, ValueError):
    """The same key appears twice in one call."""


class LengthMismatchError(AsyncOffloadError, ValueError):
    """Keys and block ids have different lengths."""


class BlockIdError(AsyncOffloadError, ValueError):
    """A block id is not an int, is out of range, or is repeated where it must be unique."""


class CapacityError(AsyncOffloadError, ValueError):
    """``prepare_store`` refused a call with more new keys than the CPU tier has blocks:
    it can never succeed, and nothing changed. ``new_keys`` and ``num_blocks`` hold both
    numbers. Unlike ``None`` (no room *now*), retrying cannot help: store fewer keys (a
    prefix of the call), skip the store, or give the tier more blocks."""

    def __init__(self, new_keys: int, num_blocks: int) -> None:
        super().__init__(
            f"prepare_store: {new_keys} keys to store, more than the {num_blocks} blocks "
            "the CPU tier holds: this store can never succeed (store fewer keys, or give "
            "the tier more blocks)"
        )
        self.new_keys = new_keys
        self.num_blocks = num_blocks

    def __reduce__(self) -> tuple[type[CapacityError], tuple[int, int]]:
        return (type(self), (self.new_keys, self.num_blocks))


class PromotionError(TransferError):
    """A load needs blocks from a lower tier, and the CPU tier has no slot to bring them
    into (every slot is pinned or being written); nothing changed. Retry later or
    recompute."""
