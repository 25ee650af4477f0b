"""Each attention kernel launched once at small shapes, with CuPy only: the program
scripts/gpu_check.sh runs under compute-sanitizer (memcheck, racecheck).

No torch: a torch process under compute-sanitizer spends minutes loading and instrumenting
torch's own modules. The kernels are compiled exactly as the backend compiles them
(andrea.cuda.launch.compiled_module, same options and name expressions, so CuPy's disk cache
from the earlier parts serves them). Every array is its own cudaMalloc of the exact size
(CuPy's memory pool would hide an overrun inside a larger block), and outputs start as NaN, so
an element a kernel forgets to write shows up here too. Exit 1 when an output is not finite.

  python3 scripts/gpu_check_launch.py               (under compute-sanitizer)
  python3 scripts/gpu_check_launch.py --resources   (the device's ptxas figures, a table)
"""

from __future__ import annotations

import sys

import numpy as np

from andrea.cuda.launch import (
    ELEMENT_TYPES,
    SUPPORTED_HEAD_DIMS,
    attention_launches,
    compiled_module,
    kernel_source,
    module_names,
)

try:
    import cupy
except ImportError:  # --help needs no CuPy; main says so when a run does
    cupy = None

# (dtype, head_dim): the ANDREA-120M case and the other two tile families, and ANDREA-120M in
# fp16; B*H, T small, T not a multiple of any tile so the masked edges and bounds checks run.
CASES = (("bfloat16", 64), ("bfloat16", 128), ("float32", 32), ("float16", 64))
HALF_TYPES = ("bfloat16", "float16")  # passed as uint16 bit patterns
BH, SEQ_LEN = 2, 77


def bits16(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> bf16 (truncated: inputs only need to be some bf16 values) or fp16 bits."""
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16)
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def as_float(x: cupy.ndarray, dtype: str) -> np.ndarray:
    host = cupy.asnumpy(x)
    if dtype == "bfloat16":
        return (host.astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return host.view(np.float16).astype(np.float32)
    return host


def run_case(dtype: str, head_dim: int, arch: str, source: str) -> bool:
    launches = attention_launches(1, BH, SEQ_LEN, head_dim, dtype)
    shape = (BH, SEQ_LEN, head_dim)
    rng = np.random.default_rng(head_dim)

    def tensor() -> cupy.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        return cupy.asarray(bits16(x, dtype) if dtype in HALF_TYPES else x)

    def poisoned(rows_shape: tuple[int, ...], elem: str) -> cupy.ndarray:
        if elem in HALF_TYPES:  # a NaN of either
            return cupy.full(rows_shape, 0x7FC0 if elem == "bfloat16" else 0x7E00,
                             dtype=cupy.uint16)
        return cupy.full(rows_shape, np.nan, dtype=cupy.float32)

    q, k, v, dout = (tensor() for _ in range(4))
    o, dq, dk, dv = (poisoned(shape, dtype) for _ in range(4))
    lse, delta = (poisoned(shape[:2], "float32") for _ in range(2))
    scale = np.float32(head_dim**-0.5)
    t = np.int32(SEQ_LEN)
    args = {
        "fwd": (q, k, v, o, lse, t, scale),
        "bwd_preprocess": (o, dout, delta, np.int32(BH * SEQ_LEN)),
        "bwd_dq": (q, k, v, dout, lse, delta, dq, t, scale),
        "bwd_dkdv": (q, k, v, dout, lse, delta, dk, dv, t, scale),
    }
    for kernel, launch in launches.items():  # fwd, preprocess, dq, dkdv: the backward order
        fn = compiled_module(source, arch, module_names(launch.name)).get_function(launch.name)
        fn(launch.grid, launch.block, args[kernel], shared_mem=0)
    cupy.cuda.runtime.deviceSynchronize()
    ok = True
    for name, x, elem in (("o", o, dtype), ("lse", lse, "float32"), ("delta", delta, "float32"),
                          ("dq", dq, dtype), ("dk", dk, dtype), ("dv", dv, dtype)):
        bad = int((~np.isfinite(as_float(x, elem))).sum())
        ok &= bad == 0
        if bad:
            print(f"{dtype} D={head_dim} {name}: {bad} elements not finite (unwritten?)")
    print(f"{dtype} D={head_dim} B*H={BH} T={SEQ_LEN}: 4 kernels launched, "
          f"{'outputs finite' if ok else 'FAIL'}")
    return ok


def kernel_attribute(fn: object, name: str) -> int:
    value = getattr(fn, name, None)
    if value is None:  # older CuPy: only the attributes dict
        value = fn.attributes[name]
    return int(value)


def resources(arch: str, source: str) -> int:
    """ptxas's figures for every tiled kernel as the device got it from NVRTC: registers,
    static shared memory, local memory (spills and stack) and resident blocks per SM."""
    print(f"{'kernel':36s} {'regs':>5s} {'smem B':>7s} {'local B':>7s} {'blocks/SM':>9s}  ({arch})")
    for dtype in ELEMENT_TYPES:
        for d in SUPPORTED_HEAD_DIMS:
            launches = attention_launches(1, 1, 128, d, dtype)
            names = module_names(launches["fwd"].name)
            module = compiled_module(source, arch, names)
            for launch in launches.values():
                fn = module.get_function(launch.name)
                try:
                    blocks = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                        fn.kernel.ptr, launch.block[0], 0)
                except Exception as exc:  # not in every CuPy: the figures above still count
                    blocks = f"n/a ({type(exc).__name__})"
                print(f"{launch.name:36s} {kernel_attribute(fn, 'num_regs'):5d} "
                      f"{kernel_attribute(fn, 'shared_size_bytes'):7d} "
                      f"{kernel_attribute(fn, 'local_size_bytes'):7d} {blocks!s:>9}")
    return 0


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if cupy is None:
        print("error: no CuPy: pip install -e '.[cuda]' on a GPU machine", file=sys.stderr)
        return 2
    arch = f"sm_{cupy.cuda.Device().compute_capability}"
    source = kernel_source()
    if argv == ["--resources"]:
        return resources(arch, source)
    cupy.cuda.set_allocator(None)  # exact cudaMalloc per array, seen as such by memcheck
    results = [run_case(dtype, d, arch, source) for dtype, d in CASES]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
