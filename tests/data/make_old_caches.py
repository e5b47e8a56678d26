"""Write the cache files that ``tests/test_cache_aliases.py`` loads: caches saved by the code before a move
of modules (unversioned headers: format version 2), so the alias table that maps old class names to new is
tested on real files.

Run once, by the code being replaced (``python tests/data/make_old_caches.py``); the files are committed.
The model's weights are integers over 1000, so every CPU builds the same model (same fingerprint).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvcompress

HERE = Path(__file__).resolve().parent
CASES = {
    "snapkv_int4": (
        "snapkv",
        {
            "budget": 16,
            "observation_window": 4,
            "storage": {"name": "quant", "group_size": 16, "residual_length": 4},
        },
    ),
    "tiered": (
        "tiered",
        {"top_k_blocks": 2, "storage": {"name": "offload", "block_size": 4, "recent": 4, "lru_pages": 2}},
    ),
}


def exact_model() -> LlamaForCausalLM:
    """A tiny Llama whose every weight is ``((i * 7919 + k) % 201 - 100) / 1000``: exact on any CPU."""
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=95,
        bos_token_id=1,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            i = torch.arange(p.numel(), dtype=torch.int64)
            p.copy_((((i * 7919 + k) % 201 - 100).float() / 1000).reshape(p.shape))
    return model


def prompt() -> torch.Tensor:
    return (torch.arange(40).reshape(1, -1) * 37 % 90 + 2).long()


def main() -> None:
    model = exact_model()
    for name, (policy, params) in CASES.items():
        cache = kvcompress.build_cache(policy, model, **params)
        with torch.inference_mode():
            model(prompt(), cache=cache, use_cache=True)
        kvcompress.persist.save(cache, HERE / f"cache_premove_{name}.safetensors", model)


if __name__ == "__main__":
    main()
