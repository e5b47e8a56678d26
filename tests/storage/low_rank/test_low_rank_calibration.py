"""Low-rank calibration on a model the user loaded: its tokenizer found from ``name_or_path`` (a folder, a
GGUF file) or given, with an error naming every place tried; the calibration range recorded with each
result, and evaluation refused where it would read calibration text."""

from __future__ import annotations

import pytest
from helpers import fake_essay, save_tiny_gguf_tokenizer
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvcompress import build_cache
from kvcompress.core.cache import make_policy
from kvcompress.harness.tasks import perplexity as ppl_task
from kvcompress.storage.low_rank.calibration_text import find_tokenizer


@pytest.fixture
def essay(tmp_path):
    path = tmp_path / "essay.txt"
    path.write_text(fake_essay(0, words=300))  # a few hundred tokens: within the tiny model's context
    return path


@pytest.fixture
def user_model(tiny_checkpoint):
    """A model loaded with transformers directly, not through ``load_model``."""
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()


def low_rank(tmp_path, text, **kw):
    return {
        "rank": 4,
        "calibration_text": str(text),
        "calibration_tokens": 64,
        "calibration_dir": str(tmp_path),
        **kw,
    }


def test_tokenizer_from_the_models_folder(user_model, essay, tmp_path):
    cache = build_cache("low_rank", user_model, **low_rank(tmp_path, essay))
    span = cache.stats()[0]["calibration_range"]
    n = len(AutoTokenizer.from_pretrained(user_model.name_or_path)(essay.read_text()).input_ids)
    assert span["text"] == str(essay) and span["tokens"] == [n - 64, n]
    assert 0 < span["chars"][0] < span["chars"][1] == len(essay.read_text())


@pytest.mark.parametrize("where", ["folder", "file"])
def test_tokenizer_from_a_gguf_file(where, user_model, tiny_checkpoint, essay, tmp_path):
    folder = tmp_path / "gguf"
    save_tiny_gguf_tokenizer(folder, tiny_checkpoint)
    user_model.name_or_path = str(folder if where == "folder" else folder / "tiny.gguf")
    ref = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert find_tokenizer(user_model)("some text").input_ids == ref("some text").input_ids
    build_cache("low_rank", user_model, **low_rank(tmp_path, essay))


def test_tokenizer_argument_and_the_error_naming_what_was_tried(user_model, tiny_checkpoint, essay, tmp_path):
    (tmp_path / "bogus").mkdir()
    (tmp_path / "bogus" / "broken.gguf").write_bytes(b"not a gguf")
    user_model.name_or_path = str(tmp_path / "bogus")
    with pytest.raises(
        ValueError, match=r"model.name_or_path: tried '.*bogus' .*broken.gguf.*Pass tokenizer="
    ):
        build_cache("low_rank", user_model, **low_rank(tmp_path, essay))
    by_path = build_cache("low_rank", user_model, **low_rank(tmp_path, essay, tokenizer=str(tiny_checkpoint)))
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    by_object = build_cache("low_rank", user_model, **low_rank(tmp_path, essay, tokenizer=tok))
    assert by_object.policy.describe()["tokenizer"] == tok.name_or_path
    assert by_path.stats()[0]["calibration_range"] == by_object.stats()[0]["calibration_range"]
    with pytest.raises(ValueError, match=r"from tokenizer='nowhere': tried 'nowhere'"):
        build_cache("low_rank", user_model, **low_rank(tmp_path, essay, tokenizer="nowhere"))


def _ppl(model, tok, policy, text, max_tokens, **over):
    cfg = OmegaConf.load("kvcompress/conf/task/perplexity.yaml")
    cfg.update(text=str(text), max_tokens=max_tokens, slices=1, speed=False, progress=False)
    cfg.update(**over)
    return ppl_task.run(model, tok, policy, cfg)


def test_perplexity_records_the_calibration_range_and_refuses_an_overlap(user_model, essay, tmp_path):
    tok = find_tokenizer(user_model)
    policy = make_policy("low_rank", **low_rank(tmp_path, essay, calibration_tokens=100))
    n = len(tok(essay.read_text()).input_ids)
    metrics = _ppl(user_model, tok, policy, essay, 64)
    assert metrics["calibration_ranges"][0]["tokens"] == [n - 100, n]  # no special tokens in this tokenizer
    assert metrics["fixed_bytes"] > 0 and metrics["per_token_cache_ratio"] < metrics["cache_ratio"]
    assert metrics["shared_bytes"] > 0  # the pre-RoPE rotary table, reported beside the cache's bytes
    with pytest.raises(ValueError, match="must not see its calibration text"):
        _ppl(user_model, tok, policy, essay, n - 50)
    with pytest.raises(ValueError, match="must not see its calibration text"):  # only the 2nd slice overlaps
        _ppl(user_model, tok, policy, essay, 64, slices=2, slice_stride=n - 100)
    other = make_policy("low_rank", **low_rank(tmp_path, "random"))  # random ids: nothing to overlap
    assert _ppl(user_model, tok, other, essay, n - 50)["calibration_ranges"][0]["chars"] is None


def test_niah_refuses_a_haystack_the_calibration_read(user_model, essay, tmp_path):
    from kvcompress.harness.tasks import niah

    cfg = OmegaConf.load("kvcompress/conf/task/niah.yaml")
    cfg.update(text=str(essay), lengths=[400], progress=False)
    policy = make_policy("low_rank", **low_rank(tmp_path, essay))
    with pytest.raises(ValueError, match=r"task=niah \(lengths=\[400\]\) reads characters \[0, 3200\]"):
        niah.run(user_model, find_tokenizer(user_model), policy, cfg)
