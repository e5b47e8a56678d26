"""The rows of ``bench_quant.py``: kvcompress policies and transformers' ``QuantizedCache`` backends, and
how to size each cache (bytes it holds, effective bits per quantized element)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import QuantizedCache

from kvcompress import build_cache
from kvcompress.core import attention
from kvcompress.core.policy import storage_bytes


@dataclass
class Row:
    """One configuration: ``kind`` is ``"ours"`` (a kvcompress policy) or ``"hf"`` (transformers)."""

    name: str
    kind: str
    target: str  # policy name, or QuantizedCache backend
    params: dict = field(default_factory=dict)
    chunk: int = 1
    last_token: int = 0

    def make(self, model):
        if self.kind == "ours":
            return build_cache(self.target, model, **self.params)
        return QuantizedCache(self.target, model.config, **self.params)


def rows(grid_chunk: int) -> list[Row]:
    """``full``; ``quant`` bits 8/4/2 x group 32/64 x residual 0/128 (g32 r128 at chunk 1, the rest at
    ``grid_chunk``), int4 at 6 bits, per-token keys as transformers groups them; transformers' fp8, quanto
    (chunk 1) and hqq (``grid_chunk``)."""
    out = [Row("full", "ours", "full")]
    for bits in (8, 4, 2):
        for group in (32, 64):
            for residual in (128, 0):
                chunk = 1 if (group, residual) == (32, 128) else grid_chunk
                params = dict(bits=bits, group_size=group, recent=residual)
                out.append(Row(f"quant int{bits} g{group} r{residual}", "ours", "quant", params, chunk))
    # 6 bits per quantized element, as transformers' int4 spends with its float32 scales and shifts
    out.append(Row("quant int4 g16 r128", "ours", "quant", dict(bits=4, group_size=16, recent=128)))
    params = dict(bits=4, group_size=16, recent=128, key_axis="token")
    out.append(Row("quant int4 g16 r128 keys-per-token", "ours", "quant", params))
    for bits in (4, 2):  # transformers' grouping of keys, to separate grouping from everything else
        params = dict(bits=bits, group_size=32, recent=128, key_axis="token")
        out.append(Row(f"quant int{bits} g32 r128 keys-per-token", "ours", "quant", params))
    out.append(Row("hf fp8 (per-tensor)", "hf", "fp8"))
    for bits in (4, 2):  # transformers' defaults: axis 0 (groups of consecutive channels of a token)
        params = dict(nbits=bits, q_group_size=32, residual_length=128)
        out.append(Row(f"hf quanto int{bits} g32 r128", "hf", "quanto", params))
    for bits in (8, 4, 2):  # axis 1: contiguous groups, as hqq recommends
        params = dict(nbits=bits, q_group_size=32, residual_length=128, axis_key=1, axis_value=1)
        out.append(Row(f"hf hqq int{bits} g32 r128", "hf", "hqq", params, grid_chunk))
    return out


def set_mode(model, kind: str) -> None:
    """Our rows attend through kvcompress's hook; transformers' caches through the model's plain SDPA."""
    if kind == "ours":
        attention.install(model)
    else:
        model.set_attn_implementation(getattr(model.config, "kvcompress_backend", "sdpa"))
        assert model.config._attn_implementation != attention.NAME


def plain_tensors(obj) -> list[torch.Tensor]:
    """The plain tensors inside ``obj``: tensor subclasses (quanto's packed tensors) are opened up."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is torch.Tensor or not hasattr(obj, "__tensor_flatten__"):
            return [obj]
        names, _ = obj.__tensor_flatten__()
        return [t for n in names for t in plain_tensors(getattr(obj, n))]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in plain_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in plain_tensors(o)]
    return []


def _residual(layer) -> list[torch.Tensor]:
    keys = getattr(layer, "keys", None)
    return [layer.keys, layer.values] if keys is not None and keys.dim() == 4 else []


def cache_size(cache, model) -> dict:
    """Bytes held, effective bits per quantized element (codes + scales + zeros) and per element overall."""
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if hasattr(cache, "memory_bytes"):  # ours
        stats = cache.stats()
        total = cache.memory_bytes()
        quantized = sum(s.get("code_bytes", 0) + s.get("scale_zero_bytes", 0) for s in stats)
        elements = sum(s.get("quantized_elements", 0) for s in stats)
        tokens = stats[0]["tokens_seen"]
    else:  # transformers: the quantized states plus the full-precision residual
        quantized, elements, total, tokens = 0, 0, 0, cache.get_seq_length()
        for layer in cache.layers:
            packed = plain_tensors([layer._quantized_keys, layer._quantized_values])
            residual = _residual(layer)
            quantized += storage_bytes(packed)
            total += storage_bytes(packed + residual)
            stored = tokens - (residual[0].shape[-2] if residual else 0)
            elements += 2 * cfg.num_key_value_heads * stored * head_dim
    all_elements = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * tokens * head_dim
    return {
        "cache_bytes": total,
        "bits_quantized": 8 * quantized / elements if elements else None,
        "bits_all": 8 * total / all_elements,
        "quantized_elements": elements,
    }
