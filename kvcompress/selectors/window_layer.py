"""The cache layer of ``sliding_window`` (StreamingLLM, Xiao et al., arXiv 2309.17453): sinks and a window.

Past the budget a decode step evicts one token, and it does so in place (O(1) in the context) wherever
the storage can move a token (``Store.can_refill``): the newest token moves into the evicted one's slot.
The step's attention reads every stored token, the evicted one included, so the move is settled at the
next look at the layer (``settle``); until then the evicted token's bytes sit in the buffer's counted
headroom and are never read again.

- Without padding the window is a ring: the slot to evict is known without looking (``_oldest``).
- With padding (or on a model's windowed layer) stored order is given up for tracked positions, and the
  token to evict is the lowest ``_priority_by_position``, per row.
- Elsewhere (storage that cannot move a token, several tokens over the budget) the kept tokens are copied.
"""

from __future__ import annotations

import torch

from kvcompress.core.layer import PolicyLayer


class SlidingWindowLayer(PolicyLayer):
    """Evicts after each step so that at most ``sink_tokens + window`` tokens stay stored."""

    grouped_decode = (
        True  # a decode query attends as other eviction layers do (``torch_attention.decode_attention``)
    )
    reads_as_stored = False  # its step selects what is read (``compress``/``attend``)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending: int | torch.Tensor | None = None  # slot (int, or (B, 1, 1)) to settle
        self._oldest = 0  # ring offset: the window's oldest token is at slot ``sink_tokens + _oldest``

    def compress(self, keys, values) -> None:
        total, budget = self.stored_length(), self.policy.budget
        if total <= budget:
            return
        if self.pos is None and self.valid is not None and not self.evicted:
            self._track_positions(total)
        one = total == budget + 1 and self.probe is None and self.store.can_refill()
        if self.pos is not None:  # stored order does not matter: positions decide
            prio = self._priority_by_position()
            if one:
                self._pending, self.evicted = prio.argmin(-1, keepdim=True), self.evicted + 1
            else:
                self.keep(prio.topk(budget, dim=-1).indices)
            return
        if one and self.valid is None:
            self._pending, self.evicted = self.policy.sink_tokens + self._oldest, self.evicted + 1
            self._oldest = (self._oldest + 1) % self.policy.window
            return
        self._unrotate()
        if self.valid is None:  # no padding: sinks are the first tokens, two slices
            self.keep_spans([(0, self.policy.sink_tokens), (total - self.policy.window, total)])
            return
        self.keep(self._priority(total).topk(budget, dim=-1).indices)

    def _track_positions(self, total: int) -> None:
        """Start tracking positions (int32 per stored token, counted) while stored order still tells them:
        nothing was evicted, so the stored tokens are the first ``total`` consumed."""
        b = self.valid.shape[0]
        self.pos = torch.arange(total, dtype=torch.int32, device=self.device).expand(b, 1, total).clone()
        self.track = True

    def _priority(self, total: int) -> torch.Tensor:
        """Per row (B, 1, T), stored in order: sinks (first real tokens) > recent window > older real
        tokens > padding."""
        valid = self.valid[:, :1]  # validity is shared by heads for this policy
        t = torch.arange(total, device=self.device)
        rank = valid.cumsum(-1)
        sink = valid & (rank <= self.policy.sink_tokens)
        recent = t >= total - self.policy.window
        return _rank(valid, sink, recent, t.float() / total)

    def _priority_by_position(self) -> torch.Tensor:
        """``_priority`` from positions (B, 1, T), in any stored order. The last ``window`` tokens consumed
        are the recent ones: a real one among them is never evicted, and padding never counts."""
        pos = self.pos[:, :1]
        valid = torch.ones_like(pos, dtype=torch.bool) if self.valid is None else self.valid[:, :1]
        sink = torch.zeros_like(valid)
        if self.policy.sink_tokens:
            real = torch.where(valid, pos.float(), torch.inf)
            k = min(self.policy.sink_tokens, pos.shape[-1])
            sink = valid & (real <= real.kthvalue(k, dim=-1, keepdim=True).values)
        return _rank(valid, sink, pos >= self.seen - self.policy.window, pos.float() / self.seen)

    def settle(self) -> None:
        """Carry out the last step's eviction (after that step's attention read the token)."""
        if self._pending is None:
            return
        slot, self._pending = self._pending, None
        if not self.store.can_refill():  # buffers it does not own (a copy.deepcopy): the same move, copied
            self.store.keep(_moved_order(slot, self.store.length, self.device))
        elif isinstance(slot, int):
            self.store.refill(slot)
        else:
            self.store.drop_one(slot)  # (B, 1, 1): each row's own slot
        if not isinstance(slot, int):
            self.move_newest(slot, ("valid", "pos"))

    def _unrotate(self) -> None:
        """Put a rotated ring back in stored order (sinks, window oldest first, newer tokens): one copy,
        only when decode by ring is followed by a step the ring does not serve."""
        if not self._oldest:
            return
        sinks, window, total = self.policy.sink_tokens, self.policy.window, self.stored_length()
        at = sinks + self._oldest
        spans = [(0, sinks), (at, sinks + window), (sinks, at), (sinks + window, total)]
        order = torch.cat([torch.arange(a, b, device=self.device) for a, b in spans])
        self._oldest = 0
        if self.valid is not None:  # padding came after the ring turned: reorder its validity alike
            self.valid = self.valid[..., order]
        self.store.keep(order.view(1, 1, -1))  # no positions are tracked on the ring

    # -- every look from outside the step settles first ----------------------------------------
    def step(self, key_states, value_states, positions=None, forward=None):
        self.settle()
        return super().step(key_states, value_states, positions, forward)

    def stored_length(self) -> int:
        self.settle()
        return super().stored_length()

    @property
    def keys(self):
        self.settle()
        return self.store.keys

    @property
    def values(self):
        self.settle()
        return self.store.values

    def tensors(self):
        self.settle()
        return super().tensors()

    def positions(self) -> torch.Tensor:
        self.settle()
        return super().positions()

    def reorder_cache(self, beam_idx) -> None:
        self.settle()
        super().reorder_cache(beam_idx)

    def reset(self) -> None:
        super().reset()
        self._pending, self._oldest = None, 0


def _rank(valid, sink, recent, older) -> torch.Tensor:
    """Sinks > recent window > older real tokens (newer first: ``older`` in [0, 1)) > padding."""
    return valid * (1.0 + older) + recent * 2.0 * valid + sink * 4.0


def _moved_order(slot: int | torch.Tensor, total: int, device) -> torch.Tensor:
    """Stored order (1 or B, 1, total - 1) after the newest token moved into ``slot`` (int or (B, 1, 1))."""
    order = torch.arange(total, device=device)
    if isinstance(slot, int):
        order[slot] = total - 1
        return order[: total - 1].view(1, 1, -1)
    order = order.expand(slot.shape[0], 1, total).scatter(-1, slot, total - 1)
    return order[..., : total - 1]
