"""One layer of low-rank storage: coefficients in calibrated bases, keys optionally pre-RoPE.

Keys arrive rotated by RoPE. With a ``Rope`` they are un-rotated at their own absolute positions before the
projection, the pre-RoPE latent is cached, and reads rotate the reconstruction back at the same positions
(Palu, arXiv 2407.21118; ShadowKV, arXiv 2410.21465). Bases are float32 whatever the model dtype, so full
rank reproduces the keys to the precision of the stored coefficients.
"""

from __future__ import annotations

import torch

from kvcompress.core.buffers import storage_bytes
from kvcompress.core.latents import rebuild, to_blocks
from kvcompress.core.plan import Latent
from kvcompress.storage.residual import ResidualStore


def _own(maps: tuple, by_component: bool = False) -> tuple:
    """Float32 copies with their own storage (not views of the whole calibration); one shared copy when
    encoder and decoder are the same tensor (plain PCA). With ``by_component`` the decoder (G, g * D, R) is
    laid out component by component in memory, as the pre-RoPE kernel reads it (``decoder.mT`` is then
    contiguous: no decode step transposes it); the matrix products take either layout."""

    def own(m: torch.Tensor, rows: bool) -> torch.Tensor:
        m = m.float().mT if rows else m.float()
        m = m.clone(memory_format=torch.contiguous_format)
        return m.mT if rows else m

    dec = own(maps[1], by_component)
    return (dec if maps[0] is maps[1] else own(maps[0], False)), dec


class LowRankStore(ResidualStore):
    """Coefficients (B, G, T_c, r) per kind (int8 codes plus a scale (B, G, T_c, 1) if asked), the exact
    residual window (B, H_kv, T_r, D), the layer's maps ``encoder[kind]`` / ``decoder[kind]``
    (G, g * D, r) float32 (one tensor for plain PCA), and with a ``rope`` the stored tokens' positions
    (B, H_kv, T) int32."""

    grows_in_place = True  # a decode step appends one latent instead of copying them all

    def __init__(self, config, layer_idx, spec, kinds, bases: dict, rope=None):
        super().__init__(config, layer_idx, spec, kinds)
        self.rope = rope if "keys" in kinds else None
        maps = {kind: _own(bases[kind], kind == "keys" and self.rope is not None) for kind in kinds}
        self.encoder = {kind: m[0] for kind, m in maps.items()}
        self.decoder = {kind: m[1] for kind, m in maps.items()}
        self.needs_positions = config.keys == "pre_rope" and "keys" in kinds  # also on NoPE layers: bytes
        self.dtype = None  # of the model's keys: coefficients and scales are stored in it
        self.counts = {"rope_kernel_steps": 0}  # decode steps whose pre-RoPE logits the C++ kernel computed
        self._maps_on: torch.device | None = None  # where the maps were last checked to be (any other device
        # a step's keys arrive on is checked again)

    def append(self, keys, values, positions=None) -> None:
        first = keys if "keys" in self.kinds else values
        self.dtype = first.dtype
        if first.device != self._maps_on:  # checked once per device, not at every step
            if any(t.device != first.device for t in self.fixed_tensors()):
                for maps in (self.encoder, self.decoder):
                    maps.update({k: t.to(first.device) for k, t in maps.items()})
            self._maps_on = first.device
        super().append(keys, values, positions)

    def encode(self, kind, x, valid=None, positions=None):
        x = x.float()
        if kind == "keys" and self.rope is not None:
            x = self.rope.unrotate(x, positions)
        enc = self.encoder[kind]  # (G, g * D, r)
        coef = to_blocks(x, enc.shape[0]) @ enc  # (B, G, n, r)
        if not self.config.int8_coefficients:
            return (coef.to(self.dtype),)
        scale = coef.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
        return torch.round(coef / scale).to(torch.int8), scale.to(self.dtype)

    def decode(self, kind, parts, out, positions=None):
        return out.copy_(self.reconstruct(kind, parts, out.shape[1], positions))

    def reconstruct(self, kind, parts, heads: int, positions=None) -> torch.Tensor:
        """Tokens (B, H_kv, n, D) float32 of coefficients ``parts``, keys rotated back at ``positions``."""
        blocks = parts[0].shape[1]
        x = rebuild(parts, self.decoder[kind], heads)  # (B, H_kv, n, D) float32
        if kind == "keys" and self.rope is not None:  # a block's heads hold the same tokens: rotate once
            b, h, n = positions.shape
            x = self.rope.rotate(x, positions.view(b, blocks, h // blocks, n)[:, :, 0])
        return x

    # -- attention in the latent space (kvcompress.kernels.fused_low_rank) ---------------------------
    compact = True

    def attends_codes(self) -> bool:
        """Whether a decode query attends in the latent space (values always, keys unless pre-RoPE)."""
        return self.config.backend != "dense" and "keys" in self.kinds and self.encoded_length > 0

    def compact_read(self) -> Latent:
        """The latents and residual windows of keys and values, for a backend that attends from them."""
        enc, res, dec = self.encoded["values"], self.residual["values"], self.decoder["values"]
        return Latent(**self.key_read(), values=enc, value_res=res, value_decoder=dec)

    def key_read(self) -> dict:
        """The keys' fields of a ``Latent`` read: latents, residual window, decoder, and for pre-RoPE keys
        the encoded keys' positions (B, H_kv, Te), the rotation and the tokens appended so far."""
        rope = self.rope
        positions = None if rope is None else self._positions(0, self.encoded_length)
        return {"keys": self.encoded["keys"], "key_res": self.residual["keys"],
                "key_decoder": self.decoder["keys"], "positions": positions, "rope": rope,
                "seen": self.appended, "counts": self.counts, "backend": self.config.backend}  # fmt: skip

    def flush_count(self, residual: int) -> int:
        return residual - self.config.recent

    def fixed_tensors(self):
        return list({id(t): t for t in [*self.encoder.values(), *self.decoder.values()]}.values())

    def loaded(self) -> None:
        """A file restores the maps contiguous: the pre-RoPE key decoder is laid out by component again, so
        a loaded cache reads the same memory layout, and computes the same bits, as the cache it saved."""
        for kind in self.kinds:
            maps = _own((self.encoder[kind], self.decoder[kind]), kind == "keys" and self.rope is not None)
            self.encoder[kind], self.decoder[kind] = maps

    def shared_tensors(self):
        return self.rope.table.tensors() if self.rope is not None else []

    # -- readable names (tests, stats) ------------------------------------------------------
    def _part(self, kind: str, i: int):
        parts = self.encoded[kind]
        return None if parts is None or len(parts) <= i else parts[i]

    key_coef = property(lambda self: self._part("keys", 0))
    value_coef = property(lambda self: self._part("values", 0))
    key_scale = property(lambda self: self._part("keys", 1))
    value_scale = property(lambda self: self._part("values", 1))
    key_basis = property(lambda self: self.encoder.get("keys"))  # coefficients = keys @ key_basis
    value_basis = property(lambda self: self.encoder.get("values"))
    keys = property(lambda self: self.residual["keys"])
    values = property(lambda self: self.residual["values"])

    def stats(self) -> dict:
        cal, c = self.config.calibration, self.config
        out = {**super().stats(), "keys_mode": c.keys, "basis": c.basis}
        for kind in self.kinds:
            blocks, n, comps = self.encoder[kind].shape  # (G, g * D, r)
            g = n // self.spec.head_dim
            out[f"{kind[:-1]}_components"] = comps  # per block of g heads
            out[f"{kind[:-1]}_rank"] = comps // g if comps % g == 0 else comps / g  # per KV head
        return {
            **out,
            "tokens_projected": self.encoded_length,
            "rope_kernel_steps": self.counts["rope_kernel_steps"],
            # the model's cos/sin by position (kvcompress.storage.rope_table): shared by every layer and
            # cache of the model, like the model's own weights, so reported here and not in ``bytes``
            "rope_table_bytes": storage_bytes(self.shared_tensors()),
            "basis_bytes": storage_bytes(self.fixed_tensors()),
            "position_bytes": storage_bytes([self.positions]),
            "calibration_source": cal["source"],
            "calibration_s": cal.get("seconds"),
            "calibration_range": cal.get("range"),
        }
