"""The table of ``generate()`` options each policy supports, asked of the layers themselves.

Beam search reorders rows (``reorder_cache``: every policy); ``num_return_sequences`` and contrastive search
copy and select rows (``batch_repeat_interleave`` / ``batch_select_indices``: refused by a storage that lays
rows out for good, ``Store.fixed_rows``); assisted and prompt-lookup decoding roll back rejected drafts
(``crop``: ``core.rollback``). Tested against ``DynamicCache`` in ``tests/contract/test_generate_options.py``.
"""

from __future__ import annotations

from pathlib import Path

from kvcompress.core import rollback
from kvcompress.harness.docgen.catalog import names
from kvcompress.harness.report import markdown_table

SPEC_LAYERS = 4


def _layers(policy) -> list:
    """The policy's layers on a small model shape; a storage that calibrates on a model (low_rank) cannot be
    built without one, so its declared classes answer instead (their answers need no state)."""
    from kvcompress.selectors import ModelSpec

    spec = ModelSpec(SPEC_LAYERS, 8, 2, 64, max_positions=4096)
    try:
        return [policy.layer(i, spec) for i in range(SPEC_LAYERS)]
    except RuntimeError:
        layer = object.__new__(policy.layer_class)
        layer.policy, layer.store = policy, object.__new__(policy.storage.store_class)
        return [layer]


def _crop(layers) -> str:
    refusals = {layer.never_crops() for layer in layers} - {None}
    if refusals:
        return "refused: " + "; ".join(sorted(refusals))
    conditions = list(dict.fromkeys(c for layer in layers for c in rollback.conditions(layer)))
    return "yes" + (", while " + "; ".join(conditions) if conditions else "")


def _rows(layers) -> str:
    why = {type(layer.store).fixed_rows for layer in layers} - {None}
    return "refused: " + "; ".join(sorted(why)) if why else "yes"


def generate_block(args, options, root: Path, md_path: Path) -> str:
    """``generate``: per ``conf/policy`` entry at its defaults, which ``generate()`` options it supports."""
    from kvcompress.core.cache import make_policy

    rows = []
    for name in names("policy"):
        layers = _layers(make_policy(name))
        rows.append({
            "policy": f"`{name}`",
            "`num_beams`": "yes",
            "rows copied / selected (contrastive search)": _rows(layers),
            "assisted / prompt lookup (`crop`)": _crop(layers),
        })  # fmt: skip
    return markdown_table(rows, list(rows[0])) + (
        "\n\n_Asked of each policy's layers at its defaults (`kvcompress.harness.docgen.generation`); a "
        "refusal is a `ValueError` naming the policy and the reason. Regenerate: `make results`._"
    )
