"""The model-family zoo: tiny random models built from transformers' own config classes (fixed seed).

Every family is small enough for unit tests and keeps what makes it different: sliding windows shorter
than the test sequences, hybrid layer types, softcapping, attention sinks, NoPE layers, partial rotary
dims, MoE blocks. ``SERVED`` must reproduce the model's own cache exactly; ``REFUSED`` must be refused by
``build_cache`` with the family's name.
"""

from __future__ import annotations

import torch
import transformers

WINDOW = 12  # shorter than the 48-token test sequences, so windowed layers really slide

COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=95, bos_token_id=1,
)  # fmt: skip

HYBRID = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

GEMMA = {"head_dim": 16, "sliding_window": WINDOW, "layer_types": HYBRID, "query_pre_attn_scalar": 16}

# family -> (config class, model class, extra config fields)
SERVED = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "ministral": ("MinistralConfig", "MinistralForCausalLM",
                  {"head_dim": 16, "sliding_window": WINDOW, "layer_types": HYBRID}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"sliding_window": WINDOW, "num_local_experts": 2, "num_experts_per_tok": 1}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**GEMMA}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**GEMMA}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"sliding_window": WINDOW, "layer_types": HYBRID}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": WINDOW, "partial_rotary_factor": 0.5}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": WINDOW}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 1, 1, 0]}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": WINDOW, "layer_types": HYBRID}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {"head_dim": 16, "sliding_window": WINDOW, "layer_types": HYBRID, "num_local_experts": 2,
                 "num_experts_per_tok": 1}),
}  # fmt: skip

REFUSED = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {"head_dim": 16}),
    "jamba": ("JambaConfig", "JambaForCausalLM", {}),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {"head_dim": 16}),
    "t5": ("T5Config", "T5ForConditionalGeneration", {}),
}


def make_family(family: str, dtype=torch.float32):
    """A tiny random model of ``family`` (eval mode, fixed seed) on its default attention backend."""
    config_cls, model_cls, extra = {**SERVED, **REFUSED}[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).to(dtype).eval()


# The ways a model rotates its keys (pre-RoPE low-rank keys and the C++ kernel's cos/sin table): the unit
# tests' tiny shape under scaled RoPE (Llama-3, YaRN), partial rotary dims (Phi-3) and NoPE layers (SmolLM3).
ROPE_TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4
)
ROPE_TINY |= dict(
    num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=95
)
ROPE = {"rope_theta": 10000.0}
SCALED_ROPE = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0},
}


def make_rope_model(family: str):
    """A tiny random model of ``family`` (fixed seed): ``llama``, ``qwen2``, a key of ``SCALED_ROPE``,
    ``phi3_partial`` or ``smollm3_nope``."""
    from conftest import make_tiny

    torch.manual_seed(0)
    if family in ("llama", "qwen2"):
        return make_tiny(family)
    if family in SCALED_ROPE:
        params = {**SCALED_ROPE[family], **ROPE, "original_max_position_embeddings": 16}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ROPE_TINY, rope_parameters=params))
    elif family == "phi3_partial":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**ROPE_TINY, partial_rotary_factor=0.5))
    elif family == "smollm3_nope":
        config = transformers.SmolLM3Config(**ROPE_TINY, no_rope_layer_interval=2)
        model = transformers.SmolLM3ForCausalLM(config)
    return model.eval()
