"""Per-layer schedules: give each decoder layer its own policy or parameters.

Example (Hydra, ``conf/policy/<name>.yaml``)::

    _target_: kvcompress.policies.SchedulePolicy
    default: {_target_: kvcompress.policies.FullPolicy}
    rules:
      - {layers: "0-1", policy: {_target_: kvcompress.policies.FullPolicy}}
      - {layers: "-4:", policy: {_target_: kvcompress.policies.SlidingWindowPolicy, window: 128}}

``layers`` is an int, ``"a-b"`` (inclusive), a Python slice ``"a:b"`` (negatives count from the last
layer) or a list of those. The first rule naming a layer wins; other layers get ``default``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcompress.policies.base import ModelSpec, Policy, PolicyLayer


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
    from kvcompress.cache import make_policy

    return make_policy(dict(p)) if isinstance(p, dict) else make_policy(p)


@dataclass
class SchedulePolicy(Policy):
    """Dispatch each layer to the first rule that names it, else to ``default``."""

    default: object = None
    rules: list = field(default_factory=list)

    def __post_init__(self):
        self.default = None if self.default is None else _as_policy(self.default)
        for rule in self.rules:
            if not {"layers", "policy"} <= set(rule):
                raise ValueError(f"schedule rule {rule!r} needs 'layers' and 'policy'")
        self.rules = [{"layers": r["layers"], "policy": _as_policy(r["policy"])} for r in self.rules]

    @property
    def name(self) -> str:
        return "schedule"

    def assignment(self, num_layers: int) -> list[Policy]:
        """The policy of every layer, in order."""
        chosen: list[Policy | None] = [None] * num_layers
        for rule in self.rules:
            for i in parse_layers(rule["layers"], num_layers):
                chosen[i] = chosen[i] or rule["policy"]
        missing = [i for i, p in enumerate(chosen) if p is None and self.default is None]
        if missing:
            raise ValueError(f"schedule: layers {missing} match no rule and there is no default policy")
        return [p or self.default for p in chosen]

    def check(self, spec: ModelSpec) -> None:
        for policy in {id(p): p for p in self.assignment(spec.num_layers)}.values():
            policy.check(spec)

    def prepare(self, model) -> None:
        from kvcompress.cache import model_spec

        for policy in {id(p): p for p in self.assignment(model_spec(model).num_layers)}.values():
            policy.prepare(model)

    def covering(self, n_tokens: int) -> SchedulePolicy:
        rules = [{"layers": r["layers"], "policy": r["policy"].covering(n_tokens)} for r in self.rules]
        return SchedulePolicy(self.default and self.default.covering(n_tokens), rules)

    def layer(self, layer_idx: int, spec: ModelSpec) -> PolicyLayer:
        return self.assignment(spec.num_layers)[layer_idx].layer(layer_idx, spec)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "default": self.default.describe() if self.default else None,
            "rules": [{"layers": r["layers"], "policy": r["policy"].describe()} for r in self.rules],
        }
