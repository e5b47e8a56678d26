#!/bin/bash
# Pre-RoPE low-rank measurements, one run at a time (resumable: a run with an ok results.json is skipped).
cd "$(dirname "$0")/../.."
OUT=${OUT:-experiments/low_rank_prerope/runs}
mkdir -p "$OUT"
run() {
  name=$1; shift
  if [ -f $OUT/$name/results.json ] && grep -q '"status": "ok"' $OUT/$name/results.json; then echo "skip $name"; return; fi
  echo "=== $name $(date +%T)"
  OMP_NUM_THREADS=1 ${PYTHON:-.venv/bin/python} -m kvcompress "$@" task.progress=false hydra.run.dir=$OUT/$name > $OUT/$name.log 2>&1
  echo "    done $(date +%T)"
}
T="task.max_tokens=1024 task.speed=false task.slices=1"
P="task.max_tokens=2048 task.prefix_tokens=1024 task.speed=false task.slices=1"
Q4R32='policy.values={name:quant,bits:4,recent:32}'
Q4R64='policy.values={name:quant,bits:4,recent:64}'
D='policy.values=dense'
OLD="policy.keys=post_rope policy.basis=head policy.key_objective=keys"  # the storage before pre-RoPE joint bases
run full policy=full $T
run pre_joint_keys_k31_vdense policy=low_rank policy.rank=31 policy.key_objective=keys $D $T
run post_head_keys_k32_vdense policy=low_rank policy.rank=32 $OLD $D $T
run pre_joint_logits_k31_vdense policy=low_rank policy.rank=31 $D $T
run pre_joint_logits_k46_q4r64 policy=low_rank policy.rank=46 "$Q4R64" $T
run pre_joint_logits_k24_q4r32 policy=low_rank policy.rank=24 "$Q4R32" $T
run post_head_keys_k24_q4r32 policy=low_rank policy.rank=24 $OLD "$Q4R32" $T
run prefix_full policy=full $P
run prefix_pre_joint_logits_k31_vdense policy=low_rank policy.rank=31 $D $P
run prefix_pre_joint_logits_k46_q4r64 policy=low_rank policy.rank=46 "$Q4R64" $P
for q in false true; do
  run niah_pre_joint_logits_k46_q4r64_qip_$q task=niah policy=low_rank policy.rank=46 "$Q4R64" task.question_in_prompt=$q "task.extra_needles=[]" "task.depths=[0,25,50,75,100]"
done
run prefix_pre_joint_logits_k24_q4r32 policy=low_rank policy.rank=24 "$Q4R32" $P
run prefix_post_head_keys_k32_vdense policy=low_rank policy.rank=32 $OLD $D $P
run post_head_keys_k32_v32 policy=low_rank policy.rank=32 $OLD $T
run pre_joint_logits_k31_vdense_error policy=low_rank policy.rank=31 policy.allocation=error $D $T
run pre_joint_logits_k64_v64_int8 policy=low_rank policy.rank=64 policy.int8_coefficients=true $T
run prefix_post_head_keys_k24_q4r32 policy=low_rank policy.rank=24 $OLD "$Q4R32" $P
run pre_joint_logits_k31_v32 policy=low_rank policy.rank=31 policy.value_rank=32 $T
# the three rank-32 layouts of the decode-speed runs (experiments/fused: low_rank_32, _head, _post), quality
# beside speed: joint pre-RoPE bases (the default), per-head pre-RoPE bases, post-RoPE keys
run pre_joint_logits_k32_v32 policy=low_rank policy.rank=32 $T
run pre_head_logits_k32_v32 policy=low_rank policy.rank=32 policy.basis=head $T
run post_joint_logits_k32_v32 policy=low_rank policy.rank=32 policy.keys=post_rope $T
