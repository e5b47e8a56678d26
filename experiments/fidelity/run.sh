#!/usr/bin/env bash
# Fidelity to the uncompressed model on the embedded default (SmolLM2-135M, float32, CPU): attention recall,
# output error, KL(full || policy), top-1 agreement and perplexity, 1024 essay tokens, ratio 0.5.
# Records land in experiments/fidelity/runs/<name>/; `bash experiments/fidelity/run.sh` (resumable).
# Measured with OMP_NUM_THREADS=1 on a shared 2-core machine: layer metrics every 4th step (task.every=4),
# KL and top-1 at every token.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
R=experiments/fidelity/runs
T="task=fidelity task.max_tokens=1024 task.chunk_size=1 task.every=4 task.progress=false"
run() { local name=$1; shift; [ -f "$R/$name/results.json" ] && grep -q '"status": "ok"' "$R/$name/results.json" && return 0; $PY -m kvcompress "$@" hydra.run.dir="$R/$name"; }

run sliding_window policy=sliding_window policy.window=508 $T
run h2o policy=h2o policy.compression_ratio=0.5 $T
run tova policy=tova policy.compression_ratio=0.5 $T
run snapkv_prefix512 policy=snapkv policy.compression_ratio=0.5 $T task.prefix_tokens=512
run block_evict policy=block_evict policy.compression_ratio=0.5 $T
run block_sparse policy=block_sparse policy.read_ratio=0.5 $T
run quant_int4 policy=quant policy.bits=4 $T
run quant_int2 policy=quant policy.bits=2 $T
# kvcompress compare: needle cases at 2k with the question after the compressed context; SnapKV (ratio 0.5)
# loses the needle at depth 25 and keeps it at depth 50
C=experiments/fidelity/compare
for d in 50 25; do
  [ -f "$C/snapkv_niah2k_d$d/compare.md" ] || $PY -m kvcompress compare policy=snapkv policy.compression_ratio=0.5 \
    task.length=2048 task.depth=$d hydra.run.dir="$C/snapkv_niah2k_d$d"
done
$PY scripts/collect.py "$R" --out experiments/fidelity \
  --columns policy,params,tokens_scored,prefix_tokens,recall_mean,recall_min,recall_min_layer,kl_mean,top1_agreement,perplexity,full_perplexity,cache_ratio,output_error_mean,key_error_mean
$PY experiments/fidelity/table.py  # the wider table (worst layer, output and key error), printed
