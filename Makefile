# Everything installs into a virtualenv; torch is pinned so the CPU build lying on disk is used
# (an unpinned torch pulls a multi-GB CUDA wheel).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
PYTEST_ARGS ?=

.PHONY: install kernels protos lint typecheck deploy-tools test test-fast up clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[worker,dev]'
	touch $@

install: $(VENV)/.installed

# The native CPU kernels, compiled for this machine's vector ISA into ~/.cache/meshserve/kernels (a no-op
# when cached); a worker would otherwise build them on its first start.
kernels: install
	$(PY) -m services.worker.kernels.loader

protos: install
	$(PY) scripts/gen_protos.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

# promtool and a Prometheus server for the deploy/ and metrics tests, from Debian's package (CI's machine
# may be fresh; a no-op where promtool is on PATH already).
deploy-tools:
	@command -v promtool >/dev/null 2>&1 || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus)

test: lint typecheck kernels deploy-tools
	$(PY) -m pytest -ra --durations=15 $(PYTEST_ARGS)

test-fast: kernels
	$(PY) -m pytest -ra -m "not slow" $(PYTEST_ARGS)

up: kernels
	$(VENV)/bin/meshserve up

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
