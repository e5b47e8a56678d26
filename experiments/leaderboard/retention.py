"""Which tokens a selector keeps on the leaderboard's single-needle documents, per layer.

Prints, for each policy at ``--ratio`` removed, the share of the needle's value tokens kept (the context
compressed alone, as in the question-after mode) and the share of the question's tokens kept (the whole
prompt compressed, as in the question-in-prompt mode), averaged over KV heads, layers and documents, and
the share of (layer, KV head) pairs that kept every one of them.
Diagnoses a row of docs/results.md#leaderboard that scores near zero: did the selector drop the needle, or
the question and the answer prefix?

    .venv/bin/python experiments/leaderboard/retention.py expected_attention snapkv kvzip

With ``--values N``: the long-value study (``retention_values``): N needles of 5-8 digits and UUID-like
strings, every policy at each ``--ratios`` in both question modes; per case the exact match and what each
layer and KV head read of the answer's own tokens (a tiered cache: its fetched pages). Writes the record
``--record`` (resumable) and its tables next to it (``.md``); ``--table RECORD [BEFORE]`` makes them again
(and prints the paired differences from BEFORE, on the same needles). ``--span S`` or ``--chunk N`` run the
score-based selectors with runs kept together (``span``, or ``unit: chunk``).

    .venv/bin/python experiments/leaderboard/retention.py --values 10 full snapkv tiered
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

from kvcompress import build_cache, make_policy
from kvcompress.eval.lm_tasks import kvc_ruler
from kvcompress.eval.question import question_index
from kvcompress.resources.models import default_model_dir, load_model
from kvcompress.runtime.context_pass import prefill
from kvcompress.selectors.eviction import base
from kvcompress.selectors.eviction import expected_attention as ea

RECORD = Path(__file__).parent / "runs" / "retention" / "long_values.json"


@contextlib.contextmanager
def recording(kept: dict):
    """Record each eviction layer's last kept indices (B, h, k) in ``kept[layer_idx]``."""
    select = base.EvictionLayer.select

    def wrapped(self, *args, **kwargs):
        idx = select(self, *args, **kwargs)
        kept[self.layer_idx] = idx.detach()
        return idx

    base.EvictionLayer.select = wrapped
    try:
        yield kept
    finally:
        base.EvictionLayer.select = select


def kept_share(model, tok, policy, ids: torch.Tensor, positions: list[int]) -> tuple[float, float]:
    """After prefilling ``ids`` (1, T): the share of ``positions`` kept, and the share of (layer, KV head)
    pairs that kept all of them, both averaged over layers and KV heads."""
    with recording({}) as kept, torch.no_grad():
        prefill(model, build_cache(policy, model), ids, tok)
    if not kept:
        raise RuntimeError(f"{policy!r} selected nothing on a {ids.shape[1]}-token prompt")
    want = torch.tensor(positions)
    hits = torch.cat([torch.isin(idx[0], want).sum(-1) for idx in kept.values()]).float()  # (layers * h,)
    return float(hits.mean() / len(positions)), float((hits == len(positions)).float().mean())


def expected_attention_terms(model, ids: torch.Tensor, ratio: float) -> list[tuple[float, float]]:
    """Per layer, the spread over keys (std, mean over query heads) of expected_attention's two logit terms
    on ``ids`` (1, T): the mean query's ``s mu.k`` and the covariance's ``s^2 k'Sigma k / 2``."""
    spreads, terms = [], ea.logit_terms

    def spy(*args, **kwargs):
        linear, quadratic = terms(*args, **kwargs)
        spreads.append((float(linear.std(-1).mean()), float(quadratic.std(-1).mean())))
        return linear, quadratic

    ea.logit_terms = spy
    try:
        with torch.no_grad():
            model(ids, cache=build_cache(make_policy("expected_attention", compression_ratio=ratio), model))
    finally:
        ea.logit_terms = terms
    return spreads


def needle_positions(tok, ids: torch.Tensor, answer: str) -> list[int]:
    """Token positions of ``ids`` (1, T) whose text overlaps the first occurrence of ``answer``."""
    text = tok.decode(ids[0])
    start = text.index(answer)
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    if enc["input_ids"] != ids[0].tolist():  # the offsets must index the very tokens the cache saw
        raise ValueError("the prompt does not re-tokenize to its own ids: needle positions would be off")
    spans = enc["offset_mapping"]
    return [i for i, (a, b) in enumerate(spans) if a < start + len(answer) and b > start]


def long_values(model, tok, args) -> None:
    """The long-value study (``retention_values``): run what the record lacks, then print its tables."""
    import retention_values as rv

    from kvcompress.harness.tasks.long_values import value_cases

    cases = value_cases(tok, args.values, args.length, seed=args.seed)
    keep = ({"span": args.span} if args.span > 1 else {}) | (
        {"unit": "chunk", "chunk_size": args.chunk} if args.chunk else {}
    )
    modes = [{"in": True, "after": False}[m] for m in args.modes]
    record = rv.run(model, tok, cases, args.policies, args.ratios, args.record, keep, modes)
    print(rv.write_tables(args.record, record))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policies", nargs="*")
    ap.add_argument("--ratio", type=float, default=0.75, help="compression_ratio (fraction removed)")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--terms", action="store_true", help="expected_attention's two logit terms per layer")
    ap.add_argument("--values", type=int, default=0, help="long-value needles per setting (0: RULER docs)")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75], help="with --values")
    ap.add_argument("--length", type=int, default=512, help="context tokens of a long-value needle")
    ap.add_argument("--modes", nargs="+", choices=["in", "after"], default=["in", "after"], help="question")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--span", type=int, default=1, help="the score-based selectors' span (1: off)")
    ap.add_argument("--chunk", type=int, default=0, help="unit: chunk with this chunk_size (0: off)")
    ap.add_argument("--record", type=Path, default=RECORD)
    ap.add_argument("--table", type=Path, nargs="+", help="a record's tables again [and pairs with a BEFORE]")
    args = ap.parse_args()
    if args.table:
        import retention_values as rv

        after, *before = [json.loads(p.read_text()) for p in args.table]
        named = {p.name: b for p, b in zip(args.table[1:], before, strict=True)}
        print(rv.write_tables(args.table[0], after, named))
        return
    torch.set_num_threads(1)
    model, tok = load_model()
    if args.values:
        long_values(model, tok, args)
        return
    meta = {"tokenizer": str(default_model_dir()), "max_seq_lengths": [1024], "num_samples": args.docs}
    docs = kvc_ruler.niah_single(**meta)["test"]
    print(
        f"share kept at compression_ratio={args.ratio}, {len(docs)} kvc_ruler_niah_single docs, 1024 tokens"
    )
    for name in args.policies:
        needle, question = [], []
        for doc in docs:
            ids = tok(doc["input"] + doc.get("gen_prefix", ""), return_tensors="pt").input_ids
            q = question_index(tok, ids[0].tolist())
            policy = make_policy(name, compression_ratio=args.ratio)
            needle.append(
                kept_share(
                    model, tok, policy, ids[:, :q], needle_positions(tok, ids[:, :q], doc["outputs"][0])
                )
            )
            question.append(kept_share(model, tok, policy, ids, list(range(q, ids.shape[1]))))
        (n, nall), (qs, qall) = torch.tensor(needle).mean(0).tolist(), torch.tensor(question).mean(0).tolist()
        print(
            f"{name:>20}: needle tokens kept {n:.0%}, all of them in {nall:.0%} of heads (context alone); "
            f"question tokens kept {qs:.0%}, all of them in {qall:.0%} of heads (whole prompt)"
        )
    if args.terms:
        ids = tok(docs[0]["input"], return_tensors="pt").input_ids
        print("expected_attention, first document: std over keys of the mean term / the covariance term")
        for layer, (mean, quad) in enumerate(expected_attention_terms(model, ids, args.ratio)):
            print(
                f"  layer {layer:2d}: {mean:6.2f} / {quad:6.2f}"
                + ("  <- covariance decides" if quad > mean else "")
            )


if __name__ == "__main__":
    main()
