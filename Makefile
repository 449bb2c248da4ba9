# es-lightning developer commands. `make test` and `make eval` set up the environment first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# This machine's CPU build of torch; a GPU user installs the package with their own torch instead.
CONSTRAINTS ?= constraints-cpu.txt

.PHONY: setup test demo eval compare pretrain lint clean

$(BIN)/es-lightning: pyproject.toml $(CONSTRAINTS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(CONSTRAINTS) torch==2.13.0
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[dev]"
	touch $@

setup: $(BIN)/es-lightning   ## create .venv and install the package with its dev extra

test: setup                  ## the test suite (what CI runs)
	$(BIN)/pytest -q

demo: setup                  ## the main command: GRPO then ES on the built-in model, table + plot + export
	$(BIN)/es-lightning fit --config recipes/grpo_es.yaml

compare: setup               ## base / GRPO / ES / GRPO->ES / ES->GRPO on 2 seeds, one table (README)
	OMP_NUM_THREADS=1 $(BIN)/es-lightning analyze compare --seeds 0 1 --out_dir lightning_logs/compare

eval: setup                  ## evaluate the built-in model: Pass@1/4/16 table
	$(BIN)/es-lightning validate --config recipes/eval.yaml

pretrain: setup              ## re-make the built-in model (see es_lightning/builtin/countdown-tiny/README.md)
	OMP_NUM_THREADS=1 $(BIN)/es-lightning fit --config recipes/builtin/pretrain.yaml

lint: setup
	$(BIN)/ruff check es_lightning tests benchmarks

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
