#!/usr/bin/env bash
# Fused-attention measurements on the embedded model (SmolLM2-135M, float32, CPU). The machine has 2 cores and was
# shared with other jobs (load average ~9-10 during these runs), so only the in-round ratios mean anything.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD
PY=${PY:-/work/main/.venv/bin/python}
# decode tok/s vs full at 4k: int4, int8, int4 unfused, block_sparse 0.25, low_rank 32, snapkv 0.5
# run 1 (3 rounds x 4 steps, load average 4-9): experiments/fused/decode_4k_run1.json; run 2, more rounds:
nice -n 10 $PY experiments/fused/decode_speed.py experiments/fused/decode_4k.json 4096 6 8
# int4 at 8k (the model's whole context), fused and unfused
nice -n 10 $PY experiments/fused/decode_speed.py experiments/fused/decode_8k.json 8192 4 4 full int4 int4_unfused
