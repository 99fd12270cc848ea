# The README's commands. `make train` and `make test` set up .venv first when it is missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
ARGS    ?=
LINTED  := launcher tests bench $(wildcard hydra_plugins scripts/*.py)

.PHONY: setup train test test-fast test-compat bench gpu-check wheelhouse lint clean

setup: $(STAMP)

# torch is pinned here for this machine's local CPU build; the package accepts the range test-compat proves.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all,ft,dev]'  # ft: not in all (few platforms), but tested here
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/train $(ARGS)

# two pytest workers, a test file each at a time (module fixtures and the SLURM cluster stay in one
# process): 32 -> 21 minutes on 2 cores, the tests being single-threaded between their worker spawns
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# the fast tier, under 3 minutes on 2 cores: unit and single-process tests, none marked `slow` (a test that
# starts processes - gloo workers, the CLI, SLURM - or trains in-process for more than ~2 s); CI runs `test`
test-fast: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(ARGS)

# the compat, parallel-equivalence, checkpoint and CUDA-path tests under the oldest and newest supported
# torch, each in its own cached venv (scripts/test_compat.sh; ARGS: other versions, e.g. 2.12.1)
test-compat:
	PY=$(PY) scripts/test_compat.sh $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(ARGS)

# the prepared one-GPU check of the CUDA path (bench/gpu_check.py); ARGS: --hardware=NAME --out=DIR
# --deadline=S --only=NAME,... --rehearse. PYTHON=python3: an environment of your own (a GPU node's torch
# with the launcher installed from a wheelhouse) instead of .venv
ifdef PYTHON
gpu-check:
	$(PYTHON) -m bench gpu_check $(ARGS)
else
gpu-check: $(STAMP)
	$(BIN)/python -m bench gpu_check $(ARGS)
endif

# every dependency but torch as wheels, for a node without internet (scripts/wheelhouse.py);
# ARGS: --out=DIR --python-version=3.12 --extras=all|none|wandb,text,...
wheelhouse: $(STAMP)
	$(BIN)/python scripts/wheelhouse.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

clean:
	rm -rf $(VENV) outputs multirun
