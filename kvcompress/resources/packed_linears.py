"""Linear layers on weights packed once for oneDNN: ``model.linears=packed`` (CPU, float32; opt-in).

A float32 ``nn.Linear`` on a CPU calls the BLAS's GEMM, which copies (packs) the whole weight matrix into its
own blocked layout on every call that has more than one row. Decoding a batch of 8 rows one token at a time
is such a call for every weight of the model, every step: on SmolLM2-135M, 8-row GEMMs then cost about
twice the 1-row ones, and the packing is a third of an lm-eval run's time at batch 8. oneDNN's linear takes
a weight packed once (``torch.ops.mkldnn._reorder_linear_weight``) and reads it as is: one-thread GEMMs of
the model's shapes take 0.4-0.6x the time at 1 row and 0.3-0.4x at 8 rows (``experiments/speed``).

The sums run in another order than the BLAS's, so logits differ from the default path at float rounding
(about 1e-4 absolute on logits of order 10). A row's logits match the same row decoded alone to float
rounding (bit-equal on this project's machine in the tiny-model test, where the default path is 8e-8 off).
The original weights stay (tied embeddings and any code that reads ``.weight`` keep working), so the model
takes twice its linear weights' memory. Off by default: a model computes as transformers computes it.
"""

from __future__ import annotations

import torch

LINEARS = ("default", "packed")
ROWS_HINT = 8  # the batch size the packed layout is tuned for; any number of rows is served


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward on a oneDNN-packed copy of its weight (the original kept as ``weight``)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def unavailable(model) -> str | None:
    """Why ``pack_linears`` cannot serve ``model`` (None when it can)."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return f"needs a float32 model on the CPU (got {param.dtype} on {param.device.type})"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN (mkldnn) linear"
    return None


def pack_linears(model) -> int:
    """Replace every float32 ``nn.Linear`` of ``model`` by a ``PackedLinear``; returns how many.

    Raises ``ValueError`` naming ``model.linears`` where packing cannot serve the model.
    """
    why = unavailable(model)
    if why is not None:
        raise ValueError(f"model.linears='packed' {why}; allowed: {list(LINEARS)} ('default' runs anywhere)")
    targets = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    for name, linear in targets:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, PackedLinear(linear))
    return len(targets)


def check(linears: str | None) -> None:
    """Refuse an unknown ``model.linears`` (before any model is loaded)."""
    if linears is not None and linears not in LINEARS:
        raise ValueError(f"model.linears={linears!r} is unknown; allowed: {list(LINEARS)}")


def apply(model, linears: str | None) -> int:
    """``model.linears`` of a run's config: ``"default"`` (or None) leaves the model as loaded; returns the
    number of linear layers packed."""
    check(linears)
    return 0 if linears in (None, "default") else pack_linears(model)
