"""The uncompressed baseline (every ratio is measured against it), and storage presets built on it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from kvcompress.core.policy import Policy, Shape


@dataclass
class FullPolicy(Policy):
    """Keep every token (in the model's dtype with the default dense storage: what ``DynamicCache`` does)."""

    FORMULA = True  # the memory formulas below are this class's own

    def kept_tokens(self, s: Shape) -> int:
        return s.total


def storage_preset(storage_class: type):
    """Class decorator making a ``StoragePreset`` dataclass over ``storage_class``: the storage's declared
    fields (names, order, defaults, validation rules) become the preset's own, never re-declared."""

    def make(cls: type) -> type:
        own = cls.__dict__.get("__annotations__", {})
        cls.__annotations__ = dict(own)
        for f in dataclasses.fields(storage_class):
            cls.__annotations__[f.name] = f.type
            setattr(cls, f.name, dataclasses.field(default=f.default, default_factory=f.default_factory,
                                                   metadata=f.metadata))  # fmt: skip
        cls.storage_class = storage_class
        return dataclass(cls)

    return make


@dataclass
class StoragePreset(FullPolicy):
    """``full`` over a storage whose fields are this policy's own (``policy=quant`` means ``policy=full
    storage=quant``), made with ``storage_preset``. ``storage`` cannot be set as well: the fields already
    say it."""

    storage_class: ClassVar[type] = None

    def __post_init__(self):
        given = self.storage
        if given is not None and not getattr(given, "_preset", False):
            raise ValueError(
                f"policy={self.name} sets its storage from its own fields; for another storage use "
                f"policy=full storage=<name> (got storage={getattr(given, 'name', given)!r})"
            )
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self.storage_class)}
        self.storage = self.storage_class(**own)
        self.storage._preset = True
        for name in own:  # the storage may fill in defaults (low_rank: rank 32 when energy is unset)
            setattr(self, name, getattr(self.storage, name))
        super().__post_init__()

    @property
    def selector(self) -> str:
        return "full"

    def covering(self, n_tokens: int) -> Policy:
        return FullPolicy(storage=self.storage.covering(n_tokens))
