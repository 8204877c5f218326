# slimckpt: every target installs what it needs into .venv on first use (see `make install`).
# PYTHON picks the interpreter that builds .venv. When that interpreter already has torch
# (a GPU cluster's image, say), .venv sees it through --system-site-packages and it is kept;
# otherwise a CPU build of torch is pinned on machines without CUDA.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.slimckpt-installed
CPU_TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# `make test` runs TEST_WORKERS pytest processes (pytest-xdist), one per core up to 4: most tests keep one
# core busy (tests/helpers/parallel.py says which tests must share a worker). TEST_WORKERS=0: one process
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

.PHONY: help install lint format test test-trainer test-all test-fast test-verl-stack s3-server quickstart bench bench-scale bench-train-scale bench-s3 compare faults stress-merge stress-flaky clean

help:
	@echo "make quickstart   verl's PPO on a tiny model on CPU: verl defaults vs +recipe=quickstart"
	@echo "make compare      GRPO, FlowRL and PPO on CPU, verl defaults vs each recipe (and killed + resumed): docs/compare_*"
	@echo "make test         the test suite but the tests marked trainer: one verl trainer run and its resume (installs .venv first)"
	@echo "make test-trainer the tests marked trainer: 16 more runs of verl's real trainer (Ray, CPU); CI runs both"
	@echo "make test-all     both, in one session (the trainer runs overlap the other tests)"
	@echo "make test-fast    the fast tests of every folder (not marked slow: no torchrun, no Ray)"
	@echo "make lint         ruff: the formatting and the lint rules of pyproject.toml (make format rewrites)"
	@echo "make test-verl-stack  the distributed/DCP/transformers tests on verl's GPU stack (torch 2.11.0, transformers 5.9.0) in .venv-verl-stack"
	@echo "make bench        merge/save benchmarks vs verl 0.9.1, written to BENCHMARKS.md"
	@echo "make bench-scale  an 8B checkpoint (world size 8) merged by slimckpt and by verl 0.9.1 under a memory cap (~50 GB disk)"
	@echo "make bench-train-scale  a 3.6B model saved and resumed inside verl, slimckpt's tiers and verl 0.9.1's, under a memory cap (~40 GB disk)"
	@echo "make bench-s3     one 3.6B step through the engine to local disk and to a local S3 server (SeaweedFS), same run (~17 GB disk)"
	@echo "make faults       SIGKILL/corruption/environment fault campaigns vs verl 0.9.1: RELIABILITY.md"
	@echo "make stress-merge 100 distributed merges (2 and 3 ranks) shaken at every race point, each compared byte for byte"
	@echo "make stress-flaky the tests that once failed without a code change, 20 times each beside a CPU load"
	@echo "make install      create .venv and install slimckpt with its test extras"
	@echo "make s3-server    a throwaway SeaweedFS S3 server on loopback, in the foreground (prints the AWS_* env to export)"

$(STAMP): pyproject.toml
	@set -e; \
	if [ ! -x "$(PY)" ]; then \
	  if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    echo "[slimckpt] $(PYTHON) already has torch: .venv reuses it (--system-site-packages)"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi; \
	$(PY) -m pip install -q --upgrade pip; \
	if $(PY) -c "import torch" >/dev/null 2>&1; then \
	  echo "[slimckpt] keeping torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "[slimckpt] CUDA machine without torch: installing the torch verl's gpu extra asks for"; \
	  $(PY) -m pip install -q -e '.[gpu,test]'; \
	else \
	  echo "[slimckpt] no CUDA: pinning $(CPU_TORCH) (CPU build)"; \
	  $(PY) -m pip install -q "$(CPU_TORCH)"; \
	fi; \
	$(PY) -m pip install -q -e '.[test]'; \
	touch $(STAMP)

install: $(STAMP)

s3-server: $(STAMP)
	$(PY) -m slimckpt_testing.s3_server

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# the slowest 10 tests are printed at the end, so a test that slows the suite is seen the day it lands.
# Each run of verl's trainer costs ~75 CPU-seconds: `make test` keeps one saved and resumed through the
# incremental tier, the tests marked trainer read the others (docs/development.md: what each proves)
test: $(STAMP)
	$(PY) -m pytest -q --durations=10 -m "not trainer" $(PARALLEL) $(PYTEST_ARGS)

test-trainer: $(STAMP)
	$(PY) -m pytest -q --durations=10 -m trainer $(PYTEST_ARGS)

# one session, not the two targets in turn: its trainer runs go in the background beside the other tests
test-all: $(STAMP)
	$(PY) -m pytest -q --durations=10 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# verl 0.9.1's GPU extras pin torch 2.11.0 and transformers 5.9.0; `make test` runs the CPU pins above.
# This builds a second venv with the GPU stack's releases (CUDA build of torch, run on the CPU:
# scripts/verl_stack_env.sh says how) and runs the test files of tests/verl_stack.txt in it.
# VERL_STACK_TORCH=torch==2.11.0 VERL_STACK_TRANSFORMERS=transformers==5.9.0 pick other releases.
VERL_STACK_VENV ?= .venv-verl-stack
test-verl-stack:
	CPU_TORCH="$(CPU_TORCH)" PYTHON="$(PYTHON)" bash scripts/verl_stack_env.sh $(VERL_STACK_VENV)
	$(VERL_STACK_VENV)/bin/python -m pytest -q $$(grep -v '^#' tests/verl_stack.txt) $(PYTEST_ARGS)

quickstart: $(STAMP)
	$(PY) -m scripts.quickstart

# COMPARE_ARGS="--steps 10 --stop-at 5" for a shorter proof; finished runs in runs/compare are reused (--force redoes them)
COMPARE_ARGS ?=
compare: $(STAMP)
	$(PY) -m scripts.compare.quality_proof --algo grpo --sigkill incremental $(COMPARE_ARGS)
	$(PY) -m scripts.compare.quality_proof --algo flowrl $(COMPARE_ARGS)
	$(PY) -m scripts.compare.quality_proof --algo ppo --sigkill incremental $(COMPARE_ARGS)

# FSDP1 rows beside FSDP2's (save and export, verl's and the incremental tier's); a size whose shards plus
# FSDP1's copy of them exceed the machine's available memory is skipped, and the report says so
BENCH_FSDP1_SIZES ?= 0.5b,1b
bench: $(STAMP)
	$(PY) -m scripts.bench.merge --json docs/bench_merge.json
	$(PY) -m scripts.bench.save --json docs/bench_save.json
	$(PY) -m scripts.bench.save --fsdp 1 --sizes $(BENCH_FSDP1_SIZES) --modes verl,incremental --tag fsdp1 \
	  --json docs/bench_save_fsdp1.json
	$(PY) -m scripts.bench.loop --json docs/bench_loop.json
	$(PY) -m scripts.bench.plan_check --out docs/plan_check.md
	$(PY) -m scripts.bench.plots
	$(PY) -m scripts.bench.headline

# not part of `make bench`: needs ~50 GB of free disk (says so and stops without it), about 30 minutes, then
# the same-box peers section (scripts/bench/merge_peers.py: ~32 GB of disk at once, about 55 minutes with
# its incremental-step row);
# BENCH_SCALE_ARGS="--verl-cap-gib 14" on a host with less memory to spare
BENCH_SCALE_ARGS ?=
bench-scale: $(STAMP)
	$(PY) -m scripts.bench.scale $(BENCH_SCALE_ARGS)
	$(PY) -m pip install -q -r scripts/bench/requirements-peers.txt
	$(PY) -m scripts.bench.merge_peers --json docs/bench_peers.json --out BENCHMARKS.md
	$(PY) -m scripts.bench.plots
	$(PY) -m scripts.bench.headline

# not part of `make bench`: needs ~40 GB of free disk (says so and stops without it), about 20 minutes;
# writes its section of BENCHMARKS.md, its README rows and docs/bench_train_scale.json
bench-train-scale: $(STAMP)
	$(PY) -m scripts.bench.train_scale
	$(PY) -m scripts.bench.plots

# not part of `make bench`: one llama3.2-3b step (14.4 GB) to disk and to a fresh local SeaweedFS, deleted after each
# row (~17 GB free disk, ~16 GB of memory, 3 pairs in about 12 minutes); BENCH_S3_ARGS="--preset 0.25b" for a short look.
# Writes its section of BENCHMARKS.md and docs/bench_s3_save.json
BENCH_S3_ARGS ?=
bench-s3: $(STAMP)
	$(PY) -m scripts.bench.s3_save $(BENCH_S3_ARGS)

# SIGKILL at random moments (50 trials per mode), corruption and environment faults: RELIABILITY.md
# FAULTS_ARGS="--trials 10 --keep 2" for a shorter run
FAULTS_ARGS ?=
faults: $(STAMP)
	$(PY) -m scripts.faults.reliability $(FAULTS_ARGS)

# not part of `make test`: about 25 minutes on 2 cores; STRESS_MERGE_ARGS="--runs 24" for a shorter run
STRESS_MERGE_ARGS ?=
stress-merge: $(STAMP)
	$(PY) -m scripts.stress.merge_bytes --json docs/stress_merge_bytes.json $(STRESS_MERGE_ARGS)

# STRESS_FLAKY_ARGS="--repeats 5" for a shorter run
STRESS_FLAKY_ARGS ?=
stress-flaky: $(STAMP)
	$(PY) -m scripts.stress.flaky $(STRESS_FLAKY_ARGS)

clean:
	rm -rf runs bench_work .pytest_cache
