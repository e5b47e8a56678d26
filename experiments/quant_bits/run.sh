#!/usr/bin/env bash
# Quantization bits vs decode-mode perplexity and cache bytes (KIVI `quant`, keys per channel, values per
# token, groups of 32, the newest 128 tokens exact), at the default perplexity setting: 3 disjoint slices
# of 1024 essay tokens, token by token (chunk_size=1), speed as median + IQR of 3 rounds.
# Records: experiments/quant_bits/runs/<name>/results.json; then `make results`.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=experiments/quant_bits/runs
source experiments/_run_lib.sh
run full policy=full
for b in 8 4 2; do run quant_int$b policy=quant policy.bits=$b; done
${PYTHON:-.venv/bin/python} scripts/collect.py "$R" --out experiments/quant_bits
