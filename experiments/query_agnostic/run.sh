#!/usr/bin/env bash
# Query-agnostic compression on the embedded default: NIAH with the question after the context (4-digit
# needle, answer prefix), snapkv unit chunk vs token (question in the prompt, 5-digit needle), multi_niah,
# prefix perplexity, kvzip under lm-eval (SmolLM2 and Gemma-3 270M), and kvzip's prefill cost next to
# snapkv. Records: experiments/query_agnostic/runs/<name>/.
# One run at a time, resumable (a run with an ok results.json is skipped).
set -euo pipefail
cd "$(dirname "$0")/../.."
K="${PYTHON:-.venv/bin/python} -m kvcompress"
R=experiments/query_agnostic/runs
run() { local name=$1; shift; [ -f "$R/$name/results.json" ] && grep -q '"status": "ok"' "$R/$name/results.json" && return 0
  echo "=== $name $(date +%T)"; OMP_NUM_THREADS=1 $K "$@" task.progress=false hydra.run.dir="$R/$name" > /dev/null; }
N4=(task=niah "task.needle='The special magic number is 7392.'" "task.question='What is the special magic number?'"
  task.answer=7392 "task.answer_prefix='The special magic number is'" task.question_in_prompt=false
  "task.extra_needles=[]" "task.depths=[0,25,50,75,100]")  # one needle: the digits are the point
N5=(task=niah "task.needle='The special magic number is 73925.'" "task.question='What is the special magic number?'"
  task.answer=73925 "task.answer_prefix='The special magic number is'" task.question_in_prompt=true
  "task.extra_needles=[]" "task.depths=[0,25,50,75,100]")
for L in 2048 4096; do
  run niah4_full_$L policy=full "${N4[@]}" task.lengths=[$L]
  for r in 0.5 0.75; do
    for p in kvzip expected_attention snapkv; do
      run niah4_${p}_${r}_$L policy=$p policy.compression_ratio=$r "${N4[@]}" task.lengths=[$L]
    done
  done
done
for r in 0.5 0.75; do
  for u in token chunk; do run niah5_snapkv_${u}_$r policy=snapkv policy.unit=$u policy.compression_ratio=$r "${N5[@]}"; done
done
for m in independent multiturn; do
  run multi_full_$m policy=full task=multi_niah task.mode=$m
  for p in kvzip snapkv; do run multi_${p}_$m policy=$p policy.compression_ratio=0.5 task=multi_niah task.mode=$m; done
  run multi_sliding_window_$m policy=sliding_window policy.window=1020 task=multi_niah task.mode=$m  # 4 + 1020 of 2048
done
PREFIX=(task.max_tokens=2049 task.prefix_tokens=1536 task.chunk_size=1 task.speed=false task.slices=1)
run prefix_full policy=full "${PREFIX[@]}"
for r in 0.5 0.75; do
  for p in kvzip snapkv; do run prefix_${p}_$r policy=$p policy.compression_ratio=$r "${PREFIX[@]}"; done
done
# kvzip under lm-eval (offline essay perplexity): each request's context is compressed by the context pass,
# then its continuation scored; max_length=512 gives the essays' later rolling windows a context to compress
lm() { local name=$1; shift; [ -f "$R/$name/results.json" ] && grep -q '"status": "ok"' "$R/$name/results.json" && return 0
  echo "=== $name $(date +%T)"; OMP_NUM_THREADS=1 $K task=lm_eval "task.tasks=[kvc_essays_ppl]" task.limit=2 \
    task.max_length=512 "$@" hydra.run.dir="$R/$name" > /dev/null; }
lm lm_eval_full policy=full
lm lm_eval_kvzip_0.5 policy=kvzip policy.compression_ratio=0.5
lm lm_eval_gemma3_full model=gemma3 policy=full
lm lm_eval_gemma3_kvzip_0.5 model=gemma3 policy=kvzip policy.compression_ratio=0.5  # its global layers
run bench_prefill task=bench "task.policies=[full,snapkv,kvzip]" "task.lengths=[2048]" task.decode_tokens=8
${PYTHON:-.venv/bin/python} scripts/collect.py "$R"
