"""``batch_size > 1`` for model=kvcompress: which requests may share a streamed batch.

Log-likelihoods: lm-eval pads a batch on the right and reads each row's logits from its own first
positions. Streamed through a policy cache one token per forward (``chunk_size=1``), a row's padding
enters the cache only after the row's last real token, so it cannot reach any logit that is scored: every
row is compressed exactly as alone, whatever the policy, and requests of any length share a batch. With
``chunk_size > 1`` the forward that carries a shorter row's last tokens would also carry its padding as
queries of that chunk (a query-aware selector such as block_sparse reads pages those queries chose), so
only requests of equal length share a batch. Generation: lm-eval pads prompts on the left, which a policy
whose layers declare ``pads_exactly = False`` refuses (``kvcompress.runtime.padding.check_padding``).
"""

from __future__ import annotations

from kvcompress.eval.streamed import input_tokens


def check_batch_size(batch_size) -> None:
    """Refuse ``batch_size=auto``: lm-eval sizes it by running full-length batches, which streamed one
    token per forward would take as long as the evaluation itself."""
    if str(batch_size).startswith("auto"):
        raise ValueError(
            f"batch_size={batch_size!r}: model=kvcompress streams every probe batch token by token; "
            "give an integer batch_size (requests streamed together)"
        )


def equal_length_groups(requests: list, max_length: int, chunk_size: int, batch_size) -> list | None:
    """Indices of ``requests`` grouped by streamed length when chunks of several tokens need it (every
    group then runs as its own lm-eval batch list), or None when any lengths may share a batch."""
    if chunk_size == 1 or int(batch_size) == 1:
        return None
    groups: dict = {}
    for i, request in enumerate(requests):
        groups.setdefault(len(input_tokens(request, max_length)), []).append(i)
    return list(groups.values())
