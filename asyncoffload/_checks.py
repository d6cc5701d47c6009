"""The checks of the engine's input: keys, block ids, request contexts, tokens.

Each raises an exception that names the call and what was wrong, before the engine
changes anything (see docs/api.md).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, SupportsIndex, TypeAlias

import torch

from asyncoffload._native import load_mgrcore
from asyncoffload.errors import BlockIdError, LengthMismatchError
from asyncoffload.keys import GROUP_IDX_BYTES, BlockTokens, IntArray, OffloadKey, tenant_key
from asyncoffload.manager import ReqContext
from asyncoffload.manager.quotas import tenancy
from asyncoffload.manager.retention import Retention

__all__ = [
    "BlockIds",
    "check_block_ids",
    "check_call",
    "check_ctx",
    "check_described",
    "check_keys",
    "check_tokens",
    "distinct",
    "filed",
]

#: KV block ids: ints (or anything ``operator.index`` takes: numpy and torch integer
#: scalars), a 1-D integer torch tensor, or a 1-D integer numpy array (vLLM's tables).
BlockIds: TypeAlias = "Sequence[SupportsIndex] | torch.Tensor | IntArray"

_ANON = ReqContext(req_id="")
_INT = {int}


def check_call(
    what: str, keys: Sequence[OffloadKey], ids: BlockIds, ctx: object, limit: int, unique: bool
) -> tuple[list[OffloadKey], list[int], ReqContext]:
    """The keys (as every tier files them), block ids (inside ``[0, limit)``;
    ``unique``: none twice) and context of a ``prepare_*`` call, checked."""
    checked = check_keys(keys, what)
    block_ids = check_block_ids(ids, len(checked), limit, what, unique)
    context = _ANON if ctx is None else check_ctx(ctx, what)
    return filed(checked, context), block_ids, context


def _native_checks() -> Any:
    """The native manager core's checks (``mgrcore``), ``False`` where it is unavailable,
    ``None`` while a background build may still bring it."""
    global _NATIVE
    core = load_mgrcore()
    if core is not None or not load_mgrcore.building:
        _NATIVE = core if core is not None else False
    return core


#: See :func:`_native_checks`.
_NATIVE: Any = None


def check_keys(keys: Sequence[OffloadKey], what: str) -> list[OffloadKey]:
    native = _NATIVE if _NATIVE is not None else _native_checks()
    if native:
        checked: list[OffloadKey] | None = native.checked_keys(keys, GROUP_IDX_BYTES)
        if checked is not None:
            return checked
    if isinstance(keys, (bytes, str)):
        raise TypeError(
            f"{what}: keys must be a sequence of OffloadKey, not one {type(keys).__name__}"
        )
    out = list(keys)
    for i, key in enumerate(out):
        if not isinstance(key, bytes):
            raise TypeError(f"{what}: keys[{i}] is a {type(key).__name__}, not bytes")
        if len(key) <= GROUP_IDX_BYTES:
            raise ValueError(
                f"{what}: keys[{i}] has {len(key)} bytes: an OffloadKey is a block hash "
                f"followed by a {GROUP_IDX_BYTES}-byte group index"
            )
    return out


def check_ctx(ctx: object, what: str) -> ReqContext:
    if ctx is None:
        return _ANON
    if not isinstance(ctx, ReqContext):
        raise TypeError(
            f"{what}: ctx must be an asyncoffload.ReqContext or None, got {type(ctx).__name__}"
        )
    if ctx.retention is not None and not isinstance(ctx.retention, Retention):
        raise TypeError(
            f"{what}: ctx.retention must be an asyncoffload.Retention or None, got "
            f"{type(ctx.retention).__name__}"
        )
    if ctx.tenant is not None or ctx.no_store or ctx.kv_transfer_params:
        tenancy(ctx)  # a bad tenant or opt-out raises here, before anything changes
    return ctx


def distinct(keys: list[OffloadKey]) -> list[OffloadKey]:
    """``keys`` without repeats, in first-seen order (``keys`` itself when none repeats)."""
    native = _NATIVE if _NATIVE is not None else _native_checks()
    repeats: bool = not native or native.distinct(keys) is None
    return list(dict.fromkeys(keys)) if repeats else keys


def check_block_ids(ids: BlockIds, n: int, limit: int, what: str, unique: bool) -> list[int]:
    if type(ids) is list:
        raw: list[Any] = ids[:]
    elif isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise BlockIdError(f"{what}: block ids must be a 1-D integer tensor")
        if ids.is_meta:
            raise BlockIdError(f"{what}: block ids on the meta device have no values")
        raw = ids.tolist()
    elif hasattr(ids, "dtype") and hasattr(ids, "tolist"):  # a numpy array (vLLM's tables)
        kind = getattr(ids.dtype, "kind", None)
        if kind not in ("i", "u") or getattr(ids, "ndim", 1) != 1:
            raise BlockIdError(
                f"{what}: block ids must be a 1-D integer array, got dtype {ids.dtype}"
            )
        raw = ids.tolist()
    else:
        raw = list(ids)
    if len(raw) != n:
        raise LengthMismatchError(f"{what}: {n} keys but {len(raw)} block ids")
    # The common case (plain ints, in range, distinct) in one native call or C-level
    # passes; anything else is converted, found and named below.
    native = _NATIVE if _NATIVE is not None else _native_checks()
    if native:
        if native.ids_ok(raw, limit, unique):
            return raw
    elif not raw or (
        set(map(type, raw)) == _INT
        and min(raw) >= 0
        and max(raw) < limit
        and (not unique or len(set(raw)) == n)
    ):
        return raw
    out: list[int] = []
    for i, b in enumerate(raw):
        # Anything operator.index takes (numpy and torch integer scalars too).
        try:
            if isinstance(b, bool):
                raise TypeError
            b = operator.index(b)
        except TypeError:
            raise BlockIdError(f"{what}: block id {b!r} at index {i} is not an int") from None
        out.append(b)
        if not 0 <= b < limit:
            raise BlockIdError(
                f"{what}: block id {b} at index {i} is outside [0, {limit}) of the KV cache"
            )
    if unique and len(set(out)) != len(out):
        raise BlockIdError(f"{what}: a destination block id appears more than once")
    return out


def check_tokens(ctx: ReqContext, tokens: BlockTokens | None) -> ReqContext:
    """``ctx`` with ``tokens`` (what the stored blocks hold), checked."""
    if ctx.tenant is not None and (tokens is not None or ctx.tokens is not None):
        raise ValueError(
            "prepare_store: tokens describe the caller's keys, and a request with a "
            "tenant files its blocks under tenant keys: derive the keys with the salt "
            "(BlockTokens.from_tokens(..., salt=)) instead of ctx.tenant"
        )
    if tokens is None:
        return ctx
    if not isinstance(tokens, BlockTokens):
        raise TypeError(f"prepare_store: tokens is a {type(tokens).__name__}, not BlockTokens")
    return dataclasses.replace(ctx, tokens=tokens)


def check_described(keys: Sequence[OffloadKey], tokens: BlockTokens) -> None:
    for i, key in enumerate(keys):
        if tokens.index(key) is None:
            raise ValueError(
                f"prepare_store: keys[{i}] is not one of the {len(tokens)} keys its "
                "BlockTokens describes"
            )


def filed(keys: list[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
    """The keys as every tier files them: per tenant when the request has one."""
    tenant = ctx.tenant
    if tenant is None:
        return keys
    if not isinstance(tenant, str):
        raise TypeError(f"ctx.tenant must be a str or None, got {type(tenant).__name__}")
    return [tenant_key(key, tenant) for key in keys]
