"""kvcompress: KV-cache compression policies as transformers cache layers, measured honestly.

The public API is what this module exports. The package is layered (``.importlinter`` checks it): ``harness``
over ``eval`` over ``metrics`` and ``memory_model``, over ``persist``, ``runtime``, ``selectors``,
``storage``, ``kernels``, and at the bottom ``core`` and ``resources``; no module imports one above it.
"""

from kvcompress.core.attention import attached, detach
from kvcompress.core.cache import KVCache, build_cache, known_policies, make_policy
from kvcompress.kernels import backends as _backends
from kvcompress.persist import load_cache
from kvcompress.persist import save as save_cache
from kvcompress.resources.data import load_text
from kvcompress.resources.models import load_model
from kvcompress.runtime.context_pass import compress_context

_backends.install()  # the package's attention backends and lent kernels (kvcompress.kernels.backends)


def pipeline(model, tokenizer, policy="full", chat_template=None, **params):
    """One context, several questions: compress the context once, answer each from its snapshot
    (``kvcompress.harness.pipeline``; imported on first use, it pulls in the task helpers)."""
    from kvcompress.harness.pipeline import pipeline as make

    return make(model, tokenizer, policy, chat_template, **params)


__version__ = "0.1.0"
__all__ = [
    "KVCache",
    "attached",
    "build_cache",
    "compress_context",
    "detach",
    "known_policies",
    "load_cache",
    "load_model",
    "load_text",
    "make_policy",
    "pipeline",
    "save_cache",
    "__version__",
]
