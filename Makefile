# kvcompress: `make run` (main experiment on the embedded default) and `make test` on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; set TORCH="torch" (or a CUDA index) on a GPU machine.
TORCH ?= torch==2.13.0
RUN_DIR ?= multirun/make-run

.PHONY: install run test test-portable test-fast lint bench bench-quant results clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,test]"
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/kvcompress -m policy=full,sliding_window task.max_tokens=1024 hydra.sweep.dir=$(RUN_DIR)
	$(BIN)/python scripts/collect.py $(RUN_DIR)

test: install
	$(BIN)/python -m pytest tests

# The whole suite on the portable build of the C++ kernels (no -march=native: what a CPU without AVX-512 runs).
test-portable: install
	KVCOMPRESS_CPU_ISA=portable $(BIN)/python -m pytest tests

test-fast: install
	$(BIN)/python -m pytest tests -m "not integration and not slow"

bench: install
	$(BIN)/kvcompress bench hydra.run.dir=outputs/bench

bench-scores: install
	$(BIN)/python benchmarks/score_capture.py

# Every results table in README.md, docs/ and experiments/*/README.md, regenerated from committed records.
results: install
	$(BIN)/python scripts/collect.py --docs

# Style, formatting, and the package's layers (.importlinter: no import upward, no cycles).
lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports

# Side-by-side of quantized caches (ours vs transformers' QuantizedCache); about 80 min on 2 shared CPU cores.
bench-quant: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python scripts/bench_quant.py --tokens 2048 --grid-chunk 16 --threads 1 --out outputs/bench_quant

clean:
	rm -rf outputs multirun .pytest_cache
