"""Predicted cache bytes: what a policy should hold, from its parameters and the model's shape alone.

``predicted_bytes`` is an independent account of ``KVCache.memory_bytes()``: it never builds a layer
or reads a tensor, it applies each policy's documented keep rule to the token count. The benchmark
reports measured / predicted (``bytes_vs_predicted``) and ``tests/test_memory_model.py`` holds every
policy to it.

Scope: one prefill forward of ``n_tokens`` (not chunked), then ``decode_tokens`` single-token steps,
``batch`` rows without padding. Below, per layer: ``kv(t) = 2 * B * H_kv * t * D * e`` (keys and values
of ``t`` tokens, ``e = dtype_bytes``) and ``T = n_tokens + decode_tokens``. Dense layers keep their
keys/values in growable buffers (``policies/storage.py``) with ``headroom(t) = t // 128`` spare token
slots, real memory that ``memory_bytes()`` counts; the prediction counts the tokens a policy keeps, so
a measurement may exceed it by up to 1/128 (0.8%), and equals it below 128 stored tokens.

Policies are matched by exact type: a policy this module has no formula for (a subclass of a known
one included) gives ``None``, never a guess. So does a ``low_rank`` policy with
``energy`` (its ranks come from calibration data, not its parameters). Without padding no layer holds a
validity mask, so none is counted.
"""

from kvcompress.memory_model import blocks, dense, eviction  # noqa: F401  (register the formulas)
from kvcompress.memory_model.core import Shape, formula, layer_policy_of, predicted_bytes, predicted_for_model

__all__ = ["Shape", "formula", "layer_policy_of", "predicted_bytes", "predicted_for_model"]
