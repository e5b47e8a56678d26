"""The prompts around a KVzip reconstruction: the repeat instruction and the chat turn that opens the reply.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416. The
context pass (``kvcompress.runtime.context_pass``) and the learned scorer's fit (``kvzap_fit``) build the same
reconstruction from these.
"""

from __future__ import annotations

from typing import NamedTuple

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
_MARK = "\x00kvcompress-turn\x00"


class Prompts(NamedTuple):
    """Token ids around the reconstructed text: the first chunk's instruction, the later chunks', what closes
    the user turn and opens the assistant's, and the chat template's opening before a user message (a
    context starting with it is reconstructed without it, as the text itself is what matters)."""

    first: list[int]
    later: list[int]
    turn: list[int]
    opening: list[int]


def repeat_prompts(tokenizer) -> Prompts:
    """The ``Prompts`` of ``tokenizer`` (turn and opening from its chat template, empty without one). No
    tokenizer: no prompt, the context is reconstructed as is."""
    if tokenizer is None:
        return Prompts([], [], [], [])
    encode = lambda s: tokenizer(s, add_special_tokens=False).input_ids if s else []  # noqa: E731
    opening = turn = ""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True
        )
        opening, turn = text.split(_MARK, 1)
    return Prompts(encode(REPEAT_FIRST), encode(REPEAT_NEXT), encode(turn), encode(opening))
