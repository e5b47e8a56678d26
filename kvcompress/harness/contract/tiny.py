"""What the contract checks run on: tiny random models (fixed seed), a token sequence, a policy at the small
parameters its class declares (``TEST_PARAMS``, so 48 tokens really compress), the tensors a layer holds."""

from __future__ import annotations

import dataclasses

import torch

FAMILIES = ("llama", "qwen2")


def make_tiny(family: str = "llama", attn: str = "sdpa"):
    """A 3-layer model of ``family`` with GQA (4 query, 2 KV heads), random weights from seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[family]
    config = config_class(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=95, bos_token_id=1,
        attn_implementation=attn,
    )  # fmt: skip
    torch.manual_seed(0)
    return model_class(config).eval()


def tokens(n: int = 48, rows: int = 1, seed: int = 1) -> torch.Tensor:
    """``(rows, n)`` random token ids that are neither padding nor end of text."""
    return torch.randint(2, 95, (rows, n), generator=torch.Generator().manual_seed(seed))


def small_policy(policy):
    """``policy`` at its class's ``TEST_PARAMS``; a per-layer schedule gets its parts' small versions."""
    from kvcompress.selectors import SchedulePolicy

    if isinstance(policy, SchedulePolicy):
        rules = [{**r, "policy": small_policy(r["policy"])} if "policy" in r else r for r in policy.rules]
        default = policy.default and small_policy(policy.default)
        return SchedulePolicy(default=default, rules=rules, storage=policy.storage)
    return dataclasses.replace(policy, **type(policy).TEST_PARAMS)


@torch.inference_mode()
def stream_logits(model, ids, cache, chunk: int) -> torch.Tensor:
    """Logits (B, N, V) of ``ids`` fed in chunks of ``chunk`` tokens through ``cache``."""
    out = [
        model(ids[:, s : s + chunk], cache=cache, use_cache=True).logits
        for s in range(0, ids.shape[1], chunk)
    ]
    return torch.cat(out, dim=1)


def held_tensors(obj, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj``'s attributes (lists, tuples, dicts and its store included)."""
    from kvcompress.storage import Store

    if depth > 4:
        return []
    found = []
    for v in vars(obj).values() if hasattr(obj, "__dict__") else obj:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += held_tensors(v, depth + 1)
        elif isinstance(v, dict):
            found += held_tensors(list(v.values()), depth + 1)
        elif isinstance(v, Store):
            found += held_tensors(v, depth + 1)
    return found


def max_memory_ratio(policy, num_layers: int = 3) -> float:
    """Bytes a policy may hold over ``full``'s for its own state: the largest its layers declare (the
    selector's ``MAX_MEMORY_RATIO`` plus its storage's excess)."""
    from kvcompress.memory_model import layer_policy_of

    def ratio(layer_policy) -> float:
        storage = getattr(layer_policy, "storage", None)
        return type(layer_policy).MAX_MEMORY_RATIO + (getattr(storage, "MAX_MEMORY_RATIO", 1.0) - 1.0)

    return max(ratio(layer_policy_of(policy, i, num_layers)) for i in range(num_layers))
