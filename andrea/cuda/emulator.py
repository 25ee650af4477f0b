"""Run kernels/microgpt_cuda.cu on the CPU through the CUDA execution-model emulator.

The unchanged kernel source (andrea.cuda.launch.kernel_source: microgpt_cuda.cu with its parts
written in place, as NVRTC gets it) is compiled by g++ against kernels/cpu/cuda_emulator.h into
a shared library (kernels/cpu/emu_entry.cpp), built once and cached by a hash of the sources and
flags, then launched on torch CPU tensors with the grid, block and arguments the GPU path uses
(andrea.cuda.launch). Sanitizer builds (ThreadSanitizer, AddressSanitizer) are standalone
programs (kernels/cpu/emu_sanitize_main.cpp). Every build accepts a modified kernel text, so
tests can check that a deliberately broken copy is caught.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from andrea import resources
from andrea.cuda.launch import (
    DQ_IN_ORDER,
    ELEMENT_TYPES,
    KERNEL_FILE,
    Launch,
    PipeConfig,
    attention_launches,
    dq_in_order_buffers,
    ds_row_stride,
    kernel_source,
    pipe_emulator_entries,
    pipe_launch,
)
from andrea.resources import kernels_dir

CPU_FILES = ("cuda_emulator.h", "emu_entry.cpp", "emu_sanitize_main.cpp")
MODES = {"fibers": 0, "threads": 1}
BASE_FLAGS = ["-std=c++17", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas", "-pthread"]
LIBRARY_FLAGS = ["-O2", "-fPIC", "-shared"]
SANITIZER_FLAGS = {
    "thread": ["-O1", "-g", "-fsanitize=thread"],
    "address": ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"],
}


def cache_dir() -> Path:
    """Where emulator builds are kept: the package cache's 'emulator' folder."""
    path = resources.cache_dir() / "emulator"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"the kernel emulator needs a C++17 compiler; {cxx!r} is not on PATH")
    return cxx


def _build(main: str, flags: list[str], kernel_text: str | None, stem: str,
           extra_texts: dict[str, str] | None = None) -> Path:
    """Compiles kernels/cpu/<main> with the kernel source (or kernel_text) into the cache.

    Keyed by a hash of compiler, flags and every source text; built under a temporary name and
    renamed, so an interrupted build never leaves a broken file behind. A process that wants a
    build another is compiling (a second test worker, a child process) waits for it under a
    lock file beside it and takes its result, rather than compiling it again.
    """
    cxx = _compiler()
    texts = {name: (kernels_dir() / "cpu" / name).read_text() for name in CPU_FILES}
    texts[KERNEL_FILE] = kernel_source() if kernel_text is None else kernel_text
    texts.update(extra_texts or {})
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in [version, *flags, main, *(f"{n}\0{t}" for n, t in sorted(texts.items()))]:
        digest.update(part.encode() + b"\0")
    out = cache_dir() / f"{stem}-{digest.hexdigest()[:20]}"
    if out.exists():
        return out
    with open(out.with_name(f".{out.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the kernel drops it if its holder dies
        if out.exists():  # built by the holder we waited for
            return out
        with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".build-") as tmp:
            for name, text in texts.items():
                Path(tmp, name).write_text(text)
            target = Path(tmp, out.name)
            cmd = [cxx, *BASE_FLAGS, *flags, "-I", tmp, "-o", str(target), str(Path(tmp, main))]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"emulator build failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
            os.replace(target, out)
    return out


# Builds of another arch's fp16 path (ANDREA_HALF_PATH in the .cu file): its fp16 instances only.
HALF_ARCH_DEFINES = {
    750: ("-DANDREA_HALF_ARCH=750", "-DANDREA_EMU_HALF_ONLY"),  # two m16n8k8 per k16 step
    700: ("-DANDREA_HALF_ARCH=700", "-DANDREA_EMU_HALF_ONLY"),  # no MMA: float FMAs, shuffles
}


# A pipelined candidate for the emulator: (kernel, dtype, head_dim, PipeConfig).
PipeCandidate = tuple[str, str, int, PipeConfig]


def build_library(kernel_text: str | None = None, defines: tuple[str, ...] = (),
                  pipes: tuple[PipeCandidate, ...] = ()) -> Path:
    """The emulator library; with `pipes`, those pipelined candidates and the preprocess
    kernels instead of the production table (ANDREA_EMU_PIPE_ONLY)."""
    extra = {}
    if pipes:
        defines = (*defines, "-DANDREA_EMU_PIPE", "-DANDREA_EMU_PIPE_ONLY")
        extra["emu_pipe_entries.inc"] = pipe_emulator_entries(list(pipes))
    return _build("emu_entry.cpp", [*LIBRARY_FLAGS, *defines], kernel_text, "libandrea_emu.so",
                  extra)


def build_sanitizer_program(
    sanitizer: str, dtype: str = "bfloat16", head_dim: int = 32, kernel_text: str | None = None,
    pipe: PipeConfig | None = None,
) -> Path:
    """A standalone program that runs forward + backward once (see emu_sanitize_main.cpp):
    the production kernels, or with `pipe` the pipelined candidates of that config (no
    launch-bounds promise, which the emulator ignores anyway), and where pipe.wgmma the sm_90a
    forward beside them."""
    ctype = ELEMENT_TYPES[dtype][0]
    flags = [
        *SANITIZER_FLAGS[sanitizer],
        f"-DANDREA_SAN_TYPE={ctype}",
        f"-DANDREA_SAN_D={head_dim}",
    ]
    stem = f"emu-{sanitizer}-{dtype}-{head_dim}"
    if pipe is not None:
        flags += [f"-DANDREA_SAN_PIPE_W={pipe.warps}", f"-DANDREA_SAN_PIPE_N={pipe.rows}",
                  f"-DANDREA_SAN_PIPE_S={pipe.stages}", f"-DANDREA_SAN_PIPE_P={pipe.passes}"]
        stem += f"-pipe-{pipe.warps}-{pipe.rows}-{pipe.stages}-{pipe.passes}"
        if pipe.wgmma:
            flags.append("-DANDREA_SAN_WGMMA")
            stem += "-wgmma"
    return _build("emu_sanitize_main.cpp", flags, kernel_text, stem)


def run_sanitizer_program(
    program: Path, bh: int, seq_len: int, mode: str = "threads", timeout: float = 300
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # Report and fail the run on the first finding; no suppression of anything.
    env["TSAN_OPTIONS"] = "halt_on_error=1 exitcode=66"
    env["ASAN_OPTIONS"] = "halt_on_error=1 detect_leaks=1"
    return subprocess.run(
        [str(program), str(bh), str(seq_len), mode],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


class Emulator:
    """The emulated kernels as a library: launch(Launch, *args) like cuLaunchKernel."""

    def __init__(self, kernel_text: str | None = None, mode: str = "fibers",
                 defines: tuple[str, ...] = (), pipes: tuple[PipeCandidate, ...] = ()) -> None:
        self.path = build_library(kernel_text, defines, pipes)
        self.lib = ctypes.CDLL(str(self.path))
        self.lib.andrea_emu_kernel_name.restype = ctypes.c_char_p
        self.lib.andrea_emu_launch.argtypes = [ctypes.c_char_p, *[ctypes.c_uint] * 6,
                                               ctypes.c_int, ctypes.c_long,
                                               ctypes.POINTER(ctypes.c_void_p)]
        self.mode = mode

    def to_half(self, x: torch.Tensor) -> torch.Tensor:
        """float32 -> float16 by the kernel file's own conversion (half_bits)."""
        return self._to_16_bits(x, self.lib.andrea_emu_to_half, torch.float16)

    def to_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """float32 -> bfloat16 by the kernel file's own conversion (bf16_bits)."""
        return self._to_16_bits(x, self.lib.andrea_emu_to_bf16, torch.bfloat16)

    @staticmethod
    def _to_16_bits(
        x: torch.Tensor, convert: Callable[..., Any], dtype: torch.dtype
    ) -> torch.Tensor:
        """x as float32 through `convert`, an entry that writes 16-bit patterns, read as dtype."""
        src = x.detach().to(torch.float32).contiguous()
        out = torch.empty(src.shape, dtype=torch.int16)
        convert(ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                ctypes.c_long(src.numel()))
        return out.view(dtype)

    def from_half(self, x: torch.Tensor) -> torch.Tensor:
        """float16 -> float32 by the kernel file's own conversion (half_to_float)."""
        src = x.detach().contiguous().view(torch.int16)
        out = torch.empty(src.shape, dtype=torch.float32)
        self.lib.andrea_emu_from_half(ctypes.c_void_p(src.data_ptr()),
                                      ctypes.c_void_p(out.data_ptr()), ctypes.c_long(src.numel()))
        return out

    def kernel_names(self) -> list[str]:
        n = self.lib.andrea_emu_kernel_count()
        return [self.lib.andrea_emu_kernel_name(i).decode() for i in range(n)]

    def kernel_info(self, name: str) -> tuple[int, int, int, int, int]:
        """(warps, streamed tile rows, shared bytes, launch-bounds min blocks, dK/dV passes) as
        the kernel source defines them: shared bytes static, or a pipelined candidate's
        dynamic; min blocks as on sm_80+ (the emulator builds ANDREA_HALF_PATH 800)."""
        values = [ctypes.c_int() for _ in range(5)]
        if self.lib.andrea_emu_kernel_info(name.encode(), *map(ctypes.byref, values)):
            raise KeyError(name)
        return tuple(v.value for v in values)

    def launch(self, launch: Launch, *args: torch.Tensor | int | float,
               mode: str | None = None) -> None:
        values = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.device.type != "cpu" or not a.is_contiguous() or a.data_ptr() % 16:
                    raise ValueError("emulated kernels take contiguous 16-byte aligned CPU tensors")
                values.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, bool) or not isinstance(a, int | float):
                raise TypeError(f"unsupported kernel argument {a!r}")
            elif isinstance(a, int):
                values.append(ctypes.c_int(a))
            else:
                values.append(ctypes.c_float(a))
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        rc = self.lib.andrea_emu_launch(
            launch.name.encode(), *launch.grid, *launch.block, MODES[mode or self.mode],
            launch.dynamic_shared_bytes, params
        )
        if rc != 0:
            raise KeyError(f"the emulated library has no kernel {launch.name!r}")


def float64_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, ...]:
    """float64 causal attention on the (already rounded) inputs: o, lse, dq, dk, dv."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    t = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1) @ v
    o.backward(dout.double())
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def float64_ds(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, scale: float,
) -> torch.Tensor:
    """float64 dS = P o (dP - delta) of causal attention, [B, H, T, T] (zero above the
    diagonal), unscaled: what the backward through dS keeps between its two kernels."""
    q, k, v, dout = (x.double() for x in (q, k, v, dout))
    t = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf), -1)
    dp = dout @ v.transpose(-1, -2)
    return p * (dp - (p * dp).sum(-1, keepdim=True))


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error relative to max(largest reference value, 1)."""
    err = (got.double() - want).abs().max().item()
    return err / max(want.abs().max().item(), 1.0)


_default: Emulator | None = None


def default_emulator() -> Emulator:
    global _default
    if _default is None:
        _default = Emulator()
    return _default


def _shape(q: torch.Tensor) -> tuple[int, int, int, int, str]:
    dtype = str(q.dtype).removeprefix("torch.")
    if q.dim() != 4 or dtype not in ELEMENT_TYPES:
        raise ValueError(f"q must be [B, n_head, T, head_dim] of {', '.join(ELEMENT_TYPES)}")
    b, h, t, d = q.shape
    return b, h, t, d, dtype


def _poisoned(like: torch.Tensor, dtype: torch.dtype | None = None,
              shape: tuple[int, ...] | None = None) -> torch.Tensor:
    # NaN everywhere before the launch: an element the kernel fails to write stays NaN.
    return torch.full(shape or like.shape, math.nan, dtype=dtype or like.dtype)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
    emulator: Emulator | None = None, mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention forward on the emulator: returns (o [B,H,T,D], lse [B,H,T] float32)."""
    emu = emulator or default_emulator()
    b, h, t, d, dtype = _shape(q)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    launches = attention_launches(b, h, t, d, dtype)
    o = _poisoned(q)
    lse = _poisoned(q, torch.float32, (b, h, t))
    emu.launch(launches["fwd"], q, k, v, o, lse, t, scale, mode=mode)
    return o, lse


def attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, scale: float | None = None, emulator: Emulator | None = None,
    mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention backward on the emulator: returns (dq, dk, dv)."""
    emu = emulator or default_emulator()
    b, h, t, d, dtype = _shape(q)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    launches = attention_launches(b, h, t, d, dtype)
    delta = _poisoned(q, torch.float32, (b, h, t))
    dq, dk, dv = _poisoned(q), _poisoned(q), _poisoned(q)
    emu.launch(launches["bwd_preprocess"], o, dout, delta, b * h * t, mode=mode)
    emu.launch(launches["bwd_dq"], q, k, v, dout, lse, delta, dq, t, scale, mode=mode)
    emu.launch(launches["bwd_dkdv"], q, k, v, dout, lse, delta, dk, dv, t, scale, mode=mode)
    return dq, dk, dv


def pipe_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
    configs: dict[str, PipeConfig], emulator: Emulator, scale: float | None = None,
    mode: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Forward and backward through pipelined candidates (`configs`: kernel -> PipeConfig for
    "fwd" and "bwd_dq", "bwd_dkdv", or the backward through dS, "bwd_dkdv_ds", "bwd_dq_ds", or
    a whole head's, "bwd_fused", or dQ added in order inside dK/dV, "bwd_dkdv_dq";
    emulator built with them): o, lse, dq, dk, dv, all outputs and the dS and float32 dQ buffers
    NaN-poisoned before their launch."""
    b, h, t, d, dtype = _shape(q)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    launches = {kernel: pipe_launch(kernel, b, h, t, d, dtype, cfg)
                for kernel, cfg in configs.items()}
    preprocess = attention_launches(b, h, t, d, dtype)["bwd_preprocess"]
    o, lse = _poisoned(q), _poisoned(q, torch.float32, (b, h, t))
    emulator.launch(launches["fwd"], q, k, v, o, lse, t, scale, mode=mode)
    delta = _poisoned(q, torch.float32, (b, h, t))
    dq, dk, dv = _poisoned(q), _poisoned(q), _poisoned(q)
    emulator.launch(preprocess, o, dout, delta, b * h * t, mode=mode)
    if "bwd_fused" in configs:  # a whole head's backward in one block
        emulator.launch(launches["bwd_fused"], q, k, v, dout, lse, delta, dq, dk, dv, t, scale,
                        mode=mode)
        return o, lse, dq, dk, dv
    if DQ_IN_ORDER in configs:  # one kernel; dQ's shares added in order through dq_acc
        acc_shape, count_shape = dq_in_order_buffers(b, h, t, d)
        dq_acc = _poisoned(q, torch.float32, acc_shape)  # written before read
        count = torch.zeros(count_shape, dtype=torch.int32)
        emulator.launch(launches[DQ_IN_ORDER], q, k, v, dout, lse, delta, dq, dk, dv, dq_acc,
                        count, t, scale, mode=mode)
        return o, lse, dq, dk, dv
    if "bwd_dq_ds" in configs:  # the backward through dS: dK/dV writing it, then dQ from it
        stride = ds_row_stride(t)
        ds = _poisoned(q, shape=(b * h, t, stride))  # what dK/dV leaves unwritten stays NaN
        emulator.launch(launches["bwd_dkdv_ds"], q, k, v, dout, lse, delta, dk, dv, ds, t, stride,
                        scale, mode=mode)
        emulator.launch(launches["bwd_dq_ds"], k, ds, dq, t, stride, scale, mode=mode)
        return o, lse, dq, dk, dv
    emulator.launch(launches["bwd_dq"], q, k, v, dout, lse, delta, dq, t, scale, mode=mode)
    emulator.launch(launches["bwd_dkdv"], q, k, v, dout, lse, delta, dk, dv, t, scale, mode=mode)
    return o, lse, dq, dk, dv
