# Quick start: `make demo` runs the demo, `make test` runs lint and the tests.
# Both create .venv on first use and install the package with its test extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: demo test lint unit bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch when none is installed: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m asyncoffload demo $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check asyncoffload tests benchmarks examples
	$(PY) -m ruff format --check asyncoffload tests benchmarks examples
	$(PY) -m mypy

unit: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test: lint unit

bench: $(STAMP)
	$(PY) benchmarks/control_plane.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
