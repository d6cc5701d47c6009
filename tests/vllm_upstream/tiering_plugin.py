"""A pytest plugin that runs vLLM 0.34's own tiering tests against our secondary tier.

vLLM's tests of its tiering (``tests/v1/kv_offload/tiering/``) drive its
``TieringOffloadingManager`` over the secondary tiers vLLM ships. Those that take a
tier of vLLM's as the tier under test run here (``scripts/vllm_upstream.sh PY OVERLAY
--tiering``) with ours in its place, before the test modules import it:

- ``ExampleSecondaryTierManager`` (an in-memory tier that ends each job when it is
  submitted; test_tiering_offloading.py, test_factory.py) becomes
  :class:`UpstreamExampleTier`: our :class:`AsyncOffloadTier` over a disk tier (slab, in
  a temporary directory), behind the example's constructor;
- ``FileSystemTierManager`` (vLLM's fs tier; test_fs_tier.py) becomes
  :class:`UpstreamFsTier`: ours over a disk tier in files mode at the test's
  ``root_dir``, behind the fs tier's constructor.

vLLM's manager, primary tier, factory and spec are vLLM's own. Some of vLLM's tests read
or write the example tier's state by its names (``chunks``, ``completed_jobs``) or the
fs tier's (``file_mapper``, ``_lookup_manager``); the adapters give those names over our
state: ``chunks[key] = True`` ("a previous cascade stored it") stores the key through our
tier and waits for it; ``completed_jobs`` holds results a test appends, handed out with
ours; the example ends every job when it is submitted, and vLLM's tests count on it, so
the adapter waits (bounded) for our jobs before each poll. Which tests fail, and why,
is in docs/vllm.md ("vLLM's own tiering tests").
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any

import pytest

from asyncoffload.tiers.format import Namespace

#: How long an adapter waits for our jobs before a poll (a busy machine included).
_WAIT_S = 20.0
#: The example tiers' directories, made under one of this run's, removed at its end.
_ROOT: list[str] = []
#: Our tiers the running test made: most of vLLM's tests never shut theirs down, so each
#: is shut down, and an example tier's directory removed, when its test ends (before,
#: every example tier's 64 MiB slab stayed until the session ended: 7 GB of disk by the
#: end of test_tiering_offloading.py).
_LIVE: list[Any] = []


def _adapters() -> tuple[type, type]:
    from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
    from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

    from asyncoffload.integrations.vllm.secondary import AsyncOffloadTier, _ours
    from asyncoffload.tiers.disk import DiskStore
    from asyncoffload.tiers.lent import LentJob

    class _Synchronous(AsyncOffloadTier):
        """Ours, each job ended when it is submitted, its result queued in
        ``completed_jobs`` (where a test may append results of its own), as the
        example tier does."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.completed_jobs: list[JobResult] = []
            super().__init__(*args, **kwargs)
            _LIVE.append(self)

        def _ended(self, job: LentJob) -> None:
            assert self._tiers.wait([job], _WAIT_S), "our tier's job did not end"
            self.completed_jobs.extend(super().get_finished_jobs())

        def submit_store(self, job_metadata: TransferJob) -> None:
            slots = self._rows.slots(job_metadata)
            self._ended(self._tiers.store(_ours(job_metadata), slots, job_metadata))

        def submit_load(self, job_metadata: TransferJob) -> None:
            slots = self._rows.slots(job_metadata)
            self._ended(self._tiers.load(_ours(job_metadata), slots, job_metadata))

        def get_finished_jobs(self) -> Iterable[JobResult]:
            self.completed_jobs.extend(super().get_finished_jobs())
            results, self.completed_jobs = self.completed_jobs, []
            return results

        def get_num_chunks(self) -> int:
            return sum(t.manager.ready for t in self.tier_stats())

        @property
        def chunks(self) -> _Chunks:
            return _Chunks(self)

    class _Chunks(MutableMapping[OffloadKey, bool]):
        """The example tier's ``chunks`` over ours: a key is in it while our tier holds
        it ready; setting one stores it (from the primary tier's first chunk: its bytes
        do not matter to these tests) and waits for the write."""

        def __init__(self, tier: _Synchronous) -> None:
            self._tier = tier

        def __contains__(self, key: object) -> bool:
            ctx = ReqContext(req_id="upstream-view")
            return self._tier.lookup(key, ctx) is LookupResult.HIT  # type: ignore[arg-type]

        def __getitem__(self, key: OffloadKey) -> bool:
            if key not in self:
                raise KeyError(key)
            return True

        def __setitem__(self, key: OffloadKey, value: bool) -> None:
            tiers = self._tier._tiers
            job = tiers.store(_ours_keys([key]), [0])
            assert tiers.wait([job], _WAIT_S) and all(job.written), job.causes
            tiers.ended()  # the store is the test's, not vLLM's: no result for it

        def __delitem__(self, key: OffloadKey) -> None:
            raise NotImplementedError("our tier drops a key by its own rules only")

        def __iter__(self) -> Iterator[OffloadKey]:
            raise NotImplementedError("our tier's index is not listed")

        def __len__(self) -> int:
            return self._tier.get_num_chunks()

    def _ours_keys(keys: list[OffloadKey]) -> Any:
        return list(keys)

    class UpstreamExampleTier(_Synchronous):
        """Ours behind ``ExampleSecondaryTierManager``'s constructor: a disk tier of 4
        MiB (slab, one lane; vLLM's tests store tens of chunks of 16 to 64 bytes) in a
        temporary directory, removed when the tier shuts down or its test ends; the
        tests' spec is a mock, so the namespace is a fixed one."""

        def __init__(
            self,
            offloading_spec: Any,
            primary_kv_view: memoryview,
            tier_type: str,
            custom_param: int = 0,
            backpressure_detector: Any = None,
        ) -> None:
            self._dir = tempfile.mkdtemp(prefix="example-", dir=_ROOT[0])
            tier = {
                "kind": "disk",
                "path": self._dir,
                "capacity": "4MiB",
                "admission": None,
                "io_threads": 1,
            }
            try:
                super().__init__(
                    offloading_spec,
                    primary_kv_view,
                    tier_type,
                    backpressure_detector,
                    tier=tier,
                )
            except BaseException:
                shutil.rmtree(self._dir, ignore_errors=True)
                raise

        def namespace(self) -> Namespace:
            return Namespace("vllm-tests", "int8", "example", self._rows.stride)

        def shutdown(self) -> None:
            super().shutdown()
            shutil.rmtree(self._dir, ignore_errors=True)

    class UpstreamFsTier(_Synchronous):
        """Ours behind ``FileSystemTierManager``'s constructor: a disk tier in files mode
        at ``root_dir`` (1 GiB; the fs tier has no bound), vLLM's locality."""

        def __init__(
            self,
            offloading_spec: Any,
            primary_kv_view: memoryview,
            tier_type: str,
            root_dir: str,
            n_read_threads: int = 16,
            n_write_threads: int = 16,
            enable_kv_events: bool = False,
            locality: str | None = None,
            backpressure_detector: Any = None,
        ) -> None:
            tier = {
                "kind": "disk",
                "path": root_dir,
                "capacity": "1GiB",
                "mode": "files",
                "admission": None,
                "io_threads": max(1, min(64, (n_read_threads + n_write_threads) // 8)),
            }
            extra = {} if locality is None else {"locality": locality}
            super().__init__(
                offloading_spec,
                primary_kv_view,
                tier_type,
                backpressure_detector,
                tier=tier,
                **extra,
            )
            self._lookup_manager = _Answered()
            self.file_mapper = _Files(self)

    class _Answered:
        """The fs tier's asynchronous lookups: vLLM's tests wait until its queue of
        answers is not empty. A disk tier of ours answers at once: never empty."""

        class _pending_results:
            @staticmethod
            def empty() -> bool:
                return False

        #: Keys queued for a probe of the disk: ours never probes (its index answers).
        _lookup_batch: list[OffloadKey] = []

    class _Files:
        """The fs tier's ``file_mapper``: where our disk tier keeps a key's file."""

        def __init__(self, tier: AsyncOffloadTier) -> None:
            (store,) = tier.stores
            assert isinstance(store, DiskStore)
            self._store = store

        def get_file_name(self, key: OffloadKey) -> str:
            return str(self._store.path_of(key))  # type: ignore[arg-type]

        @property
        def base_path(self) -> str:
            return str(self._store.dir)

    return UpstreamExampleTier, UpstreamFsTier


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--vllm-own",
        action="store_true",
        help="the baseline: vLLM's own tiers under the same tests (nothing replaced)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--vllm-own"):
        return
    import vllm.v1.kv_offload.tiering.example.manager as example_module
    import vllm.v1.kv_offload.tiering.fs.manager as fs_module

    _ROOT.append(tempfile.mkdtemp(prefix="ao-upstream-"))
    example, fs = _adapters()
    setattr(example_module, "ExampleSecondaryTierManager", example)  # noqa: B010
    setattr(fs_module, "FileSystemTierManager", fs)  # noqa: B010


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the test's own teardown: shut down each tier of ours it made and left open
    (shutdown is idempotent), removing an example tier's directory."""
    yield
    live = list(_LIVE)
    _LIVE.clear()
    errors: list[Exception] = []
    for tier in live:
        try:
            tier.shutdown()
        except Exception as exc:  # each is shut down; the first error fails the test
            errors.append(exc)
    if errors:
        raise errors[0]


def pytest_unconfigure(config: pytest.Config) -> None:
    for root in _ROOT:
        shutil.rmtree(root, ignore_errors=True)


#: vLLM 0.34's tiering tests that fail against ours, each for a reason that is vLLM's
#: tier's implementation, not the secondary-tier contract: strict xfails, so one that
#: starts to pass fails the run until it leaves this list (docs/vllm.md).
_T = "tests/v1/kv_offload/tiering/test_tiering_offloading.py::"
_F = "tests/v1/kv_offload/tiering/test_factory.py::"
_FS = "tests/v1/kv_offload/tiering/test_fs_tier.py::"
_MEDIUM = (
    "the example is a CPU-medium tier, ours a STORAGE one (disk): a filter or a cache-hit "
    "source by medium tells them apart"
)
_MOCK_VIEW = (
    "builds the tier over a MagicMock, not a primary region: ours refuses a view it "
    "cannot address (it moves the chunks' bytes; the example keeps no bytes)"
)
KNOWN_FAILURES: dict[str, str] = {
    _T + "TestExampleSecondaryTierManager::test_config_info_keys_match_the_filled_values": (
        "the example's own config fact (example_info = custom_param); ours publishes "
        "asyncoffload_tier"
    ),
    _T + "TestTieringOffloadingManager::test_tier_filter_skips_filtered_secondary"
    "[non_matching_medium]": _MEDIUM,
    _T + "TestTieringOffloadingManager::test_tier_filter_allows_matching_secondary"
    "[explicit_cpu]": _MEDIUM,
    _F + "test_pre_registered_tiers_can_be_imported": _MEDIUM,
    _F + "test_create_tier_from_registry": _MOCK_VIEW,
    _F + "test_create_multiple_tiers": _MOCK_VIEW,
    _F + "test_register_new_tier_type": _MOCK_VIEW,
    _F + "test_create_tier_from_module_path": _MOCK_VIEW,
    _FS + "test_shutdown_discards_pending_tasks": "reads the fs tier's thread pool (_pool)",
    _FS + "test_store_load_roundtrip_without_o_direct": (
        "sets the fs tier's _use_o_direct (ours: the disk tier's direct_io setting)"
    ),
    _FS + "test_out_of_bounds_block_id_smoke[False]": (
        "ours refuses a chunk outside vLLM's region at submit (ValueError naming it); "
        "the fs tier fails the job"
    ),
    _FS + "test_failed_load_after_abort_does_not_break_newer_probe": (
        "expects the fs tier's asynchronous probe of the disk (RETRY); ours answers a "
        "disk lookup from its index at once (the failed load has dropped the key: MISS)"
    ),
    _FS + "test_batched_load_first_block_fails_marks_whole_batch[False]": (
        "the fs tier stops a batch at its first bad block; ours loads every good block of "
        "the batch and fails the bad one only (successful_keys names the others)"
    ),
    _FS + "test_transient_load_failure_leaves_file[False]": (
        "makes the block's path a symlink loop (ELOOP); ours never follows a symlink at a "
        "block's path: a failed read, the block dropped and its path removed"
    ),
    _FS + "test_store_event_uses_configured_locality[None-None]": (
        "with no locality set, ours says LOCAL for a disk tier (REMOTE for a shared one); "
        "the fs tier says none"
    ),
    _FS + "test_mixed_job_results_emit_event_only_for_successful_job": (
        "injects a failure into the fs tier's own I/O function (batch_store_block)"
    ),
    _FS + "test_partially_failed_store_emits_no_event": (
        "injects a failure into the fs tier's own I/O function (batch_store_block); ours "
        "publishes a stored event for each block written, whatever the job's other blocks"
    ),
    _FS + "test_events_disabled_by_default": (
        "reads the fs tier's events list and _store_jobs (ours publishes nothing either "
        "while vLLM's KV events are off)"
    ),
    _FS + "test_events_require_global_kv_events_flag": (
        "reads the fs tier's events list and _store_jobs (ours publishes nothing either "
        "while vLLM's KV events are off)"
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--vllm-own"):
        return
    for item in items:
        reason = KNOWN_FAILURES.get(item.nodeid.split("[")[0]) or KNOWN_FAILURES.get(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=reason))


def pytest_report_header(config: pytest.Config) -> str:
    import vllm

    return (
        f"vLLM {vllm.__version__}'s own tiering tests against asyncoffload: "
        "ExampleSecondaryTierManager, FileSystemTierManager -> AsyncOffloadTier"
    )
