"""Measurements: decode-mode perplexity, true cache memory, prefill/decode speed."""

from kvcompress.metrics.memory import peak_rss_bytes
from kvcompress.metrics.perplexity import NonFiniteError, decode_perplexity
from kvcompress.metrics.speed import measure_speed

__all__ = ["NonFiniteError", "decode_perplexity", "measure_speed", "peak_rss_bytes"]
