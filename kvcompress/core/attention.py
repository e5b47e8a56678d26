"""The one place that hooks attention (with ``cache.py`` and the layer's ``update``, the only code touching
transformers internals).

transformers builds one mask for all layers from the first layer's sizes and the 2D padding mask. After
eviction, per-layer budgets or per-head lengths, that mask is wrong, so a registered attention function
``"kvcompress"`` asks each policy layer for the plan of its step (what to read, masked from the layer's own
state), runs it with a backend (``kvcompress.core.executor``) and hands the layer what attention gave. The
matching mask function must be registered too: without it transformers silently drops the causal mask.

Each forward's own state (``ForwardState``): transformers hands the model's keyword arguments down to every
attention module, which passes them to ``cache.update(..., kwargs=kwargs)`` and then to the attention
function. ``install()`` adds a forward pre-hook that puts a fresh ``ForwardState`` into those arguments for
every forward whose cache is a kvcompress cache, so the layers and the attention function read this
forward's own state: no thread-local or module global carries a forward's padding or current layer, and
nothing survives into the next forward (a caller's own mask, another model in another thread).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from kvcompress.core import executor
from kvcompress.core.executor import execute
from kvcompress.core.plan import Call, Dense, Plan
from kvcompress.core.profiling import TIMER

NAME = "kvcompress"
BACKENDS = ("sdpa", "eager")
HOOKS = "_kvcompress_hooks"  # the model attribute holding install()'s hook handles
HIDDEN = "_kvcompress_hidden"  # the model attribute saying its attention modules hand over hidden states


# the model config attribute naming the kernel behind "kvcompress", and its value when unset
CONFIG_KEY, DEFAULT = "kvcompress_backend", "sdpa"


def backend_of(config) -> str:
    return getattr(config, CONFIG_KEY, DEFAULT)


def kvcompress_mask(*args, attention_mask=None, config=None, **kwargs):
    """Mask function: the backend's usual mask (policy layers mask from their own state instead; the
    forward's padding reaches them through its ``ForwardState``)."""
    fn = eager_mask if getattr(config, CONFIG_KEY, DEFAULT) == "eager" else sdpa_mask
    return fn(*args, attention_mask=attention_mask, config=config, **kwargs)


def kvcompress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered as ``"kvcompress"``: query (B, H, q, D), key/value (B, H_kv, T, D).

    The layer that stored this module's keys (this forward's own ``ForwardState`` says which) turns its step
    into a ``Plan`` (what attention reads); the backend that serves the plan's signature runs it, or, when
    none serves a compact read, the layer gives the same step as a dense read; the layer then finishes its
    step with what attention gave (its selector's scores). Without a kvcompress layer the plan is the dense
    read of ``key``/``value``.
    """
    state = kwargs.pop(KEY, None)
    layer = None if state is None else state.pending.pop(getattr(module, "layer_idx", -1), None)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    configured = getattr(module.config, CONFIG_KEY, DEFAULT)
    # plain softmax: no training dropout, logit soft-capping or learned sinks (``s_aux``)
    plain = not module.training and getattr(module.config, "attn_logit_softcapping", None) is None
    plain = plain and kwargs.get("s_aux") is None and getattr(module, "sinks", None) is None
    call = Call(module, query, scaling, kwargs, configured, dropout, plain)
    if layer is None:
        return execute(Plan(Dense(key, value, attention_mask)), call)[0], None
    if TIMER.enabled:  # policy time: the plan and what the layer does with attention's result
        TIMER.start()
    plan = layer.plan(query, key, value)
    found = executor.chosen(plan, call)
    if found is None:
        if plan.read.form == "dense" or plan.read.required:
            raise executor.refusal(plan, call)
        plan = layer.dense_plan(plan)  # no backend reads this compact form here: the same tokens, dense
        found = executor.chosen(plan, call)
        if found is None:
            raise executor.refusal(plan, call)
    if TIMER.enabled:
        TIMER.stop()
    backend, kernel = found
    out, probs = kernel(plan, call)
    if TIMER.enabled:
        TIMER.start()
    layer.attended(plan, call, out, probs, backend.name)
    if TIMER.enabled:
        TIMER.stop()
    return out, None


KEY = "kvcompress_forward"  # the keyword argument that carries the state through the model


class ForwardState:
    """One forward's padding (``attention_mask`` (B, T) with 0 for padding, or None when every token is
    real) and the layers whose ``update`` ran and whose attention has not run yet (``pending``: a layer
    puts itself there when it stored, the attention function takes it out)."""

    def __init__(self, attention_mask: torch.Tensor | None = None, cache=None):
        if attention_mask is not None and (
            not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2
        ):
            kind = (
                tuple(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask)
            )
            raise ValueError(
                f"attention_mask {kind}: a kvcompress cache masks from each layer's own stored tokens and "
                "takes only a 2D padding mask (B, T) with 0 for padding; a 4D or per-layer mask would be "
                "ignored, so it is refused"
            )
        self.padding = attention_mask
        self.cache = cache  # the cache this forward runs with (a layer may look at the next one)
        self._valid: dict = {}  # (q, device) -> validity of the forward's last q tokens, computed once
        self.pending: dict[int, object] = {}  # layer index -> the layer that stored and awaits attention
        self.hidden: dict[int, torch.Tensor] = {}  # layer index -> its attention's input (B, q, hidden)

    def new_token_validity(self, batch: int, q: int, device) -> torch.Tensor | None:
        """Validity (B, q) bool of this forward's new tokens, or None when all are real (one check per
        forward, shared by every layer)."""
        pad = self.padding
        if pad is None or pad.shape[0] != batch or pad.shape[-1] < q:
            return None
        key = (q, str(device))
        if key not in self._valid:
            new = pad[:, -q:].to(device=device, dtype=torch.bool)
            self._valid[key] = None if bool(new.all()) else new
        return self._valid[key]


def validity(state: ForwardState | None, batch: int, q: int, device) -> torch.Tensor | None:
    """``state.new_token_validity``; None without a state (a layer driven by hand, outside a model)."""
    return None if state is None else state.new_token_validity(batch, q, device)


def pre_hook(module, args, kwargs):
    """Forward pre-hook (``with_kwargs=True``): a fresh ``ForwardState`` for a forward with a kvcompress
    cache, built from its ``attention_mask``; an outer module's state (the causal-LM wrapper's) is kept."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not getattr(cache, "takes_forward_state", False) or KEY in kwargs:
        return None
    mask = kwargs.get("attention_mask")
    if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
        mask = args[1]  # model(input_ids, attention_mask, ...) positionally
    return args, {**kwargs, KEY: ForwardState(mask, cache)}


def hidden_hook(module, args, kwargs):
    """Forward pre-hook of a decoder layer's attention module: its input hidden states (B, q, hidden) go to
    this forward's ``ForwardState`` when the cache layer of ``module.layer_idx`` asks for them
    (``wants_hidden``, KVzap's surrogate); the layer takes them out in its ``update``."""
    state = kwargs.get(KEY)
    idx = getattr(module, "layer_idx", None)
    if state is None or idx is None or state.cache is None or idx >= len(state.cache.layers):
        return None
    if getattr(state.cache.layers[idx], "wants_hidden", False):
        state.hidden[idx] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return None


def attention_modules(model) -> list:
    """The decoder layers' attention modules (``*.self_attn`` with a ``layer_idx``)."""
    found = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "self_attn"]
    return [m for m in found if getattr(m, "layer_idx", None) is not None]


def register() -> None:
    """Register the attention and mask functions (idempotent)."""
    AttentionInterface.register(NAME, kvcompress_attention)
    AttentionMaskInterface.register(NAME, kvcompress_mask)


def install(model, hidden: bool = False) -> None:
    """Route ``model``'s attention through ``"kvcompress"``, keeping its sdpa/eager kernel as the backend (any
    other implementation is refused by name, never silently replaced), and hook its forward (and its base
    model's) so each forward hands its cache a fresh ``ForwardState``. ``hidden``: also hook each attention
    module so layers that want their input hidden states get them (``hidden_hook``)."""
    register()
    current = model.config._attn_implementation
    if current != NAME:
        model.config.kvcompress_backend = _served(current)
        model.set_attn_implementation(NAME)
    if not getattr(model, HOOKS, None):
        modules = {id(m): m for m in (model, getattr(model, "base_model", model))}.values()
        handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in modules]
        setattr(model, HOOKS, handles)
    if hidden and not getattr(model, HIDDEN, False):
        modules = attention_modules(model)
        if not modules:
            raise ValueError(
                f"{type(model).__name__} has no decoder attention modules named self_attn with a layer_idx: "
                "a policy that reads the layers' input hidden states (kvzap) cannot hook them"
            )
        getattr(model, HOOKS).extend(
            m.register_forward_pre_hook(hidden_hook, with_kwargs=True) for m in modules
        )
        setattr(model, HIDDEN, True)


def _served(implementation) -> str:
    """The model's own attention implementation, when a registered backend of that name runs it (``sdpa``,
    ``eager``; a GPU backend may add ``flash_attention_2``); refused by name otherwise, never swapped."""
    if implementation in BACKENDS and implementation in executor.names():
        return implementation
    raise ValueError(
        f"the model was loaded with attn_implementation={implementation!r}, which no kvcompress attention "
        f"backend runs (model kernels served: {[b for b in BACKENDS if b in executor.names()]}); load it "
        "with attn_implementation='sdpa' or 'eager'"
    )


def uninstall(model) -> None:
    """Undo ``install``: the model's own attention implementation again, no hooks (caches built for it then
    stop working with it)."""
    for handle in getattr(model, HOOKS, None) or ():
        handle.remove()
    setattr(model, HOOKS, None)
    setattr(model, HIDDEN, False)
    if model.config._attn_implementation == NAME:
        model.set_attn_implementation(backend_of(model.config))


def detach(model) -> None:
    """Undo every change ``install`` (and so ``build_cache``) made to ``model``: its own attention
    implementation again, no hooks, no kvcompress entry in its config. Caches built for it stop working
    with it."""
    uninstall(model)
    for name in (HOOKS, HIDDEN):
        if hasattr(model, name):
            delattr(model, name)
    if "kvcompress_backend" in vars(model.config):
        del model.config.kvcompress_backend


@contextlib.contextmanager
def attached(model):
    """``with attached(model): ...`` routes ``model``'s attention through kvcompress inside the block only
    (as kvpress's ``with press(model)``): afterwards its attention implementation, config and hooks are
    exactly as they were, whatever happened inside. A model already installed stays installed."""
    implementation = model.config._attn_implementation
    config_had = "kvcompress_backend" in vars(model.config)
    backend = getattr(model.config, "kvcompress_backend", None)
    hooked = bool(getattr(model, HOOKS, None))
    install(model)
    try:
        yield model
    finally:
        if hooked:  # it was installed before the block: as it was
            model.config.kvcompress_backend = backend
        else:
            detach(model)
            if config_had:
                model.config.kvcompress_backend = backend
        if model.config._attn_implementation != implementation:
            model.set_attn_implementation(implementation)


def set_backend(model, backend: str) -> None:
    """Choose the kernel behind ``"kvcompress"``: ``"sdpa"`` (default) or ``"eager"``, also for a model loaded
    with another implementation (then only by this explicit choice)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend={backend!r} is not supported; allowed: {list(BACKENDS)}")
    if model.config._attn_implementation != NAME:  # asked for by name: it replaces the model's own
        model.set_attn_implementation(backend)
    install(model)
    model.config.kvcompress_backend = backend
