#!/usr/bin/env bash
# The leaderboard (docs/results.md#leaderboard): the headline points of kvcompress/conf/sweep/leaderboard.yaml at 30
# samples per task, then the 0.5 points, the 0.9 points of the best selectors and the 0.875 and 0.9375
# points at 10, all on the offline RULER suite at 1024 tokens in both question modes. Records:
# experiments/leaderboard/runs/; then `make leaderboard`. Resumable (resume: any): a finished point is never
# run again; one point at a time per process.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
K="${PYTHON:-.venv/bin/python} -m kvcompress -m sweep=leaderboard"
HEADLINE=(full snapkv_r75 kvzip_r75 expected_attention_r75 h2o_r75 tova_r75 pyramidkv_r75 block_evict_r75
  sliding_window_r75 snapkv_r75_int4 kvzip_r75_int4 expected_attention_r75_int4 quant_int4 quant_int2 tiered
  low_rank keydiff_r75 rkv_r75 kvzap_r75 kvzap_linear_r75 kvzap_threshold_r75 kvzap_threshold_decode_r75
  turboquant_int4 turboquant_int2 duo_r75)
HALF=(snapkv_r50 kvzip_r50 expected_attention_r50 h2o_r50 tova_r50 pyramidkv_r50 block_evict_r50
  sliding_window_r50 keydiff_r50 rkv_r50 kvzap_r50 duo_r50)
# the best at 0.75 by their mean score over both question modes: kvzip, tova, snapkv, and block_evict (which
# trails snapkv by 0.01, inside any interval, so both run)
NINETY=(${NINETY:-kvzip_r90 tova_r90 snapkv_r90 block_evict_r90 keydiff_r90 rkv_r90 kvzap_r90 duo_r90})
for p in "${HEADLINE[@]}"; do $K point="$p"; done
VARIANTS=(expected_attention_r50_mean)  # expected_attention without its covariance term (README)
# the high-compression end: 87.5% and 93.75% removed, each record with its effective ratio
HIGH=(${HIGH:-snapkv_r875 kvzip_r875 expected_attention_r875 keydiff_r875 tova_r875
  snapkv_r9375 kvzip_r9375 expected_attention_r9375 keydiff_r9375 tova_r9375})
for p in "${HALF[@]}" "${NINETY[@]}" "${VARIANTS[@]}" "${HIGH[@]}"; do $K point="$p" task.limit=10; done
${PYTHON:-.venv/bin/python} scripts/collect.py --docs
