# Two commands for a fresh machine:  make demo   (set up, build the embedded model, fine-tune)
#                                    make test   (set up, run the test suite)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= jobs/configs/embedded.yaml
EMBEDDED := .cache/embedded/model/config.json

.PHONY: setup embedded demo test clean

setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

$(EMBEDDED): | setup
	$(BIN)/python -m jobs.build_embedded

embedded: $(EMBEDDED)

demo: setup embedded
	$(BIN)/python -m jobs.finetune --config $(CONFIG) $(ARGS)
	@echo "Browse the run:  $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/outputs/mlflow.db  (then open http://127.0.0.1:5000)"

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf outputs .pytest_cache
