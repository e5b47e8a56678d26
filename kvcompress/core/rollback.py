"""Rolling back the newest tokens (``Cache.crop``): what assisted and prompt-lookup decoding need.

transformers' assisted decoding runs one forward over the draft's candidate tokens, keeps those the model
agrees with and crops the rest: ``cache.crop(-n)`` must leave the cache exactly as if the rejected tokens
had never come. A layer can promise that only when nothing it decided depended on them:

- its selector keeps no state that every query updates (H2O's accumulated attention, TOVA's and block
  eviction's decode-time choices, a Quest page summary that already covers them): ``never_crops``;
- no eviction happened since they were stored (``tail_tokens``: the newest tokens stored as they came,
  reset by any eviction, the model's own window included);
- no padding is stored (crop removes the same tokens from every row);
- and the storage can give them back as they were (``Store.crop_refusal``): dense always; quant and
  low_rank while they sit in the exact residual window and no encoding step would have gone otherwise
  without them; offload while they are in the hot tail and no page went cold because of them.

Anything else is refused by name (a ``ValueError`` saying which policy, which layer and why), never
approximated.
"""

from __future__ import annotations


class Rollback:
    """Mixin of ``PolicyLayer``: ``crop`` and the checks behind it."""

    def never_crops(self) -> str | None:
        """Why this layer's selector can never roll back tokens (its state already holds every query's
        effect), or None. Selectors whose decisions depend on decode queries override it."""
        return None

    def crop_conditions(self) -> list[str]:
        """When ``crop`` succeeds for a layer that can roll back, in words (for the docs' table)."""
        mine = {
            "never": [],
            "prefill": ["no eviction since the rejected tokens came (a verification forward over the budget "
                        "is a step of several tokens, which a prefill-time selector compresses)"],
        }.get(self.policy.evicts, ["no eviction since the rejected tokens came"])  # fmt: skip
        return mine + self.store.crop_conditions()

    def crop_refusal(self, n: int) -> str | None:
        """Why the newest ``n`` tokens cannot be removed now, or None when ``crop(-n)`` is exact."""
        why = self.never_crops()
        if why:
            return why
        if self.in_context_pass:
            return "a context pass is running"
        tail = self.tail_tokens if self.evicted == self.tail_evicted else 0
        if n > tail:
            return (
                f"only its newest {tail} tokens were stored as they came (an eviction since then was "
                "decided with the others in view)"
            )
        if self.valid is not None:
            return "padding is stored (crop removes the same tokens from every row)"
        return self.store.crop_refusal(n)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens (transformers' convention: a negative count, 0 a
        no-op), exactly: the layer is then as if they had never come. Refused by name where it cannot be
        (``crop_refusal``)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative count, the number of newest tokens to remove"
            )
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        self.end_deferred()
        why = self.crop_refusal(n)
        if why:
            raise ValueError(
                f"policy {self.policy.name!r} (layer {self.layer_idx}, storage {self.store.config.name}) "
                f"cannot roll back its newest {n} tokens, as assisted and prompt-lookup decoding need: {why}"
            )
        self.cut(n)

    def end_deferred(self) -> None:
        """A step whose attention read codes ends now (the store's flush), so ``crop_refusal`` sees the
        state a crop would change."""
        if self.deferred:
            self.deferred = False
            self.end_step()

    def cut(self, n: int) -> None:
        """Remove the newest ``n`` tokens, once ``crop_refusal(n)`` said None."""
        t = self.stored_length() - n
        self.store.crop(n)
        for name in ("valid", "pos", *self.per_token):
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, x[..., :t])
        self.seen -= n
        self.tail_tokens -= n

    @property
    def is_croppable(self) -> bool:
        """Whether this layer can ever roll back (``never_crops`` is None); transformers asks it."""
        return self.never_crops() is None
