"""The two builds of the C++ kernels (``KVCOMPRESS_CPU_ISA``): side by side, each running the vector loops it
was asked for, keyed by what the compiler says of the CPU (no ``/proc/cpuinfo`` line), a bad setting refused
by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import kernel_or_skip

from kvcompress import kernels


@pytest.fixture(autouse=True)
def _needs_kernel():
    kernel_or_skip("latent_values")  # at test time, not collection: the kernels build in the background


def _cpu_has_avx512() -> bool | None:
    cpuinfo = Path("/proc/cpuinfo")
    return "avx512f" in cpuinfo.read_text() if cpuinfo.exists() else None


@pytest.mark.parametrize("kernel", kernels.KERNELS)
def test_each_build_runs_the_vector_loops_it_was_asked_for(kernel):
    portable, native = kernels.load(kernel, "portable"), kernels.load(kernel, "native")
    assert portable is not native and portable.__file__ != native.__file__  # two builds side by side
    assert portable.vector_isa() == "portable"  # whatever the host has
    has = _cpu_has_avx512()
    if has is None:
        pytest.skip("no /proc/cpuinfo to say what this CPU has")
    assert native.vector_isa() == ("avx512" if has else "portable")


def test_the_setting_picks_the_build_callers_get(monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "portable")
    assert kernels.cpu_isa() == "portable"
    assert kernels.load("latent_values") is kernels.load("latent_values", "portable")
    monkeypatch.delenv(kernels.ISA_ENV)
    assert kernels.cpu_isa() == "native"


def test_a_bad_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    with pytest.raises(ValueError, match=r"KVCOMPRESS_CPU_ISA='avx2'.*allowed: \['native', 'portable'\]"):
        kernels.load("latent_values")
    with pytest.raises(ValueError, match="isa='sse'"):
        kernels.load("latent_values", isa="sse")


def test_build_keys_come_from_the_compiler_not_cpuinfo(monkeypatch):
    """The portable key depends on no CPU at all; the native key on the compiler's predefined macros for
    ``-march=native`` (present on aarch64 too, where ``/proc/cpuinfo`` has no ``flags`` line)."""
    source = Path(kernels.__file__).with_name("latent_values.cpp")
    real = kernels._native_macros()
    portable, native = kernels._build_key(source, "portable"), kernels._build_key(source, "native")
    assert portable != native or real is None
    monkeypatch.setattr(kernels, "_native_macros", lambda: b"#define __ARM_NEON 1")
    assert kernels._build_key(source, "portable") == portable
    assert kernels._build_key(source, "native") not in (native, portable)
    assert "-march=native" in kernels.build_flags("native")
    assert "-march=native" not in kernels.build_flags("portable")
    monkeypatch.setattr(kernels, "_native_macros", lambda: None)  # a compiler that cannot say
    assert kernels.build_flags("native") == kernels.build_flags("portable")
