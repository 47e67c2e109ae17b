# `make train`, `make test` and `make lint` (ruff). Each creates .venv and installs the project when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HF_STAMP := $(VENV)/.installed-hf
WORKDIR ?= runs/default
# Test files spread over this many processes (pytest-xdist), one file per process at a time so module
# fixtures and shared compiled steps are built once; most tests wait on one core (XLA compiles serially).
# Files go out slowest first, in tests/conftest.py's order rather than xdist's (most tests first).
TEST_WORKERS ?= 2

.PHONY: train test lint install clean

install: $(STAMP)

# pip's own progress (each package collected, downloaded and installed) shows what the first minute is spent on.
$(STAMP): pyproject.toml
	@echo "make: installing the project and its dependencies into $(VENV) (once; about a minute on a fresh clone)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -e '.[test,parquet,plots,wandb,data,chat]'
	touch $(STAMP)
	@echo "make: installed; $(VENV)/bin/python runs the project"

train: $(STAMP)
	$(PY) -m train --config=experiments/default.py --workdir=$(WORKDIR)

# The tests compare against transformers and run lm-evaluation-harness: `make test` adds the hf and eval extras.
$(HF_STAMP): $(STAMP)
	@echo "make: adding the hf, eval and serve extras the tests use (torch among them: a few minutes, once)"
	$(PY) -m pip install --quiet -e '.[test,parquet,plots,wandb,data,chat,hf,eval,serve]'
	touch $(HF_STAMP)

test: $(HF_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# ruff, configured in pyproject.toml; .ci/run runs it before the tests.
lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) runs .cache
