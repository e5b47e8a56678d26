"""``python -m kvcompress.kernels [native] [portable]``: build the C++ kernels ahead of their first use (both
builds when none is named) and say, per kernel, whether it built."""

from __future__ import annotations

import sys

from kvcompress import kernels


def main(argv: list[str]) -> int:
    isas = argv or list(kernels.ISAS)
    unknown = [isa for isa in isas if isa not in kernels.ISAS]
    if unknown:
        print(f"unknown build {unknown}; allowed: {list(kernels.ISAS)}", file=sys.stderr)
        return 2
    failed = 0
    for isa in isas:
        for kernel in kernels.KERNELS:
            built = kernels.load(kernel, isa) is not None
            failed += not built
            print(f"{kernel} ({isa}): {'built' if built else kernels.why(kernel, isa)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
