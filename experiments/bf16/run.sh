#!/usr/bin/env bash
# The main policies in bfloat16 next to float32 on the embedded default (SmolLM2-135M-Instruct, CPU):
# decode-mode perplexity, 3 disjoint slices of 1024 essay tokens, token by token (chunk_size=1), no speed
# rounds. Two streams run side by side (one per dtype, one thread each).
# Records: experiments/bf16/runs/<policy>_<dtype>/results.json; then `make results`.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=experiments/bf16/runs
source experiments/_run_lib.sh
POLICIES="full quant sliding_window h2o block_sparse tova block_evict low_rank tiered"
stream() {
  local dtype=$1 common="model.dtype=$1 task.speed=false"
  for p in $POLICIES; do run "${p}_${dtype}" policy=$p $common; done
  # selectors over int4 storage (per-token keys: these evict at every step)
  run "h2o_int4_${dtype}" policy=h2o storage=quant storage.bits=4 storage.key_axis=token $common
  run "sliding_window_int4_${dtype}" policy=sliding_window storage=quant storage.bits=4 storage.key_axis=token $common
}
stream float32 &
stream bfloat16 &
wait
