"""Refuse a run that would not fit in memory, before it starts, instead of being OOM-killed."""

from __future__ import annotations

from pathlib import Path

import torch


class ResourceError(RuntimeError):
    """The requested context and batch would exceed the memory available."""


def available_bytes(device) -> int:
    """Free device memory on CUDA, else MemAvailable of the machine (or a large number if unknown)."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50


def estimate_bytes(model, tokens: int, batch: int = 1, chunk: int | None = None) -> dict:
    """Upper bound of what a run adds beyond the weights: the uncompressed KV cache, the largest
    chunk's activations (hidden states, MLP, attention scores when the kernel materialises them) and
    its logits. ``chunk`` is the largest number of tokens in one forward (default: all)."""
    cfg = model.config.get_text_config(decoder=True)
    item = torch.finfo(model.dtype).bits // 8
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    chunk = min(chunk or tokens, tokens)
    kv = 2 * cfg.num_hidden_layers * batch * kv_heads * head_dim * tokens * item
    hidden = batch * chunk * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * item
    scores = batch * heads * chunk * tokens * 4  # eager/math SDPA materialise (q x T) float32 scores
    logits = batch * chunk * cfg.vocab_size * 4
    return {
        "kv_cache": kv,
        "activations": hidden + scores,
        "logits": logits,
        "total": kv + hidden + scores + logits,
    }


def check_fits(model, tokens: int, batch: int = 1, chunk: int | None = None, margin: float = 0.8) -> dict:
    """Raise ``ResourceError`` when the estimate exceeds ``margin`` of the available memory."""
    need = estimate_bytes(model, tokens, batch, chunk)
    have = available_bytes(model.device)
    if need["total"] > margin * have:
        gib = 1 << 30
        raise ResourceError(
            f"a run with {tokens} tokens x batch {batch} (chunk {chunk or tokens}) needs about "
            f"{need['total'] / gib:.2f} GiB (KV cache {need['kv_cache'] / gib:.2f}, activations "
            f"{need['activations'] / gib:.2f}, logits {need['logits'] / gib:.2f}) but only "
            f"{have / gib:.2f} GiB is available on {model.device}; lower the context, batch or chunk size"
        )
    return need
