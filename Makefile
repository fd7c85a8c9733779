# Set-up is idempotent: a stamp file records that .venv holds what pyproject.toml asks for.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-vllm-graph test-learning lint install system-deps vllm

# The CPU wheel of torch 2.13.0 lies on this machine's disk; installing it first by its exact version keeps
# pip from fetching a multi-GB CUDA build for the project's torch requirement.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# vLLM's CPU build in a venv of its own (it pins torch and an older transformers than ours): the server
# engine/vllm_server.py starts, and tests/vllm run against. ~3.5 GB, a few minutes.
VLLM_STAMP := .venv-vllm/.installed
$(VLLM_STAMP): scripts/vllm-venv.sh
	PYTHON=$(PYTHON) bash scripts/vllm-venv.sh .venv-vllm
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Debian packages the tests need: PostgreSQL 15 server binaries, headless Chromium with its driver, and
# bubblewrap for the harness sandbox.
system-deps:
	@bash scripts/system-deps.sh

# Flags of `lightning-dagster demo`: make demo DEMO_FLAGS="--seed 3" (or --quick, --project DIR)
demo: install
	$(BIN)/lightning-dagster demo $(DEMO_FLAGS)

lint: install
	$(BIN)/ruff check lightning_dagster tests benchmarks

# Every test but the learning test (615 s alone on 2 cores, 1028 s beside other work), which does not fit
# CI's 25 min budget for the suite: `make test-learning`
# runs it (its latest result is in benchmarks/README.md, training). Two pytest processes side by side
# (scripts/test.sh): the Dagster tests, which share one bootstrapped home, and everything else; much of the
# suite waits on child processes, servers and a browser, so both fit on two cores.
test: install system-deps lint vllm
	bash scripts/test.sh $(BIN)/python

# The calc graph with every stage on vLLM (whole weights and LoRA): 6-18 min each on two cores, kept out of
# `make test` for CI's time budget.
test-vllm-graph: install vllm
	$(BIN)/python -m pytest -q -ra -m vllm_graph tests/dagster/test_vllm_pipeline.py

test-learning: install
	$(BIN)/python -m pytest -q -ra -m learning
