"""The parameter sets that reproduce kvpress: each kvpress press (with its kwargs) beside the kvcompress
policy config that makes the same choices. Plain data, read by both sides of the differential test (this
file imports nothing, so the kvpress venv can load it too).

Each entry: ``press`` (a kvpress class name and its kwargs; ``press`` inside it is the inner scorer of a
wrapper), ``ours`` (a kvcompress policy: a registered name or a ``_target_``, and its fields), ``expect``
(what the tiny models' test asserts: 1.0, the same kept sets; ``"newest"``, sets that differ at most by the
prompt's last token; None, a named deviation in docs/methods.md, measured) and ``note`` (why).
``compression_ratio`` is added to both sides at run time (to the inner press of a wrapper).
``window_from_keep``: our window is sized per prompt as kvpress sizes it, ``int(T * (1 - ratio)) - sinks``.
"""

KVPRESS_VERSION = "0.5.5"

SNAPKV_PRESS = {"name": "SnapKVPress", "window_size": 64, "kernel_size": 5}
SNAPKV_OURS = {"name": "snapkv", "observation_window": 64, "kernel_size": 5, "pooling": "avg"}

METHODS = {
    "snapkv": {
        "press": SNAPKV_PRESS,
        "ours": SNAPKV_OURS,
        "expect": 1.0,
        "note": "kvpress's window is 64 queries; ours defaults to 32 (the SnapKV paper's code), so 64 is set",
    },
    "tova": {
        "press": {"name": "TOVAPress"},
        "ours": {"name": "tova", "evict_at": "prefill"},
        "expect": "newest",
        "note": "kvpress always keeps the prompt's last token (its own 'very slight difference from TOVA'); "
        "TOVA's paper protects none, so a head may keep another token in its place",
    },
    "knorm": {
        "press": {"name": "KnormPress"},
        "ours": {"name": "knorm"},
        "expect": 1.0,
        "note": "the package's knorm at its defaults, as kvpress: the prompt ranked once, no recent window",
    },
    "streaming_llm": {
        "press": {"name": "StreamingLLMPress", "n_sink": 4},
        "ours": {"name": "sliding_window", "sink_tokens": 4, "window_from_keep": True},
        "expect": 1.0,
        "note": "ours holds a fixed window; it is sized per prompt to kvpress's int(T(1-r)) - 4",
    },
    "keydiff": {
        "press": {"name": "KeyDiffPress"},
        "ours": {"name": "keydiff", "evict_at": "prefill"},
        "expect": 1.0,
        "note": "kvpress compresses at the prefill only: evict_at=prefill (KeyDiff's default is always)",
    },
    "expected_attention": {
        "press": {"name": "ExpectedAttentionPress", "n_future_positions": 512, "n_sink": 4},
        "ours": {"name": "expected_attention", "future_positions": 512, "sink_tokens": 4},
        "expect": 1.0,
        "note": "",
    },
    "pyramidkv": {
        "press": {"name": "PyramidKVPress", "window_size": 64, "kernel_size": 5, "beta": 20},
        "ours": {
            "_target_": "kvcompress.selectors.PyramidKVPolicy",
            "beta": 20,
            "variant": "kvpress",
            "policy": {"_target_": "kvcompress.selectors.SnapKVPolicy", "observation_window": 64},
        },
        "expect": 1.0,
        "note": "kvpress counts the window inside each layer's share (variant=kvpress; default: the paper's)",
    },
    "snapkv_defaults": {
        "press": SNAPKV_PRESS,
        "ours": {"name": "snapkv"},
        "expect": None,
        "note": "our defaults (the SnapKV paper's code: window 32) against kvpress's (64): the effect",
    },
    "pyramidkv_defaults": {
        "press": {"name": "PyramidKVPress", "window_size": 64, "kernel_size": 5, "beta": 20},
        "ours": {"name": "pyramidkv"},
        "expect": None,
        "note": "our defaults (the paper's code: window 32 on top of each layer's share) against kvpress's",
    },
    "adakv_snapkv": {
        "press": {"name": "AdaKVPress", "alpha_safeguard": 0.2, "press": SNAPKV_PRESS},
        "ours": {**SNAPKV_OURS, "adaptive": True, "adaptive_floor": 0.2},
        "expect": 1.0,
        "note": "kvpress masks the evicted pairs inside the full cache, ours stores each head's own set",
    },
    "chunkkv_snapkv": {
        "press": {"name": "ChunkKVPress", "chunk_length": 20, "press": SNAPKV_PRESS},
        "ours": {**SNAPKV_OURS, "unit": "chunk", "chunk_size": 20},
        "expect": None,
        "note": "kvpress picks one chunk set for all heads (scores summed over heads), ours per KV head",
    },
    "kvzip": {
        "press": {"name": "KVzipPress", "n_sink": 4, "chunk_size": 2048},
        "ours": {"name": "kvzip", "sink_tokens": 4, "context_chunk": 2048, "budget_scope": "model"},
        "expect": None,
        "note": "measured: the reconstruction prompts and chat turn differ between the two",
    },
}
