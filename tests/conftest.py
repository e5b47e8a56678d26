"""Tiny random models (fixed seed) for unit tests; the embedded model only in `integration` tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
POLICY_NAMES = sorted(p.stem for p in (CONF_DIR / "policy").glob("*.yaml"))

# Budgets small enough that a 48-token test sequence is really compressed; policies not listed use
# their defaults. A new policy adds its line here.
SMALL = {
    "sliding_window": {"sink_tokens": 2, "window": 12},
    "window_schedule": {
        "default": {"_target_": "kvcompress.policies.SlidingWindowPolicy", "sink_tokens": 2, "window": 12}
    },
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
