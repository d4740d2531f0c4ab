# moetune developer tasks. `make setup` once, then `make quickstart` / `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE ?= 1

.PHONY: setup quickstart test test-slow lint format docs bench clean setup-skypilot test-skypilot \
	setup-deepspeed test-deepspeed

setup: $(BIN)/moetune

$(BIN)/moetune: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# CPU build of torch first, so nothing pulls a multi-GB CUDA wheel.
	$(BIN)/pip install "torch==2.13.0" || $(BIN)/pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
	# mlx extra: mlx-lm with its CPU backend on Linux x86-64, Metal on Apple silicon (markers).
	$(BIN)/pip install -e ".[dev,mlx]"
	touch $@

# SkyPilot in its own venv (its pins are not ours); the provider calls its `sky` CLI.
SKY_VENV ?= /work/venvs/skypilot
setup-skypilot:
	$(PY) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/pip install "skypilot>=0.14,<0.15"

test-skypilot: setup setup-skypilot
	$(BIN)/pytest -q -m skypilot

# DeepSpeed (train.strategy zero3) in its own venv: an sdist with its own JIT-built C++ ops,
# opt-in like the serving stacks. The CPU accelerator's shm_comm op is built once here, so
# no rank compiles it (a rank killed mid-build leaves torch's lock file and the next waits).
DS_VENV ?= /work/venvs/ds
setup-deepspeed:
	$(PY) -m venv $(DS_VENV)
	$(DS_VENV)/bin/pip install "torch==2.13.0" || $(DS_VENV)/bin/pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
	$(DS_VENV)/bin/pip install -e ".[dev]" "deepspeed>=0.19.8,<0.20"
	$(DS_VENV)/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"

test-deepspeed: setup-deepspeed
	OMP_NUM_THREADS=1 $(DS_VENV)/bin/pytest -q -m deepspeed tests/test_train_distributed.py

quickstart: setup
	$(BIN)/moetune quickstart

test: setup
	$(BIN)/pytest -q

test-slow: setup
	$(BIN)/pytest -q -m slow

lint: setup
	$(BIN)/ruff check src tests benchmarks docs
	$(BIN)/ruff format --check src tests benchmarks docs
	$(BIN)/mypy
	$(MAKE) docs

# The docs site, strict: a broken link, a missing anchor or a page left out of nav fails.
# (examples in it are checked against the CLI by tests/test_docs.py; python
# docs/gen_examples.py rewrites them.) Not --quiet: it hides the warnings strict counts.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

format: setup
	$(BIN)/ruff format src tests benchmarks docs
	$(BIN)/ruff check --fix src tests benchmarks docs

bench: setup
	$(BIN)/python benchmarks/planner_accuracy.py --quick
	$(BIN)/python benchmarks/trace_speed.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
