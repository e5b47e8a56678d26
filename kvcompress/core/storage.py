"""The storage axis: how a layer holds the tokens its selector keeps.

A ``Storage`` is a small config dataclass (its fields are its Hydra config, ``conf/storage/<name>.yaml``);
``layer()`` builds one ``Store`` per decoder layer. Selectors (``kvcompress.selectors``) talk to a store only
through the interface below, so every selector runs over every storage, or ``refuses`` says why not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcompress.core.fields import refuse_renamed, validate
from kvcompress.core.spec import ModelSpec, Shape

KINDS = ("keys", "values")


@dataclass
class Storage:
    """Base of storage configs. Subclasses set ``name`` and ``store_class`` and add fields.

    Class attributes read by the generic tests: ``TEST_PARAMS`` (small variants that really compress a
    48-token test sequence), ``FUZZ`` (field -> ``(lo, hi)`` int range, list of choices, or a value) and
    ``MAX_MEMORY_RATIO`` (bytes allowed over dense storage's for the storage's own per-token state, while it
    still holds every token exactly; it adds to the selector's allowance).
    """

    name: ClassVar[str] = "storage"
    store_class: ClassVar[type] = None
    TEST_PARAMS: ClassVar[list[dict]] = [{}]
    FUZZ: ClassVar[dict] = {}
    MAX_MEMORY_RATIO: ClassVar[float] = 1.0
    FORMULA: ClassVar[bool] = False  # True in a class whose bytes_for describes it exactly

    def __new__(cls, *args, **kwargs):
        """Refuse a removed field by name, saying what replaced it, before the dataclass sees it."""
        self = super().__new__(cls)
        refuse_renamed(cls.name, {f.name for f in dataclasses.fields(cls)}, kwargs, "storage")
        return self

    def __post_init__(self):
        validate(self, self.name)

    def check(self, spec: ModelSpec) -> None:
        """Validate fields against the model (e.g. a group size that must divide head_dim)."""

    def prepare(self, model) -> None:
        """Called once by ``build_cache`` before layers are built (calibration)."""

    def refuses(self, selector, kinds: tuple[str, ...] = KINDS) -> str | None:
        """Why this storage cannot serve ``selector`` (a ``Policy``) for ``kinds``, or None when it can."""
        return None

    def covering(self, n_tokens: int) -> Storage:
        """A copy that stores ``n_tokens`` tokens exactly (no quantization or projection yet)."""
        return self

    def layer(self, layer_idx: int, spec: ModelSpec, kinds: tuple[str, ...] = KINDS) -> Store:
        """The store of one decoder layer, holding ``kinds`` (keys and values, or one of them)."""
        return self.store_class(self, layer_idx, spec, kinds)

    def describe(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}

    # -- memory formula ---------------------------------------------------------------------
    def bytes_for(self, s: Shape, tokens: int) -> int | None:
        """Bytes one layer holds for ``tokens`` stored tokens when the newest ones are the most recent
        (no eviction inside a residual window); None when not determined by the count alone."""
        return s.kv(tokens)

    def kind_bytes(self, s: Shape, tokens: int, kind: str) -> int | None:
        """Bytes of one kind (``keys`` or ``values``): half of ``bytes_for`` where both are held alike."""
        both = self.bytes_for(s, tokens)
        return None if both is None else both // 2

    def fixed_bytes(self, s: Shape, layer_idx: int) -> int:
        """Per-layer constants held whatever the tokens (a low-rank basis)."""
        return 0

    @property
    def count_exact(self) -> bool:
        """Whether ``bytes_for`` holds under any eviction pattern (False when a residual window exists)."""
        return True


class Store:
    """One layer's tokens. Keys/values enter and leave as ``(B, H_kv, T, D)`` in the model dtype.

    Interface used by selectors: ``append``, ``read``, ``keep`` (an index set, per row and head),
    ``keep_spans``/``drop_one`` (fast paths, optional), ``flush`` (end of a step), ``tensors``. A store may
    hold one kind only (``kinds``): it then ignores the other in ``append`` and reads it as None.
    """

    # why the batch cannot change size (batch_repeat_interleave / batch_select_indices), or None
    fixed_rows: str | None = None
    compact = False  # True: this store may offer a compact read (``attends_codes`` says when it can)

    def __init__(self, config: Storage, layer_idx: int, spec: ModelSpec, kinds: tuple[str, ...] = KINDS):
        self.config, self.layer_idx, self.spec, self.kinds = config, layer_idx, spec, tuple(kinds)

    @property
    def keeps_exactly(self) -> bool:
        """Whether ``keep`` after ``flush`` moves encoded tokens without encoding them again. A store that
        cannot (per-channel groups shared by several tokens) is flushed by a prefill-time selector only
        once its evictions are over (``PolicyLayer.end_step``)."""
        return True

    @property
    def length(self) -> int:
        raise NotImplementedError

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Store this step's tokens (B, H_kv, q, D) after those already held. ``positions`` (B or 1, q): the
        absolute positions the model rotated these keys at, or None (consecutive after the last ones)."""
        raise NotImplementedError

    def read(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Dense keys and values (B, H_kv, T, D) of every stored token, for this step's attention (None for
        a kind this store does not hold)."""
        raise NotImplementedError

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only tokens ``idx`` (B, 1 or H_kv, k), ascending; the others' storage is freed."""
        raise NotImplementedError

    def keep_pairs(self, pairs: torch.Tensor) -> None:
        """Keep (token, head) pairs ``pairs`` (B, N), pair ``t * H + h``, in one flat token axis (B, 1, N, D)
        (head-adaptive budgets); dense storage only."""
        raise NotImplementedError(f"storage {self.config.name} cannot hold heads of different lengths")

    def keep_spans(self, spans: list[tuple[int, int]]) -> None:
        """Keep the token ranges ``[a, b)`` (the same in every row and head)."""
        device = self.read_device()
        idx = torch.cat([torch.arange(a, b, device=device) for a, b in spans])
        self.keep(idx.view(1, 1, -1))

    def drop_one(self, slot: torch.Tensor) -> bool:
        """Evict token ``slot`` (B, 1 or H_kv, 1) by moving the newest into its place; False when the store
        cannot (the caller then uses ``keep``)."""
        return False

    def can_refill(self) -> bool:
        """Whether ``refill`` can evict one token in place now (a buffer this store owns, with headroom)."""
        return False

    def can_evict_one(self) -> bool:
        """Whether ``evict_one`` may evict a token in place now (False: the caller uses ``keep``)."""
        return self.can_refill()

    def evict_one(self, slot: torch.Tensor) -> int | torch.Tensor | None:
        """Evict token ``slot`` (B, 1 or H_kv, 1) of every row and head in place (stored order not kept).
        Returns the stored index (an int, or (B, 1 or H_kv, 1) as ``slot``) whose entry now sits in ``slot``,
        the entries after it having moved one down (the layer's per-token state follows), or None, doing
        nothing, when it cannot. Here: the newest token moves into the hole (``drop_one``)."""
        t = self.length
        return t - 1 if self.drop_one(slot) else None

    def refill(self, slot: int) -> None:
        """Evict token ``slot`` of every row and head by moving the newest token into its place: O(1), the
        stored order is not kept. Only after ``can_refill()`` said True."""
        raise NotImplementedError(f"{type(self).__name__} cannot evict in place")

    def attends_codes(self) -> bool:
        """Whether a decode query can attend from what is stored without a dense ``read`` (then
        ``compact_read()`` says what to read: a ``kvcompress.core.plan`` read a backend runs)."""
        return False

    def compact_read(self):
        raise NotImplementedError(f"{type(self).__name__} has no compact read")

    # flush(valid): end of a step, compress what waited in full precision (quantize, project, page out).
    # ``valid`` (B, 1 or H_kv, T) marks the stored tokens that are padding (False), or None without padding.
    # None: a store that compresses nothing later (dense); the layer's step then calls nothing.
    flush = None

    def crop_refusal(self, n: int) -> str | None:
        """Why the newest ``n`` tokens cannot be removed exactly (``crop``), or None when they can."""
        return f"storage {self.config.name} cannot remove tokens"

    def crop_conditions(self) -> list[str]:
        """When ``crop_refusal`` says None, in words (empty: always)."""
        return []

    def crop(self, n: int) -> None:
        """Remove the newest ``n`` tokens as if they had never been appended (after ``crop_refusal``)."""
        raise NotImplementedError(self.crop_refusal(n))

    def reorder(self, beam_idx: torch.Tensor) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor | None]:
        """Every tensor held, per-layer constants included."""
        raise NotImplementedError

    def fixed_tensors(self) -> list[torch.Tensor]:
        """Per-layer constants (shared by every sequence), reported apart from per-token bytes."""
        return []

    def loaded(self) -> None:
        """Called once ``load_cache`` has put a file's state back: rebuild what a file does not keep (a
        file holds contiguous tensors, so a constant laid out for a kernel is laid out again here)."""

    def shared_tensors(self) -> list[torch.Tensor]:
        """Tensors held beside the model and outside ``tensors()``: shared by every layer and cache of the
        policy, they depend on no cached token (the pre-RoPE rotary table); reported as ``shared_bytes``."""
        return []

    def stats(self) -> dict:
        return {"storage": self.config.name}

    def read_device(self) -> torch.device:
        return next(t for t in self.tensors() if t is not None).device


def take_rows(x, rows: torch.Tensor):
    """Rows ``rows`` (B',) of ``x`` along dim 0: a tensor, None, or a tuple or named tuple of them. The one
    reorder of every per-row state (beam search: which sequence each row continues)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.index_select(0, rows.to(x.device))
    items = [take_rows(t, rows) for t in x]
    return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)


def reorder_all(obj, names, rows: torch.Tensor) -> None:
    """``take_rows`` of every attribute ``names`` of ``obj`` (tensors, None, tuples of tensors)."""
    for name in names:
        setattr(obj, name, take_rows(getattr(obj, name), rows))
