#!/usr/bin/env bash
# Attention in the low-rank latent space (kvcompress/kernels/fused_low_rank.py) on the embedded model (SmolLM2-135M,
# float32, CPU, OMP_NUM_THREADS=1): decode tok/s at 4k vs full, interleaved rounds (experiments/fused's
# script), then the decode-mode perplexity check (ppl.sh). The machine has 2 cores shared with other jobs
# running at a higher priority (load average 5-8): the CPU-time ratios are the ones to read.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD
PY=${PY:-/work/main/.venv/bin/python}
# run 1 (commit 925bde5): reconstruct (off) vs latent, pre-RoPE (default keys) and post-RoPE keys
nice -n 10 $PY experiments/fused/decode_speed.py experiments/latent/decode_4k_run1.json 4096 6 8 \
  full low_rank_32_off low_rank_32 low_rank_32_post_off low_rank_32_post
# run 2 (latents grown in place; block_sparse's batched page bounds): latent pre/post-RoPE, block_sparse 0.25
nice -n 10 $PY experiments/fused/decode_speed.py experiments/latent/decode_4k_run2.json 4096 6 8 \
  full low_rank_32 low_rank_32_post block_sparse_0.25
experiments/latent/ppl.sh
