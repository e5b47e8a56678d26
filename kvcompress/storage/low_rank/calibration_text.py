"""Calibration tokens: the tail of a text, the tokenizer that reads it, and the range it covers.

Evaluation reads texts from their start and calibration from their end; the range recorded here
(``text``, token and character spans) lets tasks refuse an overlap (``check_disjoint``).
"""

from __future__ import annotations

from pathlib import Path

import torch

RANDOM = "random"


def _load(source: str):
    from transformers import AutoTokenizer

    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(source)


def find_tokenizer(model, tokenizer=None):
    """``tokenizer`` (an object, a model id, a folder or a ``.gguf`` path) or, when None, the model's own
    from ``model.name_or_path`` (a folder, or a ``.gguf`` file in it). Raises naming every place tried."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    tried = []
    if tokenizer is not None:
        candidates = [str(tokenizer)]
    else:
        source = str(getattr(model, "name_or_path", "") or "")
        folder = Path(source).expanduser()
        candidates = [source] if source else []
        if folder.is_dir():
            candidates += [str(p) for p in sorted(folder.glob("*.gguf"))]
    for source in candidates:
        try:
            return _load(source)
        except (OSError, ValueError, TypeError, KeyError) as err:
            tried.append(f"{source!r} ({type(err).__name__}: {str(err).splitlines()[0][:160]})")
    where = f"tokenizer={tokenizer!r}" if tokenizer is not None else "model.name_or_path"
    raise ValueError(
        f"low_rank calibration text needs a tokenizer and none could be loaded from {where}: tried "
        f"{', '.join(tried) or 'nothing (the model has no name_or_path)'}. Pass tokenizer= (a tokenizer, a "
        "model id, a folder or a .gguf path), or calibration_text='random' for a model without one"
    )


def calibration_ids(model, text: str, n_tokens: int, tokenizer=None) -> tuple[torch.Tensor, dict]:
    """Token ids (1, n_tokens) and their ``range``: the *last* ``n_tokens`` of ``text`` (evaluation reads
    texts from the start), or seeded uniform ids for ``text="random"`` (tests, no tokenizer).

    The range is ``{"text", "tokens": [a, b], "chars": [c, d]}``: token indices in the whole text tokenized
    without special tokens, and the characters they cover in ``kvcompress.resources.data.load_text(text)``.
    """
    if text == RANDOM:
        vocab = model.config.get_text_config(decoder=True).vocab_size
        ids = torch.randint(0, vocab, (1, n_tokens), generator=torch.Generator().manual_seed(0))
        return ids, {"text": RANDOM, "tokens": [0, n_tokens], "chars": None}
    from kvcompress.resources.data import load_text

    tok, body = find_tokenizer(model, tokenizer), load_text(text)
    ids, start_char = _tail(tok, body, n_tokens)
    total = ids.shape[1]
    if total < n_tokens:
        raise ValueError(f"low_rank.calibration_tokens={n_tokens}: text {text!r} has only {total} tokens")
    span = {
        "text": text,
        "tokens": [total - n_tokens, total],
        "chars": [start_char(total - n_tokens), len(body)],
    }
    return ids[:, -n_tokens:], span


def _tail(tok, body: str, n_tokens: int):
    """All ids (1, T) of ``body`` and a function: token index -> its first character."""
    try:
        enc = tok(body, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        return torch.tensor([enc["input_ids"]]), lambda i: int(offsets[i][0])
    except (NotImplementedError, TypeError, ValueError, KeyError):  # a slow tokenizer: no offsets
        ids = torch.tensor([tok(body, add_special_tokens=False)["input_ids"]])
        return ids, lambda i: max(0, len(body) - len(tok.decode(ids[0, i:].tolist())))


def overlaps(span: dict | None, text: str, chars: tuple[int, int]) -> bool:
    """Whether characters ``[a, b)`` of ``text`` meet a calibration ``span``."""
    if not span or span.get("text") != text or span.get("chars") is None:
        return False
    a, b = span["chars"]
    return chars[0] < b and a < chars[1]


def check_disjoint(spans: list[dict], text: str, chars, what: str) -> None:
    """Refuse an evaluation that reads characters ``chars`` (``(a, b)``, or a function giving them, called
    only when a span is on the same text) of ``text`` inside any calibration span."""
    if not any(span.get("text") == text and span.get("chars") for span in spans):
        return
    chars = chars() if callable(chars) else chars
    for span in spans:
        if overlaps(span, text, chars):
            raise ValueError(
                f"{what} reads characters {list(chars)} of {text!r}, but the policy calibrated on characters "
                f"{span['chars']} (tokens {span['tokens']}) of the same text: evaluation must not see its "
                "calibration text. Evaluate an earlier part (smaller task.max_tokens / offset), or calibrate "
                "on another text or fewer calibration_tokens"
            )


def cache_spans(cache) -> list[dict]:
    """The calibration ranges of a built cache's layers (low-rank storages; none for others), unique."""
    spans = []
    for layer in cache.layers:
        span = getattr(getattr(layer.store, "config", None), "calibration_range", None)
        if span and span not in spans:
            spans.append(span)
    return spans


def text_span(tokenizer, body: str, start: int, stop: int) -> tuple[int, int]:
    """Characters ``[a, b)`` of ``body`` covered by its tokens ``start..stop`` (as ``tokenizer(body)``)."""
    return text_chars(tokenizer, body, start), text_chars(tokenizer, body, stop)


def text_chars(tokenizer, body: str, stop: int, with_special: bool = True) -> int:
    """Characters of ``body`` covered by its first ``stop`` tokens (as ``tokenizer(body)`` splits it)."""
    if stop <= 0:
        return 0
    try:
        enc = tokenizer(body, add_special_tokens=with_special, return_offsets_mapping=True)
        return int(max(end for _, end in enc["offset_mapping"][:stop]))
    except (NotImplementedError, TypeError, ValueError, KeyError):  # a slow tokenizer: decode the prefix
        ids = tokenizer(body, add_special_tokens=with_special)["input_ids"][:stop]
        return len(tokenizer.decode(ids, skip_special_tokens=True)) + 1
