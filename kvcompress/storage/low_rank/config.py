"""Validation and description of ``LowRankStorage`` fields (kept apart from its formulas and stores), and
its calibration state: calibrated by ``prepare``, or bases taken from a cache file (``bases_from_file``)."""

from __future__ import annotations

import contextlib
import dataclasses

FROM_FILE = "cache file"  # the calibration ``source`` of a storage whose bases a cache file gave


def _plain_values(values):
    """``values`` as plain config: None, or ``{"name": ..., field: value}`` (a Storage is described)."""
    from kvcompress.core.storage import Storage

    if values is None:
        return None
    if isinstance(values, Storage):
        return values.describe()
    if isinstance(values, str):
        return {"name": values}
    if hasattr(values, "items"):
        return dict(values)
    raise ValueError(f"low_rank.values={values!r} must be null, a storage name, a dict or a Storage")


class LowRankChecks:
    """``__post_init__`` (one-time field checks), ``check`` (against the model), ``refuses`` (a selector)."""

    def __post_init__(self):
        super().__post_init__()
        if self.rank is not None and self.energy is not None:
            raise ValueError(
                f"low_rank: set exactly one of rank={self.rank} and energy={self.energy} (the other null)"
            )
        if self.rank is None and self.energy is None:
            self.rank = 32
        for field, value in (("value_rank", self.value_rank), ("allocation", self.allocation)):
            if self.rank is None and value not in (None, "uniform"):
                raise ValueError(f"low_rank.{field}={value!r} needs rank (not energy)")
        self.values = _plain_values(self.values)
        self.values_storage = self._make_values()
        self._calibration: dict | None = None
        self._ropes = None
        self._from_file = False  # inside bases_from_file: no calibration pass, placeholder bases

    def _make_values(self):
        if self.values is None:
            return None
        from kvcompress.core.registry import make_storage

        if self.value_rank is not None:
            raise ValueError(
                f"low_rank.value_rank={self.value_rank} applies to values projected here, but values="
                f"{self.values!r} stores them in another storage: leave value_rank null"
            )
        try:
            storage = make_storage(self.values)
        except ValueError as err:
            raise ValueError(f"low_rank.values: {err}") from err
        if storage.name == self.name:
            raise ValueError(
                "low_rank.values must be another storage (dense, quant...); null projects them here"
            )
        return storage

    def check(self, spec) -> None:
        for field in ("rank", "value_rank"):
            if (getattr(self, field) or 0) > spec.head_dim:
                raise ValueError(
                    f"low_rank.{field}={getattr(self, field)} must be in [1, head_dim={spec.head_dim}]"
                )
        if self.basis == "group" and spec.num_kv_heads % self.group_size:
            allowed = [g for g in range(1, spec.num_kv_heads + 1) if spec.num_kv_heads % g == 0]
            raise ValueError(
                f"low_rank.group_size={self.group_size} must divide the model's {spec.num_kv_heads} KV heads "
                f"with basis=group; allowed: {allowed}"
            )
        if self.values_storage is not None:
            self.values_storage.check(spec)

    def refuses(self, selector, kinds=("keys", "values")) -> str | None:
        if self.backend == "torch" and selector.selector != "full":
            return (
                f"low_rank.backend='torch' attends in the latent space only under the full selector "
                f"(not {selector.selector}, which narrows or scores what attention reads); use "
                "backend='auto' or 'dense'"
            )
        shared = self.basis == "joint" or (self.basis == "group" and self.group_size > 1)
        if shared and selector.evicts != "never" and not selector.heads_share_tokens:
            return (
                f"{selector.selector} may keep different tokens in each KV head, but low_rank basis="
                f"{self.basis} caches one latent per token for several heads; use basis=head with it"
            )
        if self.values_storage is not None and "values" in kinds:
            return self.values_storage.refuses(selector, ("values",))
        return None

    @contextlib.contextmanager
    def bases_from_file(self):
        """While open, ``prepare`` runs no calibration pass and ``layer`` builds stores with empty bases,
        which ``load_cache`` replaces by a file's (with its calibration range, ``calibration_from_file``):
        loading never calibrates only to overwrite the result. Once closed, ``prepare`` calibrates again."""
        self._from_file = True
        try:
            yield self
        finally:
            self._from_file = False

    def calibration_from_file(self, span: dict | None) -> None:
        """Record that this storage's bases came from a cache file whose calibration read ``span``: a loaded
        cache reports it, and evaluation still refuses that text (``calibration_text.check_disjoint``)."""
        self._calibration = {"source": FROM_FILE, "seconds": None, "range": span}

    @property
    def calibration(self) -> dict:
        if self._calibration is None:
            raise RuntimeError("low_rank is not calibrated: build it with build_cache(policy, model)")
        return self._calibration

    @property
    def calibration_range(self) -> dict | None:
        """The text span calibration read (``text``, ``tokens``, ``chars``), once calibrated."""
        return None if self._calibration is None else self._calibration.get("range")

    def describe(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        tok = fields["tokenizer"]
        if tok is not None and not isinstance(tok, str):
            fields["tokenizer"] = str(getattr(tok, "name_or_path", type(tok).__name__))
        return {"name": self.name, **fields}
