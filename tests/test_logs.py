"""Logging: the level from the environment, -v and -q on the command line."""

from __future__ import annotations

import logging

import pytest

from asyncoffload.cli import main
from asyncoffload.logs import configure_cli, level_from_env
from tests.processes import describe, run_python


@pytest.fixture(autouse=True)
def _restore_logger() -> object:
    logger = logging.getLogger("asyncoffload")
    saved = (logger.level, logger.propagate, list(logger.handlers))
    yield
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]


@pytest.mark.parametrize(
    ("raw", "level"), [("debug", logging.DEBUG), ("WARNING", logging.WARNING), ("15", 15)]
)
def test_the_environment_names_a_level(
    raw: str, level: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCOFFLOAD_LOG_LEVEL", raw)
    assert level_from_env() == level


def test_a_bad_level_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCOFFLOAD_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="ASYNCOFFLOAD_LOG_LEVEL='loud' is not a log level"):
        level_from_env()
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--requests", "4"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("verbose", "quiet", "level"),
    [(0, 0, logging.WARNING), (1, 0, logging.INFO), (2, 0, logging.DEBUG), (0, 1, logging.ERROR)],
)
def test_each_v_and_q_moves_one_step(
    verbose: int, quiet: int, level: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASYNCOFFLOAD_LOG_LEVEL", raising=False)
    restore = configure_cli(verbose, quiet)
    assert logging.getLogger("asyncoffload").level == level
    restore()


def test_main_leaves_the_package_logger_as_it_found_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A main() run inside a process that goes on (tests, embedding) must not leave its
    stderr handler behind: later records went to a closed stream and never reached the
    root logger (caplog), and a test waiting on one hung."""
    logger = logging.getLogger("asyncoffload")
    before = (list(logger.handlers), logger.level, logger.propagate)
    assert main(["demo", "--requests", "4", "--no-progress", "-v"]) == 0
    assert (list(logger.handlers), logger.level, logger.propagate) == before
    with caplog.at_level(logging.WARNING, logger="asyncoffload"):
        logging.getLogger("asyncoffload.test").warning("still heard")
    assert "still heard" in caplog.text


def test_minus_v_shows_the_engines_info_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "4", "--no-progress", "-v"]) == 0
    assert "asyncoffload: INFO: asyncoffload engine ready" in capsys.readouterr().err


def test_importing_the_package_applies_the_environment_level() -> None:
    proc = run_python(
        """
        import logging
        import asyncoffload
        print(logging.getLogger("asyncoffload").level)
        """,
        env={"ASYNCOFFLOAD_LOG_LEVEL": "DEBUG"},
    )
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout.strip() == str(logging.DEBUG)
