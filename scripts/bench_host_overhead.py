"""The host's cost of one attention forward + backward through the "cuda" backend, beside SDPA's.

At the 12M preset's shape a kernel runs for tens of microseconds, so what Python spends around
the launches decides whether the GPU waits. This times, on one tiny shape (B 1, H 1, T 16,
D 32), back-to-back calls of a forward and its backward into leaf tensors:

- bare: the loss (a sum) and its backward alone, what every row shares;
- sdpa: F.scaled_dot_product_attention(is_causal=True);
- cuda eager: andrea.cuda.attention.cuda_attention as the model calls it outside torch.compile;
- cuda op: the same kernels through the torch.library custom op, which is what a compiled graph
  calls (torch.compile needs an opaque op; eager mode does not);
- floor: a torch.autograd.Function that only allocates what cuda eager allocates (O, the
  log-sum-exp; dQ, dK, dV) and saves what it saves: what any Python autograd Function around
  these kernels costs, the part of "cuda eager" that is not andrea's checks and launches.

The rows' timings are interleaved (a timing of each row, then the next round), so a slow
moment of a shared machine falls on all of them.

Without a GPU the kernels are a stand-in CuPy's no-ops on CPU tensors, so the figures are
andrea's own Python (checks, allocations, autograd, argument conversion, contexts), not CuPy's
launch (its Cython, a few microseconds a launch) nor the GPU's time. With a GPU and CuPy the
real kernels run (bfloat16), synchronized after each timed batch.

Without a GPU but with CuPy installed, a second table times CuPy's own conversion of one
forward's kernel arguments (5 pointers, an int, a float) in the two forms andrea has passed them:
pointers as numpy uint64 scalars and as Python ints. CuPy's kernel function, called with no
driver, converts every argument and then fails at the launch; the same call without arguments
(the failure alone) is subtracted.

    python scripts/bench_host_overhead.py [--calls 300] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def stand_in_cupy() -> None:
    """A CuPy whose kernels do nothing, and a current stream, for CupyLauncher on a CPU."""

    class Kernel:
        max_dynamic_shared_size_bytes = 48 * 1024

        def __call__(self, grid, block, args, shared_mem=0, stream=None) -> None:
            pass

    class Module:
        def get_function(self, name: str) -> Kernel:
            return Kernel()

    class Context:
        def __enter__(self) -> Context:
            return self

        def __exit__(self, *exc) -> bool:
            return False

    cupy = type(sys)("cupy")
    cupy.cuda = type(sys)("cupy.cuda")
    cupy.cuda.Device = lambda index=None: Context()
    cupy.cuda.Stream = type("Stream", (), {"from_external": classmethod(
        lambda cls, handle: Context())})
    sys.modules["cupy"] = cupy
    stream = type("Stream", (), {"cuda_stream": 7})()
    torch.cuda.current_stream = lambda device=None: stream
    torch._C._cuda_getCurrentRawStream = lambda index: 7
    torch.cuda.get_device_capability = lambda device=None: (9, 0)

    from andrea.cuda import attention

    attention.compiled_module = lambda source, arch, names: Module()


def cupy_argument_costs(calls: int, repeats: int) -> dict[str, float] | None:
    """Microseconds CuPy spends converting one forward's arguments, by form (module docstring);
    None where CuPy is not installed or a GPU is there to launch on."""
    try:
        import numpy as np
        from cupy.cuda import function
    except Exception:  # noqa: BLE001 - no CuPy, or one that cannot load: nothing to time
        return None
    fn = function.Function.__new__(function.Function)  # no module: the launch fails
    stream = type("Stream", (), {"ptr": 0})()

    def call(args: tuple) -> None:
        try:
            fn((1,), (1,), args, 0, stream)
        except Exception:  # noqa: BLE001 - the launch's failure, after the conversion
            pass

    pointers = [2**40 + 256 * i for i in range(5)]
    forms = {
        "failure alone": lambda: call(()),
        "numpy uint64": lambda: call((*(np.uint64(p) for p in pointers), np.int32(256),
                                      np.float32(0.125))),
        "python int": lambda: call((*pointers, np.int32(256), np.float32(0.125))),
    }
    times = interleaved_medians(forms, calls, repeats, lambda: None)
    return {name: us - times["failure alone"] for name, us in times.items()
            if name != "failure alone"}


def interleaved_medians(fns: dict[str, Callable[[], None]], calls: int, repeats: int,
                        sync: Callable[[], None]) -> dict[str, float]:
    """Median microseconds a call of each fn: `repeats` rounds, each timing `calls` calls of
    every fn in turn (after 20 untimed ones each)."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    sync()
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            runs[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(times) for name, times in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    conversion = None if gpu else cupy_argument_costs(args.calls * 10, args.repeats)
    if not gpu:
        stand_in_cupy()
    from andrea.cuda import attention as ca
    from andrea.resources import cpu_name

    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    launcher = ca.CupyLauncher(torch.device("cuda", torch.cuda.current_device() if gpu else 0))
    if not gpu:
        launcher.device_type = "cpu"  # the stand-in's tensors live on the CPU
    generator = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(1, 1, 16, 32, device=device, dtype=dtype, generator=generator)
               .requires_grad_() for _ in range(3))
    scale = 32 ** -0.5
    index = ca._launcher_index(launcher)

    def bare() -> None:
        (q * 1.0).sum().backward()

    def sdpa() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def cuda_eager() -> None:
        ca.cuda_attention(q, k, v, launcher=launcher).sum().backward()

    def cuda_op() -> None:
        ca.causal_attention_op(q, k, v, scale, index, False)[0].sum().backward()

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):  # noqa: ANN001, ANN205 - autograd's signature
            o, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, o, lse)
            return o

        @staticmethod
        def backward(ctx, dout):  # noqa: ANN001, ANN205
            q, k, v, _, _ = ctx.saved_tensors
            dout = dout.contiguous()
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def floor() -> None:
        Floor.apply(q, k, v).sum().backward()

    sync = torch.cuda.synchronize if gpu else (lambda: None)
    where = (f"{torch.cuda.get_device_name()}, real kernels" if gpu
             else "stand-in CuPy, no-op kernels")
    print(f"host cost of a forward + backward, B 1 H 1 T 16 D 32 {str(dtype)[6:]}; "
          f"{cpu_name()}, {torch.get_num_threads()} threads; {where}; torch {torch.__version__}")
    times = interleaved_medians({"bare": bare, "sdpa": sdpa, "cuda eager": cuda_eager,
                                 "cuda op": cuda_op, "floor": floor},
                                args.calls, args.repeats, sync)
    print(f"{'':12s} {'us/call':>8s} {'beyond bare':>12s} {'against sdpa':>13s}")
    for name, us in times.items():
        beyond = us - times["bare"]
        ratio = beyond / (times["sdpa"] - times["bare"])
        print(f"{name:12s} {us:8.1f} {beyond:12.1f} {ratio:12.2f}x")
    if conversion:
        print("CuPy's conversion of one forward's arguments (5 pointers, an int, a float), "
              "us a launch:")
        for name, us in conversion.items():
            print(f"  pointers as {name:12s} {us:6.2f}")


if __name__ == "__main__":
    main()
