"""Through vLLM's adapter, the ``session`` policy reads a request's session from vLLM's
``kv_transfer_params["session_id"]`` (issue 40), on whichever vLLM is installed.

vLLM's connector calls the adapter's manager with vLLM's own ``ReqContext``: per-key
lookups, loads, stores, and the request's end; no touch. Two requests with no block in
common that name one session are one session, and its gap between turns is measured."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import pytest
from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from asyncoffload.integrations.vllm import AsyncOffloadManager
from asyncoffload.keys import OffloadKey as Key
from asyncoffload.keys import make_offload_key
from asyncoffload.manager import CPUOffloadingManager
from asyncoffload.manager.policies import SessionPolicy


def _ours(prefix: str, n: int) -> list[Key]:
    return [make_offload_key(f"{prefix}{i}".encode().ljust(8, b".")) for i in range(n)]


def _keys(prefix: str, n: int) -> list[OffloadKey]:
    return [cast(OffloadKey, key) for key in _ours(prefix, n)]


def _serve(manager: AsyncOffloadManager, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
    """A request as vLLM's connector drives it (one store, no load)."""
    manager.on_new_request(ctx)
    for key in keys:
        manager.lookup(key, ctx)
    out = manager.prepare_store(list(keys), ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)


def test_vllms_session_id_names_the_session() -> None:
    now = [0.0]
    manager = AsyncOffloadManager(16, "session", enable_events=False)
    python = manager.manager
    assert isinstance(python, CPUOffloadingManager)  # session runs on the Python manager
    policy = python.policy
    assert isinstance(policy, SessionPolicy)
    policy.use_clock(lambda: now[0])
    x, y, z = _ours("x", 2), _ours("y", 2), _ours("z", 2)
    _serve(manager, _keys("x", 2), ReqContext(req_id="r1", kv_transfer_params={"session_id": "s1"}))
    now[0] = 10.0
    _serve(manager, _keys("y", 2), ReqContext(req_id="r2", kv_transfer_params={"session_id": "s1"}))
    _serve(manager, _keys("z", 2), ReqContext(req_id="r3"))
    assert policy.session_of(x[0]) == policy.session_of(y[0]) == "s1"
    session_z = policy.session_of(z[0])
    assert session_z is not None and session_z != "s1"
    now[0] = 12.0
    assert policy.expected_wait(x[0]) == pytest.approx(8.0)  # its gap: 10 s


def test_a_bad_session_id_is_named() -> None:
    manager = AsyncOffloadManager(16, "session", enable_events=False)
    params: dict[str, Any] = {"session_id": 3}
    ctx = ReqContext(req_id="r1", kv_transfer_params=params)
    manager.on_new_request(ctx)
    with pytest.raises(ValueError, match="session"):
        manager.prepare_store(_keys("x", 2), ctx)
