#!/usr/bin/env bash
# The main policies in bfloat16 next to float32 on the embedded default (SmolLM2-135M-Instruct, CPU):
# decode-mode perplexity, 3 disjoint slices of 1024 essay tokens, token by token (chunk_size=1), no speed
# rounds. Two streams run side by side (one per dtype, one thread each).
# Records: experiments/bf16/runs/<policy>_<dtype>/results.json; then `make results`.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=experiments/bf16/runs
source experiments/_run_lib.sh
POLICIES="full quant sliding_window h2o block_sparse"
stream() {
  local dtype=$1
  for p in $POLICIES; do run "${p}_${dtype}" policy=$p model.dtype=$dtype task.speed=false; done
}
stream float32 &
stream bfloat16 &
wait
