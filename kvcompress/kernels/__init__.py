"""Hand-written CPU kernels, built once per machine with the system's C++ compiler.

``quant_attention.cpp`` computes KIVI decode attention sums straight from packed codes (Liu et al., arXiv
2402.02750), one pass over a KV head's bytes: for every token group the key scales fold into the query and
the zero points into one constant; for every token the value scales fold into its probability. Unlike the
``torch.compile`` form of the same sums (``kvcompress.kernels.fused_quant``), the loops unpack 16 tokens at a
time
into a small buffer that stays in L1 and share it between the GQA group's query heads (no float copy of
the cache, no horizontal sum per token); its speed against a float32 cache is in experiments/fused.
Two builds of every kernel sit side by side under torch's extension folder: ``native`` (``-march=native``:
AVX-512 where the CPU has it) and ``portable`` (the compiler's baseline for the architecture: SSE2 on
x86-64, NEON on aarch64). ``KVCOMPRESS_CPU_ISA`` picks the one callers use (``native`` by default); every
vector loop has a portable twin, and the kernel tests run both builds on any host. A build is keyed by its
sources, the flags and, for ``native``, the macros the compiler predefines for this CPU (which name its
instruction set on any architecture, unlike a ``/proc/cpuinfo`` line). ``load()`` returns ``None`` with the
reason (``why()``) where no compiler is available, and callers fall back to the tensor form.

Every entry point returns its result, or ``None`` where it does not serve the inputs (a rotary position
the table does not hold); the caller then runs the tensor form. Nothing else signals "not served".

``page_attention.cpp`` computes Quest's decode attention over the chosen pages of a float32 cache where they
lie (Tang et al., arXiv 2406.10774): logits page by page, then, after torch's softmax, the values' sum; no
gathered copy of the pages (``load("page_attention")``).

``rope_latent.cpp`` computes decode logits over pre-RoPE low-rank keys (Palu, arXiv 2407.21118): a few keys
at a time are rebuilt from their latents in registers, rotated at their positions from a shared cos/sin
table and dotted with the GQA group's queries (``load("rope_latent")``,
``kvcompress.kernels.fused_low_rank``).

``latent_values.cpp`` mixes low-rank latents by the probabilities (``sum_t p_t c_t``, a few rows by T tokens:
what a BLAS does worst) with each latent read once into register accumulators (``load("latent_values")``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import subprocess
import sys
import threading
import warnings
from pathlib import Path

from kvcompress.resources.files import exclusive

KERNELS = ("quant_attention", "page_attention", "rope_latent", "latent_values")
ISAS = ("native", "portable")
ISA_ENV = "KVCOMPRESS_CPU_ISA"
WAIT_ENV = "KVCOMPRESS_KERNEL_WAIT_S"
_BASE_FLAGS = ("-O3", "-fopenmp-simd")
_BUILT: dict[tuple[str, str], dict[str, object]] = {}
_LOCKS: dict[tuple[str, str], threading.Lock] = {}


def cpu_isa() -> str:
    """The build callers use: ``$KVCOMPRESS_CPU_ISA`` (``native`` when unset)."""
    isa = os.environ.get(ISA_ENV, "") or "native"
    if isa not in ISAS:
        raise ValueError(f"{ISA_ENV}={isa!r} is not a kernel build; allowed: {list(ISAS)}")
    return isa


@functools.cache
def _native_macros() -> bytes | None:
    """What the compiler predefines with ``-march=native`` (its view of this CPU), or None where it cannot
    tell (then ``native`` builds with the portable flags)."""
    compiler = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run(
            [compiler, "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
            capture_output=True, timeout=60, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return b"\n".join(sorted(done.stdout.splitlines()))


def build_flags(isa: str) -> list[str]:
    """Compiler flags of build ``isa`` on this machine."""
    native = isa == "native" and _native_macros() is not None
    return [*_BASE_FLAGS, *(["-march=native"] if native else [])]


def _build_key(source: Path, isa: str) -> str:
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # included by the sources
    cpu = (_native_macros() or b"") if isa == "native" else b""
    flags = " ".join(build_flags(isa)).encode()
    blob = b"\0".join([source.read_bytes(), headers, platform.machine().encode(), flags, cpu])
    return hashlib.sha1(blob).hexdigest()[:12]


def load(kernel: str = "quant_attention", isa: str | None = None):
    """The built module of ``kernel`` (one of ``KERNELS``) in build ``isa`` (default ``cpu_isa()``), or
    ``None`` where it cannot be built (see ``why(kernel)``)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernels.load: kernel={kernel!r}; allowed: {list(KERNELS)}")
    isa = cpu_isa() if isa is None else isa
    if isa not in ISAS:
        raise ValueError(f"kernels.load: isa={isa!r}; allowed: {list(ISAS)}")
    built = _BUILT.setdefault((kernel, isa), {})
    with _LOCKS.setdefault((kernel, isa), threading.Lock()):  # another thread may be building it
        if "module" not in built:
            built["module"], built["error"] = _build(kernel, isa)
            if built["module"] is None:
                warnings.warn(f"kvcompress C++ kernel {kernel} ({isa}) unavailable ({built['error']}); "
                              "slower tensor forms used", stacklevel=2)  # fmt: skip
    return built["module"]


def prebuild(isas=ISAS) -> subprocess.Popen:
    """Build every kernel in ``isas`` in a separate process (started and returned: ``python -m
    kvcompress.kernels``), so a process that will need them (the test suite) compiles while it does other
    work on another core; ``load`` in this process waits for a kernel the other one is building (a lock the
    operating system drops when its holder exits, however it exits) and then imports what it built."""
    cmd = [sys.executable, "-m", "kvcompress.kernels", *isas]
    quiet = subprocess.DEVNULL
    return subprocess.Popen(cmd, stdin=quiet, stdout=quiet, stderr=quiet)


def _build(kernel: str, isa: str):
    """(module, None), or (None, the reason) where the build fails (no compiler, headers or ninja)."""
    source = Path(__file__).with_name(f"{kernel}.cpp")
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as build

        quiet = os.environ.get("KVC_KERNEL_VERBOSE", "0") != "1"
        name = f"kvc_{kernel}_{isa}_{_build_key(source, isa)}"
        folder = Path(_get_build_directory(name, verbose=False))
        with build_lock(folder, f"{kernel} ({isa})"):
            if not (folder / f"{name}.so").exists():
                print(f"kvcompress: building the C++ kernel {kernel} ({isa} build; once per machine, in "
                      "about a minute)", file=sys.stderr)  # fmt: skip
            flags = build_flags(isa)
            return build(name=name, sources=[str(source)], extra_cflags=flags, build_directory=str(folder),
                         verbose=not quiet), None  # fmt: skip
    except Exception as err:  # the tensor form runs instead
        return None, f"{err!r:.300}"


@contextlib.contextmanager
def build_lock(folder: Path, what: str, wait_s: float | None = None):
    """Hold the build of ``folder`` against every other process (``resources.files.exclusive``: an ``flock``
    the operating system releases when its holder dies, unlike torch's own lock file, which a killed build
    leaves behind for every later one to wait on forever). Holding ours, no other build is running, so such a
    leftover file is removed. Waits at most ``wait_s`` (``$KVCOMPRESS_KERNEL_WAIT_S``, default 1800 s), then
    raises ``TimeoutError``."""
    wait_s = float(os.environ.get(WAIT_ENV, "1800")) if wait_s is None else wait_s
    with exclusive(folder / "kvcompress.lock", what, wait_s):
        (folder / "lock").unlink(missing_ok=True)  # torch's, left by a build that was killed
        yield


def why(kernel: str = "quant_attention", isa: str | None = None) -> str | None:
    """Why ``load(kernel, isa)`` returned ``None`` (``None`` when it built or was not tried)."""
    return _BUILT.get((kernel, cpu_isa() if isa is None else isa), {}).get("error")
