#!/usr/bin/env bash
# Tiered KV cache (tiered selector over offload storage) on the embedded default (SmolLM2-135M, CPU).
# Records land in experiments/tiered/runs/<name>/results.json; `bash experiments/tiered/run.sh [niah|ppl|bench]`.
# Sections: niah, niah8k, ppl, bench, bench8k (all by default); resumable: finished records are skipped.
# Measured with OMP_NUM_THREADS=2 on a shared 2-core CPU machine (the "device" is the CPU: see README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
PY=${PY:-.venv/bin/python}
K="nice -n ${NICE:-10} $PY -m kvcompress"
R=experiments/tiered/runs
NIAH8="task=niah task.question_in_prompt=false task.chat_template=true task.progress=false task.extra_needles=[]"
NIAH="$NIAH8 task.depths=[0,25,50,75,100]"
PREFIX="task=perplexity task.max_tokens=2049 task.prefix_tokens=1536 task.chunk_size=1 task.speed=false task.progress=false task.slices=1"
DECODE="task=perplexity task.max_tokens=1024 task.chunk_size=1 task.speed=false task.progress=false task.slices=1"
BENCH="task=bench task.policies=[full,tiered] task.peers=[] task.lengths=[2048,4096] task.decode_tokens=16 task.warmup=1 task.repeats=1 task.progress=false"
BUDGET=600  # tokens per layer and KV head: the eviction policies at tiered's device bytes at 2k (~0.29 of full)
# ONLY="name ..." runs just those records (two streams on two cores: give each its own names)
run() {
  local name=$1; shift
  [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]] && return 0
  [ -f "$R/$name/results.json" ] && grep -q '"status": "ok"' "$R/$name/results.json" && return 0
  $K "$@" hydra.run.dir="$R/$name"
}

what=${1:-all}
if [[ $what == all || $what == niah ]]; then
  # NIAH at 2k, 5 depths, question AFTER the compressed context (decode steps), chat template
  # tiered with its defaults written out (block_size 8, recent 32, 38 pages per step and KV head: 0.289 of full)
  run niah2k_tiered_host policy=tiered policy.top_k_blocks=38 storage=offload storage.block_size=8 storage.recent=32 storage.lru_pages=38 $NIAH
  run niah2k_snapkv policy=snapkv policy.budget=$BUDGET policy.compression_ratio=null $NIAH
  run niah2k_h2o policy=h2o policy.budget=$BUDGET policy.compression_ratio=null $NIAH
  run niah2k_block_evict policy=block_evict policy.budget=$BUDGET policy.compression_ratio=null $NIAH
  run niah2k_full policy=full $NIAH
fi
if [[ $what == all || $what == niah8k ]]; then
  # NIAH at 8k (the model's context), 5 depths, question after: a needle of our own that full finds at 8k.
  # At 8k SmolLM2-135M finds no needle in the first ~10% of the context (full missed depths 0 and 10 with a
  # number, a password and a vault-code needle: experiments/tiered/README.md), so the depths span 25-100%.
  # About 0.29 of full's device bytes: page summaries are 1/8 of the bytes at any length, so 160 pages
  # (1280 tokens) are read per step.
  N8K=("task.lengths=[8000]" "task.needle='The secret password is pineapple.'"
    "task.question='What is the secret password?'" task.answer=pineapple
    "task.answer_prefix='The secret password is'" "task.depths=[25,40,60,80,100]")
  BUDGET8K=2330  # tokens per layer and KV head: the eviction policies at tiered's device bytes at 8k
  run niah8k_full policy=full $NIAH8 "${N8K[@]}"
  run niah8k_tiered_host policy=tiered policy.top_k_blocks=160 storage=offload storage.lru_pages=160 $NIAH8 "${N8K[@]}"
  # pages of 16 tokens: summaries cost 1/16 of the bytes instead of 1/8, so 110 pages (1760 tokens) fit in 0.29
  run niah8k_tiered_b16 policy=tiered policy.top_k_blocks=110 storage=offload storage.block_size=16 \
    storage.lru_pages=110 $NIAH8 "${N8K[@]}"
  # float16 page bounds (rounded outward): half the summary bytes buy 220 pages (1760 tokens) at the same bytes
  run niah8k_tiered_f16 policy=tiered policy.top_k_blocks=220 storage=offload storage.lru_pages=220 \
    storage.summary_dtype=float16 $NIAH8 "${N8K[@]}"
  for p in snapkv h2o block_evict; do
    run niah8k_$p policy=$p policy.budget=$BUDGET8K policy.compression_ratio=null $NIAH8 "${N8K[@]}"
  done
fi
if [[ $what == all || $what == ppl ]]; then
  # decode-mode perplexity over 1024 tokens at ~0.3 device bytes: fewer LRU pages than the 2k default
  run decode_full policy=full $DECODE
  run decode_tiered policy=tiered policy.top_k_blocks=17 storage=offload storage.lru_pages=17 $DECODE
  # prefix perplexity: 1536 tokens prefilled (in 256-token chunks), 512 scored, defaults (<= 0.3 at 2k)
  run prefix_full policy=full $PREFIX
  run prefix_tiered policy=tiered $PREFIX
fi
if [[ $what == all || $what == bench ]]; then
  # decode tokens/s vs full at 2k and 4k, host and disk tiers, bytes fetched per step
  run bench_host policy=full $BENCH
  run bench_disk policy=full $BENCH "+task.policy_overrides.tiered={storage:{name:offload,tier:disk}}"
  # after unpadded decode stopped passing a mask to SDPA (which then repeated the KV heads): 4k, 2 samples
  run bench_host_4k_nomask policy=full task=bench "task.policies=[full,tiered]" "task.peers=[]" \
    "task.lengths=[4096]" task.decode_tokens=16 task.warmup=1 task.repeats=2 task.progress=false
fi
if [[ $what == all || $what == bench8k ]]; then
  # at 8k, no warm-up round (a tiered prefill of 8k tokens takes minutes here): one sample each
  run bench_host_8k policy=full $BENCH "task.lengths=[8000]" task.warmup=0
  run bench_disk_8k policy=full $BENCH "task.lengths=[8000]" task.warmup=0 \
    "+task.policy_overrides.tiered={storage:{name:offload,tier:disk}}"
fi
$PY scripts/collect.py "$R" || true
