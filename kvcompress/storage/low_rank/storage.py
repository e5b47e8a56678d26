"""Low-rank storage: keys (pre- or post-RoPE) and values as coefficients in calibrated bases, newest exact.

After Palu (Chang et al., "Palu: Compressing KV-Cache with Low-Rank Projection", arXiv 2407.21118), which
caches a low-rank latent of pre-RoPE keys and reconstructs on read, with per-head, grouped (G-LRD) or joint
bases; xKV (arXiv 2503.18893) and ShadowKV (arXiv 2410.21465) also project pre-RoPE keys. Bases are the
eigenbases of calibration moments (``kvcompress.storage.low_rank.calibration``); values may go to another
storage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcompress.core.fields import Bool, Choice, Float, Int
from kvcompress.core.spec import ModelSpec, Shape
from kvcompress.core.storage import KINDS, Storage
from kvcompress.storage.low_rank import bases as lrb
from kvcompress.storage.low_rank.config import FROM_FILE, LowRankChecks
from kvcompress.storage.low_rank.store import LowRankStore
from kvcompress.storage.split import SplitStore

SOURCES = {"pre_rope": "keys_pre", "post_rope": "keys_post"}
QUERY_WEIGHTS = {"pre_rope": "queries_pre", "post_rope": "queries_post"}
OBJECTIVES = ("logits", "keys")
BACKENDS = ("auto", "dense", "torch")  # backend: which attention backend reads the latents (dense: none)


@dataclass
class LowRankStorage(LowRankChecks, Storage):
    """Cache rank-``rank`` coefficients of keys (and values); the newest ``recent`` tokens exact.

    Args:
        rank: components per KV head for keys (a block of g heads keeps ``rank * g``); null with ``energy``.
        value_rank: the values' rank when it differs from ``rank`` (null: ``rank``).
        energy: instead of ``rank``, keep per layer the fewest components holding this share of the
            calibration energy in every block (keys and values chosen separately).
        allocation: ``uniform`` (``rank`` in every layer) or ``error`` (the same total spread over layers to
            minimise the summed error measured at calibration: squared logit error for keys with
            ``key_objective=logits``, each layer's share of its energy otherwise).
        keys: ``pre_rope`` (un-rotate, project, rotate back on read) or ``post_rope`` (project rotated keys).
        key_objective: what the key bases minimise: ``logits`` (the attention-logit error ``q . e`` over the
            calibration queries, ``kvcompress.storage.low_rank.calibration_queries``) or ``keys`` (the key
            error, plain PCA).
        basis: ``head`` (one basis per KV head), ``group`` (per ``group_size`` KV heads) or ``joint`` (one
            over all KV heads of a layer); shared bases need every head to keep the same tokens.
        group_size: KV heads per basis with ``basis=group`` (must divide the model's KV heads).
        values: null (values projected here, rank ``value_rank``) or another storage for the values alone,
            e.g. ``{name: quant, bits: 4}`` or ``dense``.
        recent: newest tokens kept exactly, in the model dtype.
        int8_coefficients: store coefficients as int8 codes with one scale (model dtype) per token and block.
        calibration_text: ``pg_essays`` (its last ``calibration_tokens`` tokens), a ``.txt``/``.jsonl``
            path, a `datasets` spec, or ``random``.
        calibration_tokens: tokens of calibration text.
        calibration_dir: where calibrations are saved (default: ``<kvcompress cache>/calibration``).
        tokenizer: for the calibration text: a tokenizer, a model id, a folder or a ``.gguf`` path (null: the
            model's own, from ``model.name_or_path``).
        backend: which attention backend reads the latents at decode: values always, keys too unless
            pre-RoPE (those are rebuilt, on a CPU inside a C++ kernel that rotates and dots them in registers,
            with no (T, D) copy; ``kvcompress.kernels.fused_low_rank``). The latent read is offered on one
            unpadded decode query on a full-attention layer under the ``full`` selector; elsewhere keys and
            values are reconstructed (the same numbers). ``auto``: the first backend that serves it
            (``torch``), else the reconstruction. ``torch``: that backend only; a selector that never allows
            the latent read is refused, and so is a step it cannot serve (not plain softmax attention).
            ``dense``: always reconstruct keys and values for the model's own attention.
    """

    name = "low_rank"
    store_class = LowRankStore  # built by ``layer`` with the calibrated bases (not by the base class)
    FORMULA = True  # bytes_for below is this class's own
    MAX_MEMORY_RATIO = 1.04  # pre-RoPE keys: an int32 position per token and KV head, 3.1% of K+V at D=16
    TEST_PARAMS = [
        {
            "rank": 4,
            "recent": 4,
            "basis": "head",
            "calibration_text": "random",
            "calibration_tokens": 64,
        },
        {
            **{"rank": 3, "basis": "joint", "recent": 5, "calibration_text": "random"},
            "calibration_tokens": 64,
            "values": {
                "name": "quant",
                "bits": 4,
                "group_size": 4,
                "recent": 4,
                "value_axis": "token",
            },
        },
    ]
    FUZZ = {
        "rank": (1, 16),
        "recent": (0, 12),
        "keys": ["pre_rope", "post_rope"],
        "basis": list(lrb.BLOCKS),
        "group_size": [1, 2],
        "values": [None, None, "dense", {"name": "quant", "bits": 4, "group_size": 4, "recent": 3}],
        "calibration_text": "random",
        "calibration_tokens": 64,
    }

    rank: int | None = Int(None, low=1, null=True)  # null with energy null: 32
    value_rank: int | None = Int(None, low=1, null=True)
    energy: float | None = Float(None, 0, 1, low_open=True, null=True)
    allocation: str = Choice("uniform", ("uniform", "error"))
    keys: str = Choice("pre_rope", tuple(SOURCES))
    key_objective: str = Choice("logits", OBJECTIVES)
    basis: str = Choice("joint", lrb.BLOCKS)
    group_size: int = Int(2, low=1)
    values: object = None
    recent: int = Int(0, low=0)
    int8_coefficients: bool = Bool(False)
    calibration_text: str = "pg_essays"
    calibration_tokens: int = Int(2048, low=1)
    calibration_dir: str | None = None
    tokenizer: object = None
    backend: str = Choice("auto", BACKENDS)

    def prepare(self, model) -> None:
        """Calibrate on ``model`` (or reload a saved calibration of the same model and text); and its RoPE."""
        from kvcompress.storage.low_rank.calibration import calibrate
        from kvcompress.storage.rope import model_ropes

        n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        if self.keys == "pre_rope":
            try:
                self._ropes = model_ropes(model, n_layers)
            except ValueError as err:
                raise ValueError(
                    f"low_rank.keys='pre_rope' cannot work here: {err}; use keys=post_rope"
                ) from err
        if not self._from_file:  # a cache file being loaded holds the bases (bases_from_file)
            self._calibration = calibrate(
                model, self.calibration_text, self.calibration_tokens, self.calibration_dir, self.tokenizer
            )
        if self.values_storage is not None:
            self.values_storage.prepare(model)

    def covering(self, n_tokens: int) -> LowRankStorage:
        values = self.values_storage and self.values_storage.covering(n_tokens).describe()
        out = dataclasses.replace(self, recent=max(self.recent, n_tokens), values=values)
        out._calibration, out._ropes = self._calibration, self._ropes
        return out

    def blocks(self, spec: ModelSpec) -> int:
        """KV heads per basis (g)."""
        return lrb.heads_per_block(self.basis, self.group_size, spec.num_kv_heads)

    def layer_bases(self, layer_idx: int, spec: ModelSpec, kinds) -> dict:
        """(encoder, decoder) of ``kinds`` for one layer, each (G, g * D, r) (one tensor for plain PCA)."""
        if self._from_file:  # placeholders in the stores' layout, replaced by the file's (persist._build)
            g = self.blocks(spec)
            empty = torch.zeros(spec.num_kv_heads // g, g * spec.head_dim, 0)
            return {kind: (empty, empty) for kind in kinds}
        calibration = self.calibration  # refuses an uncalibrated storage
        if calibration.get("source") == FROM_FILE:
            raise RuntimeError("low_rank: its bases came from a cache file; build_cache(policy, model) "
                               "calibrates it before it builds new layers")  # fmt: skip
        g, out = self.blocks(spec), {}
        for kind in kinds:
            source, weight = self.moments(kind)
            enc, dec, eig = lrb.bases(calibration, source, g, spec.head_dim, weight)
            rank = self.rank if kind == "keys" else (self.value_rank or self.rank)
            r = lrb.layer_ranks(eig, g, rank, self.energy, self.allocation, weight is None)[layer_idx]
            e = enc[layer_idx, ..., :r]
            out[kind] = (e, e if dec is enc else dec[layer_idx, ..., :r])
        return out

    def moments(self, kind: str) -> tuple[str, str | None]:
        """Calibration moment of ``kind`` and the query moment weighing its error (None: plain PCA)."""
        if kind == "values":
            return "values", None
        weight = QUERY_WEIGHTS[self.keys] if self.key_objective == "logits" else None
        return SOURCES[self.keys], weight

    def layer(self, layer_idx: int, spec: ModelSpec, kinds=KINDS):
        own = tuple(k for k in kinds if k == "keys" or self.values_storage is None)
        bases = self.layer_bases(layer_idx, spec, own)
        rope = self._ropes[layer_idx] if self.keys == "pre_rope" else None
        store = LowRankStore(self, layer_idx, spec, own, bases, rope)
        if own == tuple(kinds):
            return store
        values = self.values_storage.layer(layer_idx, spec, ("values",))
        return SplitStore(self, layer_idx, spec, store, values)

    # -- memory formula ---------------------------------------------------------------------
    def kind_bytes(self, s: Shape, tokens: int, kind: str) -> int | None:
        """Keys: the newest ``min(T, R)`` exact, the others as ``rank`` coefficients per token and head in the
        model dtype (or int8 codes plus one model-dtype scale per token and block), plus an int32 position
        per token and head for pre-RoPE keys. Values: the same with ``value_rank``, or their storage's."""
        if kind == "values" and self.values_storage is not None:
            return self.values_storage.kind_bytes(s, tokens, "values")
        if self.energy is not None or self.allocation != "uniform":
            return None  # ranks come from calibration data, not from the parameters
        rank = self.rank if kind == "keys" else (self.value_rank or self.rank)
        exact = min(tokens, self.recent)
        coded = (
            s.batch * s.kv_heads * (tokens - exact) * rank * (1 if self.int8_coefficients else s.dtype_bytes)
        )
        blocks = s.kv_heads // self.blocks_of(s)
        scales = s.batch * blocks * (tokens - exact) * s.dtype_bytes if self.int8_coefficients else 0
        positions = s.per_token(4, tokens) if kind == "keys" and self.keys == "pre_rope" else 0
        return s.kv(exact) // 2 + coded + scales + positions

    def bytes_for(self, s: Shape, tokens: int) -> int | None:
        parts = [self.kind_bytes(s, tokens, kind) for kind in KINDS]
        return None if None in parts else sum(parts)

    def fixed_bytes(self, s: Shape, layer_idx: int) -> int:
        """The layer's float32 bases (G, g * D, r * g) per projected kind (keys: an encoder and a decoder with
        ``key_objective=logits``), plus the values storage's own."""
        if self.energy is not None or self.allocation != "uniform":
            return 0
        g = self.blocks_of(s)
        ranks = [self.rank] * (2 if self.key_objective == "logits" else 1)  # an encoder and a decoder
        ranks += [] if self.values_storage else [self.value_rank or self.rank]
        own = sum(s.kv_heads * s.head_dim * r * g * 4 for r in ranks)
        return own + (self.values_storage.fixed_bytes(s, layer_idx) if self.values_storage else 0)

    def blocks_of(self, s: Shape) -> int:
        return lrb.heads_per_block(self.basis, self.group_size, s.kv_heads)

    @property
    def count_exact(self) -> bool:
        return self.recent == 0 and (self.values_storage is None or self.values_storage.count_exact)
