"""``model.linears=packed``: oneDNN linears on weights packed once give the default path's logits (float
rounding aside) with every ``nn.Linear`` replaced, a row decoded in a batch matches it alone (float rounding
aside: what lm-eval's batch-1 scores need), and settings it cannot serve are refused by name."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny

from kvcompress import build_cache
from kvcompress.resources import packed_linears

pytestmark = pytest.mark.skipif(
    packed_linears.unavailable(make_tiny("llama")) is not None, reason="no oneDNN linear in this torch build"
)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased q/k/v projections
def test_packed_model_gives_the_default_logits(family):
    model = make_tiny(family)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    ids = torch.randint(0, 90, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids).logits
        assert packed_linears.apply(model, "packed") == linears > 0
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert model.lm_head.weight is model.model.embed_tokens.weight or not model.config.tie_word_embeddings


def test_a_rows_decode_logits_in_a_batch_match_it_alone():
    model = make_tiny("llama")
    packed_linears.apply(model, "packed")
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 90, (8, 12), generator=gen)
    with torch.inference_mode():
        rows = []
        for batch in (ids, ids[:1]):
            cache = build_cache("full", model)
            model(batch[:, :-1], cache=cache, use_cache=True)
            rows.append(model(batch[:, -1:], cache=cache, use_cache=True).logits[0])
    torch.testing.assert_close(rows[0], rows[1], rtol=1e-5, atol=1e-5)


def test_default_leaves_the_model_and_bad_settings_are_refused():
    model = make_tiny("llama")
    assert packed_linears.apply(model, "default") == 0 == packed_linears.apply(model, None)
    assert any(type(m) is torch.nn.Linear for m in model.modules())
    allowed = r"model.linears='fast' is unknown; allowed: \['default', 'packed'\]"
    with pytest.raises(ValueError, match=allowed):
        packed_linears.apply(model, "fast")
    with pytest.raises(ValueError, match=r"model.linears='packed' needs a float32 model on the CPU"):
        packed_linears.apply(make_tiny("llama", dtype=torch.bfloat16), "packed")


def test_a_run_records_its_packed_linears_and_refuses_unknown_ones(tmp_path, tiny_checkpoint, fake_cache):
    from helpers import fake_essay, run_config

    from kvcompress.harness.app import run_experiment

    (tmp_path / "essays.txt").write_text(" ".join(fake_essay(i) for i in range(3)))
    runs = {
        name: run_experiment(run_config(tiny_checkpoint, tmp_path, f"model.linears={name}"), tmp_path / name)
        for name in ("default", "packed")
    }
    assert runs["default"]["environment"]["packed_linears"] == 0
    assert runs["packed"]["environment"]["packed_linears"] > 0
    ppl = [runs[k]["metrics"]["perplexity"] for k in ("default", "packed")]
    assert ppl[1] == pytest.approx(ppl[0], rel=1e-5)
    with pytest.raises(ValueError, match="model.linears='fast' is unknown"):
        run_experiment(run_config(tiny_checkpoint, tmp_path, "model.linears=fast"), tmp_path / "fast")
