#!/usr/bin/env bash
# Head-adaptive budgets (adaptive: true, Ada-KV arXiv 2407.11550) against the same selector without them, on
# the embedded default: NIAH at 1k (11 depths x 2 needles, 22 cases paired across runs) with the question in
# the prompt and after it; prefix perplexity (3 slices: a 1536-token prefix compressed once, 512 tokens
# scored one at a time); bytes held.
# Records: experiments/adaptive/runs/<name>/; then `make results`. One run at a time, resumable.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=experiments/adaptive/runs
source experiments/_run_lib.sh
PREFIX=(task.max_tokens=2049 task.prefix_tokens=1536 task.chunk_size=1 task.speed=false task.slices=3)
for p in snapkv h2o kvzip; do  # in this order: a prompt-time, a decode-time, a query-agnostic selector
  for r in 0.5 0.75; do
    for a in false true; do
      for q in true false; do
        run niah_${p}_${r}_a${a}_q$q policy=$p policy.compression_ratio=$r policy.adaptive=$a task=niah \
          task.question_in_prompt=$q "task.lengths=[1024]"
      done
      run prefix_${p}_${r}_a$a policy=$p policy.compression_ratio=$r policy.adaptive=$a "${PREFIX[@]}"
    done
  done
done
${PYTHON:-.venv/bin/python} scripts/collect.py "$R"
