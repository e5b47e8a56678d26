"""Per-layer schedules: give each decoder layer its own selector, storage, or both.

Example (Hydra, ``conf/policy/<name>.yaml``)::

    _target_: kvcompress.selectors.SchedulePolicy
    default: {_target_: kvcompress.selectors.FullPolicy}
    rules:
      - {layers: "0-1", policy: {_target_: kvcompress.selectors.FullPolicy}}
      - {layers: "-4:", policy: {_target_: kvcompress.selectors.SlidingWindowPolicy, window: 128}}
      - {layers: "2:", storage: {name: quant, bits: 4}}

``layers`` is an int, ``"a-b"`` (inclusive), a Python slice ``"a:b"`` (negatives count from the last
layer) or a list of those. For each layer the first rule with a ``policy`` naming it sets the selector
(else ``default``) and the first rule with a ``storage`` naming it sets the storage (else the schedule's
``storage``, else the selector's own).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvcompress.core.fields import validate
from kvcompress.core.policy import ModelSpec, Policy, PolicyLayer


def parse_layers(spec, num_layers: int) -> list[int]:
    """Layer indices named by ``spec``; raises if a layer is outside ``[0, num_layers)``."""
    if isinstance(spec, (list, tuple)):
        return [i for part in spec for i in parse_layers(part, num_layers)]
    if isinstance(spec, int):
        idx = [spec + num_layers if spec < 0 else spec]
    elif isinstance(spec, str) and ":" in spec:
        start, _, stop = spec.partition(":")
        idx = list(range(num_layers))[slice(int(start) if start else None, int(stop) if stop else None)]
    elif isinstance(spec, str) and "-" in spec.lstrip("-"):
        lo, hi = spec.split("-", 1)
        idx = list(range(int(lo), int(hi) + 1))
    elif isinstance(spec, str) and spec.lstrip("-").isdigit():
        return parse_layers(int(spec), num_layers)
    else:
        raise ValueError(f"schedule layers={spec!r}: use an int, 'a-b', 'a:b' or a list of those")
    bad = [i for i in idx if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"schedule layers={spec!r} names layer(s) {bad}; the model has {num_layers} layers")
    return idx


def _as_policy(p) -> Policy:
    if isinstance(p, Policy):
        return p
    from kvcompress.core.cache import make_policy

    return make_policy(dict(p)) if isinstance(p, dict) or hasattr(p, "items") else make_policy(p)


def with_storage(policy: Policy, storage) -> Policy:
    """``policy``'s selector over ``storage`` (a storage preset such as ``quant`` becomes ``full``)."""
    from kvcompress.core.registry import make_storage
    from kvcompress.selectors.full import FullPolicy, StoragePreset

    storage = make_storage(storage)
    if isinstance(policy, StoragePreset):
        return FullPolicy(storage=storage)
    return dataclasses.replace(policy, storage=storage)


@dataclass
class SchedulePolicy(Policy):
    """Dispatch each layer to the first rule that names it, else to ``default``."""

    default: object = None
    rules: list = field(default_factory=list)

    def __post_init__(self):
        validate(self, self.name)
        self.default = None if self.default is None else _as_policy(self.default)
        rules = []
        for rule in self.rules:
            rule = dict(rule)
            if "layers" not in rule or not ({"policy", "storage"} & set(rule)):
                raise ValueError(f"schedule rule {rule!r} needs 'layers' and a 'policy', a 'storage' or both")
            if "policy" in rule:
                rule["policy"] = _as_policy(rule["policy"])
            rules.append(rule)
        self.rules, self._assigned = rules, {}

    @property
    def name(self) -> str:
        """The preset it was made from (``mixed_precision``, ``window_schedule``: both build this class), else
        ``schedule``."""
        return self.__dict__.get("registry_name", "schedule")

    @property
    def evicts(self) -> str:
        kinds = {p.evicts for p in [self.default, *(r["policy"] for r in self.rules if "policy" in r)] if p}
        return next((k for k in ("always", "prefill") if k in kinds), "never")

    def _pick(self, key: str, num_layers: int) -> list:
        chosen = [None] * num_layers
        for rule in self.rules:
            if key in rule:
                for i in parse_layers(rule["layers"], num_layers):
                    chosen[i] = chosen[i] if chosen[i] is not None else rule[key]
        return chosen

    def assignment(self, num_layers: int) -> list[Policy]:
        """The policy of every layer, in order (the same objects on every call)."""
        if num_layers in self._assigned:
            return self._assigned[num_layers]
        selectors = [p or self.default for p in self._pick("policy", num_layers)]
        missing = [i for i, p in enumerate(selectors) if p is None]
        if missing:
            raise ValueError(f"schedule: layers {missing} match no rule and there is no default policy")
        storages = [s if s is not None else self.storage for s in self._pick("storage", num_layers)]
        made: dict = {}  # one object per distinct (selector, storage) pair: prepared once
        out = []
        for p, s in zip(selectors, storages, strict=True):
            key = (id(p), id(s))
            if key not in made:
                made[key] = p if s is None else with_storage(p, s)
                if self.apply_to == "all":  # the schedule's own apply_to reaches every layer's policy
                    made[key] = dataclasses.replace(made[key], apply_to="all")
            out.append(made[key])
        self._assigned[num_layers] = out
        return out

    def _unique(self, num_layers: int) -> list[Policy]:
        return list({id(p): p for p in self.assignment(num_layers)}.values())

    def check(self, spec: ModelSpec) -> None:
        for policy in self._unique(spec.num_layers):
            policy.check(spec)

    def prepare(self, model) -> None:
        from kvcompress.core.cache import model_spec

        for policy in self._unique(model_spec(model).num_layers):
            policy.prepare(model)

    def covering(self, n_tokens: int) -> SchedulePolicy:
        """Every rule's policy at covering budget; storage rules resolved into their policies."""
        rules = [{**r, "policy": r["policy"].covering(n_tokens)} if "policy" in r else r for r in self.rules]
        rules = [
            {**r, "storage": _storage_of(r["storage"]).covering(n_tokens)} if "storage" in r else r
            for r in rules
        ]
        storage = None if self.storage is None else _storage_of(self.storage).covering(n_tokens)
        default = self.default and self.default.covering(n_tokens)
        return SchedulePolicy(default, rules, storage=storage, apply_to=self.apply_to)

    def layer(self, layer_idx: int, spec: ModelSpec) -> PolicyLayer:
        return self.assignment(spec.num_layers)[layer_idx].layer(layer_idx, spec)

    def describe(self) -> dict:
        def rule(r):
            out = {"layers": r["layers"]}
            if "policy" in r:
                out["policy"] = r["policy"].describe()
            if "storage" in r:
                out["storage"] = _storage_of(r["storage"]).describe()
            return out

        return {
            "name": self.name,
            "default": self.default.describe() if self.default else None,
            "rules": [rule(r) for r in self.rules],
            "storage": None if self.storage is None else _storage_of(self.storage).describe(),
            **({"apply_to": self.apply_to} if self.apply_to != "full_attention" else {}),
        }


def _storage_of(spec):
    from kvcompress.core.registry import make_storage

    return make_storage(spec)
