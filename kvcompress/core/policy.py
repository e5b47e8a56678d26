"""The selector axis: which tokens a layer keeps and which of them each step reads.

A policy is a small dataclass (its fields are its Hydra config, ``conf/policy/<name>.yaml``); ``layer()``
builds one transformers ``CacheLayerMixin`` per decoder layer: the policy's ``layer_class`` over a
``Store`` of its ``storage`` (``kvcompress.storage``, dense by default). Fields are declared with their
constraints (``kvcompress.core.fields``) and validated once here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from kvcompress.core.buffers import storage_bytes
from kvcompress.core.fields import Choice, refuse_renamed, validate
from kvcompress.core.layer import PolicyLayer
from kvcompress.core.spec import ModelSpec, Shape

__all__ = ["ModelSpec", "Policy", "PolicyLayer", "Shape", "storage_bytes"]

APPLY_TO = (
    "full_attention",
    "all",
)  # which layers a policy compresses; windowed layers keep the model's window


@dataclass
class Policy:
    """Base of all selectors. Subclasses set ``layer_class`` and add fields.

    Class attributes read by the generic tests and the memory model, declared next to each policy:
    ``TEST_PARAMS`` (fields that make a 48-token test sequence really compress), ``FUZZ`` (a dict, or a
    list of alternative dicts, of field -> ``(lo, hi)`` range, list of choices, or a value),
    ``MEMORY_VARIANTS`` (field sets beyond ``TEST_PARAMS`` at which the memory model is checked against
    real caches), ``MAX_MEMORY_RATIO`` (bytes allowed over ``full``'s for selector state; a storage's own
    allowance adds to it, ``Storage.MAX_MEMORY_RATIO``) and ``evicts``: ``"never"``,
    ``"prefill"`` (only steps of several tokens) or ``"always"`` (decode steps too).

    What a storage may ask of a selector is declared here too: ``heads_share_tokens`` (every KV head keeps
    the same tokens, so one latent per token can serve them all) and ``reads_pages`` (the selector fetches
    pages by score, what a cold tier serves); ``refuses_storage`` names the storages a selector cannot
    run over. ``refusal()`` is the one place both sides' refusals meet.

    Args:
        apply_to: ``full_attention``: only full-attention layers are compressed, windowed layers keep the
            model's own window; ``all``: every layer, inside the model's window.
    """

    layer_class: ClassVar[type] = PolicyLayer
    evicts: ClassVar[str] = "never"
    heads_share_tokens: ClassVar[bool] = False
    reads_pages: ClassVar[bool] = False
    TEST_PARAMS: ClassVar[dict] = {}
    FUZZ: ClassVar[dict | list] = {}
    MAX_MEMORY_RATIO: ClassVar[float] = 1.05
    FORMULA: ClassVar[bool] = False  # True in a class whose kept_tokens/state_bytes describe it exactly
    FORMULA_HERITABLE: ClassVar[bool] = False  # True: FORMULA holds for subclasses that keep the formulas
    MEMORY_VARIANTS: ClassVar[list] = []  # field sets beyond TEST_PARAMS the memory model is checked at

    storage: object = field(default=None, kw_only=True)
    apply_to: str = Choice("full_attention", APPLY_TO, kw_only=True)

    def __new__(cls, *args, **kwargs):
        """Refuse a removed field by name, saying what replaced it, before the dataclass sees it."""
        self = super().__new__(cls)
        refuse_renamed(self.name, {f.name for f in dataclasses.fields(cls)}, kwargs)
        return self

    def __post_init__(self):
        validate(self, self.name)
        from kvcompress.core.registry import make_storage

        self.storage = make_storage(self.storage)

    @property
    def name(self) -> str:
        """The registry name: its YAML's file name (``registry.name_of``), or the name it was made from."""
        from kvcompress.core.registry import name_of

        name = name_of(type(self), "policy") or self.__dict__.get("registry_name")
        if name is None:
            raise ValueError(
                f"{type(self).__module__}.{type(self).__qualname__} has no registry name: add "
                "conf/policy/<name>.yaml with its _target_ (a folder of your own joins through "
                "KVCOMPRESS_CONF_PATH)"
            )
        return name

    @property
    def selector(self) -> str:
        """The selector's name (a storage preset such as ``quant`` is the ``full`` selector)."""
        return self.name

    def refuses_storage(self, storage) -> str | None:
        """Why this selector cannot run over ``storage`` (naming what to use instead), or None."""
        return None

    def refusal(self) -> str | None:
        """The declared reason this selector and its storage cannot work together (the selector's side
        first, then the storage's ``refuses``), naming the fix; None when they can."""
        return self.refuses_storage(self.storage) or self.storage.refuses(self)

    def check(self, spec: ModelSpec) -> None:
        """Validate fields against the model, and the selector against its storage (``refusal``)."""
        self.storage.check(spec)
        reason = self.refusal()
        if reason:
            raise ValueError(f"{self.selector} over storage={self.storage.name} cannot work: {reason}")

    def prepare(self, model) -> None:
        """Called by ``build_cache`` before ``layer()``; storages that need the model (calibration) use it."""
        self.storage.prepare(model)

    def covering(self, n_tokens: int) -> Policy:
        """A copy whose budget covers ``n_tokens``: it must then behave exactly like ``full``."""
        return dataclasses.replace(self, storage=self.storage.covering(n_tokens))

    def layer(self, layer_idx: int, spec: ModelSpec) -> PolicyLayer:
        """This policy's layer, or on a windowed layer with ``apply_to: full_attention`` the model's own
        window over dense storage (``ModelWindowLayer``)."""
        if spec is not None and spec.window(layer_idx) is not None and self.apply_to == "full_attention":
            from kvcompress.core.model_window import ModelWindowLayer
            from kvcompress.core.registry import make_storage

            return ModelWindowLayer(self, layer_idx, spec, make_storage(None).layer(layer_idx, spec))
        return self.layer_type()(self, layer_idx, spec, self.storage.layer(layer_idx, spec))

    def layer_type(self) -> type:
        """The class of this policy's layers (a variant of ``layer_class`` where an option asks for one)."""
        return self.layer_class

    def describe(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "storage"}
        if self.apply_to == "full_attention":
            fields.pop("apply_to")  # the default: keeps records of full-attention models as they were
        return {"name": self.name, **_plain(fields), "storage": self.storage.describe()}

    # -- memory formula (per layer; see kvcompress.memory_model) ----------------------------
    def kept_tokens(self, s: Shape) -> int | None:
        """Tokens per row and KV head held after ``s.prefill`` then ``s.decode`` one-token steps; None
        (no prediction, never a guess) for a selector that declares no formula."""
        return None

    def state_bytes(self, s: Shape, kept: int) -> int:
        """Bytes of the selector's own tensors (scores, positions, page summaries) at ``kept`` tokens."""
        return 0

    def layer_parts(self, s: Shape, layer_idx: int) -> list[tuple[Shape, int]] | None:
        """Layer ``layer_idx``'s KV heads as parts held in stores of their own, each ``(its shape, tokens it
        keeps)``: one part of every head here (``kept_tokens``); a selector that splits heads gives more."""
        kept = self.kept_tokens(s)
        return None if kept is None else [(s, kept)]


def _plain(value):
    """Nested policies as their descriptions (schedules, PyramidKV's inner policy)."""
    if isinstance(value, Policy):
        return value.describe()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
