#!/usr/bin/env bash
# Sliding-window eviction on lm-eval's offline kvc_niah task (30 documents: 256/512/1024 words x 5 depths
# x 2), through the kvcompress lm-eval model; window=2044 keeps everything (the reference).
# Records: experiments/niah_eviction/runs/<name>/results.json; then `make results`.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=experiments/niah_eviction/runs
source experiments/_run_lib.sh
for w in 124 508 2044; do
  run window_$w policy=sliding_window policy.window=$w task=lm_eval "task.tasks=[kvc_niah]"
done
