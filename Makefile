# Two commands on a fresh machine (python3 with pip and venv, make): `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2

.PHONY: demo test test-default-codegen test-slow test-gpu-defaults bench lint docs docs-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test,docs]"
	touch $(STAMP)

$(VENV)/.bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(VENV)/.bench

demo: $(STAMP)
	MPLBACKEND=Agg $(PY) -m solvers.demo

test: $(STAMP)
	$(PY) -m ruff check implicit solvers tests benchmarks
	MPLBACKEND=Agg $(PY) -m pytest -n $(PYTEST_WORKERS) --durations=15 -q

# Not part of CI: the suite compiled with XLA:CPU's default code generation (conftest.py:
# the suite otherwise uses a cheaper one, the same HLO compiled to slower machine code).
test-default-codegen: $(STAMP)
	TEST_XLA_CODEGEN=default MPLBACKEND=Agg $(PY) -m pytest -n $(PYTEST_WORKERS) -q

test-slow: $(STAMP)
	MPLBACKEND=Agg $(PY) -m pytest -n $(PYTEST_WORKERS) -q -m slow

# Not part of CI: the default suite on CPU with the defaults a GPU/TPU gets
# (tests/gpu_defaults.py: check_every's accelerator values, Neumann steps per trip).
test-gpu-defaults: $(STAMP)
	MPLBACKEND=Agg PYTHONPATH=tests $(PY) -m pytest -n $(PYTEST_WORKERS) -q -p gpu_defaults

bench: $(VENV)/.bench
	MPLBACKEND=Agg $(PY) -m benchmarks

# The notebooks are shown with their outputs: tools/execute_notebooks.py first runs the
# notebook tests of those whose executed copy (build/notebooks/) is missing or stale
# (none after `make test`, so CI pays nothing extra).
docs: $(STAMP)
	$(PY) tools/execute_notebooks.py -n $(PYTEST_WORKERS)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet
	@echo "documentation site written to site/"

# Not part of CI: build the site, serve it on localhost and check it in headless
# Chromium (Debian's `chromium`, installed here if missing) driven by Playwright.
# docs_check.py, like `make docs`, first executes the notebooks whose copies are stale.
docs-check: $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,docs,docs-check]"
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	MPLBACKEND=Agg $(PY) tools/docs_check.py

lint: $(STAMP)
	$(PY) -m ruff check implicit solvers tests benchmarks

clean:
	rm -rf $(VENV) demo_output benchmarks/results .pytest_cache site site_check build/notebooks
