"""PyramidKV budgets: a fixed total split over layers so that the budget shrinks with depth.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
arXiv 2406.02069. Built on the schedule mechanism: every layer gets its own copy of an eviction
policy (SnapKV by default, as in the paper) with its own budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvcompress.core.fields import Float, Int
from kvcompress.core.policy import ModelSpec, Policy, PolicyLayer
from kvcompress.selectors.eviction.base import BUDGETS, EvictionPolicy, check_one_budget
from kvcompress.selectors.schedule import SchedulePolicy, _as_policy

_SNAPKV = {"_target_": "kvcompress.selectors.SnapKVPolicy"}


def pyramid_weights(num_layers: int, beta: float) -> list[float]:
    """Linear weights with mean 1: the first layer gets ``2 - 1/beta``, the last ``1/beta``."""
    if num_layers == 1:
        return [1.0]
    top, bottom = 2.0 - 1.0 / beta, 1.0 / beta
    return [top - (top - bottom) * i / (num_layers - 1) for i in range(num_layers)]


def pyramid_budgets(mean: int, num_layers: int, beta: float, reserved: int = 0) -> list[int]:
    """Integer per-layer budgets summing to ``mean * num_layers``; the part above ``reserved`` (kept by
    every layer, e.g. SnapKV's window) is shaped like a pyramid, as in the paper."""
    reserved = reserved if mean > reserved else 0
    raw = [reserved + (mean - reserved) * w for w in pyramid_weights(num_layers, beta)]
    budgets = [max(1, int(r)) for r in raw]
    order = sorted(range(num_layers), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    for i in order[: max(0, mean * num_layers - sum(budgets))]:  # hand out the rounding remainder
        budgets[i] += 1
    return budgets


def pyramid_fractions(keep: float, num_layers: int, beta: float) -> list[float]:
    """Per-layer kept fractions with mean ``keep``, shaped like a pyramid and capped at 1 (the excess of
    capped layers goes to the others in proportion to their weights)."""
    weights = pyramid_weights(num_layers, beta)
    fractions = [keep * w for w in weights]
    while any(f > 1.0 + 1e-12 for f in fractions):
        excess = sum(f - 1.0 for f in fractions if f > 1.0)
        free = [i for i, f in enumerate(fractions) if f < 1.0]
        if not free:
            break
        fractions = [min(f, 1.0) for f in fractions]
        share = sum(weights[i] for i in free)
        for i in free:
            fractions[i] += excess * weights[i] / share
    return fractions


@dataclass
class PyramidKVPolicy(Policy):
    """Give layer ``i`` a copy of ``policy`` whose budget shrinks with depth; the mean over layers is
    ``budget`` (or ``1 - compression_ratio`` of the tokens seen). ``beta`` sets the steepness: the last
    layer gets ``1/beta`` of the mean (above the policy's reserved window). With ``compression_ratio``
    the prompt length is unknown when layers are built, so the whole kept fraction is shaped (no window
    is reserved) and layers that would keep more than everything are capped, their excess spread.
    ``storage`` applies to every layer's copy."""

    TEST_PARAMS = {"budget": 12, "compression_ratio": None, "beta": 4}
    FUZZ = [{**alt, "beta": [1, 4, 20, 30]} for alt in BUDGETS]
    MEMORY_VARIANTS = [
        {"budget": None, "compression_ratio": 0.5},
        {"budget": 100, "compression_ratio": None, "policy": {"_target_": "kvcompress.selectors.H2OPolicy"}},
    ]

    policy: object = field(default_factory=lambda: dict(_SNAPKV))
    budget: int | None = Int(None, low=1, null=True)
    compression_ratio: float | None = Float(None, 0.0, 1.0, high_open=True, null=True)
    beta: float = Float(20.0, 1.0, 1e9)

    def __post_init__(self):
        try:
            probe = self.policy if isinstance(self.policy, Policy) else self._inner(1, None)
        except TypeError as err:  # a policy without budget / compression_ratio fields
            raise ValueError(f"pyramidkv.policy={self.policy!r} must be an eviction policy ({err})") from err
        if not isinstance(probe, EvictionPolicy):
            allowed = "h2o, snapkv, tova"
            raise ValueError(f"pyramidkv.policy must be an eviction policy ({allowed}), got {probe.name}")
        check_one_budget(self)
        super().__post_init__()
        self._schedules: dict = {}

    @property
    def evicts(self) -> str:
        return self._inner(1, None).evicts

    def _inner(self, budget: int | None, ratio: float | None) -> EvictionPolicy:
        """A copy of the inner policy at ``budget`` / ``ratio``, on the layers this policy's ``apply_to``
        names (the inner policy's own ``apply_to`` is overridden: the one asked for is pyramidkv's)."""
        fields = {"budget": budget, "compression_ratio": ratio, "apply_to": self.apply_to}
        if isinstance(self.policy, Policy):
            return dataclasses.replace(self.policy, **fields)
        return _as_policy({**dict(self.policy), **fields})

    def schedule(self, num_layers: int) -> SchedulePolicy:
        """The per-layer schedule this policy stands for (the same object for a given depth)."""
        if num_layers in self._schedules:
            return self._schedules[num_layers]
        if self.budget is not None:
            budgets = pyramid_budgets(self.budget, num_layers, self.beta, self._inner(1, None).reserved)
            per_layer = [self._inner(b, None) for b in budgets]
        else:
            keep = pyramid_fractions(1.0 - self.compression_ratio, num_layers, self.beta)
            per_layer = [self._inner(None, max(0.0, 1.0 - f)) for f in keep]
        rules = [{"layers": i, "policy": p} for i, p in enumerate(per_layer)]
        axes = {"storage": self.storage, "apply_to": self.apply_to}
        self._schedules[num_layers] = SchedulePolicy(rules=rules, **axes)
        return self._schedules[num_layers]

    def budgets(self, num_layers: int) -> list:
        """Each layer's budget (or compression ratio), for reports."""
        return [r["policy"].budget or r["policy"].compression_ratio for r in self.schedule(num_layers).rules]

    def check(self, spec: ModelSpec) -> None:
        self.schedule(spec.num_layers).check(spec)

    def prepare(self, model) -> None:
        from kvcompress.core.cache import model_spec

        self.schedule(model_spec(model).num_layers).prepare(model)

    def covering(self, n_tokens: int) -> Policy:
        axes = {"storage": self.storage, "apply_to": self.apply_to}
        return SchedulePolicy(default=self._inner(n_tokens, None), **axes).covering(n_tokens)

    def layer(self, layer_idx: int, spec: ModelSpec) -> PolicyLayer:
        return self.schedule(spec.num_layers).layer(layer_idx, spec)

    def describe(self) -> dict:
        inner = {
            k: v
            for k, v in self._inner(1, None).describe().items()
            if k not in ("budget", "compression_ratio", "apply_to")
        }
        fields = {"budget": self.budget, "compression_ratio": self.compression_ratio, "beta": self.beta}
        if self.apply_to != "full_attention":  # the default stays out: records of earlier runs unchanged
            fields["apply_to"] = self.apply_to
        return {"name": self.name, "policy": inner, **fields, "storage": self.storage.describe()}
