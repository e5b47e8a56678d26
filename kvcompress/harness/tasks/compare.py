"""``kvcompress compare``: one prompt answered with and without the compressed cache, side by side.

Both caches take the same prompt (context, then the question: in the prompt or after it, as the retrieval
tasks do), then each greedy-decodes its own answer, in lockstep. While their inputs are still the same,
every step is probed (``kvcompress.metrics.fidelity``): at the first step where the two pick different
tokens the report names the layers with the lowest attention recall and the text positions full attended
to that the policy had dropped. Without ``prompt`` the prompt is a needle-in-a-haystack case.
"""

from __future__ import annotations

import torch

from kvcompress.core.cache import build_cache
from kvcompress.harness.tasks.compare_report import diagnose, markdown
from kvcompress.harness.tasks.niah import make_case
from kvcompress.harness.tasks.retrieval import eos_ids, is_correct, split_prompt
from kvcompress.metrics.fidelity import Lockstep, logit_divergence
from kvcompress.resources.files import write_json_atomic, write_text_atomic
from kvcompress.runtime.context_pass import after_prefill


def prompt_parts(tokenizer, cfg):
    """Context and question ids (1, n) of the prompt, the expected answer (or None) and the needle span."""
    if cfg.get("prompt"):
        head, tail = split_prompt(tokenizer, cfg.prompt, cfg.question, cfg.chat_template, cfg.answer_prefix)
        return head, tail, None, None
    case = make_case(tokenizer, cfg, cfg.length, cfg.depth)
    head, tail = split_prompt(tokenizer, case.context, case.question, cfg.chat_template, cfg.answer_prefix)
    needle = len(tokenizer(" " + cfg.needle, add_special_tokens=False).input_ids)
    start = _find(head[0].tolist(), tokenizer(" " + cfg.needle, add_special_tokens=False).input_ids)
    return head, tail, case.answer, None if start is None else (start, start + needle)


def _find(ids: list[int], part: list[int]) -> int | None:
    """First index of ``part`` (without its first token, whose spacing may merge) inside ``ids``."""
    core = part[1:] or part
    for i in range(len(ids) - len(core) + 1):
        if ids[i : i + len(core)] == core:
            return max(i - (len(part) - len(core)), 0)
    return None


@torch.inference_mode()
def _prompt(model, tokenizer, full, cache, head, tail, in_prompt: bool, probes: Lockstep):
    """Feed the prompt to both caches; returns both last logits (1, V) and the probe of the last forward."""
    after = after_prefill(model, tokenizer)
    if in_prompt:
        head, tail = torch.cat([head, tail], 1), tail[:, :0]
    probes.measure(tail.shape[1] == 0)
    lf, lp = (model(head, cache=c, use_cache=True, logits_to_keep=1).logits[:, -1] for c in (full, cache))
    step = probes.step() if tail.shape[1] == 0 else None
    probes.measure(False)
    after(cache, head)  # a query-agnostic policy's context pass (unprobed)
    for i in range(tail.shape[1]):  # the question as decode steps; the last one is probed
        probes.measure(i == tail.shape[1] - 1)
        lf, lp = (model(tail[:, i : i + 1], cache=c, use_cache=True).logits[:, -1] for c in (full, cache))
    if step is None:
        step = probes.step()
    return lf, lp, step


@torch.inference_mode()
def generate(model, tokenizer, full, cache, head, tail, cfg) -> dict:
    """Greedy answers of both caches in lockstep; per step tokens and KL, and the first divergence's probe."""
    probes = Lockstep(full, cache, exact=False)
    lf, lp, step = _prompt(model, tokenizer, full, cache, head, tail, cfg.question_in_prompt, probes)
    stop, out = eos_ids(model, tokenizer), {"full": [], "policy": [], "kl": [], "recall": []}
    first, probe, last = None, None, step
    done = {"full": False, "policy": False}
    for i in range(cfg.max_new_tokens):
        picks = {"full": int(lf[0].argmax()), "policy": int(lp[0].argmax())}
        out["kl"].append(float(logit_divergence(lf[:, None], lp[:, None])[0]) if first is None else None)
        out["recall"].append(float(step["recall"].mean()) if step is not None else None)
        if first is None and picks["full"] != picks["policy"]:
            first, probe = i, step
        for side, tok in picks.items():
            done[side] = done[side] or tok in stop
            out[side].append(None if done[side] else tok)
        if all(done.values()):
            break
        probes.measure(first is None)  # inputs still identical: the next step is comparable
        lf, lp = (
            _next(model, c, picks[s], done[s], x) for c, s, x in ((full, "full", lf), (cache, "policy", lp))
        )
        step = probes.step() if first is None else None
        last = step if step is not None else last
    probe = probe if probe is not None else last  # no divergence: the last probed step
    return {**out, "first_divergence": first, "probe": probe, "prompt_tokens": head.shape[1] + tail.shape[1]}


def _next(model, cache, token: int, done: bool, last):
    if done:
        return last
    ids = torch.tensor([[token]], device=model.device)
    return model(ids, cache=cache, use_cache=True).logits[:, -1]


def run(model, tokenizer, policy, cfg, out_dir=None) -> dict:
    """The side-by-side report (printed, ``compare.md``, ``compare.json``); its summary for results.json."""
    head, tail, expected, needle = prompt_parts(tokenizer, cfg)
    full, cache = build_cache("full", model), build_cache(policy, model)
    gen = generate(model, tokenizer, full, cache, head, tail, cfg)
    ids = torch.cat([head, tail], 1)[0].tolist()
    report = diagnose(gen, ids, tokenizer, cfg, needle)
    for side in ("full", "policy"):
        text = tokenizer.decode([t for t in gen[side] if t is not None], skip_special_tokens=True)
        report[f"{side}_response"] = text
        if expected is not None:
            report[f"{side}_correct"] = is_correct(text, expected)
    report["policy"] = policy.describe()
    text = markdown(report)
    print(text)
    if out_dir is not None:
        write_text_atomic(out_dir / "compare.md", text + "\n")
        write_json_atomic(out_dir / "compare.json", report)
    return {k: v for k, v in report.items() if k not in ("steps", "policy")}
