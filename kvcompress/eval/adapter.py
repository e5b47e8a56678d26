"""lm-eval model ``kvcompress``: lm-eval's ``hf`` model with every request run through a policy cache.

Log-likelihoods: each batch streams through a fresh policy cache, ``chunk_size`` tokens per forward, so
every scored token saw only what the policy kept (one full forward pass, what ``hf`` does, never reads a
cache); each forward's logits are scored at once (``kvcompress.eval.streamed``), never held whole.
Generation: ``generate`` gets a fresh policy cache and stops on the model's generation-config eos ids.
Model args are those of ``hf`` plus the policy and its fields (``policy.<field>`` where a field has the name
of an ``hf`` argument, ``hf.<name>`` for that argument: ``split_policy_args``)::

    lm_eval.simple_evaluate(
        model="kvcompress", model_args="pretrained=smollm2-135m,policy=sliding_window,window=124", ...
    )
"""

from __future__ import annotations

import inspect
from collections import Counter
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from kvcompress.core import registry
from kvcompress.core.attention import set_backend
from kvcompress.core.cache import build_cache, known_policies, make_policy
from kvcompress.core.fields import refuse_renamed
from kvcompress.core.policy import Policy
from kvcompress.eval.batching import check_batch_size, equal_length_groups
from kvcompress.eval.calibration_guard import CalibrationGuard
from kvcompress.eval.question import QUESTION_START, compress_then_feed, parse_mode
from kvcompress.eval.streamed import Scores, score_requests, stream
from kvcompress.metrics.compression import (
    attention_backends,
    flag_uncompressed,
    full_cache_bytes,
    is_compressed,
    kept_counts,
    ratios_of,
    read_counts,
    tokens_evicted,
)
from kvcompress.resources import packed_linears
from kvcompress.resources.models import DEFAULT_MODEL, EMBEDDED_MODELS, embedded_model_dir, resolve_device
from kvcompress.runtime.context_pass import needs_context_pass, prefill
from kvcompress.runtime.padding import Padded, check_padding
from kvcompress.storage.low_rank.calibration_text import cache_spans

POLICY_PREFIX, HF_PREFIX = "policy.", "hf."  # model args meant for the policy's fields / for ``hf`` itself


def hf_arguments() -> set[str]:
    """Names ``hf`` (``HFLM``) and this adapter take as model args."""
    names = set(inspect.signature(HFLM.__init__).parameters) | set(
        inspect.signature(KVCompressLM.__init__).parameters
    )
    return names - {"self", "kwargs"}


def split_policy_args(policy, kwargs: dict) -> tuple[Policy, dict]:
    """The policy named by ``policy`` with its fields taken out of ``kwargs``; the rest goes to ``hf``.

    A field is named plainly (``window=124``) or with the ``policy.`` prefix (``policy.tokenizer=...``); a
    plain name that is both a field and an ``hf`` argument (``low_rank``'s calibration ``tokenizer``) is
    refused, naming both meanings: it is written ``policy.<name>`` for the field, ``hf.<name>`` for ``hf``.
    """
    if isinstance(policy, Policy) or not isinstance(policy, str):
        prefixed = sorted(k for k in kwargs if k.startswith(POLICY_PREFIX))
        if prefixed:
            raise ValueError(f"model_args {prefixed}: policy fields by prefix need a policy given by name")
        rest = {k.removeprefix(HF_PREFIX): v for k, v in kwargs.items()}
        if isinstance(policy, Policy):
            return policy, rest
        # a {_target_: ..., field: value} mapping (Hydra, JSON model args)
        return make_policy(dict(OmegaConf.to_container(OmegaConf.create(policy)))), rest
    if policy not in known_policies():
        raise ValueError(f"policy={policy!r} is unknown; known policies: {known_policies()}")
    fields = set(registry.load("policy", policy)) - {"_target_"}  # every field its class declares
    params, rest, hf = {}, {}, hf_arguments()
    for key, value in kwargs.items():
        name = key.removeprefix(POLICY_PREFIX)
        refuse_renamed(policy, fields, [] if key.startswith(HF_PREFIX) else [name])  # a removed field
        if key.startswith(HF_PREFIX):
            rest[key.removeprefix(HF_PREFIX)] = value
        elif key.startswith(POLICY_PREFIX) and name not in fields:
            raise ValueError(f"model_args {key}: policy {policy!r} has no field {name!r}; its fields: "
                             f"{sorted(fields)}")  # fmt: skip
        elif key == name and key not in fields:
            rest[key] = value
        elif key == name and key in hf:
            raise ValueError(
                f"model_args {key}={value!r} is ambiguous: {key!r} is a field of policy {policy!r} and an "
                f"argument of lm-eval's hf model; write policy.{key}={value} for the policy's field or "
                f"hf.{key}={value} for lm-eval's"
            )
        else:
            params[name] = value
    return make_policy(policy, **params), rest


def resolve_pretrained(pretrained: str, kwargs: dict) -> tuple[str, dict]:
    """Map kvcompress model names onto what ``hf`` loads: an embedded model, a ``.gguf`` file."""
    if pretrained in EMBEDDED_MODELS:
        return str(embedded_model_dir(pretrained)), kwargs
    path = Path(pretrained).expanduser()
    if path.suffix == ".gguf":
        return str(path.parent), {**kwargs, "gguf_file": path.name}
    return pretrained, kwargs


KINDS = ("loglikelihood", "generate")


def _hint(kind: str, chunk_size: int, context_pass: bool) -> str:
    """What to set when requests of ``kind`` never compressed."""
    if context_pass:  # KVzip: only a context pass compresses, whatever the chunks
        return (
            "A query-agnostic policy compresses each request's context (its prompt for generation): these "
            "contexts were within its budget, or a single token (rolling log-likelihoods of documents "
            "shorter than max_length): lower the budget or set max_length below the documents' length."
        )
    if kind == "generate":
        return "Generation prefills the prompt whole: lower the budget below the prompt length."
    return (
        f"Log-likelihoods stream each request chunk_size={chunk_size} token(s) per forward; policies that "
        "compress at prefill (snapkv, pyramidkv) never act on one-token forwards: raise chunk_size (tokens "
        "inside a chunk then see the whole chunk) or lower the budget below the request length."
    )


def _counters() -> dict:
    counts = {"requests": 0, "tokens": 0, "tokens_evicted": 0, "tokens_read": 0.0, "tokens_visible": 0}
    return counts | {"attention_backends": Counter()}  # layer-steps per attention backend


@register_model("kvcompress")
class KVCompressLM(CalibrationGuard, HFLM):
    """``HFLM`` whose forward passes and generations read and write a kvcompress policy cache.

    Args:
        pretrained: as for ``hf`` (hub id, local folder, loaded model) or ``"smollm2-135m"``, a ``.gguf``.
        policy: a name from ``conf/policy/`` (its fields are model args too), a ``Policy`` or a config dict.
        chunk_size: tokens per forward when streaming log-likelihood requests (1 = exact decode mode).
        attn_backend: kernel behind kvcompress's attention function (``sdpa`` or ``eager``).
        question_in_prompt: ``False`` compresses each generation prompt's context alone and feeds its
            question after (``kvcompress.eval.question``); ``True`` (default) prefills the prompt whole.
        question_start: regex of where a prompt's question begins (its last match), for the mode above;
            ``None``: ``question.QUESTION_START``.
        linears: ``"packed"`` runs the model's linear layers on oneDNN with weights packed once (CPU,
            float32; ``kvcompress.resources.packed_linears``), ``None`` or ``"default"`` leaves them.
        **kwargs: ``hf`` model args (``max_length``, ``dtype``, ``batch_size``...) and policy fields.
            ``batch_size`` requests stream together (``kvcompress.eval.batching``: each row scores as alone).
    """

    def __init__(
        self, pretrained=DEFAULT_MODEL, policy="full", chunk_size=1, attn_backend=None, linears=None, **kwargs
    ):
        self.question_in_prompt = parse_mode(kwargs.pop("question_in_prompt", True))
        self.question_start = str(kwargs.pop("question_start", None) or QUESTION_START)
        policy, kwargs = split_policy_args(policy, kwargs)
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size={chunk_size} must be an integer >= 1")
        check_batch_size(kwargs.get("batch_size", 1))
        packed_linears.check(linears)
        if isinstance(pretrained, str):
            pretrained, kwargs = resolve_pretrained(pretrained, kwargs)
        kwargs["device"] = str(kwargs.get("device") or resolve_device(None))
        super().__init__(pretrained=pretrained, **kwargs)
        self.policy, self.chunk_size = policy, int(chunk_size)
        if attn_backend:
            set_backend(self.model, attn_backend)
        packed_linears.apply(self.model, linears)  # a model handed in packed already is left as it is
        cache = build_cache(policy, self.model)  # validates the policy, installs the attention hook
        self.calibration_ranges = cache_spans(cache)  # documents reading these are refused
        self.context_pass = needs_context_pass(cache)  # KVzip: each request's context is compressed first
        self.kvc_stats = {**_counters(), "chunk_size": self.chunk_size, "forward_calls": 0}
        self.kvc_stats |= {kind: _counters() for kind in KINDS}

    def _new_cache(self):
        return build_cache(self.policy, self.model)

    def _record(self, cache, batch: int, forwards: int, kind: str) -> None:
        """Count the call's rows and evicted tokens (padding included), overall and for its ``kind``
        (``KINDS``); keep the cache size of the longest sequence (tokens consumed, bytes held)."""
        evicted = tokens_evicted(cache) * batch  # slots dropped, in every row of the batch
        read, visible = read_counts(cache)
        self.kvc_stats["forward_calls"] += forwards
        self._add_kept(*kept_counts(cache.stats()), batch)
        for stats in (self.kvc_stats, self.kvc_stats[kind]):
            stats["requests"] += batch  # rows: a batch of 8 is 8 requests
            stats["tokens_evicted"] += evicted
            stats["tokens_read"] += read * batch
            stats["tokens_visible"] += visible * batch
            stats["attention_backends"].update(attention_backends(cache))
            if cache.get_seq_length() >= stats["tokens"]:
                stats.update(tokens=cache.get_seq_length(), batch=batch, cache_bytes=cache.memory_bytes())

    def _add_kept(self, seen: list[int], kept: list[list[int]], batch: int) -> None:
        """Sum tokens seen per layer and kept per (layer, KV head) over requests (row 0 for each row of a
        batch): ``compression`` reports their effective compression ratios."""
        sums = self.kvc_stats.setdefault(
            "kept", {"seen": [0] * len(seen), "kept": [[0] * len(k) for k in kept]}
        )
        sums["seen"] = [a + b * batch for a, b in zip(sums["seen"], seen, strict=True)]
        sums["kept"] = [
            [a + b * batch for a, b in zip(x, y, strict=True)]
            for x, y in zip(sums["kept"], kept, strict=True)
        ]

    def compression(self) -> dict:
        """``tokens_evicted`` over all requests and ``compressed`` when every kind of request that ran
        compressed (evicted a token, or its longest request held fewer bytes than ``full``); a warning
        names the kinds that never did. One ``full`` prefill per kind, for the byte reference."""
        verdicts = {}
        for kind in KINDS:
            c = self.kvc_stats[kind]
            if c["requests"]:
                full = full_cache_bytes(self.model, c["tokens"], c["batch"])
                read = c["tokens_read"] / c["tokens_visible"] if c["tokens_visible"] else None
                verdicts[kind] = is_compressed(c["tokens_evicted"], c["cache_bytes"], full, read)
        missed = [kind for kind, ok in verdicts.items() if not ok]
        visible = self.kvc_stats["tokens_visible"]
        result = {
            "tokens_evicted": self.kvc_stats["tokens_evicted"],
            "read_ratio": self.kvc_stats["tokens_read"] / visible if visible else None,
            "compressed": bool(verdicts) and not missed,
            "attention_backends": dict(sorted(self.kvc_stats["attention_backends"].items())),
        }
        if "kept" in self.kvc_stats:  # over every request: tokens kept over tokens seen, at each's end
            result |= ratios_of(self.kvc_stats["kept"]["seen"], self.kvc_stats["kept"]["kept"])
        if missed:
            evidence = " (no eviction, every token read, bytes not below full)"
            what = " or ".join(f"its {k} requests" for k in missed) + evidence
            hint = " ".join(dict.fromkeys(_hint(k, self.chunk_size, self.context_pass) for k in missed))
            result |= flag_uncompressed(self.policy.name, what, hint)
        return result

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """lm-eval's, scored as each batch streams (``streamed.score_requests``: no (B, T, V) logits), over
        groups of equal streamed length where ``chunk_size > 1`` needs them."""
        if self.backend != "causal":
            raise ValueError("model=kvcompress supports decoder-only (causal) models; got a seq2seq model")
        groups = equal_length_groups(requests, self.max_length, self.chunk_size, self.batch_size)
        if groups is None:
            return score_requests(self, requests, disable_tqdm)
        results = [None] * len(requests)
        for idx in groups:
            scored = score_requests(self, [requests[i] for i in idx], disable_tqdm)
            for i, result in zip(idx, scored, strict=True):
                results[i] = result
        return results

    def _chunk_logits(self, inps: torch.Tensor, cache=None, start: int = 0):
        """Each forward's logits (B, c, V) of ``inps`` (B, T) from position ``start`` on, streamed through
        ``cache`` (a fresh policy cache by default), ``chunk_size`` tokens per forward; the cache's counters
        are recorded once the stream ends."""
        cache = self._new_cache() if cache is None else cache
        starts = range(start, inps.shape[1], self.chunk_size)
        for s in tqdm(starts, desc="kvcompress stream", leave=False, disable=len(starts) < 256):
            yield self.model(inps[:, s : s + self.chunk_size], cache=cache, use_cache=True).logits
        self._record(cache, inps.shape[0], len(starts), "loglikelihood")

    def _stream(self, inps: torch.Tensor, inplens: list[int], prompts: list[int] | None = None) -> Scores:
        """``streamed.stream`` of ``inps`` (B, T): scored as each forward's logits come. With a policy that
        compresses by a context pass (KVzip), each row's prompt (``prompts[i]`` tokens: the request's
        context but its last token) is prefilled and compressed first, and the rest streams through the
        compressed cache, one row at a time (each row's context is its own)."""
        with torch.no_grad():
            if not self.context_pass or prompts is None:
                return stream(self._chunk_logits(inps), inps, inplens, self.softmax_dtype)
            rows = [
                self._compressed_row(inps[i : i + 1], n, p)
                for i, (n, p) in enumerate(zip(inplens, prompts, strict=True))
            ]
            return Scores(*(torch.cat([getattr(r, f) for r in rows]) for f in ("logprob", "greedy", "last")))

    def _compressed_row(self, row: torch.Tensor, inplen: int, prompt: int) -> Scores:
        """One row (1, T): its first ``prompt`` tokens prefilled and compressed (``context_pass.prefill``),
        the rest streamed through the compressed cache and scored."""
        cache = self._new_cache()
        if prompt > 0:
            prefill(self.model, cache, row[:, :prompt], self.tokenizer, logits_to_keep=1)
        chunks = self._chunk_logits(row[:, :inplen], cache, start=prompt)
        return stream(chunks, row, [inplen], self.softmax_dtype, start=prompt)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits (B, T, V) of ``inps`` (B, T), every forward's kept (lm-eval's paths other than
        log-likelihoods). Rows are right-padded by lm-eval: padding follows a row's last token and never
        reaches a scored logit."""
        if attn_mask is not None or labels is not None:
            raise ValueError("model=kvcompress supports decoder-only (causal) models; got a seq2seq call")
        with torch.no_grad():
            return torch.cat(list(self._chunk_logits(inps)), dim=1)

    def _model_generate(self, context, max_length: int, stop, **generation_kwargs):
        """Generate with a fresh policy cache; stop on the generation config's eos ids (not tokenizer's)."""
        eos = self.model.generation_config.eos_token_id
        if eos is not None:
            generation_kwargs.setdefault("eos_token_id", eos)
        cache = self._new_cache()
        mask = generation_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):  # lm-eval pads a batch's prompts on the left
            check_padding(cache, self.policy.name, "batch_size")
        if not self.question_in_prompt:  # the context compressed alone, the question fed after it
            compress_then_feed(self.model, cache, context, self.tokenizer, self.question_start)
        elif self.context_pass:  # the prompt but its last token, prefilled and compressed; generate() goes on
            head = None if mask is None else mask[:, :-1]
            Padded(self.model, cache, head).prompt(context[:, :-1], self.tokenizer)
        out = super()._model_generate(context, max_length, stop, cache=cache, **generation_kwargs)
        self._record(cache, context.shape[0], out.shape[1] - context.shape[1], "generate")
        return out

    def get_model_info(self) -> dict:
        """What lm-eval stores under ``config``: the model, the policy, ``chunk_size`` and cache counters."""
        return {
            "model_num_parameters": self.model.num_parameters(),
            "model_dtype": str(self.model.dtype),
            "kvcompress": {
                "policy": self.policy.describe(),
                "question_in_prompt": self.question_in_prompt,
                "calibration_ranges": self.calibration_ranges,
                **self.kvc_stats,
                **self.compression(),
            },
        }
