"""Operations that would block the host on a GPU, counted on any device with a ``TorchDispatchMode``.

Every aten op a step runs is seen, so the count on a CPU is what a GPU would wait for: values read back
(``item``, ``int``, ``bool``, ``float``: ``_local_scalar_dense``; ``equal``), shapes that depend on data
(``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` by a tensor, indexing by a boolean mask)
and tensors built from host data (``torch.tensor(list)``: ``lift_fresh``). ``tolist`` reads memory without an
aten op, and under ``torch.inference_mode`` so do ``item``, ``int`` and ``float`` on a CPU tensor, so these
are counted by wrapping the methods (``WRAPPED``). Each count names the first kvcompress source line on the
stack, so a table says where to look.
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READ_BACK = {"aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default"}
DATA_SHAPED = {
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.repeat_interleave.Tensor",
}
FROM_HOST = {"aten.lift_fresh.default"}
# Read back without an aten op the mode sees: ``tolist`` always, and on inference tensors ``item`` and the
# conversions to Python numbers (a CPU fast path skips the dispatcher); wrapped, each counts once.
WRAPPED = ("tolist", "item", "__int__", "__float__", "__index__")
# Functions that run once per model forward, not once per layer: the forward's padding check and the
# model's own mask (transformers reads the padding mask back to decide whether SDPA may skip it).
PER_FORWARD = {"new_token_validity", "kvcompress_mask"}
# Functions whose host tensors stay on the host by design: the cold tier gathers its rows and indices
# there and uploads them through pinned staging buffers on a copy stream (``ColdPages.fetch_into``). Their
# ``from_host`` tensors are not counted; what they read back would be.
HOST_SIDE = {"fetch_into"}
PACKAGE = str(Path(__file__).resolve().parents[1])
HERE = str(Path(__file__).resolve())


def kind_of(func, args) -> str | None:
    """Which host-blocking kind an aten call is (``read_back``, ``data_shaped``, ``from_host``), or None."""
    name = str(func)
    if name in READ_BACK:
        return "read_back"
    if name in DATA_SHAPED:
        return "data_shaped"
    if name in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default"):
        indices = args[1] if len(args) > 1 else ()
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return "data_shaped"  # a boolean mask index: its result's size is a count of True values
    if name in FROM_HOST:
        return "from_host"
    return None


def _where() -> tuple[str, str]:
    """The first kvcompress source line (outside this module) on the stack, as ``path:line``, and its
    function's name."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(PACKAGE) and frame.filename != HERE:
            return f"{Path(frame.filename).relative_to(Path(PACKAGE).parent)}:{frame.lineno}", frame.name
    return "outside kvcompress", ""


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs() as s: ...``: ``s.kinds`` (per kind), ``s.lines`` (per source line), ``s.total``;
    ``s.per_forward``: those made once per model forward (``PER_FORWARD``); ``s.in_layers``: the rest."""

    def __init__(self):
        super().__init__()
        self.kinds: collections.Counter = collections.Counter()
        self.lines: collections.Counter = collections.Counter()
        self.per_forward = 0
        self._methods: dict = {}
        self._wrapped = False

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    @property
    def in_layers(self) -> int:
        return self.total - self.per_forward

    def _count(self, kind: str) -> None:
        line, function = _where()
        if kind == "from_host" and function in HOST_SIDE:
            return
        self.kinds[kind] += 1
        self.lines[line] += 1
        self.per_forward += function in PER_FORWARD

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = kind_of(func, args)
        if kind is not None and not self._wrapped:
            self._count(kind)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._methods = {name: getattr(torch.Tensor, name) for name in WRAPPED}
        for name, method in self._methods.items():
            setattr(torch.Tensor, name, self._counted(method))
        return super().__enter__()

    def _counted(self, method):
        """``method`` counted as one read-back, its own aten ops not counted again."""

        def counted(tensor, *args, **kwargs):
            if self._wrapped:
                return method(tensor, *args, **kwargs)
            self._count("read_back")
            self._wrapped = True
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._wrapped = False

        return counted

    def __exit__(self, *exc):
        for name, method in self._methods.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)
