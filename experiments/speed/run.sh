#!/usr/bin/env bash
# Speed on the embedded model (SmolLM2-135M, float32, CPU, one thread per process): the decode ratio of the
# C++ quant kernel and the other compressed caches to full, lm-eval batching, the 1k-8k scaling table,
# kvzip's context pass stage by stage, and the decode table by policy and storage.
# `bash experiments/speed/run.sh [decode|paired|evict|lm_eval|scaling|kvzip|step|table]` (all by default);
# resumable: finished records are skipped. Records: experiments/speed/runs/<name>/results.json (decode:
# experiments/fused/decode_4k_kernel.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH=$PWD
PY=${PY:-.venv/bin/python}
R=experiments/speed/runs
done_ok() { [ -f "$1" ] && grep -q '"status": "ok"' "$1"; }
what=${1:-all}
# the contenders of every issue-18 target at 4k: full, the int widths, block_sparse, low_rank (joint, per-head,
# post-RoPE) and every eviction policy at ratio 0.5
TARGETS_4K="full int4_kernel int8_kernel int2_kernel block_sparse_0.25 low_rank_32 low_rank_32_head low_rank_32_post
  snapkv_0.5 h2o_0.5 tova_0.5 pyramidkv_0.5 block_evict_0.5 expected_attention_0.5 kvzip_0.5 sliding_window_2048"
if [[ $what == all || $what == decode ]]; then
  # interleaved decode tok/s vs full (rounds x steps, medians and ranges in the record)
  F=experiments/fused
  [ -f $F/decode_4k_kernel.json ] || $PY $F/decode_speed.py $F/decode_4k_kernel.json 4096 4 4 full int4_kernel \
    int8_kernel int2_kernel int4_unfused block_sparse_0.25 low_rank_32 low_rank_32_post snapkv_0.5
  # block_sparse after it stopped masking unpadded reads (a mask made SDPA repeat the KV heads)
  [ -f $F/decode_4k_block_sparse.json ] || $PY $F/decode_speed.py $F/decode_4k_block_sparse.json 4096 4 4 full \
    block_sparse_0.25 int4_kernel
  # pages read in place (block_sparse's C++ kernel) against gathered; the window evicting in place (a ring);
  # low_rank's pre-RoPE keys rebuilt from joint and from per-head bases
  [ -f $F/decode_4k_inplace.json ] || $PY $F/decode_speed.py $F/decode_4k_inplace.json 4096 6 4 full \
    block_sparse_0.25 block_sparse_0.25_gather sliding_window_2048 int4_kernel low_rank_32 low_rank_32_head
  # pre-RoPE low_rank with its C++ kernel (keys rebuilt, rotated and dotted in registers; a shared cos/sin table)
  [ -f $F/decode_4k_rope_kernel.json ] || $PY $F/decode_speed.py $F/decode_4k_rope_kernel.json 4096 6 4 full \
    low_rank_32 low_rank_32_head low_rank_32_post block_sparse_0.25
  # every target of the issue at 4k in one interleaved run, after the page choice and the rope kernel
  [ -f $F/decode_4k_final.json ] || $PY $F/decode_speed.py $F/decode_4k_final.json 4096 6 4 $TARGETS_4K
  # at 8k (8000: the context must also hold the decoded tokens), the int widths against full, more rounds
  [ -f $F/decode_8k_kernel.json ] || $PY $F/decode_speed.py $F/decode_8k_kernel.json 8000 6 4 full int4_kernel \
    int8_kernel int2_kernel int4_unfused
fi
if [[ $what == all || $what == paired ]]; then
  # every target again, each contender paired with a full measurement just before it (full restored to one
  # snapshot each time): drift within a round cancels. After the decode-overhead cuts (in-place per-token
  # state, a cheaper PolicyTimer). 4k: all 16 contenders; 8k: the int widths
  F=experiments/fused
  [ -f $F/decode_4k_paired.json ] || $PY $F/decode_speed.py $F/decode_4k_paired.json 4096 10 4 --paired \
    $TARGETS_4K
  # the same 4k run once more after the last overhead cuts, with 6 steps a round (the machine's noise is per
  # measurement: longer ones average more of it)
  [ -f $F/decode_4k_paired_last.json ] || $PY $F/decode_speed.py $F/decode_4k_paired_last.json 4096 12 6 \
    --paired $TARGETS_4K
  [ -f $F/decode_8k_paired.json ] || $PY $F/decode_speed.py $F/decode_8k_paired.json 8000 10 4 --paired full \
    int4_kernel int8_kernel int2_kernel
  # every target once more after the low-rank kernel cuts (pre-RoPE keys turned in registers, the next tile's
  # latents prefetched, the probabilities' mix of latents in C++, inverse rotation rows once per table)
  [ -f $F/decode_4k_paired_kernels.json ] || $PY $F/decode_speed.py $F/decode_4k_paired_kernels.json 4096 12 \
    6 --paired $TARGETS_4K
  # and after the overhead cuts that followed (pre-RoPE keys un-rotated by one C++ call per layer and step,
  # H2O's decode eviction by one float32 argmin)
  [ -f $F/decode_4k_paired_cuts.json ] || $PY $F/decode_speed.py $F/decode_4k_paired_cuts.json 4096 12 6 \
    --paired $TARGETS_4K
  [ -f $F/decode_4k_paired_cuts2.json ] || $PY $F/decode_speed.py $F/decode_4k_paired_cuts2.json 4096 12 6 \
    --paired $TARGETS_4K  # the same run again: how far a median moves between runs
  # every target after kvzip's decode moved to the grouped attention (as the other eviction layers)
  [ -f $F/decode_4k_paired_grouped.json ] || $PY $F/decode_speed.py $F/decode_4k_paired_grouped.json 4096 12 \
    6 --paired $TARGETS_4K
  # and after sliding_window's decode moved to the grouped attention too
  [ -f $F/decode_4k_paired_window.json ] || $PY $F/decode_speed.py $F/decode_4k_paired_window.json 4096 12 \
    6 --paired $TARGETS_4K
fi
if [[ $what == all || $what == evict ]]; then
  # every eviction policy at ratio 0.5 (each prefills 4k tokens itself: scores decide what stays)
  F=experiments/fused
  [ -f $F/decode_4k_evict.json ] || $PY $F/decode_speed.py $F/decode_4k_evict.json 4096 3 4 full snapkv_0.5 \
    h2o_0.5 tova_0.5 pyramidkv_0.5 block_evict_0.5 expected_attention_0.5 kvzip_0.5 sliding_window_2048
  # again on a quiet machine with twice the rounds, the window evicting in place (a ring) since
  [ -f $F/decode_4k_evict_quiet.json ] || $PY $F/decode_speed.py $F/decode_4k_evict_quiet.json 4096 6 4 full \
    snapkv_0.5 h2o_0.5 tova_0.5 pyramidkv_0.5 block_evict_0.5 expected_attention_0.5 kvzip_0.5 sliding_window_2048
fi
if [[ $what == all || $what == lm_eval ]]; then
  # lm-eval kvc_essays_ppl, --limit 8, chunk_size 1 (exact decode mode): batch 8, then batch 1, of one policy
  lm_eval_pair() {  # NAME POLICY [OVERRIDE...]: records $R/NAME_b8 and $R/NAME_b1
    for b in 8 1; do
      done_ok $R/${1}_b$b/results.json || $PY -m kvcompress task=lm_eval task.limit=8 task.chunk_size=1 \
        task.batch_size=$b policy=$2 "${@:3}" hydra.run.dir=$R/${1}_b$b > /dev/null
    done
  }
  lm_eval_pair lm_eval sliding_window
  # sliding_window again once its eviction became in place (a ring; per row with padding), no window copy
  lm_eval_pair lm_eval_ring sliding_window
  # again, both on the same commit and a quiet machine (the ring's batch-1 record above predates a fix)
  lm_eval_pair lm_eval_final sliding_window
  # once more after the decode-overhead cuts (in-place per-token state, a cheaper PolicyTimer), back to back
  lm_eval_pair lm_eval_last sliding_window
  # the same with full: sliding_window copied its window at every step, a cost that grows with the batch
  lm_eval_pair lm_eval_full full
  # both batch sizes on linears packed once for oneDNN (model.linears=packed): the BLAS repacked every weight
  # at every 8-row decode step, a third of the batch-8 run
  lm_eval_pair lm_eval_packed sliding_window model.linears=packed
  lm_eval_pair lm_eval_packed2 sliding_window model.linears=packed  # the same pair again: the noise
  # each forward's logits scored as they stream (kvcompress.eval.streamed), never concatenated into (B, T, V)
  # and log-softmaxed again whole: packed linears, then the model's own
  lm_eval_pair lm_eval_streamed sliding_window model.linears=packed
  lm_eval_pair lm_eval_streamed_default sliding_window
  lm_eval_pair lm_eval_streamed_default2 sliding_window  # the default pair again: the noise
fi
if [[ $what == all || $what == scaling ]]; then
  # the scaling table: decode tok/s, prefill time, RSS, ratios to full and DynamicCache, ms per 1k context
  done_ok $R/scaling/results.json || $PY -m kvcompress task=bench "task.lengths=[1024,2048,4096,8000]" \
    "task.policies=[full,quant,snapkv,sliding_window]" "task.peers=[dynamic]" \
    task.decode_tokens=8 task.warmup=1 task.repeats=1 task.progress=false hydra.run.dir=$R/scaling > /dev/null
fi
if [[ $what == all || $what == kvzip ]]; then
  # kvzip's prefill + context pass against a plain prefill of 2048 tokens, stage by stage, 5 rounds.
  # kvzip_pass_before is the same script run in a worktree of commit ccdd7a3 (scores from a float32 softmax of
  # every chunk query over every key, per layer and chunk)
  done_ok $R/kvzip_pass_after/results.json || $PY benchmarks/kvzip_prefill.py --repeats 5 --label after \
    --out $R/kvzip_pass_after
fi
if [[ $what == all || $what == step ]]; then
  # the decode step's weight: DynamicCache, full, int4 (per-channel and per-token keys), h2o and tova at 0.5 over
  # dense and over int4, at 512, 4k and 8k (8000: the context must also hold the decoded tokens), paired
  S=experiments/speed/decode_step
  for n in 512 4096 8000; do
    [ -f $S/composed_$n.json ] || $PY experiments/fused/decode_speed.py $S/composed_$n.json $n 5 8 --paired \
      full dynamic int4_kernel int4_token h2o_0.5 tova_0.5 h2o_0.5_int4 tova_0.5_int4
  done
  # at 512 again once the layer's update became transformers' Cache.update of the layer (a9ba8cb), with the
  # two selectors written since (keydiff asks attention for nothing; rkv re-compresses every 128 tokens)
  [ -f $S/update_512.json ] || $PY experiments/fused/decode_speed.py $S/update_512.json 512 5 8 --paired \
    full dynamic int4_kernel h2o_0.5 keydiff_0.5 rkv_0.5
  # the bound on any ratio-0.5 selector: full over half the prompt (full_half), beside h2o at 0.5 and over int4
  for n in 512 4096; do
    [ -f $S/bound_$n.json ] || $PY experiments/fused/decode_speed.py $S/bound_$n.json $n 5 8 --paired \
      full full_half dynamic int4_token h2o_0.5 h2o_0.5_int4
  done
fi
if [[ $what == all || $what == table ]]; then
  # decode speed by policy and storage (the three decode targets): DynamicCache, full, full over the first
  # half of the prompt, int4 (quant), and h2o, snapkv and kvzip at 0.5 over dense and over int4, at 512, 4096
  # and 8000 tokens, in one process: each cache prefilled once per length, then a warm-up round and 5 timed
  # rounds of 32 tokens each, every cache restored to its post-prompt state before its turn
  done_ok $R/decode_table/results.json || $PY experiments/speed/decode_table.py --out $R/decode_table \
    --lengths 512 4096 8000 --decode-tokens 32 --warmup 1 --repeats 5
fi
$PY scripts/collect.py $R || true
