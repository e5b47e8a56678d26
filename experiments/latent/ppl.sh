#!/usr/bin/env bash
# Decode-mode perplexity at 1024 tokens (one slice, token by token) of low_rank rank 32, reconstruct
# (backend=dense, runs/*_off) vs attention in the latent space (backend=torch, runs/*_on), pre-RoPE (default)
# and post-RoPE keys. The folders keep the names of the records written before the field was renamed.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD
PY=${PY:-/work/main/.venv/bin/python}
for keys in pre_rope post_rope; do
  for mode in off on; do
    backend=$([ "$mode" = on ] && echo torch || echo dense)
    nice -n 10 $PY -m kvcompress policy=low_rank policy.rank=32 policy.keys=$keys policy.backend=$backend \
      task=perplexity task.slices=1 task.max_tokens=1024 task.speed=false task.progress=false \
      hydra.run.dir=experiments/latent/runs/ppl_${keys}_$mode
  done
done
