# Everything runs in .venv, created here from the machine's python3 (3.11+).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: test test-exhaustive demo bench bench-full lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,flax,viz,notebooks,tunix]'
	touch $@

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,flax,viz,notebooks,tunix,bench]'
	touch $@

lint: $(STAMP)
	$(PY) -m ruff check jax_reshard tests benchmarks examples
	$(PY) -m ruff format --check jax_reshard tests benchmarks examples
	$(PY) -m mypy

test: lint
	$(PY) -m pytest

test-exhaustive: lint
	JAX_RESHARD_EXHAUSTIVE=1 $(PY) -m pytest

demo: $(STAMP)
	$(PY) -m jax_reshard demo

bench: $(BENCH_STAMP)
	$(PY) -m benchmarks.refit --quick
	$(PY) -m benchmarks.dispatch
	$(PY) -m benchmarks.dispatch --placement colocated --leaves 1,100,1000
	$(PY) -m benchmarks.dispatch --layers 1,60
	$(PY) -m benchmarks.tunix_sync

bench-full: $(BENCH_STAMP)
	$(PY) -m benchmarks.refit --full

clean:
	rm -rf $(VENV) bench_results
