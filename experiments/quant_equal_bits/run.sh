#!/usr/bin/env bash
# Our int4 against transformers' QuantizedCache (quanto) at equal bits per quantized element (6: quanto's
# int4 g32 keeps float32 scales and shifts, ours int4 g16 float16 ones), next to full and our int4 g32:
# decode-mode perplexity over 3 slices of 2048 essay tokens (mean + 95% interval), bytes, decode speed
# (median + IQR). Needs the bench extra: pip install -e ".[bench]". Record:
# experiments/quant_equal_bits/runs/main/results.json (rows); then `make results`.
set -euo pipefail
cd "$(dirname "$0")/../.."
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" ${PYTHON:-.venv/bin/python} scripts/bench_quant.py --tokens 2048 \
  --slices 3 --threads 1 --only "full,int4 g16,int4 g32 r128,hf quanto int4" \
  --out experiments/quant_equal_bits/runs/main
