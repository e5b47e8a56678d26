"""Fidelity of a policy cache to the uncompressed one, per layer and KV head, at one decode step.

Two caches see the same tokens in lockstep: ``full`` and the policy's. A ``Recorder`` watches every layer
of one cache (``PolicyLayer.watch``) and, on measured steps, keeps what the step's last query read:

- full: its attention probabilities over absolute positions (B, H_kv, T) (averaged over each KV group's
  query heads) and its attention output;
- policy: the positions its attention read and was allowed to see (B, H_kv, T'), its output, and the
  relative error of the keys/values it read against the exact ones its own run produced (kept in a
  shadow dense store: quantized or low-rank storage counts as held, its reconstruction error shows here).

``compare_step`` turns the two into attention recall (the share of full's attention mass on positions the
policy still holds: the cache hit rate), output error (relative L2 of the attention output against
full's) and the mass full put on each position the policy had dropped. Everything is O(T) per layer and
step: only the last query's scores are computed, never T x T. ``logit_divergence`` gives KL(full||policy)
and top-1 agreement of next-token distributions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcompress.core.torch_attention import window_scores
from kvcompress.storage import DenseStorage

TINY = 1e-30


class Recorder:
    """Watches every layer of ``cache``; ``measure`` turns recording on for the next forwards.

    Args:
        role: ``"full"`` (the reference: records probabilities) or ``"policy"`` (records what it held and,
            with ``exact=True``, keeps a shadow of its exact keys/values for reconstruction errors).
    """

    def __init__(self, cache, role: str, exact: bool = True):
        if role not in ("full", "policy"):
            raise ValueError(f"Recorder role={role!r}; allowed: ['full', 'policy']")
        self.role, self.measure, self.records = role, False, {}
        self.shadow = {} if role == "policy" and exact else None
        for layer in cache.layers:
            layer.watch(self)

    def stored(self, layer, keys, values) -> None:
        """Called by ``PolicyLayer.update`` with the step's exact keys/values (B, H_kv, q, D)."""
        if self.shadow is None:
            return
        store = self.shadow.get(layer.layer_idx)
        if store is None:
            store = self.shadow[layer.layer_idx] = DenseStorage().layer(layer.layer_idx, layer.spec)
        store.append(keys, values)

    def attended(self, layer, query, key, value, mask, scaling: float, out) -> None:
        """Called by the attention function: query (B, H, q, D), key/value (B, H_kv, T, D) as read, the
        boolean mask (B or 1, h, q, T) or None, the output (B, q, H, D)."""
        if not self.measure:
            return
        pos, allowed = read_set(layer, key, mask)
        rec = {"seen": layer.seen, "pos": pos, "allowed": allowed, "out": _grouped(out[:, -1], key.shape[1])}
        if self.role == "full":
            probs = window_scores(query[:, :, -1:], key, scaling, allowed)[:, :, 0]  # (B, H_kv, T)
            rec["probs"] = _absolute(probs, pos, allowed, layer.seen)
        elif self.shadow is not None:
            exact_k, exact_v = self.shadow[layer.layer_idx].read()  # (B, H_kv, seen, D)
            rec["key_error"] = _rel_error(key, _at(exact_k, pos), allowed)
            rec["value_error"] = _rel_error(value, _at(exact_v, pos), allowed)
        self.records[layer.layer_idx] = rec

    def take(self) -> dict[int, dict]:
        out, self.records = self.records, {}
        return out


def read_set(layer, key, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (B, H_kv, T) int64 of the keys attention read, and which the step's last query could see."""
    b, h_kv, t, _ = key.shape
    pos = layer.read_pos
    if pos is None or pos.shape[-1] != t:
        raise RuntimeError(
            f"layer {layer.layer_idx} ({type(layer).__name__}): positions of the {t} keys read are unknown "
            f"(got {None if pos is None else tuple(pos.shape)}); the layer must set read_pos in attend()"
        )
    pos = pos.expand(b, h_kv, t).long()
    if mask is None:  # plain causal: the last query sees every key read
        return pos, torch.ones(b, h_kv, t, dtype=torch.bool, device=key.device)
    m = mask[:, :, -1, :]  # (B or 1, 1 or H_kv or H, T)
    if m.shape[1] not in (1, h_kv):
        m = m[:, :: m.shape[1] // h_kv]  # per query head, expanded from KV heads: one per group
    return pos, m.expand(b, h_kv, t)


def _grouped(out: torch.Tensor, h_kv: int) -> torch.Tensor:
    """Output (B, H, D) of the last query as (B, H_kv, g * D) float32: the query heads of each KV group."""
    return out.reshape(out.shape[0], h_kv, -1).float()


def _absolute(probs, pos, allowed, seen: int) -> torch.Tensor:
    """Probabilities (B, H_kv, T) at stored slots -> (B, H_kv, seen) at absolute positions."""
    out = torch.zeros(*probs.shape[:2], seen + 1, dtype=torch.float32, device=probs.device)
    out.scatter_add_(-1, pos.masked_fill(~allowed, seen), probs * allowed)
    return out[..., :seen]


def _at(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rows ``pos`` (B, H_kv, T) of ``x`` (B, H_kv, S, D)."""
    return x.gather(2, pos.clamp(max=x.shape[2] - 1)[..., None].expand(-1, -1, -1, x.shape[-1]))


def _rel_error(read: torch.Tensor, exact: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Relative L2 error (B, H_kv) of ``read`` against ``exact`` (B, H_kv, T, D) over the allowed keys."""
    w = allowed[..., None]
    diff = ((read.float() - exact.float()) * w).pow(2).sum((-1, -2))
    return (diff / (exact.float() * w).pow(2).sum((-1, -2)).clamp_min(TINY)).sqrt()


def held_mask(rec: dict, seen: int) -> torch.Tensor:
    """(B, H_kv, seen) bool: the absolute positions the policy read and its last query could see."""
    pos, allowed = rec["pos"], rec["allowed"]
    held = torch.zeros(*pos.shape[:2], seen + 1, dtype=torch.bool, device=pos.device)
    held.scatter_(-1, pos.masked_fill(~allowed, seen), True)
    return held[..., :seen]


def compare_step(full: dict[int, dict], policy: dict[int, dict]) -> dict[str, torch.Tensor]:
    """Per layer and KV head (L, H_kv), batch-averaged: ``recall``, ``output_error``, ``key_error``,
    ``value_error`` (zeros without a shadow); ``attention`` (L, H_kv, seen): full's attention at absolute
    positions, ``dropped``: the part of it on positions the policy did not hold.

    Recall is ``1 - dropped / total`` so that holding everything gives exactly 1.
    """
    layers = sorted(full)
    if layers != sorted(policy):
        raise RuntimeError(f"fidelity: layers recorded differ (full {layers}, policy {sorted(policy)})")
    rows = {k: [] for k in ("recall", "output_error", "key_error", "value_error", "attention", "dropped")}
    for i in layers:
        f, p = full[i], policy[i]
        if f["seen"] != p["seen"]:
            raise RuntimeError(f"fidelity: layer {i} saw {p['seen']} tokens, full saw {f['seen']}")
        probs = f["probs"]  # (B, H_kv, seen)
        dropped = probs * ~held_mask(p, f["seen"])
        rows["recall"].append(1 - dropped.sum(-1) / probs.sum(-1).clamp_min(TINY))
        err = (p["out"] - f["out"]).norm(dim=-1) / f["out"].norm(dim=-1).clamp_min(TINY)
        rows["output_error"].append(err)
        zero = torch.zeros_like(err)
        rows["key_error"].append(p.get("key_error", zero))
        rows["value_error"].append(p.get("value_error", zero))
        rows["attention"].append(probs)
        rows["dropped"].append(dropped)
    return {k: torch.stack(v).mean(1) for k, v in rows.items()}  # (L, B, ...) -> (L, ...)


def logit_divergence(full_logits: torch.Tensor, policy_logits: torch.Tensor):
    """KL(full || policy) and top-1 agreement (B, q) of next-token distributions from logits (B, q, V)."""
    lf = F.log_softmax(full_logits.float(), dim=-1)
    lp = F.log_softmax(policy_logits.float(), dim=-1)
    kl = F.kl_div(lp, lf, log_target=True, reduction="none").sum(-1)
    return kl, lf.argmax(-1) == lp.argmax(-1)


class Lockstep:
    """A ``full`` cache and a policy cache watched together; ``step()`` compares their last forwards."""

    def __init__(self, full_cache, policy_cache, exact: bool = True):
        self.full = Recorder(full_cache, "full")
        self.policy = Recorder(policy_cache, "policy", exact)

    def measure(self, on: bool) -> None:
        self.full.measure = self.policy.measure = on

    def step(self) -> dict[str, torch.Tensor]:
        return compare_step(self.full.take(), self.policy.take())
