# The README's commands. `make train` and `make test` set up .venv first when it is missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
ARGS    ?=
LINTED  := launcher tests bench $(wildcard hydra_plugins scripts/*.py)

.PHONY: setup train test test-compat bench gpu-check lint clean

setup: $(STAMP)

# torch is pinned here for this machine's local CPU build; the package accepts the range test-compat proves.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,hf]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/train $(ARGS)

test: $(STAMP)
	$(BIN)/pytest -q $(ARGS)

# the compat, parallel-equivalence, checkpoint and CUDA-path tests under the oldest and newest supported
# torch, each in its own cached venv (scripts/test_compat.sh; ARGS: other versions, e.g. 2.12.1)
test-compat:
	PY=$(PY) scripts/test_compat.sh $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(ARGS)

# the prepared one-GPU check of the CUDA path (bench/gpu_check.py); ARGS: --hardware=NAME --out=DIR
gpu-check: $(STAMP)
	$(BIN)/python -m bench gpu_check $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

clean:
	rm -rf $(VENV) outputs multirun
