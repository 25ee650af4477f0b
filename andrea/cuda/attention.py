"""The "cuda" attention backend: kernels/microgpt_cuda.cu through CuPy, as a torch custom op.

Pieces, smallest first:

- a *launcher* runs one `Launch` (andrea.cuda.launch) with torch tensors and scalars as the
  kernel arguments. `CupyLauncher` JIT-compiles the .cu file with `cupy.RawModule` (NVRTC, the
  options and name expressions of andrea.cuda.launch) and launches on PyTorch's current CUDA
  stream, passing tensors by `data_ptr()` without copies. `EmulatorLauncher` runs the same
  kernels on the CPU (andrea.cuda.emulator), so the autograd wiring below is testable without a
  GPU;
- `attention_forward` / `attention_backward`: the launch sequence of one causal attention,
  forward (O and the log-sum-exp) and backward (preprocess, dQ, dK/dV; or dK/dV writing dS,
  then dQ from it, where andrea.cuda.launch.TUNED says so for the launcher's architecture);
- `causal_attention_op` (torch.ops.andrea.causal_attention), a `torch.library.custom_op` with a
  fake (shape) implementation and an autograd formula that saves q, k, v, O and the log-sum-exp
  for the backward (never the T x T matrix), so torch.compile traces through it without a graph
  break; and `cuda_attention(q, k, v)`, which the model calls: the op under torch.compile, and
  outside it the same forward and backward as a plain autograd Function (the op's dispatch
  costs host time that small shapes feel).

Importing this module needs neither CuPy nor a GPU; CuPy is imported when a GPU launcher is made.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from andrea.cuda.launch import (
    DQ_IN_ORDER,
    STATIC_SHARED_LIMIT,
    Launch,
    check_dtype,
    check_head_dim,
    compiled_module,
    dq_in_order_buffers,
    ds_row_stride,
    kernel_source,
    module_names,
    naive_attention_launches,
    tuned_launches,
)

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
ALIGNMENT = 16  # bytes; the kernels load 16-byte vectors from every tensor's base pointer

KernelArg = torch.Tensor | int | float


class Launcher(Protocol):
    """Runs one kernel launch; tensor arguments are passed by pointer, scalars by value. arch:
    the architecture its kernels are tuned for (andrea.cuda.launch.TUNED), None for the
    production kernels."""

    device_type: str
    arch: str | None

    def launch(self, launch: Launch, *args: KernelArg) -> None: ...


class EmulatorLauncher:
    """The kernels on the CPU through the g++-built emulator (slow; for tests). arch: the TUNED
    entries to launch (the emulator must be built with those candidates), None: production."""

    device_type = "cpu"

    def __init__(self, emulator: Any = None, arch: str | None = None) -> None:
        from andrea.cuda.emulator import default_emulator

        self.emulator = emulator or default_emulator()
        self.arch = arch

    def launch(self, launch: Launch, *args: KernelArg) -> None:
        self.emulator.launch(launch, *args)


def device_arch(device: torch.device) -> str:
    """NVRTC's name of the device's architecture, e.g. "sm_90" for an H100/H200."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


# The kernels' scalar types: an int argument is a C `int`, a float one a `float` (bool is
# neither: type(True) is bool).
_SCALARS: dict[type, Callable[[Any], Any]] = {int: np.int32, float: np.float32}


def kernel_values(args: tuple[KernelArg, ...]) -> tuple[Any, ...]:
    """Kernel arguments as CuPy passes them: a tensor by its pointer (no copy) as a Python int,
    which CuPy passes as a 64-bit integer, a pointer's size, and converts faster than a numpy
    scalar (scripts/bench_host_overhead.py); a scalar as the kernels' type."""
    values: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            values.append(a.data_ptr())
            continue
        convert = _SCALARS.get(type(a))
        if convert is None:
            raise TypeError(f"unsupported kernel argument {a!r}")
        values.append(convert(a))
    return tuple(values)


def current_stream_handle(device: torch.device) -> int:
    """PyTorch's current cudaStream_t on the device: the raw handle inductor's own launches read,
    without the Stream object torch.cuda.current_stream builds at each call."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


class CupyLauncher:
    """The kernels on one GPU through CuPy, on PyTorch's current stream for that device."""

    device_type = "cuda"

    def __init__(self, device: torch.device) -> None:
        import cupy  # fail here, with the import error, not at the first launch

        self.device = device
        self.arch = device_arch(device)
        self.source = kernel_source()
        self._cupy = cupy
        self._functions: dict[str, Any] = {}
        self._kernels: dict[tuple[str, int], Any] = {}  # (name, dynamic shared bytes) -> kernel
        self._streams: dict[int, Any] = {}  # cudaStream_t -> CuPy stream

    def _function(self, name: str) -> Any:
        fn = self._functions.get(name)
        if fn is None:
            module = compiled_module(self.source, self.arch, module_names(name))
            fn = self._functions[name] = module.get_function(name)
        return fn

    def _kernel(self, launch: Launch) -> Any:
        """The launch's kernel, compiled on first use and opted into its dynamic shared memory
        beyond 48 KiB; looked up once per launch, so a later launch costs a dict lookup."""
        key = (launch.name, launch.dynamic_shared_bytes)
        fn = self._kernels.get(key)
        if fn is None:
            with self._cupy.cuda.Device(self.device.index):
                fn = self._function(launch.name)
                dynamic = launch.dynamic_shared_bytes
                if dynamic > STATIC_SHARED_LIMIT and fn.max_dynamic_shared_size_bytes < dynamic:
                    fn.max_dynamic_shared_size_bytes = dynamic
            self._kernels[key] = fn
        return fn

    def bound(self, launch: Launch, *args: KernelArg) -> Callable[[], None]:
        """The launch with its arguments converted once: a call launches it on CuPy's current
        device and stream (a timing loop sets both once in context())."""
        return functools.partial(self._kernel(launch), launch.grid, launch.block,
                                 kernel_values(args), shared_mem=launch.dynamic_shared_bytes)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """This launcher's device and PyTorch's current stream there, as CuPy's current ones."""
        with self._cupy.cuda.Device(self.device.index):
            with self._stream(current_stream_handle(self.device)):
                yield

    def launch(self, launch: Launch, *args: KernelArg) -> None:
        # bound() and context() in one, without their objects, the stream handed to the call
        # rather than made CuPy's current one: at the 12M preset's shape a kernel runs for tens
        # of microseconds, so the host's cost per launch is what decides whether the GPU waits
        # (scripts/bench_host_overhead.py).
        fn = self._kernel(launch)
        values = kernel_values(args)
        stream = self._stream(current_stream_handle(self.device))
        with self._cupy.cuda.Device(self.device.index):
            fn(launch.grid, launch.block, values, shared_mem=launch.dynamic_shared_bytes,
               stream=stream)

    def _stream(self, handle: int) -> Any:
        """PyTorch's stream `handle` (a cudaStream_t) as a CuPy stream, one object per handle.

        CuPy 14 deprecates ExternalStream (a DeprecationWarning at every launch) for
        Stream.from_external, which takes any object with the CUDA stream protocol's
        `__cuda_stream__`; CuPy 13 has only ExternalStream.
        """
        stream = self._streams.get(handle)
        if stream is None:
            import cupy

            from_external = getattr(cupy.cuda.Stream, "from_external", None)
            if from_external is not None:
                stream = from_external(_StreamHandle(handle))
            else:
                stream = cupy.cuda.ExternalStream(handle)
            self._streams[handle] = stream
        return stream


class _StreamHandle:
    """A raw cudaStream_t under the CUDA stream protocol (version 0), whatever torch offers."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_launchers: dict[int, CupyLauncher] = {}


def gpu_launcher(device: torch.device) -> CupyLauncher:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _launchers:
        _launchers[index] = CupyLauncher(torch.device("cuda", index))
    return _launchers[index]


def default_launcher(device: torch.device) -> Launcher:
    if device.type != "cuda":
        raise ValueError(
            f"the cuda attention backend needs CUDA tensors, got device {device}; "
            "pass launcher=EmulatorLauncher() to run the kernels on the CPU"
        )
    return gpu_launcher(device)


# ---------------------------------------------------------------------------------------------
# Validation and the launch sequence


@functools.lru_cache(maxsize=64)
def _launches(b: int, h: int, t: int, d: int, dtype: str, naive: bool = False,
              arch: str | None = None) -> dict[str, Launch]:
    if naive:
        return naive_attention_launches(b, h, t, d, dtype)
    return tuned_launches(b, h, t, d, dtype, arch)


def _check_tensor(name: str, x: torch.Tensor, like: torch.Tensor, shape: tuple[int, ...],
                  dtype: torch.dtype, device_type: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device != like.device or x.device.type != device_type:
        raise ValueError(
            f"{name} is on {x.device}; every attention tensor must be on one {device_type} device "
            f"(q is on {like.device})"
        )
    if x.dtype != dtype:
        raise ValueError(f"{name} is {x.dtype}, expected {dtype} like q")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape}")
    if not x.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (strides {x.stride()}); the kernels read "
            "[B, n_head, T, head_dim] row-major: call .contiguous() first"
        )
    if x.data_ptr() % ALIGNMENT:
        raise ValueError(
            f"{name}'s data pointer is not {ALIGNMENT}-byte aligned (a view at an offset?)"
        )


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 device_type: str) -> tuple[int, int, int, int, str]:
    """Validates q, k, v for the kernels; returns (B, n_head, T, head_dim, dtype name).

    Raises UserError for what a config chooses (head_dim, dtype, B*n_head too large) and
    ValueError for a caller's misuse (device, shapes, strides, alignment).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a 4-d tensor [B, n_head, T, head_dim]")
    b, h, t, d = q.shape
    check_head_dim(d)
    if q.dtype not in DTYPE_NAMES:
        check_dtype(str(q.dtype).removeprefix("torch."))  # raises UserError naming it
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, q, (b, h, t, d), q.dtype, device_type)
    _launches(b, h, t, d, DTYPE_NAMES[q.dtype])  # UserError for B*n_head beyond the grid
    return b, h, t, d, DTYPE_NAMES[q.dtype]


def _new(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
         poison: bool) -> torch.Tensor:
    # Poisoned (NaN) outputs make an element a kernel fails to write visible in a comparison.
    if poison:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
    launcher: Launcher | None = None, poison: bool = False, naive: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention forward: (O [B, H, T, D] in q's dtype, lse [B, H, T] float32).

    naive: run the one-block-per-(batch, head) baseline kernels instead (benchmarks only).
    """
    launcher = launcher or default_launcher(q.device)
    b, h, t, d, dtype = check_inputs(q, k, v, launcher.device_type)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    o = _new((b, h, t, d), q.dtype, q.device, poison)
    lse = _new((b, h, t), torch.float32, q.device, poison)
    launches = _launches(b, h, t, d, dtype, naive, getattr(launcher, "arch", None))
    launcher.launch(launches["fwd"], q, k, v, o, lse, t, scale)
    return o, lse


def attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, scale: float | None = None, launcher: Launcher | None = None,
    poison: bool = False, naive: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention backward from the forward's O and lse: (dq, dk, dv); naive as above."""
    launcher = launcher or default_launcher(q.device)
    b, h, t, d, _ = check_inputs(q, k, v, launcher.device_type)
    _check_tensor("o", o, q, (b, h, t, d), q.dtype, launcher.device_type)
    _check_tensor("dout", dout, q, (b, h, t, d), q.dtype, launcher.device_type)
    _check_tensor("lse", lse, q, (b, h, t), torch.float32, launcher.device_type)
    return _backward_launches(q, k, v, o, lse, dout, scale, launcher, poison, naive)


def _backward_launches(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, scale: float | None, launcher: Launcher, poison: bool, naive: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention_backward past its checks, for tensors already known to fit the kernels."""
    b, h, t, d = q.shape
    dtype = DTYPE_NAMES[q.dtype]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    arch = getattr(launcher, "arch", None)
    launches = _launches(b, h, t, d, dtype, naive, arch)
    delta = _new((b, h, t), torch.float32, q.device, poison)
    dq, dk, dv = (_new((b, h, t, d), q.dtype, q.device, poison) for _ in range(3))
    launcher.launch(launches["bwd_preprocess"], o, dout, delta, b * h * t)
    if "bwd_fused" in launches:
        launcher.launch(launches["bwd_fused"], q, k, v, dout, lse, delta, dq, dk, dv, t, scale)
        return dq, dk, dv
    if DQ_IN_ORDER in launches:  # dQ's shares added in key-block order through dq_acc
        acc_shape, count_shape = dq_in_order_buffers(b, h, t, d)
        dq_acc = _new(acc_shape, torch.float32, q.device, poison)  # written before read
        count = torch.zeros(count_shape, dtype=torch.int32, device=q.device)
        launcher.launch(launches[DQ_IN_ORDER], q, k, v, dout, lse, delta, dq, dk, dv, dq_acc,
                        count, t, scale)
        return dq, dk, dv
    if "bwd_dq_ds" in launches:
        _backward_through_ds(q, k, v, dout, lse, delta, (dq, dk, dv), scale, launcher, arch,
                             poison)
        return dq, dk, dv
    launcher.launch(launches["bwd_dq"], q, k, v, dout, lse, delta, dq, t, scale)
    launcher.launch(launches["bwd_dkdv"], q, k, v, dout, lse, delta, dk, dv, t, scale)
    return dq, dk, dv


# The most memory the backward through dS holds for its dS buffer at once: a larger batch goes
# through in turns of fewer sequences (the kernels see each turn as a batch of its own).
DS_BUFFER_BYTES = 512 * 2**20


def _backward_through_ds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                         lse: torch.Tensor, delta: torch.Tensor,
                         grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float,
                         launcher: Launcher, arch: str | None, poison: bool) -> None:
    """dK/dV writing dS into a [n*H, T, stride] buffer, then dQ = scale * dS K from it, n
    sequences a turn. A turn's tensors are views at a sequence boundary, so their pointers stay
    16-byte aligned where n*H*T is a multiple of 4 (the float32 lse and delta rows)."""
    b, h, t, d = q.shape
    dtype = DTYPE_NAMES[q.dtype]
    stride = ds_row_stride(t)
    per_sequence = h * t * stride * q.element_size()
    align = 4 // math.gcd(h * t, 4)  # sequences per turn keeping lse/delta views aligned
    turn = min(b, max(align, DS_BUFFER_BYTES // per_sequence // align * align))
    ds = _new((turn * h, t, stride), q.dtype, q.device, poison)
    dq, dk, dv = grads
    for i in range(0, b, turn):
        j = min(b, i + turn)
        launches = _launches(j - i, h, t, d, dtype, False, arch)
        part = [x[i:j] for x in (q, k, v, dout, lse, delta, dq, dk, dv)]
        pq, pk, pv, pdout, plse, pdelta, pdq, pdk, pdv = part
        launcher.launch(launches["bwd_dkdv_ds"], pq, pk, pv, pdout, plse, pdelta, pdk, pdv, ds,
                        t, stride, scale)
        launcher.launch(launches["bwd_dq_ds"], pk, ds, pdq, t, stride, scale)


# ---------------------------------------------------------------------------------------------
# The op torch sees. A custom_op is opaque to dynamo and AOTAutograd: they record a call with the
# shapes register_fake gives, so torch.compile builds one graph around the kernels (forward and
# backward) instead of breaking the graph at a Python function it cannot trace. Its arguments
# must be tensors and plain values, so a launcher travels as an index into _LAUNCHERS
# (-1: default_launcher for the tensors' device, looked up when the op runs).

_LAUNCHERS: list[Launcher] = []


def _launcher_index(launcher: Launcher | None) -> int:
    if launcher is None:
        return -1
    for i, known in enumerate(_LAUNCHERS):
        if known is launcher:
            return i
    _LAUNCHERS.append(launcher)
    return len(_LAUNCHERS) - 1


def _launcher_at(index: int, device: torch.device) -> Launcher:
    return default_launcher(device) if index < 0 else _LAUNCHERS[index]


@torch.library.custom_op("andrea::causal_attention", mutates_args=())
def causal_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        launcher: int, naive: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, log-sum-exp) of causal attention by the kernels; see attention_forward."""
    return attention_forward(q, k, v, scale, _launcher_at(launcher, q.device), naive=naive)


@causal_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, launcher: int,
      naive: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("andrea::causal_attention_backward", mutates_args=())
def causal_attention_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, scale: float, launcher: int, naive: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by the kernels; see attention_backward."""
    return attention_backward(q, k, v, o, lse, _aligned(dout), scale,
                              _launcher_at(launcher, q.device), naive=naive)


@causal_attention_backward_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
      dout: torch.Tensor, scale: float, launcher: int, naive: bool
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    q, k, v, scale, launcher, naive = inputs
    o, lse = output
    # O and the log-sum-exp let the backward recompute P tile by tile: O(T) extra memory.
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.scale, ctx.launcher, ctx.naive = scale, launcher, naive


def _kernel_dout(dout: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # Upstream gradients are often strided views (the head merge's transpose); the kernels need
    # them row-major in q's dtype. This is the one copy the backward may make. The log-sum-exp is
    # an internal output: nothing downstream differentiates through it.
    return dout.to(q.dtype).contiguous()


def _aligned(x: torch.Tensor) -> torch.Tensor:
    # A contiguous gradient can still start at an offset no kernel may read 16 bytes at a time
    # (the output's gradient inside a concatenation's): a copy starts where the allocator does.
    return x.clone() if x.data_ptr() % ALIGNMENT else x


def _backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None
              ) -> tuple[torch.Tensor | None, ...]:
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = causal_attention_backward_op(q, k, v, o, lse, _kernel_dout(dout, q), ctx.scale,
                                              ctx.launcher, ctx.naive)
    return dq, dk, dv, None, None, None


causal_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The op's forward and backward without the op, for eager mode. custom_op's dispatch runs
    in Python: about 60 us of host time a forward + backward on a 2-core Xeon, half of SDPA's
    GPU time at the 12M preset's shape on an H200 (scripts/bench_host_overhead.py). Only
    torch.compile needs an opaque op."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                launcher: Launcher | None, naive: bool) -> torch.Tensor:
        o, lse = attention_forward(q, k, v, scale, launcher, naive=naive)
        _setup_context(ctx, (q, k, v, scale, launcher, naive), (o, lse))
        return o

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # q, k, v were checked by the forward, which made O and the log-sum-exp, and dout has
        # O's shape (autograd's rule), q's dtype and layout (_kernel_dout) and an aligned start:
        # nothing is left to check. The host's time here is the 12M preset's eager step's.
        q, k, v, o, lse = ctx.saved_tensors
        dout = _aligned(_kernel_dout(dout, q))
        launcher = ctx.launcher or default_launcher(q.device)
        dq, dk, dv = _backward_launches(q, k, v, o, lse, dout, ctx.scale, launcher, False,
                                        ctx.naive)
        return dq, dk, dv, None, None, None


def cuda_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
    launcher: Launcher | None = None, naive: bool = False,
) -> torch.Tensor:
    """Causal self-attention [B, n_head, T, head_dim] -> same, differentiable in q, k, v.

    naive: the one-block-per-(batch, head) baseline kernels (the benchmark's cuda_naive).
    """
    if torch.compiler.is_compiling():
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        o, _ = causal_attention_op(q, k, v, scale, _launcher_index(launcher), naive)
        return o
    # attention_forward checks the inputs (and finds the launcher) before autograd records
    # anything; scale None is 1/sqrt(head_dim) there and in attention_backward alike.
    return _EagerAttention.apply(q, k, v, scale, launcher, naive)
