"""Keys in one store, values in another: e.g. pre-RoPE low-rank keys with int4 KIVI values.

Each part is an ordinary store built for one kind (``Storage.layer(..., kinds=("keys",))``), with its own
residual window and codec; this store routes every call to both, so selectors see one store.
"""

from __future__ import annotations

from kvcompress.core.plan import Latent
from kvcompress.core.storage import Store


class SplitStore(Store):
    """``key_store`` holds the keys and ``value_store`` the values of the same tokens."""

    def __init__(self, config, layer_idx, spec, key_store: Store, value_store: Store):
        super().__init__(config, layer_idx, spec)
        self.key_store, self.value_store = key_store, value_store

    def _both(self):
        return self.key_store, self.value_store

    @property
    def length(self) -> int:
        return self.key_store.length

    @property
    def keeps_exactly(self) -> bool:
        return self.key_store.keeps_exactly and self.value_store.keeps_exactly

    def append(self, keys, values, positions=None) -> None:
        for store in self._both():
            store.append(keys, values, positions)

    def read(self):
        return self.key_store.read()[0], self.value_store.read()[1]

    def keep(self, idx) -> None:
        for store in self._both():
            store.keep(idx)

    def keep_spans(self, spans) -> None:
        for store in self._both():
            store.keep_spans(spans)

    compact = True

    def attends_codes(self) -> bool:
        return self.key_store.attends_codes()

    def compact_read(self) -> Latent:
        """The key store's latents (``LowRankStore.key_read``), and the values read dense (B, H_kv, T, D)."""
        return Latent(**self.key_store.key_read(), values=None, value_res=self.value_store.read()[1])

    def flush(self, valid=None) -> None:
        for store in self._both():
            if store.flush is not None:
                store.flush(valid)

    def crop_refusal(self, n: int) -> str | None:
        return self.key_store.crop_refusal(n) or self.value_store.crop_refusal(n)

    def crop_conditions(self) -> list[str]:
        return list(dict.fromkeys(self.key_store.crop_conditions() + self.value_store.crop_conditions()))

    def crop(self, n: int) -> None:
        for store in self._both():
            store.crop(n)

    def reorder(self, beam_idx) -> None:
        for store in self._both():
            store.reorder(beam_idx)

    def reset(self) -> None:
        for store in self._both():
            store.reset()

    def tensors(self):
        return [t for store in self._both() for t in store.tensors()]

    def fixed_tensors(self):
        return [t for store in self._both() for t in store.fixed_tensors()]

    def shared_tensors(self):
        return [t for store in self._both() for t in store.shared_tensors()]

    @property
    def keys(self):
        return self.key_store.keys

    @property
    def values(self):
        return self.value_store.values

    def stats(self) -> dict:
        keys, values = self.key_store.stats(), self.value_store.stats()
        out = {**keys, "storage": self.config.name, "values_storage": values.pop("storage")}
        return out | {f"values_{k}": v for k, v in values.items()}
