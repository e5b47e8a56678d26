#!/usr/bin/env bash
# StreamingLLM sink + window budget vs decode-mode perplexity and bytes: 3 disjoint slices of 512 essay
# tokens, token by token; window=508 keeps all 512 tokens (the uncompressed reference).
# Records: experiments/window_budget/runs/<name>/results.json; then `make results`.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=experiments/window_budget/runs
source experiments/_run_lib.sh
for w in 28 60 124 252 508; do
  run window_$w policy=sliding_window policy.window=$w task.max_tokens=512 task.speed_repeats=2
done
${PYTHON:-.venv/bin/python} scripts/collect.py "$R" --out experiments/window_budget
