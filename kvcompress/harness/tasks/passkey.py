"""Passkey retrieval: a random number hidden in repeated filler text, the classic long-context test.

Mohtashami & Jaggi, "Landmark Attention: Random-Access Infinite Context Length for Transformers",
arXiv 2305.16300. Same grid, modes and scoring as the needle task (see ``retrieval``); each case draws
its own passkey from ``seed``, so cases differ but runs repeat.
"""

from __future__ import annotations

import random

from kvcompress.harness.tasks.grid import run_grid
from kvcompress.harness.tasks.retrieval import Case


def passkey_context(tokenizer, cfg, length: int, depth: float, key: str) -> tuple[str, int]:
    """Intro + filler with the key sentence at ``depth`` percent, about ``length`` tokens long."""
    if not 0 <= depth <= 100:
        raise ValueError(f"task.depths: depth={depth} must be in [0, 100]")
    count = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    needle = cfg.needle.format(key=key)
    room = length - count(cfg.intro) - count(needle)
    per_filler = count(cfg.filler + " ")
    if room < per_filler:
        raise ValueError(f"task.lengths: length={length} leaves no room for filler around the passkey")
    fillers = [cfg.filler] * (room // per_filler)
    cut = round(len(fillers) * depth / 100)
    text = " ".join([cfg.intro, *fillers[:cut]])
    return " ".join([text, needle, *fillers[cut:]]), count(text)


def make_case(tokenizer, cfg, length: int, depth: float, trial: int = 0) -> Case:
    """One passkey case; each ``trial`` (``task.trials`` per cell) draws its own key."""
    seed = f"{cfg.seed}-{length}-{depth}" + (f"-{trial}" if trial else "")  # trial 0: the keys of old runs
    rng = random.Random(seed)
    key = str(rng.randrange(10 ** (cfg.digits - 1), 10**cfg.digits))
    context, position = passkey_context(tokenizer, cfg, length, depth, key)
    return Case(length, depth, context, cfg.question, key, position)


def run(model, tokenizer, policy, cfg, out_dir=None) -> dict:
    """Accuracy over ``cfg.lengths`` x ``cfg.depths``; per-case records, table and heat map in ``out_dir``."""
    if cfg.digits < 1:
        raise ValueError(f"task.digits={cfg.digits} must be >= 1")
    return run_grid(
        model, tokenizer, policy, cfg, lambda n, d, k: make_case(tokenizer, cfg, n, d, k), out_dir,
        name="passkey", needles=int(cfg.get("trials", 1)),
    )  # fmt: skip
