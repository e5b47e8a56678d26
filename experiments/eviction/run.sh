#!/usr/bin/env bash
# Eviction policies at compression ratios 0.25 / 0.5 / 0.75 on the embedded default:
#  - decode-mode perplexity (3 slices x 1024 tokens, chunk 1) for the policies that evict while decoding;
#  - prefix perplexity (3 slices: a 1536-token prefix compressed in one prefill, 512 tokens scored) for all;
#  - NIAH at 2k (11 depths x 2 needles) with the question in the prompt and after it.
# sliding_window gets the token counts of each ratio (4 sinks + window). Records:
# experiments/eviction/runs/<name>/results.json; then `make results`. Long: a NIAH run is 22 cases.
# `bash run.sh [all|ppl|niah]`: ppl = the perplexity rows only, niah = the NIAH rows only (two streams).
set -euo pipefail
cd "$(dirname "$0")/../.."
R=experiments/eviction/runs
source experiments/_run_lib.sh
what=${1:-all}
DECODE="task.speed=false"
PREFIX="task.max_tokens=2049 task.prefix_tokens=1536 task.speed=false"
declare -A WINDOW=([0.25]=764 [0.5]=508 [0.75]=252)          # 1024 tokens: 4 + window kept
declare -A WINDOW_PREFIX=([0.25]=1533 [0.5]=1020 [0.75]=508)  # 2049 tokens
declare -A WINDOW_NIAH=([0.25]=1560 [0.5]=1039 [0.75]=517)    # about 2086 prompt tokens
PREFIXED=(h2o tova block_evict snapkv pyramidkv expected_attention kvzip)
ppl_rows() {
  local r=$1
  for p in h2o tova block_evict; do run ppl_${p}_$r policy=$p policy.compression_ratio=$r $DECODE; done
  run ppl_sliding_window_$r policy=sliding_window policy.window=${WINDOW[$r]} $DECODE
  for p in "${PREFIXED[@]}"; do run prefix_${p}_$r policy=$p policy.compression_ratio=$r $PREFIX; done
  run prefix_sliding_window_$r policy=sliding_window policy.window=${WINDOW_PREFIX[$r]} $PREFIX
}
niah_rows() {
  local r=$1
  for p in "${PREFIXED[@]}"; do
    for q in true false; do
      run niah_${p}_${r}_q$q policy=$p policy.compression_ratio=$r task=niah task.question_in_prompt=$q
    done
  done
  for q in true false; do
    run niah_sliding_window_${r}_q$q policy=sliding_window policy.window=${WINDOW_NIAH[$r]} task=niah \
      task.question_in_prompt=$q
  done
}
if [[ $what == all || $what == ppl ]]; then
  run ppl_full policy=full $DECODE
  run prefix_full policy=full $PREFIX
  for r in 0.5 0.25 0.75; do ppl_rows $r; done  # the middle ratio first: a stopped run keeps the most useful rows
fi
if [[ $what == all || $what == niah ]]; then
  for q in true false; do run niah_full_q$q policy=full task=niah task.question_in_prompt=$q; done
  for r in 0.5 0.25 0.75; do niah_rows $r; done
fi
${PYTHON:-.venv/bin/python} scripts/collect.py "$R" --out experiments/eviction
