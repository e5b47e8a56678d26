"""Predicted cache bytes: what a policy should hold, from its parameters and the model's shape alone.

``predicted_bytes`` is an independent account of ``KVCache.memory_bytes()``: it never builds a layer or
reads a tensor. Each selector declares, next to its code, how many tokens a layer keeps
(``Policy.kept_tokens``) and what its own state costs (``Policy.state_bytes``); each storage declares what
that many tokens cost (``Storage.bytes_for``) plus its per-layer constants (``Storage.fixed_bytes``). The
benchmark reports measured / predicted (``bytes_vs_predicted``) and
``tests/memory_model/test_memory_model.py`` holds every selector x storage pair to it.

Scope: one prefill forward of ``n_tokens`` (not chunked), then ``decode_tokens`` single-token steps,
``batch`` rows without padding. Dense layers keep their keys/values in growable buffers
(``storage/buffers.py``) with ``headroom(t) = t // 128`` spare token slots, real memory that
``memory_bytes()`` counts; the prediction counts the tokens kept, so a measurement may exceed it by up to
1/128 (0.8%), and equals it below 128 stored tokens.

A prediction is ``None``, never a guess, when a formula is missing (a policy class that declares none
beyond the default), when ranks come from calibration data (``low_rank`` with ``energy``), or when a
selector that evicts at decode steps runs over a storage with a full-precision window (which tokens the
window holds then depends on the scores).
"""

from kvcompress.core.spec import Shape
from kvcompress.memory_model.core import layer_policy_of, predicted_bytes, predicted_for_model

__all__ = ["Shape", "layer_policy_of", "predicted_bytes", "predicted_for_model"]
