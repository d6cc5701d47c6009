"""Requests' retention hints under vLLM: ``kv_transfer_params["asyncoffload_retention"]``.

vLLM hands the scheduler's manager each request's ``kv_transfer_params`` on its
context. :class:`RequestHints` reads the hint there when the request starts (parsed and
checked by :func:`~asyncoffload.manager.retention.retention_from_params`), holds it for
the request in the manager's pin table until it ends (vLLM's contexts carry no
``retention``), and reports the pins to vLLM's metrics.

A hint is never dropped silently. Where it cannot be honoured it is refused whole,
counted (``vllm:asyncoffload_pins_refused``) and logged (at most once a minute): with
retention off (no ``pin_budget`` in ``kv_connector_extra_config``; the C core, vLLM's
default manager, has no pins), or when it is malformed (the warning names the key and
what is wrong). A malformed hint does not fail the request: raising in vLLM's scheduler
would stop the engine for every request. A server that wants the error can check the
parameter first with ``retention_from_params``.

No vLLM import here: vLLM's objects are read by their attributes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from asyncoffload.manager import CPUOffloadingManager, NativeManager
from asyncoffload.manager.pins import PinStats
from asyncoffload.manager.retention import retention_from_params

__all__ = ["RequestHints"]

log = logging.getLogger("asyncoffload")

#: A refused hint is logged at most this often.
WARN_EVERY_S = 60.0


class RequestHints:
    """The hints of one vLLM manager's requests (``enabled``: a ``pin_budget`` is set)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        #: Requests whose hint was refused whole (retention off, or malformed).
        self.refused = 0
        self._reported = 0
        self._pins = PinStats(0, 0, 0, 0, 0, 0, 0, 0, 0)  # as last reported
        self._warned_at: float | None = None

    def start(self, manager: CPUOffloadingManager | NativeManager, ctx: Any) -> None:
        """A request starts: hold its hint for it, or refuse it (counted, logged)."""
        params = getattr(ctx, "kv_transfer_params", None)
        if not params:
            return
        try:
            hint = retention_from_params(params)
        except ValueError as exc:
            self._refuse(f"request {ctx.req_id}: {exc}; the request runs without it")
            return
        if hint is None:
            return
        if not self.enabled or not isinstance(manager, CPUOffloadingManager):
            self._refuse(
                f"request {ctx.req_id} asks for retention, which is off: set pin_budget in "
                "kv_connector_extra_config to honour kv_transfer_params' "
                "asyncoffload_retention"
            )
            return
        manager.pins.hint(ctx.req_id, hint)

    def end(self, manager: CPUOffloadingManager | NativeManager, ctx: Any) -> None:
        """A request ended: its hint goes (its pins stay until they expire)."""
        if self.enabled and isinstance(manager, CPUOffloadingManager):
            manager.pins.forget_request(ctx.req_id)

    def _refuse(self, why: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("retention hint refused (%d so far): %s", self.refused, why)

    def report(
        self,
        stats: Any,
        manager: CPUOffloadingManager | NativeManager,
        names: tuple[str, str, str],
    ) -> None:
        """Report the pins to vLLM's ``stats`` (``names``: the pinned gauge, the refused
        and expired counters): increments since the last report."""
        pinned, refused, expired = names
        refused_now = self.refused - self._reported
        self._reported = self.refused
        if isinstance(manager, CPUOffloadingManager):
            pins, was = manager.pins.stats(), self._pins
            self._pins = pins
            stats.set_gauge(pinned, pins.pinned)
            refused_now += pins.refused - was.refused
            if pins.expired - was.expired:
                stats.increase_counter(expired, pins.expired - was.expired)
        if refused_now:
            stats.increase_counter(refused, refused_now)
