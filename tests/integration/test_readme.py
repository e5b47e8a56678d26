"""The README is a front door that works as written: under 200 lines, every code fence on a line of its own,
every link to a file of the checkout resolving, its Python blocks run as written on the embedded model, its
refused pair refused. Its command-line block runs from an installed wheel in
``tests/integration/test_wheel_install.py`` (``readme_commands`` below is what that test replays)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import README, code_blocks, readme_commands
from transformers import LlamaConfig, LlamaForCausalLM

from kvcompress import build_cache

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_is_short_and_its_fences_stand_alone():
    lines = README.splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; the front door stays under 200"
    fences = [line for line in lines if "```" in line]
    bad = [line for line in fences if not re.fullmatch(r"```\w*", line)]
    assert not bad, f"a fence shares its line with text (the block after it renders as prose): {bad}"
    assert len(fences) % 2 == 0


def test_every_link_to_a_file_resolves():
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if not t.startswith("http")]
    assert local, "the README links to its docs"
    assert [t for t in local if not (ROOT / t).exists()] == []


def test_the_command_line_block_names_only_real_commands():
    commands = readme_commands()
    assert len(commands) >= 4
    subcommands = {c[1] for c in commands if len(c) > 1 and "=" not in c[1] and not c[1].startswith("-")}
    assert subcommands <= {"compare", "ask", "bench", "check-policy"}


def _head_dim_64():
    """A tiny Llama with the embedded model's head size (64), so quant's default groups divide it."""
    torch.manual_seed(0)
    sizes = {"hidden_size": 128, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
    config = LlamaConfig(vocab_size=64, num_hidden_layers=2, max_position_embeddings=256, **sizes)
    return LlamaForCausalLM(config).eval()


def test_the_refused_pair_is_refused_and_its_fix_is_served():
    (example,) = re.findall(r"`(build_cache\([^`]*\))` is refused", README)
    model = _head_dim_64()
    with pytest.raises(ValueError, match="cannot work.*key_axis=token"):
        eval(example, {"build_cache": build_cache, "model": model})
    fixed = eval(
        example.replace('"quant"', '{"name": "quant", "key_axis": "token"}'),
        {"build_cache": build_cache, "model": model},
    )
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 40)), cache=fixed, use_cache=True)
    assert fixed.stats()[0]["tokens_evicted"] > 0 and fixed.stats()[0]["storage"] == "quant"


@pytest.mark.integration
@pytest.mark.slow
def test_the_python_blocks_run_as_written():
    api, attached = [b for b in code_blocks("python") if "kvcompress" in b]
    scope: dict = {}
    exec(api, scope)  # loads the embedded model, streams 1024 tokens through sliding_window, generates
    model, cache, tok = scope["model"], scope["cache"], scope["tok"]
    config = model.config
    per_token = 2 * config.num_key_value_heads * config.head_dim * model.dtype.itemsize
    kept = cache.stats()[0]["tokens_stored"]
    assert kept == 4 + 252  # sink_tokens + window, of 1024 tokens streamed
    layers = config.num_hidden_layers
    assert (
        kept * per_token * layers <= cache.memory_bytes() < 0.3 * 1024 * per_token * layers
    )  # a quarter of full
    assert scope["out"].shape[1] > len(tok(["Hello"]).input_ids[0])
    before = (config._attn_implementation, dict(model._forward_hooks))
    exec(attached, scope)
    assert scope["out"].shape[1] > scope["inputs"]["input_ids"].shape[1]
    assert (model.config._attn_implementation, dict(model._forward_hooks)) == before
