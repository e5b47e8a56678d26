"""The policy cache: a transformers ``Cache`` whose layers are kvcompress policy layers.

With ``attention.py`` this is the only module that touches transformers internals.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import torch
from transformers.cache_utils import Cache

from kvcompress.core import attention, registry, rollback
from kvcompress.core.buffers import storage_bytes
from kvcompress.core.families import attention_layout
from kvcompress.core.policy import ModelSpec, Policy
from kvcompress.core.registry import CONF_DIR

__all__ = ["CONF_DIR", "KVCache", "build_cache", "known_policies", "known_storages", "make_policy"]


class KVCache(Cache):
    """A ``Cache`` of policy layers; adds ``memory_bytes()`` and ``stats()``."""

    takes_forward_state = True  # install()'s hook hands each forward a fresh attention.ForwardState

    def __init__(self, layers, policy, model=None):
        super().__init__(layers=layers)
        self.policy = policy
        self._model = None if model is None else weakref.ref(model)  # for save(): its fingerprint

    def memory_bytes(self) -> int:
        """Every byte the cache holds (distinct storages over all layers), metadata included."""
        return storage_bytes(t for layer in self.layers for t in layer.tensors())

    def stats(self) -> list[dict]:
        """One dict per layer: tokens seen/stored/evicted, bytes, and policy-specific counters."""
        return [layer.stats() for layer in self.layers]

    @property
    def is_croppable(self) -> bool:
        """True when every layer can roll back tokens (``core.rollback``). Where one never can, this raises
        its reason instead of answering False: transformers asks before assisted decoding, and would
        otherwise fail with a message that names neither the policy nor the cause."""
        for layer in self.layers:
            why = layer.never_crops()
            if why:
                raise ValueError(
                    f"policy {self.policy.name!r} cannot roll back tokens (layer {layer.layer_idx}), as "
                    f"assisted and prompt-lookup decoding need: {why}"
                )
        return True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens from every layer, exactly, or from none
        (``core.rollback``: a refusal names this cache's policy, the layer and why)."""
        rollback.crop(self, tokens_to_remove)

    # -- one compressed context, many questions ---------------------------------------------------
    def __deepcopy__(self, memo):
        return fork(self)

    def snapshot(self) -> KVCache:
        """An exact copy of the current state (``restore`` it before each question)."""
        return fork(self)

    def restore(self, snapshot: KVCache) -> None:
        """Return to ``snapshot``'s state exactly; the snapshot stays usable for the next restore."""
        self.layers = fork(snapshot).layers

    def model(self):
        """The model this cache was built for, or None when it is gone (``kvcompress.save_cache`` uses it)."""
        return None if self._model is None else self._model()


def fork(cache: KVCache) -> KVCache:
    """A deep copy of ``cache`` that shares only what never changes (the policy, the model spec, storage
    configs and per-layer constants such as a low-rank basis), so restoring it gives back the identical
    compressed state: no byte of a later question or answer survives."""
    memo = {}
    for layer in cache.layers:
        layer.settle()  # a pending eviction is carried out, not copied
        for shared in (layer.policy, layer.spec, layer.store.config, *layer.store.fixed_tensors()):
            memo[id(shared)] = shared
    new = copy.copy(cache)
    with torch.inference_mode():  # caches are filled under inference mode: copy them there too
        new.layers = copy.deepcopy(cache.layers, memo)
    for layer in new.layers:  # copied buffers were not allocated by the copy's slots
        layer.slots.clear()
        if hasattr(layer.store, "slots"):
            layer.store.slots.clear()
    return new


def known_policies() -> list[str]:
    return registry.known("policy")


def known_storages() -> list[str]:
    return registry.known("storage")


def policy_from_config(cfg: dict) -> Policy:
    """Instantiate a policy from a ``{_target_: ..., field: value}`` mapping (a Hydra policy config)."""
    return registry.instantiate(cfg, "policy")


def make_policy(policy, /, **params) -> Policy:
    """A policy object from a name in ``conf/policy/`` (plus field overrides), a config dict or an existing
    object. ``storage=`` (a name, ``{"name": ..., field: value}`` or a ``Storage``) sets the storage axis."""
    if isinstance(policy, Policy):
        return dataclasses.replace(policy, **params) if params else policy
    if isinstance(policy, dict):
        return policy_from_config({**policy, **params})
    return registry.from_name("policy", policy, params, always=("storage", "apply_to"))


def model_spec(model) -> ModelSpec:
    """What policies need to know about ``model``; refuses models that have no decoder KV cache."""
    cfg = model.config.get_text_config(decoder=True)
    if getattr(model.config, "is_encoder_decoder", False) or not model.can_generate():
        raise ValueError(
            f"model family {getattr(cfg, 'model_type', '?')!r} ({type(model).__name__}) is not supported: it "
            "is not a decoder-only causal LM; kvcompress policies compress the KV cache of models like "
            "Llama, Qwen2, Gemma or Mistral"
        )
    layer_types, windows = attention_layout(model)
    heads = cfg.num_attention_heads
    return ModelSpec(
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        max_positions=getattr(cfg, "max_position_embeddings", 0) or 0,
        model_type=getattr(cfg, "model_type", "unknown"),
        layer_types=layer_types,
        windows=windows,
    )


def build_cache(policy, model, /, **params) -> KVCache:
    """Build a policy cache for ``model``: ``policy`` is a name from ``conf/policy/``, a dict config or a
    ``Policy``; ``params`` override its fields (``storage=`` picks the storage axis: ``"quant"``,
    ``{"name": "quant", "bits": 4}``...). Refuses a selector/storage pair that cannot work, saying why.
    Routes the model's attention through kvcompress."""
    policy = make_policy(policy, **params)
    spec = model_spec(model)
    policy.check(spec)
    policy.prepare(model)
    layers = [policy.layer(i, spec) for i in range(spec.num_layers)]
    attention.install(model, hidden=any(layer.wants_hidden for layer in layers))
    return KVCache(layers, policy, model)


PEERS = ("dynamic", "hf_sliding_window", "hf_quantized_fp8")


def peer_cache(name: str, model, window: int = 256):
    """transformers' own caches, for side-by-side benchmarks: ``dynamic`` (DynamicCache),
    ``hf_sliding_window`` (DynamicSlidingWindowLayer per layer) and ``hf_quantized_fp8`` (QuantizedCache)."""
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer, QuantizedCache

    n = model_spec(model).num_layers
    if name == "dynamic":
        return DynamicCache(config=model.config)
    if name == "hf_sliding_window":
        return Cache(layers=[DynamicSlidingWindowLayer(sliding_window=window) for _ in range(n)])
    if name == "hf_quantized_fp8":
        return QuantizedCache("fp8", model.config)
    raise ValueError(f"peer cache {name!r} is unknown; known: {list(PEERS)}")


def held_bytes(cache) -> int:
    """Bytes of every tensor reachable from a cache's layers (works for transformers' caches too)."""
    if hasattr(cache, "memory_bytes"):
        return cache.memory_bytes()
    return storage_bytes(t for layer in cache.layers for t in _tensors_of(layer))


def _tensors_of(obj, depth: int = 0):
    values = vars(obj).values() if hasattr(obj, "__dict__") else obj
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)) and depth < 3:
            yield from _tensors_of(v, depth + 1)
