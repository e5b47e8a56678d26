"""Per-document metrics of the kvcompress offline lm-eval tasks (copied next to the task YAMLs)."""

import re


def process_perplexity(doc, results):
    """Word/byte perplexity and bits per byte from a document's rolling log-likelihood."""
    (loglikelihood,) = results
    text = doc["page"]
    words = len(re.split(r"\s+", text.strip()))
    n_bytes = len(text.encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
    }
