# kvcompress: `make run` (main experiment on the embedded default) and `make test` on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; set TORCH="torch" (or a CUDA index) on a GPU machine.
TORCH ?= torch==2.13.0
RUN_DIR ?= multirun/make-run

.PHONY: install run test test-compat test-portable test-fast lint bench bench-quant results leaderboard clean

# transformers: `make install` gets the newest release the range in pyproject.toml allows; these are the
# other minor releases it allows, each checked by `make test-compat` in its own venv (same torch).
COMPAT_TRANSFORMERS ?= 5.24
COMPAT_VENV ?= .venv-compat
# the 18 decoder families of the zoo and the contract every policy keeps
COMPAT_TESTS ?= tests/contract/test_families.py tests/contract/test_policy_contract.py

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,test]"
	touch $@

install: $(VENV)/.installed

$(COMPAT_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/pip install -q "$(TORCH)"
	$(COMPAT_VENV)/bin/pip install -q -e ".[dev,test]" "transformers==$(firstword $(COMPAT_TRANSFORMERS)).*"
	touch $@

# The sweep's end-of-run callback collects $(RUN_DIR) (summary.md/.csv, plots) and prints its table once.
run: install
	$(BIN)/kvcompress -m policy=full,sliding_window task.max_tokens=1024 hydra.sweep.dir=$(RUN_DIR)

# The suite runs on every core (pytest-xdist: one worker per core, each on one thread, an idle worker taking
# tests from a busy one); PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= auto
PARALLEL = OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal

test: install
	$(PARALLEL) tests

# The family zoo and the policy contract under each older transformers release in COMPAT_TRANSFORMERS.
test-compat: $(COMPAT_VENV)/.installed
	set -e; for release in $(COMPAT_TRANSFORMERS); do \
		$(COMPAT_VENV)/bin/pip install -q "transformers==$$release.*"; \
		$(COMPAT_VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"; \
		$(COMPAT_VENV)/bin/python -m pytest $(COMPAT_TESTS); \
	done

# The whole suite on the portable build of the C++ kernels (no -march=native: what a CPU without AVX-512 runs).
test-portable: install
	KVCOMPRESS_CPU_ISA=portable $(PARALLEL) tests

test-fast: install
	$(PARALLEL) tests -m "not integration and not slow"

# kvpress (pinned, with the transformers it allows) in its own venv beside $(VENV), same CPU torch: the
# differential test against the reference (tests/peers, tiny random models), then the recorded comparison on the
# embedded model (experiments/peers/record.json; docs/methods.md's table comes from it by `make results`).
PEERS_VENV ?= .venv-peers
KVPRESS ?= kvpress==0.5.5
PEERS_PROMPTS ?= 5

$(PEERS_VENV)/.installed:
	$(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q "$(TORCH)"
	$(PEERS_VENV)/bin/pip install -q "$(KVPRESS)" "transformers<5.3" "$(TORCH)"
	touch $@

.PHONY: test-peers
test-peers: install $(PEERS_VENV)/.installed
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -p no:xdist tests/peers
	OMP_NUM_THREADS=1 $(BIN)/python experiments/peers/record.py --prompts $(PEERS_PROMPTS) --out experiments/peers/record.json
	$(BIN)/python scripts/collect.py --docs

bench: install
	$(BIN)/kvcompress bench hydra.run.dir=outputs/bench

bench-scores: install
	$(BIN)/python benchmarks/score_capture.py

# Every results table in README.md, docs/ and experiments/*/README.md, regenerated from committed records.
results: install
	$(BIN)/python scripts/collect.py --docs

# The leaderboard's figure and table in docs/results.md, from experiments/leaderboard/runs (no run): a
# generated block like the others, so this is `make results`.
leaderboard: results

# Style, formatting, and the package's layers (.importlinter: no import upward, no cycles).
lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports

# Side-by-side of quantized caches (ours vs transformers' QuantizedCache); about 80 min on 2 shared CPU cores.
bench-quant: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python scripts/bench_quant.py --tokens 2048 --grid-chunk 16 --threads 1 --out outputs/bench_quant

clean:
	rm -rf outputs multirun .pytest_cache
