# moetune developer tasks. `make setup` once, then `make quickstart` / `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE ?= 1

.PHONY: setup quickstart test test-slow lint format docs bench clean setup-skypilot test-skypilot \
	setup-deepspeed test-deepspeed setup-llamacpp test-interop

setup: $(BIN)/moetune

$(BIN)/moetune: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# this machine's torch build first (CUDA per the driver, ROCm, Apple MPS, else CPU; docs/install.md;
	# MOETUNE_TORCH=cpu|cu128|cu130|rocmX.Y|pypi to choose), so moetune's install keeps it.
	where=$$($(PY) src/moetune/lint/torch_index.py) && $(BIN)/pip install "torch==2.13.0" $$where
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

# llama.cpp for the gguf interop tier in minutes, nothing compiled: xllamacpp's prebuilt
# CPU wheel (manylinux_2_17) exports llama.h's C API, driven through llama-cpp-py-sync's
# CFFI declarations of the same llama.h (its own libllama.so needs glibc >= 2.38); the
# converter is the llama-cpp-python sdist's vendor/llama.cpp (convert_hf_to_gguf.py,
# conversion/, gguf-py). Builds b11549 / b11548 / 0c1e570 (2026-10-10 / -10 / -01).
LLAMACPP_VENV ?= $(CURDIR)/.venv-llamacpp
LLAMACPP_SRC := $(LLAMACPP_VENV)/llama.cpp
LLAMACPP_PINS := "xllamacpp==2026.10.11549" "llama-cpp-py-sync==0.11548"
LLAMACPP_SDIST := llama-cpp-python==0.3.36
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed-b11549

setup-llamacpp: $(LLAMACPP_STAMP) $(LLAMACPP_SRC)/convert_hf_to_gguf.py

$(LLAMACPP_STAMP):
	$(PY) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install -q $(LLAMACPP_PINS)
	touch $@

$(LLAMACPP_SRC)/convert_hf_to_gguf.py:
	rm -rf $(LLAMACPP_VENV)/sdist $(LLAMACPP_SRC) && mkdir -p $(LLAMACPP_SRC)
	$(LLAMACPP_VENV)/bin/pip download -q --no-deps --no-binary :all: $(LLAMACPP_SDIST) -d $(LLAMACPP_VENV)/sdist
	tar xzf $(LLAMACPP_VENV)/sdist/*.tar.gz -C $(LLAMACPP_SRC) --strip-components=3 --wildcards \
		'*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
	rm -rf $(LLAMACPP_VENV)/sdist

# The gguf part of the interop tier (export, convert, serve in llama.cpp, compare with peft).
test-interop: setup setup-llamacpp
	MOETUNE_LLAMACPP_PYTHON=$(LLAMACPP_VENV)/bin/python MOETUNE_LLAMA_CPP=$(LLAMACPP_SRC) \
		$(BIN)/pytest -q -m interop -k gguf

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
