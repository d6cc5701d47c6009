"""Tests of asyncoffload.integrations.sglang (`make test-sglang`). Where SGLang's modules
are importable, :func:`~tests.sglang.sglang_cpu.import_sglang` runs first, before any of
this package's modules imports SGLang."""

import importlib.util

if importlib.util.find_spec("sglang") is not None:
    from tests.sglang.sglang_cpu import import_sglang

    import_sglang()
