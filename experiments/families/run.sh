#!/usr/bin/env bash
# Gemma-3 270M (hybrid 5:1 sliding/global, window 512): NIAH at 1k in both question modes and decode-mode
# perplexity with apply_to both ways. Records: experiments/families/runs/<name>/results.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
K="${PYTHON:-.venv/bin/python} -m kvcompress"
R=experiments/families/runs
# a base model: no chat template; a 4-digit needle with an answer prefix, which full finds at 4 of 5 depths
NIAH=(model=gemma3 task=niah task.lengths=[1024] task.chat_template=false task.progress=false
  "task.needle='The special magic number is 7392.'" "task.question='What is the special magic number?'"
  task.answer=7392 "task.answer_prefix='The special magic number is'" "task.extra_needles=[]" "task.depths=[0,25,50,75,100]")
PPL="model=gemma3 task.max_tokens=1024 task.chunk_size=1 task.speed=false task.progress=false task.slices=1"
run() { local name=$1; shift; [ -f "$R/$name/results.json" ] && grep -q '"status": "ok"' "$R/$name/results.json" && return 0; $K "$@" hydra.run.dir="$R/$name"; }
for q in true false; do
  run niah_full_q$q policy=full "${NIAH[@]}" task.question_in_prompt=$q
  run niah_snapkv_q$q policy=snapkv policy.compression_ratio=0.5 "${NIAH[@]}" task.question_in_prompt=$q
  run niah_h2o_q$q policy=h2o policy.compression_ratio=0.5 "${NIAH[@]}" task.question_in_prompt=$q
done
run ppl_full policy=full $PPL
run ppl_window_global policy=sliding_window policy.window=252 policy.apply_to=full_attention $PPL
run ppl_window_all policy=sliding_window policy.window=252 policy.apply_to=all $PPL
