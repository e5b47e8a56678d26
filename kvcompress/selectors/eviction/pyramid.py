"""PyramidKV budgets: a fixed total split over layers so that the budget shrinks with depth.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
arXiv 2406.02069. Built on the schedule mechanism: every layer gets its own copy of an eviction
policy (SnapKV by default, as in the paper) whose kept count is its share of the pyramid (``layer_keep``),
computed from the prompt's length as the paper's reference code does (KVCache-Factory, ``PyramidKVCluster``,
commit c97f9d7), or as kvpress 0.5.5's ``PyramidKVPress`` does (``variant: kvpress``).

``evict_at`` is handed to the inner policy (each layer then evicts at prefill only, or at decode steps too,
keeping its pyramid share of the tokens seen); left null, the inner policy's own (SnapKV's ``prefill``, the
paper's). A ``threshold`` is refused: it replaces the budget, and the pyramid is a schedule of budgets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial

from kvcompress.core.fields import Choice, Float, Int
from kvcompress.core.policy import ModelSpec, Policy, PolicyLayer
from kvcompress.selectors.eviction.base import BUDGETS, EvictionPolicy, check_one_budget
from kvcompress.selectors.eviction.when import EVICT_AT
from kvcompress.selectors.schedule import SchedulePolicy, _as_policy

_SNAPKV = {"_target_": "kvcompress.selectors.SnapKVPolicy"}
VARIANTS = ("reference", "kvpress")
WHEN = (None, *EVICT_AT)  # None: the inner policy's own evict_at


def reference_keep(n: int, layer: int, layers: int, mean: int, window: int, beta: float) -> int:
    """Tokens layer ``layer`` keeps of ``n`` in the reference code: ``mean`` (max_capacity_prompt) per layer,
    of which ``window`` is the observation window; the part above it runs linearly from ``max_num`` (the
    first layer, at most ``n - window``) down to ``min_num`` (``(mean - window) // beta``), integer steps."""
    prefix = mean - window
    if n < mean or prefix <= 0:
        return min(n, mean)
    if n < 2 * prefix:  # a short prompt: every layer keeps ``mean`` (the reference's uniform branch)
        return mean
    low = int(prefix // beta)
    high = 2 * prefix - low
    if high >= n - window:
        high, low = n - window, 2 * prefix - (n - window)
    steps = (high - low) // (layers - 1) if layers > 1 else 0
    return high - layer * steps + window


def kvpress_keep(n: int, layer: int, layers: int, mean: float, window: int, beta: float) -> int:
    """The same pyramid as kvpress 0.5.5 sizes it: the window counts inside each layer's share, shares are
    floats rounded per layer, and a pyramid whose last layer would keep less than ``window`` is uniform."""
    low = mean / beta
    high = 2 * mean - low
    if high >= n - window:
        high, low = n - window, 2 * mean - (n - window)
    if not n >= high >= low >= window:
        return max(1, round(mean))
    steps = (high - low) / (layers - 1) if layers > 1 else 0.0
    return round(high - layer * steps)


def layer_keep(
    n: int, *, layer: int, layers: int, budget, ratio, window: int, beta: float, variant: str
) -> int:
    """Layer ``layer``'s kept count after ``n`` tokens: its share of a pyramid whose mean is ``budget`` (or
    ``n * (1 - ratio)``), in [1, n]."""
    if variant == "kvpress":
        mean = budget if budget is not None else n * (1.0 - ratio)
        return max(1, min(n, kvpress_keep(n, layer, layers, mean, window, beta)))
    mean = budget if budget is not None else max(1, int(n * (1.0 - ratio) + 1e-9))
    return max(1, min(n, reference_keep(n, layer, layers, mean, window, beta)))


@dataclass
class PyramidKVPolicy(Policy):
    """Give layer ``i`` a copy of ``policy`` whose kept count shrinks with depth: the mean over layers is
    ``budget`` (or ``1 - compression_ratio`` of the tokens seen). Each layer's share is computed from the
    prompt's length at prefill (``layer_keep``): the first layer keeps up to all but the window, the last
    ``1/beta`` of the mean above the window. ``variant``: ``reference`` (the paper's code: the window on top
    of each layer's pyramid share, integer steps) or ``kvpress`` (kvpress 0.5.5: the window inside it).
    ``storage`` applies to every layer's copy.

    Args:
        evict_at: prefill | always, handed to every layer's copy of ``policy`` (refused by name where that
            policy refuses it); null: the policy's own (SnapKV's: prefill, the paper's).
        threshold: refused (null only): a threshold replaces the budget, which is what the pyramid
            schedules; a threshold over SnapKV's scores is ``snapkv.threshold``.
    """

    TEST_PARAMS = {"budget": 12, "compression_ratio": None, "beta": 4}
    # not always: snapkv then holds its last queries, above a short sequence's full cache (as snapkv's FUZZ)
    FUZZ = [{**alt, "beta": [1, 4, 20, 30], "evict_at": [None, "prefill"]} for alt in BUDGETS]
    MEMORY_VARIANTS = [
        {"budget": None, "compression_ratio": 0.5},
        {"budget": 100, "compression_ratio": None, "policy": {"_target_": "kvcompress.selectors.H2OPolicy"}},
        {"budget": None, "compression_ratio": 0.5, "evict_at": "always"},
        {"budget": 100, "compression_ratio": None, "evict_at": "prefill",
         "policy": {"_target_": "kvcompress.selectors.H2OPolicy"}},
    ]  # fmt: skip

    policy: object = field(default_factory=lambda: dict(_SNAPKV))
    budget: int | None = Int(None, low=1, null=True)
    compression_ratio: float | None = Float(None, 0.0, 1.0, high_open=True, null=True)
    beta: float = Float(20.0, 1.0, 1e9)
    variant: str = Choice("reference", VARIANTS)
    evict_at: str | None = Choice(None, WHEN)
    threshold: float | None = Choice(None, (None,))  # declared to be refused by name (``_threshold_refusal``)
    sizes_served = ("budget", "compression_ratio")  # what ``when.check_one_budget`` offers

    def __post_init__(self):
        why = self._threshold_refusal()
        if why:
            raise ValueError(why)
        try:
            probe = self.policy if isinstance(self.policy, Policy) else self._made(budget=1)
        except (TypeError, ValueError) as err:  # a policy without budget / compression_ratio fields
            raise ValueError(f"pyramidkv.policy={self.policy!r} must be an eviction policy ({err})") from err
        if not isinstance(probe, EvictionPolicy):
            allowed = "h2o, snapkv, tova"
            raise ValueError(f"pyramidkv.policy must be an eviction policy ({allowed}), got {probe.name}")
        check_one_budget(self)
        super().__post_init__()
        self._schedules: dict = {}
        why = self._when_refusal()
        if why:
            raise ValueError(why)

    def _config(self) -> dict:
        """The inner policy's config entries (none for a policy object: its fields are its own)."""
        try:
            return {} if isinstance(self.policy, Policy) else dict(self.policy)
        except (TypeError, ValueError):  # not a config: the probe refuses it
            return {}

    def _threshold_refusal(self) -> str | None:
        """Why a threshold (pyramidkv's or its policy's) cannot be served: it leaves no budget to schedule."""
        inner = self._config().get("threshold", getattr(self.policy, "threshold", None))
        where, value = ("threshold", self.threshold) if inner is None else ("policy.threshold", inner)
        if value is None:
            return None
        return (
            f"pyramidkv.{where}={value!r} is not served: a threshold replaces the budget, and pyramidkv is "
            "a schedule of per-layer budgets, so it would have nothing to schedule (every layer keeping the "
            f"pairs over the same threshold); use policy=snapkv threshold={value} (snapkv.threshold) for a "
            "threshold over SnapKV's scores; allowed: [None]"
        )

    def _when_refusal(self) -> str | None:
        """Why ``evict_at`` cannot be handed to the inner policy, or None."""
        if self.evict_at is None:
            return None
        own = self._config().get("evict_at")
        if own is not None and own != self.evict_at:
            return (
                f"pyramidkv.evict_at={self.evict_at!r} and pyramidkv.policy.evict_at={own!r} disagree: set "
                "one of them"
            )
        served, why = [None], None
        for at in EVICT_AT:
            try:
                self._made(budget=1, evict_at=at)
                served.append(at)
            except ValueError as err:
                why = str(err) if at == self.evict_at else why
        if why is None:
            return None
        return f"pyramidkv.evict_at={self.evict_at!r} is not served by its policy ({why}); allowed: {served}"

    @property
    def evicts(self) -> str:
        return self._inner(1, None).evicts

    def _made(self, **fields) -> Policy:
        """A copy of the inner policy with ``fields`` replaced, on the layers this policy's ``apply_to``
        names (the inner policy's own ``apply_to`` is overridden: the one asked for is pyramidkv's)."""
        fields = {"compression_ratio": None, "apply_to": self.apply_to, **fields}
        if isinstance(self.policy, Policy):
            return dataclasses.replace(self.policy, **fields)
        return _as_policy({**dict(self.policy), **fields})

    def _inner(self, budget: int | None, ratio: float | None) -> EvictionPolicy:
        """A copy of the inner policy at ``budget`` / ``ratio`` and this policy's ``evict_at`` (if set)."""
        when = {} if self.evict_at is None else {"evict_at": self.evict_at}
        return self._made(budget=budget, compression_ratio=ratio, **when)

    def schedule(self, num_layers: int) -> SchedulePolicy:
        """The per-layer schedule this policy stands for (the same object for a given depth): copies of the
        inner policy at the mean budget / ratio, each sized by its layer's ``layer_keep`` (set on the copies
        the schedule assigns, after it has put them over this policy's storage)."""
        if num_layers in self._schedules:
            return self._schedules[num_layers]
        inner = [self._inner(self.budget, self.compression_ratio) for _ in range(num_layers)]
        rules = [{"layers": i, "policy": p} for i, p in enumerate(inner)]
        schedule = SchedulePolicy(rules=rules, storage=self.storage, apply_to=self.apply_to)
        for i, layer_policy in enumerate(schedule.assignment(num_layers)):
            layer_policy.keep_rule = partial(
                layer_keep, layer=i, layers=num_layers, budget=self.budget, ratio=self.compression_ratio,
                window=layer_policy.reserved, beta=self.beta, variant=self.variant,
            )  # fmt: skip
        self._schedules[num_layers] = schedule
        return schedule

    def budgets(self, num_layers: int, n_tokens: int) -> list[int]:
        """Each layer's kept count after a prompt of ``n_tokens``, for reports."""
        return [p.keep_count(n_tokens) for p in self.schedule(num_layers).assignment(num_layers)]

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
        if self.variant != "reference":  # the default stays out: records of earlier runs unchanged
            fields["variant"] = self.variant
        if self.evict_at is not None:  # unset stays out (the inner's, in ``policy``): records unchanged
            fields["evict_at"] = self.evict_at
        if self.apply_to != "full_attention":  # the default stays out: records of earlier runs unchanged
            fields["apply_to"] = self.apply_to
        return {"name": self.name, "policy": inner, **fields, "storage": self.storage.describe()}
