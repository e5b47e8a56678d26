"""Documents of the offline lm-eval tasks, built from the embedded essays (deterministic, no network)."""

from __future__ import annotations

import random
import re

from kvcompress.resources.data import DEFAULT_TEXT, essays_dir

ESSAY_MIN_CHARS = 2000
ESSAY_MAX_CHARS = 6000
NEEDLE = "The special magic number is {}."
QUESTION = "What is the special magic number mentioned in the text above?"
NIAH_LENGTHS = (256, 512, 1024)
NIAH_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _cut(text: str, max_chars: int) -> str:
    """The first ``max_chars`` characters of ``text``, cut back to the last whitespace."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    return head[: head.rstrip().rfind(" ")].rstrip() if " " in head else head


def _essays() -> list[tuple[str, str, int]]:
    """(title, stripped text, first character in ``load_text("pg_essays")``) of every essay, in its order."""
    out, at = [], 0
    for path in sorted(essays_dir().glob("*.txt")):
        text = path.read_text(encoding="utf-8").strip()
        out.append((path.stem, text, at))
        at += len(text) + 2  # load_text joins the essays with a blank line
    return out


def essay_documents() -> list[dict]:
    """One document per essay of at least 2000 characters: its first ~6000 characters (cut at a space).
    ``span``: the characters of ``load_text("pg_essays")`` it reads (checked against calibration ranges)."""
    docs = []
    for title, text, at in _essays():
        if len(text) >= ESSAY_MIN_CHARS:
            page = _cut(text, ESSAY_MAX_CHARS)
            docs.append({"title": title, "page": page, "text": DEFAULT_TEXT, "span": [at, at + len(page)]})
    return docs


def _sentence_start(words: list[str], at: int) -> int:
    """The first index >= ``at`` that starts a sentence (previous word ends with . ? !), else ``at``."""
    for i in range(at, len(words)):
        if i == 0 or words[i - 1].endswith((".", "?", "!")):
            return i
    return at


def niah_documents(lengths=NIAH_LENGTHS, depths=NIAH_DEPTHS, repeats: int = 2, seed: int = 0) -> list[dict]:
    """Needle-in-a-haystack documents: a 7-digit magic number hidden at ``depth`` of ``length`` essay words.

    The question comes after the context; the answer is the number (exact match on the digits).
    """
    essays = _essays()
    found = [(at + m.start(), at + m.end()) for _, text, at in essays for m in re.finditer(r"\S+", text)]
    words = [word for _, text, _ in essays for word in text.split()]  # found[i]: characters of words[i]
    rng = random.Random(seed)
    docs = []
    for length in lengths:
        if length >= len(words):
            raise ValueError(f"niah length={length} words exceeds the {len(words)} words of the essays")
        for depth in depths:
            for rep in range(repeats):
                start = rng.randrange(len(words) - length)
                hay = words[start : start + length]
                number = str(rng.randrange(1_000_000, 10_000_000))
                at = _sentence_start(hay, round(depth * length))
                context = " ".join(hay[:at] + [NEEDLE.format(number)] + hay[at:])
                docs.append(
                    {
                        "id": f"L{length}-D{depth:g}-R{rep}",
                        "context": context,
                        "question": QUESTION,
                        "answer": number,
                        "length": length,
                        "depth": depth,
                        "needle_word": at,
                        "text": DEFAULT_TEXT,
                        "span": [found[start][0], found[start + length - 1][1]],
                    }
                )
    return docs
