"""Tiny random models (fixed seed) for unit tests; the embedded model only in `integration` tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
POLICY_NAMES = sorted(p.stem for p in (CONF_DIR / "policy").glob("*.yaml"))

_QUANT = "kvcompress.policies.QuantPolicy"

# Budgets small enough that a 48-token test sequence is really compressed; policies not listed use
# their defaults. A new policy adds its line here.
SMALL = {
    "sliding_window": {"sink_tokens": 2, "window": 12},
    "quant": {"bits": 4, "group_size": 4, "residual_length": 8},
    "mixed_precision": {
        "default": {"_target_": _QUANT, "bits": 8, "group_size": 4, "residual_length": 8},
        "rules": [
            {"layers": "0", "policy": {"_target_": "kvcompress.policies.FullPolicy"}},
            {
                "layers": "-1:",
                "policy": {"_target_": _QUANT, "bits": 2, "group_size": 4, "residual_length": 8},
            },
        ],
    },
    "h2o": {"budget": 12, "compression_ratio": None, "recent": 4, "window": 6},
    "snapkv": {"budget": 12, "compression_ratio": None, "window": 4, "kernel_size": 3, "slack": 3},
    "tova": {"budget": 12, "compression_ratio": None},
    "pyramidkv": {"budget": 12, "compression_ratio": None, "beta": 4},
    "block_sparse": {"block_size": 4, "top_k_blocks": 3},
    "block_evict": {
        "block_size": 4,
        "budget": 16,
        "keep_ratio": None,
        "sink_tokens": 2,
        "recent": 4,
        "window": 4,
    },
    "low_rank": {"rank": 4, "residual_length": 4, "calibration_text": "random", "calibration_tokens": 64},
    "window_schedule": {
        "default": {"_target_": "kvcompress.policies.SlidingWindowPolicy", "sink_tokens": 2, "window": 12}
    },
}

# Policies that keep metadata on top of a full cache may exceed the 5% default slack of the contract test.
MAX_MEMORY_RATIO = {
    "block_sparse": 1.3,  # Quest: page key min/max, 1/block_size of K+V
    "h2o": 1.07,  # float32 score + int32 position per token and head: 6.25% of K+V at head_dim 16
}


def _common(**extra):
    return dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=95,
        bos_token_id=1,
        **extra,
    )


def make_tiny(family: str = "llama", dtype=torch.float32, attn="sdpa"):
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_common(), attn_implementation=attn))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_common(), attn_implementation=attn))
    else:
        raise ValueError(family)
    return model.to(dtype).eval()


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model(request):
    return make_tiny(request.param)


@pytest.fixture
def llama():
    return make_tiny("llama")


@pytest.fixture
def tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, 95, (1, 48), generator=g)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Folder of a tiny random Llama + byte-level tokenizer: loads like any local HF model."""
    from helpers import fake_essay, save_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny_checkpoint")
    save_tiny_checkpoint(path, [fake_essay(i) for i in range(4)])
    return path


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """An asset cache (KVCOMPRESS_CACHE) holding four short fake essays; no network, no real assets."""
    from helpers import write_fake_essays

    root = tmp_path / "kvc_cache"
    write_fake_essays(root)
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    return root


@pytest.fixture(scope="session")
def real_model():
    from kvcompress import load_model

    return load_model("smollm2-135m", device="cpu")


def make_char_tokenizer():
    """A character-level tokenizer matching the tiny models' 96-token vocabulary, with a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["<pad>", "\n"] + [chr(c) for c in range(32, 126)]  # 96 tokens; id 95 ('}') is the tiny eos
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token="<pad>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="}")
    fast.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    )
    return fast


@pytest.fixture(scope="session")
def char_tokenizer():
    return make_char_tokenizer()
