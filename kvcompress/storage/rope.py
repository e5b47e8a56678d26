"""The model's own rotary embedding, to un-rotate cached keys to pre-RoPE and rotate them back on read.

RoPE (Su et al., "RoFormer", arXiv 2104.09864) rotates each key by an angle set by its absolute position;
no fixed subspace fits rotated keys, so low-rank caches project pre-RoPE keys (Palu, arXiv 2407.21118;
ShadowKV, arXiv 2410.21465). The model applies ``k * cos + P(k) * sin`` with an orthogonal pairing ``P``
(half split, interleaved, partial rotary dims) and possibly scaled ``cos``/``sin`` (YaRN's attention
factor). Calling the model's own ``apply_rotary_pos_emb`` with ``(cos, -sin) / (cos^2 + sin^2)`` inverts it
exactly whatever the pairing, partial dims or scaling (Llama-3, linear, YaRN), so nothing is re-implemented.
On a CPU, where the model pairs channels by halves (checked on random keys, ``rope_table.matches``), cos/sin
come from one table by position shared by the layers (``rope_table.RopeTable``) instead of the module: the
same values, and the same products and sums as the model's function.
"""

from __future__ import annotations

import inspect
import sys

import torch

from kvcompress.core import kernel_slots
from kvcompress.storage import rope_table
from kvcompress.storage.rope_table import RopeTable

# RoPE types whose frequencies depend on the longest sequence seen so far: a key rotated earlier could not
# be un-rotated with today's frequencies (and the rotary module changes state when called).
STATEFUL_ROPE = ("dynamic", "longrope")


class Rope:
    """One decoder layer's rotary embedding: ``rotate`` / ``unrotate`` keys (B, H_kv, n, D) at ``positions``
    (B, h, n), in float32; ``h`` divides H_kv and each of its rows serves H_kv / h consecutive heads (a block
    of heads sharing one latent keeps the same tokens: their rotation is computed once)."""

    def __init__(self, rotary, apply, layer_type: str | None = None, table: RopeTable | None = None):
        self.rotary, self.apply, self.layer_type = rotary, apply, layer_type
        self.table = table or RopeTable(self._cos_sin)  # cos/sin by position, shared by alike layers
        self._fits: dict[int, bool] = {}  # head_dim -> whether the fused kernel's rotation is the model's

    def __deepcopy__(self, memo):
        return self  # the model's rotation and its table: constants, shared by a cache and its snapshots

    def fits_kernel(self, head_dim: int) -> bool:
        """Whether the fused kernel's half-split rotation equals the model's for ``head_dim`` channels."""
        if head_dim not in self._fits:
            self._fits[head_dim] = rope_table.matches(self, self.table, head_dim)
        return self._fits[head_dim]

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B * h, n, rotary dims) in float32."""
        flat = positions.reshape(-1, positions.shape[-1]).long()
        probe = torch.empty(0, dtype=torch.float32, device=positions.device)
        extra = () if self.layer_type is None else (self.layer_type,)
        cos, sin = self.rotary(probe, flat, *extra)
        return cos.float(), sin.float()

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, halves: bool = False):
        """x (B, H_kv, n, D) turned by cos/sin (B * h, n, ...): the model's function, or with ``halves`` the
        table's rows (rotary dims / 2) through ``rope_table.rotate_halves``, the same products and sums."""
        b, h, n, d = x.shape
        rows = cos.shape[0]  # B * h: each row's cos/sin broadcast over its H_kv / h heads
        flat = x.float().reshape(rows, b * h // rows, n, d)
        if halves:
            return rope_table.rotate_halves(flat, cos[:, None], sin[:, None]).view(b, h, n, d)
        # the model's function rotates a query too: an empty one costs nothing
        return self.apply(flat[:, :0], flat, cos, sin)[1].view(b, h, n, d)

    def _table(self, positions: torch.Tensor, width: int, inverse: bool):
        """The shared table's cos, sin (P, rotary dims / 2), its inverse rows with ``inverse``; None where it
        does not serve (not a CPU, another pairing): the model's module is asked then."""
        if positions.device.type != "cpu" or not self.fits_kernel(width):
            return None
        self.table.covering(1)
        return self.table.inverse() if inverse else (self.table.cos, self.table.sin)

    def _rows(self, positions: torch.Tensor, width: int, inverse: bool):
        """cos, sin (B * h, n, rotary dims / 2) of ``positions`` from the shared table (``_table``), or None
        where it does not serve or does not hold a position yet."""
        table = self._table(positions, width, inverse)
        if table is None:
            return None
        rows, n = positions.numel() // positions.shape[-1], positions.shape[-1]
        flat = positions.reshape(-1)
        try:  # index_select refuses a negative position too (no wrapping)
            return tuple(t.index_select(0, flat).view(rows, n, -1) for t in table)
        except IndexError:  # past the table: the decode kernel extends it as the sequence grows
            return None

    def _by_kernel(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor | None:
        """``_turn`` by the kernel lent for it (``kernel_slots``: the C++ ``rope_latent.turn_keys``, the
        table's rows with the same products and sums as ``rotate_halves``, one call instead of a dozen tensor
        ops per encoded key), or None where none serves (``_table``, a position the table does not hold, no
        compiler)."""
        table = self._table(positions, x.shape[-1], inverse)
        return None if table is None else kernel_slots.first("turn_keys", x, positions, *table)

    def _turn(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
        turned = self._by_kernel(x, positions, inverse) if x.numel() else None
        if turned is not None:
            return turned
        rows = self._rows(positions, x.shape[-1], inverse)
        if rows is not None:
            return self._apply(x, *rows, halves=True)
        cos, sin = self._cos_sin(positions)
        return self._apply(x, *(rope_table.inverted(cos, sin) if inverse else (cos, sin)))

    def rotate_by_module(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``rotate`` through the model's own rotary module and function (the table's reference)."""
        return self._apply(x, *self._cos_sin(positions))

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys (float32) of pre-RoPE keys ``x`` at ``positions``."""
        return self._turn(x, positions, inverse=False)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys (float32) of post-RoPE keys ``x`` at ``positions``: the inverse of ``rotate``."""
        return self._turn(x, positions, inverse=True)


def _decoder(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model


def _attention_modules(decoder) -> dict[int, torch.nn.Module]:
    """Self-attention module of each decoder layer, by ``layer_idx``."""
    found = {}
    for module in decoder.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and type(module).__name__.endswith("Attention"):
            found.setdefault(idx, module)
    return found


def _rotary_module(decoder):
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        rotary = next((m for m in decoder.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    return rotary


def model_ropes(model, num_layers: int) -> list[Rope | None]:
    """Per decoder layer its ``Rope``, or None for a layer without RoPE (NoPE: SmolLM3, Llama-4 layers).

    Raises ``ValueError`` naming the model when its rotary embedding cannot be inverted this way.
    """
    decoder, kind = _decoder(model), getattr(model.config, "model_type", type(model).__name__)
    rotary, attention = _rotary_module(decoder), _attention_modules(decoder)
    if rotary is None or not attention:
        raise ValueError(f"{kind}: no rotary embedding module found, so keys cannot be un-rotated")
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if any(s in rope_type for s in STATEFUL_ROPE):
        raise ValueError(
            f"{kind}: rope_type={rope_type!r} changes its frequencies with the sequence length, so a cached "
            "key cannot be un-rotated exactly later"
        )
    takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    ropes, tables = [], {}
    for i in range(num_layers):
        attn = attention.get(i)
        apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None) if attn else None
        if attn is not None and not getattr(attn, "use_rope", True):
            ropes.append(None)  # a NoPE layer: its keys are never rotated
            continue
        if apply is None:
            raise ValueError(f"{kind}: layer {i} has no apply_rotary_pos_emb beside its attention module")
        layer_type = layer_types[i] if takes_type and layer_types else None
        rope = Rope(rotary, apply, layer_type, tables.get(layer_type))
        tables.setdefault(layer_type, rope.table)  # one table per rotation: layers of a type share it
        ropes.append(rope)
    return ropes
