"""RULER (Hsieh et al., arXiv 2404.06654) offline: lm-eval's own generators, on haystacks that need no hub.

Copied next to the ``kvc_ruler_*`` YAMLs. Each builder calls lm-eval's RULER sample generator with the
tokenizer named by the model args or metadata (``smollm2-135m``, the embedded default, when none is) at the
lengths in ``max_seq_lengths`` (default 1024): the noise haystack ("The grass is green...") for the needle
variants, lm-eval's own variable-tracking, common-words and frequent-words sets. ``kvc_ruler_niah_single``
is lm-eval's ``niah_single_1`` document for document; multi-key, multi-value and multi-query put RULER's
needles (4 keys, 4 values, 4 queries) in the noise haystack where lm-eval's hub tasks use essays. Scoring is
lm-eval's ``string_match_all`` on its post-processed prediction: the fraction of expected strings found.

lm-eval's generators draw from the global ``random`` (and numpy's) state, so their documents depend on what
ran before them; each builder seeds both (metadata ``seed``, default 0) first, so a task's documents depend
only on the tokenizer, the length and the seed, whichever tasks run with it: every leaderboard point
answers the same samples. lm-eval's own task, built first after its default seeding, gets the same ones.
"""

import random

import datasets
import numpy as np

DEFAULT_LENGTHS = (1024,)
VT_MIN_LENGTH = 1024


def _tokenizer_name(kwargs: dict) -> str:
    from kvcompress.resources.models import DEFAULT_MODEL, EMBEDDED_MODELS, embedded_model_dir

    name = next((kwargs[k] for k in ("tokenizer", "pretrained") if isinstance(kwargs.get(k), str)), None)
    name = name or DEFAULT_MODEL
    return str(embedded_model_dir(name)) if name in EMBEDDED_MODELS else name


def _setup(kwargs: dict):
    from lm_eval.tasks.ruler.common_utils import get_tokenizer

    seed = int(kwargs.get("seed", 0))
    random.seed(seed)
    np.random.seed(seed + 1234)  # lm-eval's default numpy seed is its python seed's default + 1234
    lengths = [int(n) for n in kwargs.get("max_seq_lengths") or DEFAULT_LENGTHS]
    return get_tokenizer(_tokenizer_name(kwargs)), lengths


def _dataset(rows) -> dict:
    return {"test": datasets.Dataset.from_list(list(rows), split=datasets.Split.TEST)}


def _niah(kwargs: dict, haystack: str = "repeat", **needles) -> dict:
    from lm_eval.tasks.ruler.niah_utils import TEMPLATE  # lm-eval's own needle prompt
    from lm_eval.tasks.ruler.prepare_niah import generate_samples, get_haystack

    tokenizer, lengths = _setup(kwargs)
    rows = []
    for seq in lengths:
        rows += generate_samples(
            get_haystack(type_haystack=haystack),
            max_seq_length=seq,
            template=TEMPLATE,
            type_haystack=haystack,
            type_needle_k="words",
            type_needle_v="numbers",
            num_samples=int(kwargs.get("num_samples", 500)),
            TOKENIZER=tokenizer,
            **needles,
        )
    return _dataset(rows)


def niah_single(**kwargs) -> dict:
    """One 7-digit value for one word key in the noise haystack (lm-eval's ``niah_single_1``)."""
    return _niah(kwargs)


def niah_multikey(**kwargs) -> dict:
    """Four keys' needles in the noise haystack; one is asked (RULER's multi-key design)."""
    return _niah(kwargs, num_needle_k=4)


def niah_multivalue(**kwargs) -> dict:
    """One key with four values in the noise haystack; all four are asked."""
    return _niah(kwargs, num_needle_v=4)


def niah_multiquery(**kwargs) -> dict:
    """Four keys' needles in the noise haystack; all four are asked."""
    return _niah(kwargs, num_needle_q=4)


def variable_tracking(**kwargs) -> dict:
    """Chains of variable assignments in the noise haystack (lm-eval's ``ruler_vt``)."""
    from lm_eval.tasks.ruler.vt_utils import get_dataset

    tokenizer, lengths = _setup(kwargs)
    if min(lengths) < VT_MIN_LENGTH:  # its in-context example alone takes up to 500 tokens
        raise ValueError(
            f"kvc_ruler_vt: max_seq_lengths={lengths}: every length must be >= {VT_MIN_LENGTH} (below it "
            "lm-eval's variable-tracking generator never finds a sample that fits and does not return)"
        )
    return _dataset(row for seq in lengths for row in get_dataset(tokenizer=tokenizer, seq=seq))


def common_words(**kwargs) -> dict:
    """The ten most common words of a list (lm-eval's ``ruler_cwe``)."""
    from lm_eval.tasks.ruler.cwe_utils import get_dataset

    tokenizer, lengths = _setup(kwargs)
    return _dataset(row for seq in lengths for row in get_dataset(tokenizer=tokenizer, seq=seq))


def frequent_words(**kwargs) -> dict:
    """The three most frequent coded words (lm-eval's ``ruler_fwe``)."""
    from lm_eval.tasks.ruler.fwe_utils import get_dataset

    tokenizer, lengths = _setup(kwargs)
    return _dataset(row for seq in lengths for row in get_dataset(tokenizer=tokenizer, max_seq_length=seq))


def process_results(doc: dict, results: list[str]) -> dict:
    """lm-eval's RULER score of one document: ``string_match_all`` of its post-processed prediction."""
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all

    return {"score": string_match_all(postprocess_pred(results), [doc["outputs"]])}
