"""Decode-mode perplexity of the embedded model under every registered policy, bit for bit: two checkouts
compared.

A refactor that must not change behaviour (a package move, a new executor) should leave every NLL identical
to the last bit and every cache the same size. Run it once per checkout and compare the JSON files:

    PYTHONPATH=/path/to/old/checkout python scripts/bit_equal.py old.json
    python scripts/bit_equal.py new.json
    python -c "import json,sys; a,b=(json.load(open(p)) for p in sys.argv[1:]); print(a==b)" old.json new.json

Each line: the mean NLL over 299 predictions (300 tokens, one per step) as a float hex, and
``memory_bytes()`` at the end. The cases are the settings below, every registered policy at its defaults
(``default:<name>``) and the prefix perplexity (200 prompt tokens in one prefill, the context pass where the
policy needs one, then 99 streamed) of the prefill-time selectors (``prefix:<name>``). Extra arguments after
the output file run only the named cases.
"""

from __future__ import annotations

import json
import sys

import torch

import kvcompress
from kvcompress.metrics.perplexity import decode_perplexity
from kvcompress.runtime.context_pass import after_prefill

EVICT = {"budget": 64, "compression_ratio": None}
CASES = {
    "full": ("full", {}),
    "sliding_window": ("sliding_window", {"sink_tokens": 4, "window": 60}),
    "h2o": ("h2o", EVICT),
    "snapkv": ("snapkv", {**EVICT, "slack": 8}),
    "tova": ("tova", EVICT),
    "quant4": ("quant", {}),
    "quant2": ("quant", {"bits": 2}),
    "block_sparse": ("block_sparse", {"top_k_blocks": 3}),
    "block_evict": ("block_evict", {"budget": 128, "compression_ratio": None}),
    "tiered": ("tiered", {}),
    "pyramidkv": ("pyramidkv", EVICT),
    "expected_attention": ("expected_attention", EVICT),
    "low_rank": ("low_rank", {"rank": 32}),
    "snapkv_int4": ("snapkv", {**EVICT, "storage": {"name": "quant", "bits": 4}}),
}
PREFIX = ("snapkv", "kvzip", "tiered", "pyramidkv", "expected_attention")
PREFIX_TOKENS = 200


def cases() -> dict:
    """Every case: ``{name: (policy, params, prefix_tokens or None)}``."""
    out = {name: (policy, params, None) for name, (policy, params) in CASES.items()}
    out |= {f"default:{name}": (name, {}, None) for name in kvcompress.known_policies()}
    return out | {f"prefix:{name}": (name, {}, PREFIX_TOKENS) for name in PREFIX}


def main(out: str, only: list[str]) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, tokenizer = kvcompress.load_model()
    ids = tokenizer(kvcompress.load_text(), return_tensors="pt").input_ids[:, :300]
    after = after_prefill(model, tokenizer)
    results = {}
    for name, (policy, params, prefix) in cases().items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        cache = kvcompress.build_cache(policy, model, **params)
        r = decode_perplexity(model, ids, cache, progress=False, prefix_tokens=prefix, after_prefix=after)
        results[name] = [float(r["nll"]).hex(), cache.memory_bytes()]
        print(name, *results[name], flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
