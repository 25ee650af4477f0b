"""The attention kernels' errors against float64 on the CPU emulator, fp32, bf16 and fp16 side by
side at the shapes of tests/test_kernel_numerics.py, and fp16's sm_75 and sm_70 paths.

  python scripts/kernel_errors.py            (a markdown table: kernels/README.md has its output)

Each error is the largest |kernel - float64| over an output, relative to max(|float64|, 1), as
the tests judge it; "in u" divides by the element type's unit roundoff (bf16 2^-8, fp16 2^-11).
"""

from __future__ import annotations

import math
import sys

import torch

from andrea.cuda import emulator as kernel_emulator

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
# (head_dim, T, (B, H)): those of tests/test_kernel_numerics.py's CASES.
SHAPES = [(d, t, bh) for d in (32, 64)
          for t, bh in zip((1, 17, 64, 100, 129), [(2, 3), (1, 2), (2, 1), (1, 3), (1, 2)],
                           strict=True)] + [(128, 33, (1, 2)), (32, 5, (2, 16))]
OUTPUTS = ("o", "lse", "dq", "dk", "dv")


def errors(emu: kernel_emulator.Emulator, dtype: torch.dtype, d: int, t: int,
           bh: tuple[int, int]) -> list[float]:
    gen = torch.Generator().manual_seed(t * 7 + d)  # the test's inputs
    q, k, v, dout = (torch.randn(*bh, t, d, generator=gen).to(dtype) for _ in range(4))
    o, lse = kernel_emulator.attention_forward(q, k, v, emulator=emu)
    grads = kernel_emulator.attention_backward(q, k, v, o, lse, dout, emulator=emu)
    want = kernel_emulator.float64_reference(q, k, v, dout, 1 / math.sqrt(d))
    return [kernel_emulator.max_error(g, w) for g, w in zip((o, lse, *grads), want, strict=True)]


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    emu = kernel_emulator.default_emulator()
    paths = {arch: kernel_emulator.Emulator(defines=defines)
             for arch, defines in kernel_emulator.HALF_ARCH_DEFINES.items()}
    columns = ["fp32", "bf16", "fp16", "fp16 sm_75", "fp16 sm_70"]
    print("| D | T | B,H | " + " | ".join(f"{c}: max error (o, dq, dk, dv)" for c in columns)
          + " |")
    print("|---|---|---|" + "---|" * len(columns))
    worst = {c: 0.0 for c in columns}
    worst_lse = 0.0
    for d, t, bh in SHAPES:
        cells = []
        for column in columns:
            name = column.split()[0]
            build = paths[int(column[-2:]) * 10] if column.startswith("fp16 sm_") else emu
            errs = errors(build, DTYPES[name], d, t, bh)
            worst_lse = max(worst_lse, errs[1])
            top = max(errs[0], *errs[2:])
            worst[column] = max(worst[column], top)
            cells.append(f"{top:.1e} ({top / UNIT_ROUNDOFF[name]:.2f} u)")
        print(f"| {d} | {t} | {bh[0]},{bh[1]} | " + " | ".join(cells) + " |")
    print("| **worst** | | | " + " | ".join(
        f"**{worst[c]:.1e} ({worst[c] / UNIT_ROUNDOFF[c.split()[0]]:.2f} u)**" for c in columns)
        + " |")
    print(f"\nlse (float32 in every path): at most {worst_lse:.1e}")


if __name__ == "__main__":
    main()
