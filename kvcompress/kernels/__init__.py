"""Hand-written CPU kernels, built once per machine with the system's C++ compiler.

``quant_attention.cpp`` computes KIVI decode attention sums straight from packed codes (Liu et al., arXiv
2402.02750), one pass over a KV head's bytes: for every token group the key scales fold into the query and
the zero points into one constant; for every token the value scales fold into its probability. Unlike the
``torch.compile`` form of the same sums (``kvcompress.fused_quant``), the loops unpack 16 tokens at a time
into a small buffer that stays in L1 and share it between the GQA group's query heads (no float copy of
the cache, no horizontal sum per token), which is what makes it faster than a float32 cache on a CPU.
The build is compiled for this machine's instruction set (``-march=native``) and cached
under torch's extension folder, keyed by the source and the CPU's flags; ``load()`` returns ``None`` with
the reason where no compiler is available, and callers fall back to the tensor form.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("quant_attention.cpp")
_BUILT: dict[str, object] = {}


def _machine_key() -> str:
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    blob = SOURCE.read_bytes() + platform.machine().encode() + flags.encode()
    return hashlib.sha1(blob).hexdigest()[:12]


def load():
    """The built ``quant_attention`` module, or ``None`` where it cannot be built (see ``why()``)."""
    if "module" not in _BUILT:
        try:
            from torch.utils.cpp_extension import load as build

            quiet = os.environ.get("KVC_KERNEL_VERBOSE", "0") != "1"
            note = "kvcompress: loading the C++ quant kernel (built once per machine, in about a minute)"
            print(note, file=sys.stderr)
            _BUILT["module"] = build(
                name=f"kvc_quant_attention_{_machine_key()}", sources=[str(SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=not quiet,
            )  # fmt: skip
        except Exception as err:  # no compiler, no headers, no ninja: the tensor form runs instead
            _BUILT["module"], _BUILT["error"] = None, f"{err!r:.300}"
            warnings.warn(f"kvcompress C++ kernels unavailable ({_BUILT['error']}); slower tensor forms used",
                          stacklevel=2)  # fmt: skip
    return _BUILT["module"]


def why() -> str | None:
    """Why ``load()`` returned ``None`` (``None`` when it built or was not tried)."""
    return _BUILT.get("error")
