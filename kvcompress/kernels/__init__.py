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

``page_attention.cpp`` computes Quest's decode attention over the chosen pages of a float32 cache where they
lie (Tang et al., arXiv 2406.10774): logits page by page, then, after torch's softmax, the values' sum; no
gathered copy of the pages (``load("page_attention")``).

``rope_latent.cpp`` computes decode logits over pre-RoPE low-rank keys (Palu, arXiv 2407.21118): a few keys
at a time are rebuilt from their latents in registers, rotated at their positions from a shared cos/sin
table and dotted with the GQA group's queries (``load("rope_latent")``, ``kvcompress.fused_low_rank``).

``latent_values.cpp`` mixes low-rank latents by the probabilities (``sum_t p_t c_t``, a few rows by T tokens:
what a BLAS does worst) with each latent read once into register accumulators (``load("latent_values")``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

KERNELS = ("quant_attention", "page_attention", "rope_latent", "latent_values")
_BUILT: dict[str, dict[str, object]] = {}


def _machine_key(source: Path) -> str:
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # included by the sources
    blob = source.read_bytes() + headers + platform.machine().encode() + flags.encode()
    return hashlib.sha1(blob).hexdigest()[:12]


def load(kernel: str = "quant_attention"):
    """The built module of ``kernel`` (one of ``KERNELS``), or ``None`` where it cannot be built (see
    ``why(kernel)``)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernels.load: kernel={kernel!r}; allowed: {list(KERNELS)}")
    built = _BUILT.setdefault(kernel, {})
    if "module" not in built:
        source = Path(__file__).with_name(f"{kernel}.cpp")
        try:
            from torch.utils.cpp_extension import load as build

            quiet = os.environ.get("KVC_KERNEL_VERBOSE", "0") != "1"
            note = f"kvcompress: loading the C++ kernel {kernel} (built once per machine, in about a minute)"
            print(note, file=sys.stderr)
            built["module"] = build(
                name=f"kvc_{kernel}_{_machine_key(source)}", sources=[str(source)],
                extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=not quiet,
            )  # fmt: skip
        except Exception as err:  # no compiler, no headers, no ninja: the tensor form runs instead
            built["module"], built["error"] = None, f"{err!r:.300}"
            warnings.warn(f"kvcompress C++ kernel {kernel} unavailable ({built['error']}); slower tensor "
                          "forms used", stacklevel=2)  # fmt: skip
    return built["module"]


def why(kernel: str = "quant_attention") -> str | None:
    """Why ``load(kernel)`` returned ``None`` (``None`` when it built or was not tried)."""
    return _BUILT.get(kernel, {}).get("error")
