"""Where a policy diverges from the uncompressed model: attention recall, output error and KL, step by step.

One text streams through the policy cache and, in lockstep on the same tokens, through a ``full`` cache
(``kvcompress.metrics.fidelity``). Every ``every``-th step records, per layer and KV head, the attention
recall (share of full's attention mass on what the policy still holds: its cache hit rate), the relative
error of the attention output against full's and of the keys/values read against the exact ones; every
step records KL(full || policy) and top-1 agreement of the next-token distributions, and the policy's
perplexity (decode mode, as ``task=perplexity`` with the same text options). A step's layer metrics are
those of its last query (O(T) per layer, no T x T). Writes ``fidelity.json`` and heat maps in the run
folder; ``results.json`` gets the one-line summary.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvcompress.core.cache import build_cache
from kvcompress.harness.guard import check_fits
from kvcompress.harness.tasks.fidelity_report import summarize, write_outputs
from kvcompress.harness.tasks.perplexity import text_tokens
from kvcompress.metrics.compression import (
    attention_backends,
    compression_check,
    full_cache_bytes,
    read_ratio,
    tokens_evicted,
)
from kvcompress.metrics.fidelity import Lockstep, logit_divergence
from kvcompress.metrics.perplexity import NonFiniteError, _check_prefix
from kvcompress.resources.data import load_text
from kvcompress.runtime.context_pass import after_prefill
from kvcompress.storage.low_rank.calibration_text import cache_spans, check_disjoint, text_span

METRICS = ("recall", "output_error", "key_error", "value_error")


def check_model(model) -> None:
    """Recall is computed from softmax(q k / sqrt(d)); refuse models whose attention adds to it."""
    cfg = model.config.get_text_config(decoder=True)
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            "task=fidelity: the model soft-caps attention logits (attn_logit_softcapping); attention recall "
            "from plain softmax scores would be wrong for it"
        )


def check_every(every) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"task.every={every!r} must be an integer >= 1 (measure layers every n-th step)")
    return every


@torch.inference_mode()
def stream(model, ids, full, cache, cfg, after_prefix=None) -> dict:
    """Feed ``ids`` (1, N) through both caches in lockstep; returns the per-step trace and the policy's NLL.

    ``cfg``: ``chunk_size``, ``prefix_tokens`` (one unscored prefill, as prefix perplexity), ``every``.
    """
    n, every = ids.shape[1], check_every(cfg.get("every", 1))
    first = _check_prefix(cfg.get("prefix_tokens"), n)
    probes = Lockstep(full, cache)
    if first:
        model(ids[:, :first], cache=full, use_cache=True, logits_to_keep=1)
        model(ids[:, :first], cache=cache, use_cache=True, logits_to_keep=1)
        if after_prefix is not None:
            after_prefix(cache, ids[:, :first])
    trace = {"token": [], "kl": [], "top1": [], "layer_step": [], **{k: [] for k in METRICS}}
    nll = nll_full = 0.0
    starts = range(first, n - 1, cfg.chunk_size)
    for step, start in enumerate(tqdm(starts, desc="fidelity", disable=not cfg.get("progress", True))):
        chunk = ids[:, start : min(start + cfg.chunk_size, n - 1)]
        probes.measure(step % every == 0)
        lf = model(chunk, cache=full, use_cache=True).logits
        lp = model(chunk, cache=cache, use_cache=True).logits
        if not torch.isfinite(lp).all():
            raise NonFiniteError(start)
        targets = ids[:, start + 1 : start + 1 + chunk.shape[1]]
        nll += F.cross_entropy(lp[0].float(), targets[0], reduction="sum").item()
        nll_full += F.cross_entropy(lf[0].float(), targets[0], reduction="sum").item()
        kl, top1 = logit_divergence(lf, lp)
        trace["token"] += range(start, start + chunk.shape[1])
        trace["kl"] += kl[0].tolist()
        trace["top1"] += top1[0].tolist()
        if step % every == 0:
            layers = probes.step()
            trace["layer_step"].append(start + chunk.shape[1] - 1)  # the measured (last) query's position
            for k in METRICS:
                trace[k].append(layers[k].tolist())
    probes.measure(False)
    trace["nll"] = nll / max(len(trace["kl"]), 1)
    trace["nll_full"] = nll_full / max(len(trace["kl"]), 1)
    return trace


def run(model, tokenizer, policy, cfg, out_dir=None) -> dict:
    """The summary (recall, KL, top-1, perplexity, bytes) for ``results.json``; ``fidelity.json`` and plots
    in ``out_dir``."""
    check_model(model)
    offset = cfg.get("offset_tokens", 0)
    ids = text_tokens(
        tokenizer, cfg.text, cfg.max_tokens, offset, getattr(model.config, "max_position_embeddings", 0)
    )
    check_fits(model, cfg.max_tokens, chunk=max(cfg.chunk_size, cfg.get("prefix_tokens") or 0))
    full, cache = build_cache("full", model), build_cache(policy, model)
    spans = cache_spans(cache)
    chars = functools.partial(text_span, tokenizer, load_text(cfg.text), offset, offset + cfg.max_tokens)
    check_disjoint(spans, cfg.text, chars, f"task=fidelity (max_tokens={cfg.max_tokens})")
    trace = stream(model, ids, full, cache, cfg, after_prefill(model, tokenizer))
    metrics = summarize(trace)
    metrics.update(
        perplexity=math.exp(trace["nll"]),
        nll=trace["nll"],
        full_perplexity=math.exp(trace["nll_full"]),  # the lockstep full cache on the same scored tokens
        chunk_size=cfg.chunk_size,
        prefix_tokens=cfg.get("prefix_tokens"),
        every=cfg.get("every", 1),
        cache_bytes=cache.memory_bytes(),
        full_cache_bytes=full_cache_bytes(model, ids.shape[1] - 1),
        calibration_ranges=spans,
    )
    metrics["cache_ratio"] = metrics["cache_bytes"] / metrics["full_cache_bytes"]
    metrics |= _acted(policy, cache, metrics)
    if out_dir is not None:
        write_outputs(trace, metrics, out_dir, title=f"{policy.name} {_params(policy)}")
    return metrics


def _acted(policy, cache, metrics: dict) -> dict:
    """Did the policy change anything: evicted, held fewer bytes, or (Quest) read fewer tokens than full; a
    warning only when none of these (``metrics.compression``)."""
    held = (metrics["cache_bytes"], metrics["full_cache_bytes"])
    hint = "Set a budget below task.max_tokens, or task.prefix_tokens for prefill-time policies."
    check = compression_check(policy.name, tokens_evicted(cache), *held, hint, read_ratio(cache))
    return check | {"attention_backends": attention_backends(cache)}


def _params(policy) -> str:
    d = policy.describe()
    return " ".join(f"{k}={v}" for k, v in d.items() if k not in ("name", "storage") and v is not None)
