"""The recorded part of ``make test-peers``: kvpress and kvcompress on the embedded model (SmolLM2-135M, the
dequantized HF folder kvcompress keeps in its cache), five needle prompts of about 2k tokens with the question
inside the prompt (chat template), compression ratio 0.5; per method the kept-set Jaccard per (layer, KV
head) and the greedy answers. One JSON record (``--out``); ``docs/methods.md``'s table is generated from it.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/peers/record.py --out experiments/peers/record.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_compare import compare, finish, start_kvpress  # noqa: E402
from peer_methods import KVPRESS_VERSION, METHODS  # noqa: E402
from peer_ours import run_ours  # noqa: E402

from kvcompress import load_model  # noqa: E402
from kvcompress.harness.results import environment  # noqa: E402
from kvcompress.harness.tasks.niah import make_case  # noqa: E402
from kvcompress.harness.tasks.retrieval import case_prompt  # noqa: E402
from kvcompress.resources.files import write_json_atomic  # noqa: E402
from kvcompress.resources.models import default_model_dir  # noqa: E402

NUMBERS = ["58213", "90417", "36752", "71946", "24608"]
DEPTHS = [10.0, 30.0, 50.0, 70.0, 90.0]


def needle_prompts(tokenizer, n: int, length: int) -> tuple[list[list[int]], list[str]]:
    """``n`` needle prompts (token ids, question inside, chat template) and their expected answers."""
    prompts, answers = [], []
    for number, depth in list(zip(NUMBERS, DEPTHS, strict=True))[:n]:
        needle, question = f"The special magic number is {number}.", "What is the special magic number?"
        cfg = OmegaConf.create({
            "needle": needle, "question": question, "answer": number, "text": "pg_essays",
            "chat_template": True, "answer_prefix": "",
        })  # fmt: skip
        head, tail = case_prompt(tokenizer, make_case(tokenizer, cfg, length, depth), cfg)
        prompts.append(torch.cat([head, tail], 1)[0].tolist())
        answers.append(number)
    return prompts, answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "record.json"))
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    folder = default_model_dir()
    model, tok = load_model(str(folder), dtype="float32", device="cpu")
    prompts, expected = needle_prompts(tok, args.prompts, args.length)
    methods = args.methods.split(",")
    start = time.perf_counter()
    started = start_kvpress(
        folder, prompts, methods, args.ratio, args.max_new_tokens
    )  # in parallel with ours
    ours = run_ours(model, tok, methods, prompts, args.ratio, args.max_new_tokens)
    ours_s = time.perf_counter() - start
    theirs = finish(started)
    kvpress_s = time.perf_counter() - start
    summary = compare(ours, theirs["methods"])
    decode = lambda ids: ids if isinstance(ids, str) else tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    for name in methods:
        summary[name]["answers"] = {
            "kvcompress": [decode(r["answer"]) for r in ours[name]],
            "kvpress": [decode(r["answer"]) for r in theirs["methods"][name]],
        }
        summary[name]["settings"] = {k: METHODS[name][k] for k in ("press", "ours", "expect", "note")}
    record = {
        "model": "smollm2-135m", "compression_ratio": args.ratio, "prompt_tokens": [len(p) for p in prompts],
        "expected": expected, "question_in_prompt": True, "max_new_tokens": args.max_new_tokens,
        "kvpress_pinned": KVPRESS_VERSION, "peers_versions": theirs["versions"], "seconds": {
            "kvpress": round(kvpress_s, 1), "kvcompress": round(ours_s, 1)},
        "methods": summary, "environment": environment(),
    }  # fmt: skip
    out = Path(args.out)
    if out.is_file() and set(methods) != set(METHODS):  # a subset rerun: the other methods' rows stay
        old = json.loads(out.read_text())
        record["methods"] = {**old.get("methods", {}), **summary}
    write_json_atomic(out, record)
    for name, row in summary.items():
        print(f"{name:20s} jaccard mean {row['jaccard_mean']:.3f} min {row['jaccard_min']:.3f} "
              f"answers equal {row['answers_equal']}/{row['answers_compared']}")  # fmt: skip


if __name__ == "__main__":
    main()
