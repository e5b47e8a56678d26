"""``kvcompress ask``: one context file, one or more questions, answered through a policy cache.

    kvcompress ask --context report.txt --question "Who signed it?" --question "When?" \\
        --policy snapkv --set compression_ratio=0.5

Prints each answer and a table of the stages (seconds, tokens, cache bytes); ``--json FILE`` also writes
them (atomically). The model is the embedded default unless ``--model`` names another.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from kvcompress.resources.files import write_json_atomic
from kvcompress.resources.models import DEFAULT_MODEL


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvcompress ask", description=__doc__.split("\n\n")[0])
    p.add_argument("--context", required=True, help="a text file with the context ('-': standard input)")
    p.add_argument("--question", action="append", required=True, help="a question (repeat for more)")
    p.add_argument("--policy", default="full", help="a policy name from conf/policy (default: full)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a policy field, e.g. compression_ratio=0.5 or storage=quant")  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or path (default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: auto)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cuda when available)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--question-in-prompt", action="store_true",
                   help="compress the context with each question in it (default: after it)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="also write answers and stages to this file")
    return p.parse_args(argv)


def overrides(pairs: list[str]) -> dict:
    """``FIELD=VALUE`` strings as a dict, each value read as YAML (numbers, booleans, null, mappings)."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE, e.g. compression_ratio=0.5")
        out[key.strip()] = yaml.safe_load(value)
    return out


def read_context(where: str) -> str:
    if where == "-":
        return sys.stdin.read()
    path = Path(where)
    if not path.is_file():
        raise SystemExit(f"--context {where}: no such file")
    return path.read_text(encoding="utf-8")


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    context, params = read_context(args.context), overrides(args.set)
    from kvcompress import load_model, pipeline

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    pipe = pipeline(model, tokenizer, args.policy, **params)
    out = pipe(context, args.question, args.max_new_tokens, question_in_prompt=args.question_in_prompt)
    for question, answer in zip(args.question, out.answers, strict=True):
        print(f"Q: {question}\nA: {answer.strip()}\n")
    print(out.table())
    record = {"policy": out.policy, "params": params, "questions": args.question, "answers": out.answers,
              "question_in_prompt": args.question_in_prompt, "stages": out.stages}  # fmt: skip
    if args.json is not None:
        write_json_atomic(args.json, record)
    return json.loads(json.dumps(record))
