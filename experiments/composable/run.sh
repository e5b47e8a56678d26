#!/usr/bin/env bash
# Composable caches on the embedded default: selectors over quant / low_rank storage next to dense.
# Records land in experiments/composable/runs/<name>/results.json; `bash experiments/composable/run.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
K=".venv/bin/kvcompress"
R=experiments/composable/runs
# the task defaults these records were made with (five depths, one needle), pinned
NIAH="task=niah task.question_in_prompt=true task.progress=false task.depths=[0,25,50,75,100] task.extra_needles=[]"
PREFIX="task.max_tokens=2049 task.prefix_tokens=1536 task.chunk_size=1 task.speed=false task.progress=false task.slices=1"
DECODE="task.max_tokens=1024 task.chunk_size=1 task.speed=false task.progress=false task.slices=1"
run() { local name=$1; shift; [ -f "$R/$name/results.json" ] && grep -q '"status": "ok"' "$R/$name/results.json" && return 0; $K "$@" hydra.run.dir="$R/$name"; }

# SnapKV keeps half, int4 stores it: bytes at a 2k prompt, NIAH with the question in the prompt, prefix ppl
run niah_snapkv_dense policy=snapkv $NIAH
run niah_snapkv_int4 policy=snapkv storage=quant storage.bits=4 $NIAH
run prefix_full policy=full $PREFIX
run prefix_snapkv_dense policy=snapkv $PREFIX
run prefix_snapkv_int4 policy=snapkv storage=quant storage.bits=4 $PREFIX
# H2O budget 512 over int4 / int8 (per-token groups: H2O evicts at every decode step), decode mode
run decode_full policy=full $DECODE
run decode_h2o_dense policy=h2o policy.budget=512 $DECODE
run decode_h2o_int4 policy=h2o policy.budget=512 storage=quant storage.bits=4 storage.key_axis=token $DECODE
run decode_h2o_int8 policy=h2o policy.budget=512 storage=quant storage.bits=8 storage.key_axis=token $DECODE
# a window over low-rank storage
run decode_window_dense policy=sliding_window $DECODE
run decode_window_lowrank32 policy=sliding_window storage=low_rank storage.rank=32 $DECODE
run decode_window_lowrank48 policy=sliding_window storage=low_rank storage.rank=48 $DECODE
.venv/bin/python scripts/collect.py "$R"
