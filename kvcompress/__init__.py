"""kvcompress: KV-cache compression policies as transformers cache layers, measured honestly."""

from kvcompress.cache import KVCache, build_cache, known_policies, make_policy
from kvcompress.context_pass import compress_context
from kvcompress.data import load_text
from kvcompress.models import load_model
from kvcompress.persist import load_cache

__version__ = "0.1.0"
__all__ = [
    "KVCache",
    "build_cache",
    "compress_context",
    "known_policies",
    "load_cache",
    "load_model",
    "load_text",
    "make_policy",
    "__version__",
]
