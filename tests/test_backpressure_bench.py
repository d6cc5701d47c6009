"""benchmarks/backpressure.py's arguments: a write rate of 0 ran on into a
ZeroDivisionError in every write the tier submitted; it is refused up front, naming the
argument (``inf`` is unthrottled)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "backpressure.py"


@functools.cache
def bench() -> ModuleType:
    """The script as a module, loaded once (it imports the demo and the engine)."""
    spec = importlib.util.spec_from_file_location("bench_backpressure", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_backpressure"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rate", ["0", "-5", "nan", "fast"])
def test_a_write_rate_not_above_zero_is_refused_naming_it(
    rate: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench().main(["--write-rate", rate, "--repeat", "1", "--requests", "1"])
    assert exit_info.value.code == 2
    assert "argument --write-rate: must be a number of blocks a second above 0" in (
        capsys.readouterr().err
    )


def test_inf_is_unthrottled() -> None:
    assert bench().write_rate("inf") == float("inf")
