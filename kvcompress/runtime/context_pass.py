"""The context pass of query-agnostic selectors (KVzip): reconstruct the prefilled context against its cache.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416.

Why an explicit call: the reconstruction runs the whole model again over the context's token ids, which
no cache layer sees (layers get keys and values, never ids) and which cannot run from inside the
forward that would trigger it. So the caller, who holds the ids, says when the context is complete::

    model(context_ids, cache=cache)                  # prefill: stores every token
    compress_context(model, cache, context_ids, tok) # scores by reconstruction, then evicts

``prefill`` does both, and runs the pass only for caches whose layers declare ``needs_context_pass``; the
tasks (retrieval, multi-query, prefix perplexity) use it, so any policy gets what it needs.
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcompress.core import attention
from kvcompress.core.layer import expand_heads, step_inputs
from kvcompress.core.masks import cat_valid
from kvcompress.core.plan import Dense, Plan
from kvcompress.selectors.eviction.kvzip_prompts import Prompts, repeat_prompts

OVERLAP = 8  # last tokens of the previous chunk quoted in the next chunk's prompt


def needs_context_pass(cache) -> bool:
    return any(getattr(layer, "needs_context_pass", False) for layer in getattr(cache, "layers", ()))


def reconstruction_chunks(context_ids, attention_mask, prompts: Prompts, chunk: int):
    """Inputs of the reconstruction forwards: per chunk, ids (B, n) and query validity (B, n) or None.

    Each row reconstructs its own real tokens (left padding and the chat opening dropped) ``chunk`` at a
    time: the instruction (the later ones quote the previous chunk's last ``OVERLAP`` tokens), the turn
    switch, the chunk. Shorter rows are right-padded with id 0, marked invalid.
    """
    masks = torch.ones_like(context_ids) if attention_mask is None else attention_mask
    rows = [ids[m.bool()].tolist() for ids, m in zip(context_ids.cpu(), masks.cpu(), strict=True)]
    n = len(prompts.opening)
    rows = [r[n:] if n and r[:n] == prompts.opening and len(r) > n else r for r in rows]
    n_chunks = max(-(-len(r) // chunk) for r in rows)
    for i in range(n_chunks):
        pieces = []
        for r in rows:
            body = r[i * chunk : (i + 1) * chunk]
            head = prompts.first if i == 0 else prompts.later + r[max(0, i * chunk - OVERLAP) : i * chunk]
            pieces.append(head + prompts.turn + body if body else [])
        width = max(len(p) for p in pieces)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for b, p in enumerate(pieces):
            ids[b, : len(p)], valid[b, : len(p)] = torch.tensor(p, dtype=torch.long), True
        yield ids, (None if bool(valid.all()) else valid)


@torch.inference_mode()
def compress_context(model, cache, context_ids, tokenizer=None, attention_mask=None) -> dict:
    """Run the context pass of every layer that needs one, then let those layers evict; the other layers
    (the model's own window on windowed layers, ``full`` layers of a schedule) see the reconstruction as the
    model would and store none of it.

    Args:
        context_ids: (B, T) the ids just prefilled (left padded as they were, with ``attention_mask``).
        tokenizer: builds the repeat instruction and chat turn; None reconstructs without them.

    Returns:
        ``{"context_pass": bool, "context_pass_s", "context_chunks"}`` (``False`` when no layer needs one).
    """
    layers = [layer for layer in cache.layers if getattr(layer, "needs_context_pass", False)]
    if not layers:
        return {"context_pass": False}
    start, seen = time.perf_counter(), cache.get_seq_length()
    pads = 0 if attention_mask is None else (attention_mask == 0).sum(-1, keepdim=True).cpu()
    prompts, size = repeat_prompts(tokenizer), layers[0].policy.context_chunk
    chunks = list(reconstruction_chunks(context_ids, attention_mask, prompts, size))
    held = cache.layers
    cache.layers = [PassView(layer) for layer in held]  # every layer sees the pass; none stores it
    try:
        for layer in layers:
            layer.begin_pass()
        for ids, valid in chunks:
            _reconstruct(model, cache, ids, valid, seen - pads)
    except BaseException:
        for layer in layers:
            layer.end_pass(evict=False)
        raise
    finally:
        cache.layers = held
    from kvcompress.selectors.eviction.kvzip_budgets import plan

    for layer, keep in zip(layers, plan(layers), strict=True):
        layer.end_pass(keep=keep)
    seconds = time.perf_counter() - start
    return {"context_pass": True, "context_pass_s": seconds, "context_chunks": len(chunks)}


class PassView(CacheLayerMixin):
    """One cache layer during a context pass: each reconstruction forward reads what the layer holds followed
    by the forward's own keys and values, masked as the model would (causal, within its window), and the
    layer stores none of it. Its selector acts on the pass only when it scores it (``needs_context_pass``:
    ``observe_pass`` gets each forward's attention); for every other layer (the model's own window on
    Gemma-3, a ``full`` layer of a schedule) the pass is not one of its steps: nothing counted, no scores.
    Everything else (lengths, mask sizes) is the layer's own."""

    def __init__(self, layer):
        if not layer.is_initialized:
            raise RuntimeError("compress_context needs a prefilled cache (no tokens stored yet)")
        why = layer.pass_refusal()
        if why:
            raise ValueError(f"layer {layer.layer_idx}: {why}")
        self.layer, self.valid = layer, None
        self.scores = getattr(layer, "needs_context_pass", False)

    def __getattr__(self, name):  # what the view does not define is the layer's (not before it has one)
        if name == "layer":
            raise AttributeError(name)
        return getattr(self.layer, name)

    def lazy_initialization(self, key_states, value_states) -> None:
        """Never needed: a pass runs over prefilled layers only."""

    def get_seq_length(self) -> int:
        return self.layer.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layer.get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return self.layer.get_max_length()

    def update(self, key_states, value_states, *args, **kwargs):
        """A reconstruction step (B, H_kv, q, D): what the layer holds then the step's own tokens; ``valid``
        keeps the keys' validity (B, h, T + q) and the queries' (B, q) or None for ``observe_pass``. The
        attention function that follows gets this view (the forward's ``pending``)."""
        layer = self.layer
        forward = step_inputs(key_states, args, kwargs)[1]
        if forward is not None:
            forward.pending[layer.layer_idx] = self
        keys, values = layer.store.read()  # (B, H_kv, T, D): what the context left, nothing appended
        b, _, q, _ = key_states.shape
        queries = attention.validity(forward, b, q, key_states.device)
        valid = cat_valid(layer.valid, queries, keys.shape[-2], b, q, key_states.device)
        layer._view = (keys.shape[-2] + q, valid, None)  # causal among the pass tokens, after the context
        self.valid = (valid, queries)
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

    def plan(self, query, key, value) -> Plan:
        """The dense read of ``update``'s keys/values (B, H_kv, T + q, D) under the layer's own mask."""
        mask = expand_heads(self.layer.attention_mask(query.shape[2]), query.shape[1])
        probs = self.layer.observed_probs if self.scores else "none"
        return Plan(Dense(key, value, mask), probs, self.layer.grouped_decode)

    def attended(self, plan: Plan, call, out, probs, backend: str) -> None:
        """A scoring layer sees this forward's attention (``probs``: each query's log-sum-exp, or None)."""
        if self.scores:
            keys_valid, queries_valid = self.valid
            self.layer.observe_pass(call.query, plan.read.key, call.scaling, probs, keys_valid, queries_valid)
        self.valid = None

    def never_crops(self) -> str | None:
        return "a context pass is running"


def _reconstruct(model, cache, ids, valid, first_position) -> None:
    """One teacher-forced chunk (B, n) at the positions right after each row's context; nothing is stored."""
    b, n = ids.shape
    dev = model.device
    kwargs = {"position_ids": (torch.arange(n) + first_position).expand(b, -1).to(dev)}
    if valid is not None:
        mask = torch.cat([torch.ones(b, cache.get_seq_length(), dtype=torch.long), valid.long()], dim=1)
        kwargs["attention_mask"] = mask.to(dev)
    model(ids.to(dev), cache=cache, use_cache=True, logits_to_keep=1, **kwargs)


def prefill_chunk(cache) -> int | None:
    """Tokens per prefill forward a cache asks for (its layers' ``prefill_chunk``, the smallest), or None."""
    sizes = [getattr(layer, "prefill_chunk", None) for layer in getattr(cache, "layers", ())]
    sizes = [n for n in sizes if n]
    return min(sizes) if sizes else None


def forward_prompt(model, cache, ids, **kwargs):
    """Prefill ``ids`` (1 or B, T): one forward, or forwards of ``prefill_chunk(cache)`` tokens (a tiered
    cache: device bytes then peak at its hot budget plus one chunk). Returns the last forward's output;
    a padding ``attention_mask`` (B, T) is cut per chunk, with positions counted from each row's first token.
    """
    ids = ids.to(model.device)
    size = prefill_chunk(cache)
    if not size or ids.shape[1] <= size:
        return model(ids, cache=cache, use_cache=True, **kwargs)
    mask = kwargs.pop("attention_mask", None)
    positions = None if mask is None else (mask.long().cumsum(-1) - 1).clamp(min=0)
    for start in range(0, ids.shape[1], size):
        end = start + size
        if mask is not None:
            kwargs.update(attention_mask=mask[:, :end], position_ids=positions[:, start:end])
        out = model(ids[:, start:end], cache=cache, use_cache=True, **kwargs)
    return out


def prefill(model, cache, ids, tokenizer=None, **kwargs):
    """Prefill ``ids`` (1 or B, T) (``forward_prompt``), then the context pass when the cache needs one;
    returns the (last) forward's output (its logits saw the uncompressed prompt, as any prefill's do)."""
    out = forward_prompt(model, cache, ids, **kwargs)
    if needs_context_pass(cache):
        compress_context(model, cache, ids, tokenizer, kwargs.get("attention_mask"))
    return out


def after_prefill(model, tokenizer=None):
    """A callable ``(cache, ids)`` that runs ``compress_context`` when the cache needs it, else nothing (for
    loops that do their own prefill: prefix perplexity, speed)."""

    def run(cache, ids) -> None:
        if needs_context_pass(cache):
            compress_context(model, cache, ids, tokenizer)

    return run
