"""The memory model's formulas against byte counts derived here by hand, on the embedded model's shape."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvcompress import make_policy
from kvcompress.memory_model import predicted_bytes
from kvcompress.selectors import H2OPolicy, LowRankPolicy, SchedulePolicy

# SmolLM2-135M's shape: 30 layers, 9 query / 3 KV heads, head_dim 64
SPEC_ARGS = dict(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_positions=8192)
BF16, F32 = 2, 4


@pytest.fixture
def spec():
    from kvcompress.selectors import ModelSpec

    return ModelSpec(**SPEC_ARGS)


def kv_bytes(tokens: int, dtype_bytes: int = BF16, layers: int = 30) -> int:
    return layers * 2 * 3 * tokens * 64 * dtype_bytes  # layers x (K, V) x H_kv x T x D x bytes


def test_quant_int4_g32_r128_at_1024_tokens(spec):
    # 1024 - 128 = 896 tokens have left the residual window in whole groups of 32; 128 stay bf16
    codes = 3 * 896 * 64 // 2  # per tensor: two 4-bit codes a byte
    scale_zero = 2 * (3 * 896 * 64 // 32) * 2  # one bf16 scale and one zero per 32 elements
    residual = 3 * 128 * 64 * 2
    per_layer = 2 * (codes + scale_zero + residual)  # keys and values
    assert per_layer == 313_344
    got = predicted_bytes(make_policy("quant", bits=4, group_size=32, recent=128), spec, 1024, BF16)
    assert got == 30 * per_layer
    assert got / kv_bytes(1024) == pytest.approx(0.398, abs=1e-3)


def test_quant_float32_model_residual_and_unaligned_length(spec):
    # 1000 tokens: (1000 - 128) // 32 * 32 = 864 quantized, 136 residual in float32; scales float16 (auto)
    codes, scale_zero, residual = 3 * 864 * 64 // 2, 2 * (3 * 864 * 2) * 2, 3 * 136 * 64 * 4
    got = predicted_bytes("quant", spec, 990, F32, decode_tokens=10)
    assert got == 30 * 2 * (codes + scale_zero + residual)


def test_mixed_precision_sums_its_layers(spec):
    full = 2 * 3 * 1024 * 64 * 2
    int8 = 2 * (3 * 896 * 64 + 2 * (3 * 896 * 2) * 2 + 3 * 128 * 64 * 2)
    int4 = 313_344
    assert predicted_bytes("mixed_precision", spec, 1024, BF16) == 2 * full + 18 * int8 + 10 * int4


def test_h2o_ratio_keeps_half_plus_float32_accumulator_and_int32_position(spec):
    kept = 503  # int(1007 * 0.5): the target tracks every token seen, prompt and decode
    got = predicted_bytes(make_policy("h2o", compression_ratio=0.5), spec, 1000, BF16, decode_tokens=7)
    assert got == kv_bytes(kept) + 30 * 3 * kept * (4 + 4)


def test_snapkv_slack_recompresses_and_holds_queries(spec):
    # budget 100 after the prompt; decode grows it to 108 (= 100 + slack), step 9 makes 109 -> back to
    # 100, step 18 again, steps 19 and 20 leave 102. The layer holds the last 32 queries of 9 heads.
    policy = make_policy(
        "snapkv", budget=100, compression_ratio=None, observation_window=32, slack=8, evict_at="always"
    )
    got = predicted_bytes(policy, spec, 500, BF16, decode_tokens=20)
    assert got == kv_bytes(102) + 30 * 9 * 32 * 64 * 2
    no_slack = make_policy("snapkv", budget=100, compression_ratio=None)
    assert predicted_bytes(no_slack, spec, 500, BF16, decode_tokens=20) == kv_bytes(120)


def test_pyramidkv_budgets_sum_to_mean_times_layers(spec):
    """The reference code's integer steps leave the last layer a little above min_num: the total is each
    layer's ``reference_keep``, within 1% of 30 x 200 tokens."""
    from kvcompress.selectors.eviction.pyramid import reference_keep

    policy = make_policy("pyramidkv", budget=200, compression_ratio=None)
    per_layer = [reference_keep(1000, i, 30, 200, 32, 20) for i in range(30)]
    assert predicted_bytes(policy, spec, 1000, BF16) == kv_bytes(sum(per_layer), layers=1)
    assert sum(per_layer) == pytest.approx(200 * 30, rel=0.01) and per_layer[0] > per_layer[-1]


def test_window_tova_and_block_sparse(spec):
    assert predicted_bytes("sliding_window", spec, 1000, BF16) == kv_bytes(4 + 252)
    assert predicted_bytes("sliding_window", spec, 100, BF16, decode_tokens=5) == kv_bytes(105)
    assert predicted_bytes("tova", spec, 7, BF16) == kv_bytes(3)  # max(1, int(7 * 0.5))
    pages = 63  # ceil(1000 / 16), each a key min and max row
    assert predicted_bytes("block_sparse", spec, 1000, BF16) == kv_bytes(1000) + kv_bytes(pages)


def test_low_rank_int8_coefficients_with_residual(spec):
    projected = 1000 - 64
    coef = 3 * projected * (16 + 16)  # int8 key and value coefficients
    scales = 2 * 3 * projected * 2  # one bf16 scale per token, head and tensor
    residual, bases = 2 * 3 * 64 * 64 * 2, 3 * 64 * 32 * 4  # float32 bases whatever the model dtype
    policy = LowRankPolicy(
        rank=16,
        recent=64,
        int8_coefficients=True,
        basis="head",
        keys="post_rope",
        key_objective="keys",
    )
    assert predicted_bytes(policy, spec, 1000, BF16) == 30 * (coef + scales + residual + bases)


def test_low_rank_pre_rope_joint_counts_positions_and_joint_bases(spec):
    projected = 1000 - 64
    coef = 3 * projected * (16 + 16)
    scales = 2 * 1 * projected * 2  # one latent (and scale) per token for all 3 KV heads
    positions = 3 * 1000 * 4  # int32 per stored token and head, residual included
    residual = 2 * 3 * 64 * 64 * 2
    bases = 3 * (3 * 64) * (16 * 3) * 4  # (H * D, 3 * rank): a key encoder and decoder, a value basis
    policy = LowRankPolicy(rank=16, recent=64, int8_coefficients=True)
    assert predicted_bytes(policy, spec, 1000, BF16) == 30 * (coef + scales + positions + residual + bases)


def test_low_rank_keys_with_int4_values(spec):
    keys = 3 * 1000 * 24 * 2 + 3 * 1000 * 4  # bf16 coefficients (no residual) + positions
    values = make_policy("quant").storage.bytes_for(shape(spec, 1000), 1000) // 2  # KIVI values alone
    bases = 2 * 3 * 64 * 24 * 3 * 4  # the keys' encoder and decoder (query-aware: key_objective=logits)
    policy = LowRankPolicy(rank=24, values={"name": "quant", "bits": 4})
    assert predicted_bytes(policy, spec, 1000, BF16) == 30 * (keys + values + bases)


def shape(spec, tokens):
    from kvcompress.core.spec import Shape

    return Shape(1, spec.num_kv_heads, spec.num_heads, spec.head_dim, BF16, tokens, 0)


def test_batch_rows_scale_everything_but_bases(spec):
    assert predicted_bytes("full", spec, 300, BF16, batch=4) == 4 * kv_bytes(300)
    one, four = (predicted_bytes(LowRankPolicy(rank=8), spec, 300, BF16, batch=b) for b in (1, 4))
    assert four - 4 * one == -3 * 30 * 3 * (3 * 64 * 8 * 3) * 4  # the per-layer joint maps are not per row


@dataclass
class UnknownH2O(H2OPolicy):
    """A subclass the memory model has never seen (it may keep more than its parent)."""


def test_unknown_policies_give_none_not_a_guess(spec):
    assert predicted_bytes(UnknownH2O(budget=10), spec, 100, BF16) is None
    assert predicted_bytes(LowRankPolicy(rank=None, energy=0.9), spec, 100, BF16) is None  # calibrated ranks
    schedule = SchedulePolicy(
        default=make_policy("full"), rules=[{"layers": 3, "policy": UnknownH2O(budget=8)}]
    )
    assert predicted_bytes(schedule, spec, 100, BF16) is None


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"n_tokens": 0}, "n_tokens=0"),
        ({"dtype_bytes": 3}, "dtype_bytes=3"),
        ({"batch": 0}, "batch=0"),
        ({"decode_tokens": -1}, "decode_tokens=-1"),
        ({"n_tokens": 1.5}, "n_tokens=1.5"),
    ],
)
def test_bad_inputs_name_the_field(spec, kwargs, field):
    args = {"n_tokens": 10, "dtype_bytes": BF16, **kwargs}
    with pytest.raises(ValueError, match=field):
        predicted_bytes("full", spec, **args)


def test_model_dependent_checks_of_the_policy_apply(spec):
    with pytest.raises(ValueError, match="group_size=48"):
        predicted_bytes(make_policy("quant", group_size=48, value_axis="token"), spec, 10, BF16)
