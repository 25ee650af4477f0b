"""Launch configuration of the attention kernels in kernels/microgpt_cuda.cu.

The single source of truth on the Python side for tile sizes, grid, block, shared memory, the
supported head dims and the NVRTC options; the CUDA runtime loader and the CPU emulator both use
it. Importable without a GPU and without CuPy. TILES is the home of the production tile table.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass
from typing import Any

from andrea.errors import UserError
from andrea.resources import kernels_dir

KERNEL_FILE = "microgpt_cuda.cu"  # in kernels_dir(); the parts it includes beside it
SUPPORTED_HEAD_DIMS: tuple[int, ...] = (32, 64, 128)

# torch dtype name -> (C++ element type in the .cu file, bytes per element)
ELEMENT_TYPES: dict[str, tuple[str, int]] = {
    "float32": ("float", 4), "bfloat16": ("bf16_t", 2), "float16": ("half_t", 2),
}

# The production kernels' tile table, its one home: kernels/attn_tiles.cuh repeats it for the
# compilers (TileCfg, MinBlocks, DkdvPasses), and tests/test_kernel_numerics.py fails when the
# two differ; the pipelined candidates start from it. It changes only from the measurements of
# scripts/gpu_tune_attention.py (kernels/README.md, "Tuning for a GPU").
# (dtype, head_dim) -> kernel -> (warps W, streamed tile rows N); a block owns M = 16*W rows.
TILES: dict[tuple[str, int], dict[str, tuple[int, int]]] = {
    ("bfloat16", 32): {"fwd": (4, 64), "dq": (4, 64), "dkdv": (4, 64)},
    ("bfloat16", 64): {"fwd": (4, 64), "dq": (4, 64), "dkdv": (4, 64)},
    ("bfloat16", 128): {"fwd": (4, 32), "dq": (4, 16), "dkdv": (4, 16)},
    # fp16: bf16's tiles (same element size and fragments; the sm_70 scalar path needs no scratch)
    ("float16", 32): {"fwd": (4, 64), "dq": (4, 64), "dkdv": (4, 64)},
    ("float16", 64): {"fwd": (4, 64), "dq": (4, 64), "dkdv": (4, 64)},
    ("float16", 128): {"fwd": (4, 32), "dq": (4, 16), "dkdv": (4, 16)},
    ("float32", 32): {"fwd": (4, 32), "dq": (4, 32), "dkdv": (4, 32)},
    ("float32", 64): {"fwd": (4, 32), "dq": (2, 32), "dkdv": (2, 32)},
    ("float32", 128): {"fwd": (2, 16), "dq": (1, 16), "dkdv": (1, 16)},
}
# The same kernels' __launch_bounds__ promises on sm_80+ (min blocks an SM; absent: none) and
# dK/dV's column passes (absent: 1). kernels/attn_tiles.cuh says why each is there.
PRODUCTION_MIN_BLOCKS: dict[tuple[str, int, str], int] = {
    ("bfloat16", 64, "dq"): 3, ("bfloat16", 64, "dkdv"): 3, ("float16", 64, "dq"): 3,
    ("float16", 64, "dkdv"): 3, ("float16", 32, "dq"): 4, ("float32", 32, "fwd"): 8,
    ("bfloat16", 32, "fwd"): 5, ("float16", 32, "fwd"): 5,
}
PRODUCTION_PASSES: dict[tuple[str, int], int] = {("bfloat16", 64): 2, ("float16", 64): 2}

PREPROCESS_THREADS = 128
MAX_GRID_Y = 65535  # batch * n_head rides on grid.y
STATIC_SHARED_LIMIT = 48 * 1024

KERNEL_TEMPLATES = {
    "fwd": "attn_fwd",
    "bwd_preprocess": "attn_bwd_preprocess",
    "bwd_dq": "attn_bwd_dq",
    "bwd_dkdv": "attn_bwd_dkdv",
}
# The naive baseline (speed reference of the performance goal): one block of NAIVE_THREADS per
# (batch, head). Its backward reuses "bwd_preprocess" from KERNEL_TEMPLATES.
NAIVE_TEMPLATES = {
    "fwd": "attn_fwd_naive",
    "bwd_dq": "attn_bwd_dq_naive",
    "bwd_dkdv": "attn_bwd_dkdv_naive",
}
NAIVE_THREADS = 128  # ANDREA_NAIVE_THREADS in the .cu file


_INCLUDE = re.compile(r'^#include "([\w.]+)"\n', re.M)


def kernel_source(name: str = KERNEL_FILE) -> str:
    """kernels/microgpt_cuda.cu with the parts it #includes (kernels/attn_*.cuh) written in
    place, #line directives keeping their names and lines in diagnostics: the one text NVRTC and
    the CPU emulator compile. NVRTC gets no include path, so the modules' cache keys (this
    process's and CuPy's on disk, both of the source text) cover every part."""
    text = (kernels_dir() / name).read_text()

    def expand(m: re.Match) -> str:
        after = text.count("\n", 0, m.end()) + 1  # the parent's line after the #include
        return f'#line 1 "{m[1]}"\n{kernel_source(m[1])}#line {after} "{name}"\n'

    return _INCLUDE.sub(expand, text)


def nvrtc_options(arch: str) -> list[str]:
    """The exact NVRTC options the runtime passes, e.g. arch="sm_90".

    No --use_fast_math: the fp32 path must stay within ~1e-5 of float64, and exp2f/log2f are
    cheap enough. Compile to cubin (-arch=sm_XX), never ship PTX: a newer NVRTC's PTX may be
    too new for the driver. Every function in the kernel source is marked __device__ or
    __global__, so no -default-device; no include path, because kernel_source has its parts
    written in place.
    """
    return ["--std=c++17", f"-arch={arch}"]


# What cupy.RawModule appends to nvrtc_options before NVRTC sees them (cupy/cuda/compiler.py,
# CuPy 13.6 and 14.2 alike): flush-to-zero denormals, its own -arch (the device's, the same as
# ours), and device as the default execution space. CuPy 14 adds --pch only when
# CUPY_NVRTC_USE_PCH=1 (precompiled headers: the same cubin, checked with NVRTC 13.0), and both
# add -I folders of their own headers, which the kernel source never includes. -ftz=true flushes
# fp32 denormals to zero and changes ptxas's register choices.
CUPY_ADDED_OPTIONS: tuple[str, ...] = ("-ftz=true", "--device-as-default-execution-space")


def runtime_nvrtc_options(arch: str, device_arch: str | None = None) -> list[str]:
    """What NVRTC really gets when the runtime compiles for `arch` on a GPU of `device_arch`
    (default: arch): nvrtc_options as passed, then CuPy's additions, its -arch the device's
    (the compile tests build with these)."""
    return [*nvrtc_options(arch), CUPY_ADDED_OPTIONS[0], f"-arch={device_arch or arch}",
            *CUPY_ADDED_OPTIONS[1:]]


def module_names(name: str) -> tuple[str, ...]:
    """The kernel instances compiled together with `name` (a name expression): one module per
    (dtype, head_dim), so a run compiles only what it launches, about a sixth of every instance;
    the naive baseline (benchmarks only) is a module of its own, and so is each template
    instance TUNED names."""
    template, template_args = name[: name.index("<")], name[name.index("<") :]
    if template in (*PIPE_TEMPLATES.values(), *WGMMA_TEMPLATES.values(),
                    *OVERLAP_TEMPLATES.values()):  # TUNED: its own module
        return (name,)
    group = NAIVE_TEMPLATES if template in NAIVE_TEMPLATES.values() else KERNEL_TEMPLATES
    return tuple(f"{t}{template_args}" for t in group.values())


# Compiled modules of this process, keyed by (source sha256, arch, options, name expressions).
# Across processes CuPy's disk cache (CUPY_CACHE_DIR) serves a module compiled before only from
# CuPy 14.2 on: earlier versions key a module with name_expressions differently and recompile it
# in every process (seconds per module on first use).
_MODULES: dict[tuple[str, str, tuple[str, ...], tuple[str, ...]], Any] = {}
_MODULES_LOCK = threading.Lock()


def compiled_module(source: str, arch: str, names: tuple[str, ...]) -> Any:
    """A cupy.RawModule of `source` for `arch` (e.g. "sm_90") holding the instances `names`
    (built for module_arch(arch, names): sm_90a for the wgmma kernels).

    Imports CuPy (only here); needs no torch, so a CuPy-only program (the compute-sanitizer
    case of scripts/gpu_check.sh) compiles exactly what the backend compiles.
    """
    import cupy

    arch = module_arch(arch, names)
    options = tuple(nvrtc_options(arch))
    key = (hashlib.sha256(source.encode()).hexdigest(), arch, options, names)
    with _MODULES_LOCK:
        module = _MODULES.get(key)
        if module is None:
            module = cupy.RawModule(
                code=source, options=options, backend="nvrtc", name_expressions=list(names)
            )
            module.compile()  # compile now, not at the first launch inside a timed region
            _MODULES[key] = module
    return module


# The oldest GPU architecture each NVRTC major version compiles for: CUDA 13 dropped Maxwell,
# Pascal and Volta (sm_50 to sm_72); CUDA 12 has sm_50 and up. Without the target NVRTC fails
# at the first launch; asked before, the backend can fall back to SDPA and say why.
OLDEST_ARCH = {11: 35, 12: 50, 13: 75}


def arch_problem(arch: str, nvrtc_major: int) -> str | None:
    """Why NVRTC `nvrtc_major` cannot compile the kernels for `arch` (e.g. "sm_70"), or None."""
    oldest = OLDEST_ARCH.get(nvrtc_major, max(OLDEST_ARCH.values()))
    if int(arch.removeprefix("sm_")) >= oldest:
        return None
    return (
        f"CuPy's NVRTC {nvrtc_major} cannot compile for {arch} (its oldest target is "
        f"sm_{oldest}); install CuPy for CUDA 12 (pip install cupy-cuda12x) on this GPU"
    )


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        supported = ", ".join(str(d) for d in SUPPORTED_HEAD_DIMS)
        raise UserError(
            f"model.head_dim={head_dim} has no CUDA attention kernel (supported: {supported}); "
            "use model.attention=sdpa or a supported head_dim"
        )


def check_dtype(dtype: str) -> None:
    if dtype not in ELEMENT_TYPES:
        raise UserError(
            f"attention dtype {dtype!r} has no CUDA kernel "
            f"(supported: {', '.join(ELEMENT_TYPES)})"
        )


def name_expression(kernel: str, dtype: str, head_dim: int, naive: bool = False) -> str:
    """NVRTC name expression of a kernel instance, e.g. 'attn_fwd<bf16_t, 64>'."""
    template = (NAIVE_TEMPLATES if naive else KERNEL_TEMPLATES)[kernel]
    return f"{template}<{ELEMENT_TYPES[dtype][0]}, {head_dim}>"


def all_name_expressions() -> list[str]:
    """Every kernel instance of the .cu file, the naive baseline included."""
    return [
        name_expression(kernel, dtype, d, naive)
        for dtype in ELEMENT_TYPES
        for d in SUPPORTED_HEAD_DIMS
        for naive, templates in ((False, KERNEL_TEMPLATES), (True, NAIVE_TEMPLATES))
        for kernel in templates
    ]


def static_shared_bytes(kernel: str, dtype: str, head_dim: int) -> int:
    """Bytes of the kernel's static shared memory (layout `Smem` in the .cu file)."""
    if kernel == "bwd_preprocess":
        return 0
    kind = kernel.removeprefix("bwd_")
    warps, n = TILES[(dtype, head_dim)][kind]
    elem = ELEMENT_TYPES[dtype][1]
    m = 16 * warps
    ld = head_dim + 16 // elem
    a_tiles = 1 if kind == "fwd" else 2
    stat_rows = {"fwd": 4, "dq": m, "dkdv": n}[kind]
    scratch = warps * 16 * (n + 4) if dtype == "float32" else 4  # fp32's P staging tile
    return (a_tiles * m * ld + 2 * n * ld) * elem + 2 * stat_rows * 4 + scratch * 4


@dataclass(frozen=True)
class Launch:
    name: str  # NVRTC name expression
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_shared_bytes: int = 0  # what the launch passes as dynamic shared memory


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def attention_launches(
    batch: int, n_head: int, seq_len: int, head_dim: int, dtype: str
) -> dict[str, Launch]:
    """Launches for one causal attention over q, k, v of shape [batch, n_head, seq_len, head_dim].

    Keys: "fwd", then for the backward in this order "bwd_preprocess", "bwd_dq", "bwd_dkdv".
    """
    check_head_dim(head_dim)
    check_dtype(dtype)
    if seq_len < 1 or batch < 1 or n_head < 1:
        raise UserError(f"attention shape B={batch}, H={n_head}, T={seq_len} must be positive")
    bh = batch * n_head
    if bh > MAX_GRID_Y:
        raise UserError(f"batch*n_head={bh} exceeds {MAX_GRID_Y}; use a smaller micro-batch")
    if bh * seq_len >= 2**31:  # the preprocess kernel's row count is an int
        raise UserError(
            f"batch*n_head*seq_len={bh * seq_len:,} rows exceed 2^31; use a smaller micro-batch"
        )
    launches = {}
    for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        warps, _ = TILES[(dtype, head_dim)][kernel.removeprefix("bwd_")]
        launches[kernel] = Launch(
            name=name_expression(kernel, dtype, head_dim),
            grid=(_ceil_div(seq_len, 16 * warps), bh, 1),
            block=(32 * warps, 1, 1),
        )
    launches["bwd_preprocess"] = Launch(
        name=name_expression("bwd_preprocess", dtype, head_dim),
        grid=(_ceil_div(bh * seq_len, PREPROCESS_THREADS), 1, 1),
        block=(PREPROCESS_THREADS, 1, 1),
    )
    return {k: launches[k] for k in ("fwd", "bwd_preprocess", "bwd_dq", "bwd_dkdv")}


def naive_attention_launches(
    batch: int, n_head: int, seq_len: int, head_dim: int, dtype: str
) -> dict[str, Launch]:
    """The naive baseline's launches, keyed like `attention_launches` (same argument lists).

    One block of NAIVE_THREADS per (batch, head) on grid.x; "bwd_preprocess" is the regular one.
    """
    # Validates as the regular kernels do (B*n_head within their grid.y limit keeps grid.x small).
    regular = attention_launches(batch, n_head, seq_len, head_dim, dtype)
    launches = {
        kernel: Launch(
            name=name_expression(kernel, dtype, head_dim, naive=True),
            grid=(batch * n_head, 1, 1),
            block=(NAIVE_THREADS, 1, 1),
        )
        for kernel in NAIVE_TEMPLATES
    }
    launches["bwd_preprocess"] = regular["bwd_preprocess"]
    return {k: launches[k] for k in ("fwd", "bwd_preprocess", "bwd_dq", "bwd_dkdv")}


# ----------------------------------------------------------------------- pipelined candidates
# attn_fwd_pipe, attn_bwd_dq_pipe, attn_bwd_dkdv_pipe in the .cu file: the tile shape, the
# cp.async pipeline depth and the __launch_bounds__ promise as template parameters, dynamic
# shared memory. scripts/gpu_tune_attention.py builds, checks and times them; the production
# path launches the kernels of TILES. The candidates are generated here from TILES, so the
# table has one home.
PIPE_TEMPLATES = {
    "fwd": "attn_fwd_pipe",
    "bwd_dq": "attn_bwd_dq_pipe",
    "bwd_dkdv": "attn_bwd_dkdv_pipe",
    # the backward through dS: dK/dV writing dS, then dQ = scale * dS K (kernels/attn_pipe.cuh)
    "bwd_dkdv_ds": "attn_bwd_dkdv_ds",
    "bwd_dq_ds": "attn_bwd_dq_ds",
    # a whole head's backward in one block, dS in shared memory: short sequences only
    "bwd_fused": "attn_bwd_fused",
}
DS_KERNELS = ("bwd_dkdv_ds", "bwd_dq_ds")
FUSED_KERNEL = "bwd_fused"
DS_STRIDE_MULTIPLE = 128  # the dS buffer's row stride: T rounded up to this (tiles divide it)


def ds_row_stride(seq_len: int) -> int:
    """Row stride of the backward's dS buffer [B*H, T, stride]: every key block's and dQ key
    tile's columns lie inside a row, and rows start 16-byte aligned."""
    return _ceil_div(seq_len, DS_STRIDE_MULTIPLE) * DS_STRIDE_MULTIPLE


# The sm_90a candidates (kernels/attn_hopper.cuh): a PipeConfig with wgmma=True names these.
WGMMA_TEMPLATES = {"fwd": "attn_fwd_wgmma", "bwd_dkdv_ds": "attn_bwd_dkdv_ds_wgmma",
                   "bwd_dq_ds": "attn_bwd_dq_ds_wgmma", "bwd_dkdv": "attn_bwd_dkdv_wgmma",
                   "bwd_dq": "attn_bwd_dq_wgmma", "bwd_dkdv_dq": "attn_bwd_dkdv_dq_wgmma"}
# Their twins with overlap=True: a tile's last products in flight during the next tile's softmax
# (forward) or dS (backward), the same bits; a tile stays read one iteration longer, so the
# pipeline needs OVERLAP_MIN_STAGES.
OVERLAP_TEMPLATES = {"fwd": "attn_fwd_wgmma_overlap", "bwd_dkdv": "attn_bwd_dkdv_wgmma_overlap",
                     "bwd_dq": "attn_bwd_dq_wgmma_overlap",
                     "bwd_dkdv_ds": "attn_bwd_dkdv_ds_wgmma_overlap",
                     # a tile's dQ share added while the next tile's first products run
                     "bwd_dkdv_dq": "attn_bwd_dkdv_dq_wgmma_overlap"}
OVERLAP_MIN_STAGES = 3
WGMMA_ARCH = {"sm_90": "sm_90a"}  # the GPU architecture -> the target with wgmma on it

# "bwd_dkdv_dq", the backward after the preprocess in one kernel: dK, dV and dQ, each query
# tile's dQ shares added in key-block order through a float32 buffer (dq_in_order_buffers). A
# warpgroup's 64 keys a block, 64 queries a tile.
DQ_IN_ORDER = "bwd_dkdv_dq"
DQ_IN_ORDER_ROWS = 64


def dq_in_order_buffers(batch: int, n_head: int, seq_len: int,
                        head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of DQ_IN_ORDER's two buffers: dQ's float32 partial sums [B*H, T, D] (written
    before read: no clearing) and a turn counter per (batch*head, query tile), int32, zeroed
    before every launch."""
    return ((batch * n_head, seq_len, head_dim),
            (batch * n_head, _ceil_div(seq_len, DQ_IN_ORDER_ROWS)))


def module_arch(arch: str, names: tuple[str, ...] | list[str]) -> str:
    """The target a module of `names` compiles for on a GPU of `arch`: the arch-specific one
    (sm_90a) when it holds a wgmma kernel, which exists only there; else `arch` itself. NVRTC
    builds for sm_90a also when CuPy appends its own -arch=sm_90 after ours."""
    hopper = (*WGMMA_TEMPLATES.values(), *OVERLAP_TEMPLATES.values())
    if not any(name[: name.index("<")] in hopper for name in names):
        return arch
    if arch not in WGMMA_ARCH:
        raise ValueError(f"{', '.join(names)}: wgmma kernels run only on {', '.join(WGMMA_ARCH)}, "
                         f"not {arch}")
    return WGMMA_ARCH[arch]


DYNAMIC_SHARED_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024,
                        "sm_90": 227 * 1024}  # per block, with the opt-in attribute


def block_shared_limit(arch: str | None) -> int:
    """The shared memory a block may have on `arch`: DYNAMIC_SHARED_LIMIT's, or for an
    architecture the table does not know the 48 KiB every GPU gives without the opt-in."""
    return DYNAMIC_SHARED_LIMIT.get(arch or "", STATIC_SHARED_LIMIT)


@dataclass(frozen=True, order=True)
class PipeConfig:
    """One candidate: W warps (a block owns 16*W rows), N streamed rows per tile, STAGES-deep
    cp.async pipeline (1: synchronous, as the production kernels), MINB blocks per SM promised
    to ptxas (0: none), PASSES column passes of a streamed tile in dK/dV; WGMMA: the sm_90a
    kernel (WGMMA_TEMPLATES; W a multiple of 4, a warpgroup per 64 rows) instead of mma.sync;
    OVERLAP: its twin of OVERLAP_TEMPLATES."""

    warps: int
    rows: int
    stages: int
    min_blocks: int = 0
    passes: int = 1
    wgmma: bool = False
    overlap: bool = False

    def label(self) -> str:
        extra = f" minb{self.min_blocks}" if self.min_blocks else ""
        extra += f" p{self.passes}" if self.passes > 1 else ""
        extra += " wgmma" if self.wgmma else ""
        extra += " overlap" if self.overlap else ""
        return f"W{self.warps} N{self.rows} S{self.stages}{extra}"

    def code(self) -> str:
        """The config as Python, defaults left out: what a TUNED line says."""
        args = [self.warps, self.rows, self.stages]
        if self.passes != 1:
            args += [self.min_blocks, self.passes]
        elif self.min_blocks:
            args.append(self.min_blocks)
        flags = (", wgmma=True" if self.wgmma else "") + (", overlap=True" if self.overlap else "")
        return f"PipeConfig({', '.join(map(str, args))}{flags})"


# The tuned kernels, by GPU architecture: (arch, dtype, head_dim) -> kernel -> PipeConfig, the
# winners of scripts/gpu_tune_attention.py on that architecture (it prints these lines, ready to
# paste). Where a key is present the "cuda" backend launches those template instances instead
# of the production kernels of TILES: "fwd", and the backward as "bwd_dq" and "bwd_dkdv", or
# through dS as "bwd_dkdv_ds" and "bwd_dq_ds"; a kernel not named keeps its production kernel.
# "bwd_fused" (a whole head's backward in one block) replaces the backward where the sequence
# fits the block's shared memory, and leaves the longer ones to the others.
# Another architecture, or one not measured, runs the production kernels. sm_90's entries were
# measured on an H100 (docs/log.md, 2026-12-06, the first GPU run of the speed script); each
# passed its check against float64 there, through autograd too.
TUNED: dict[tuple[str, str, int], dict[str, PipeConfig]] = {
    # bfloat16 B8 H12 T1024 D64: f+b 0.432 ms, production 0.650
    ("sm_90", "bfloat16", 64): {"fwd": PipeConfig(8, 64, 2, wgmma=True),
                                "bwd_dq": PipeConfig(8, 64, 2, wgmma=True),
                                "bwd_dkdv": PipeConfig(4, 64, 2, wgmma=True)},
    # bfloat16 B32 H12 T256 D32: f+b 0.104 ms, production 0.142
    ("sm_90", "bfloat16", 32): {"fwd": PipeConfig(4, 64, 3), "bwd_fused": PipeConfig(8, 32, 1)},
    # float16 B8 H12 T1024 D64: f+b 0.783 ms, production 1.069
    ("sm_90", "float16", 64): {"fwd": PipeConfig(8, 32, 2),
                               "bwd_dq": PipeConfig(4, 64, 2, wgmma=True),
                               "bwd_dkdv": PipeConfig(8, 32, 2)},
}


def production_pipe_config(kernel: str, dtype: str, head_dim: int, stages: int = 1) -> PipeConfig:
    """The candidate with the production kernel's tile (TILES), promise and passes."""
    kind = kernel.removeprefix("bwd_")
    warps, rows = TILES[(dtype, head_dim)][kind]
    return PipeConfig(warps, rows, stages, PRODUCTION_MIN_BLOCKS.get((dtype, head_dim, kind), 0),
                      PRODUCTION_PASSES.get((dtype, head_dim), 1) if kind == "dkdv" else 1)


# The sequence length the whole-head backward's candidates must hold (the 12M preset's windows).
FUSED_MIN_SEQ_LEN = 256


def pipe_candidates(kernel: str, dtype: str, head_dim: int) -> list[PipeConfig]:
    """Every candidate of a kernel for (dtype, head_dim): the production tile first (at 1 and 2
    stages), then W in {2, 4, 8} x N in {32, 64, 128} x stages in {1, 2, 3} (dK/dV: 1 and, where
    a pass keeps 32 columns or more, 2 column passes), where the N-wide score fragments fit the
    registers (forward N <= 128; backward, whose S and dP are both live, N <= 4096 / D) and the
    shared memory fits sm_90's 227 KiB per block. The whole-head backward ("bwd_fused"): W in
    {8, 4, 16} x query chunks of the production dK/dV pass's N (its bits) and of 64, 32, 16,
    where FUSED_MIN_SEQ_LEN positions fit sm_90's shared memory (bf16 and fp16 at head_dim 32)."""
    if kernel == DQ_IN_ORDER:  # a wgmma kernel only (hopper_candidates)
        return []
    if kernel == FUSED_KERNEL:
        prod = production_pipe_config("bwd_dkdv", dtype, head_dim)
        chunks = dict.fromkeys((prod.rows // prod.passes, 64, 32, 16))
        return [cfg for n in chunks if n <= 4096 // head_dim for w in (8, 4, 16)
                if pipe_shared_bytes(kernel, dtype, head_dim, cfg := PipeConfig(w, n, 1),
                                     FUSED_MIN_SEQ_LEN) <= DYNAMIC_SHARED_LIMIT["sm_90"]]
    if kernel == "bwd_dq_ds":  # a plain product: only the tile shape and the pipeline matter
        return [PipeConfig(w, n, s) for w in (4, 8, 2) for n in (64, 128, 32) for s in (2, 3, 1)
                if pipe_shared_bytes(kernel, dtype, head_dim, PipeConfig(w, n, s))
                <= DYNAMIC_SHARED_LIMIT["sm_90"]]
    found = [production_pipe_config(kernel.removesuffix("_ds"), dtype, head_dim, s)
             for s in (1, 2)]
    dkdv = kernel in ("bwd_dkdv", "bwd_dkdv_ds")
    max_rows = (128 if head_dim <= 64 else 64) if kernel == "fwd" else 4096 // head_dim
    for warps in (4, 8, 2):
        for rows in (64, 32, 128):
            for stages in (1, 2, 3):
                for passes in (1, 2) if dkdv and rows >= 64 else (1,):
                    cfg = PipeConfig(warps, rows, stages, 0, passes)
                    if rows <= max_rows and cfg not in found and pipe_shared_bytes(
                            kernel, dtype, head_dim, cfg) <= DYNAMIC_SHARED_LIMIT["sm_90"]:
                        found.append(cfg)
    return found


def hopper_candidates(kernel: str, dtype: str, head_dim: int) -> list[PipeConfig]:
    """The sm_90a (wgmma) candidates of a kernel in bf16 and fp16 (none in fp32, or for the
    kernels without a wgmma twin): a warpgroup or two (W 4, 8), 64 or 128 streamed rows (dK/dV:
    64, as S, dP, their A fragments and both accumulators are live at once: at 128 rows ptxas
    spills at 255 registers from head_dim 32 up), the forward at 2 and 3 stages, the backward
    (through dS, or recomputing S and dP in dQ) at 2; after each, where the kernel has one (all
    but dQ from dS, a product alone), its overlap twin a stage deeper (the same tiles ahead;
    the backward's only up to head_dim 64: at 128 ptxas spills some of them), where the shared
    memory fits sm_90's 227 KiB a block. DQ_IN_ORDER has one tile shape: W 4, N 64."""
    if kernel not in WGMMA_TEMPLATES or dtype not in ("bfloat16", "float16"):
        return []
    rows = (64,) if kernel in ("bwd_dkdv_ds", "bwd_dkdv", DQ_IN_ORDER) else (64, 128)
    stages = (2, 3) if kernel == "fwd" else (2,)
    found = []
    for warps in (4,) if kernel == DQ_IN_ORDER else (4, 8):
        for n in rows:
            for depth in stages:
                found.append(PipeConfig(warps, n, depth, wgmma=True))
                if kernel in OVERLAP_TEMPLATES and (kernel == "fwd" or head_dim <= 64):
                    found.append(PipeConfig(warps, n, max(depth + 1, OVERLAP_MIN_STAGES),
                                            wgmma=True, overlap=True))
    return [cfg for cfg in found if pipe_shared_bytes(kernel, dtype, head_dim, cfg)
            <= DYNAMIC_SHARED_LIMIT["sm_90"]]


def pipe_name_expression(kernel: str, dtype: str, head_dim: int, cfg: PipeConfig) -> str:
    """e.g. 'attn_fwd_pipe<bf16_t, 64, 4, 64, 2, 0>' (dK/dV: passes last; the whole-head
    backward has no stages: 'attn_bwd_fused<bf16_t, 32, 8, 64, 0>')."""
    args = [ELEMENT_TYPES[dtype][0], head_dim, cfg.warps, cfg.rows, cfg.stages, cfg.min_blocks]
    if kernel == FUSED_KERNEL:
        del args[4]
    if kernel in ("bwd_dkdv", "bwd_dkdv_ds"):
        args.append(cfg.passes)
    template = (OVERLAP_TEMPLATES if cfg.overlap else WGMMA_TEMPLATES if cfg.wgmma
                else PIPE_TEMPLATES)[kernel]
    return f"{template}<{', '.join(str(a) for a in args)}>"


def pipe_shared_bytes(kernel: str, dtype: str, head_dim: int, cfg: PipeConfig,
                      seq_len: int | None = None) -> int:
    """Dynamic shared memory of a candidate (PipeSmem<...>::bytes in the .cu file; dQ from dS:
    DsSmem<...>::bytes; wgmma: HopperSmem<...>::bytes; the whole-head backward, which holds
    the sequence: FusedSmem<...>::bytes(seq_len))."""
    kind = {"bwd_dkdv_ds": "dkdv", DQ_IN_ORDER: "dkdv"}.get(kernel, kernel.removeprefix("bwd_"))
    elem = ELEMENT_TYPES[dtype][1]
    m, ld = 16 * cfg.warps, head_dim + 16 // elem
    if kernel == FUSED_KERNEL:  # Q, dO, K, V and dS [rows, rows + pad], lse, delta, scratch
        if seq_len is None:
            raise ValueError(f"{kernel}: its shared memory holds the sequence: give seq_len")
        rows = _ceil_div(seq_len, cfg.rows) * cfg.rows
        scratch = cfg.warps * 16 * (cfg.rows + 4) if dtype == "float32" else 0
        return (4 * rows * ld + rows * (rows + 16 // elem)) * elem + 4 * (2 * rows + scratch)
    if cfg.wgmma:  # HopperSmem: unpadded core-matrix tiles, the statistics after them
        owned = {"fwd": m, "dkdv": 2 * m, "dq": 2 * m, "dq_ds": 0}[kind] * head_dim
        stage = m * cfg.rows + cfg.rows * head_dim if kind == "dq_ds" else 2 * cfg.rows * head_dim
        stats = {"dkdv": cfg.stages * 2 * cfg.rows * 4, "dq": 2 * m * 4}.get(kind, 0)
        ds_tile = m * cfg.rows if kernel == DQ_IN_ORDER else 0  # dS^T, for dQ's product
        return (owned + cfg.stages * stage + ds_tile) * elem + stats
    if kind == "dq_ds":  # per stage an M x N dS tile and an N x D K tile
        return cfg.stages * (m * (cfg.rows + 16 // elem) + cfg.rows * ld) * elem
    a_tiles = 1 if kind == "fwd" else 2
    stat_floats = {"fwd": 0, "dq": 2 * m, "dkdv": cfg.stages * 2 * cfg.rows}[kind]
    scratch = cfg.warps * 16 * (cfg.rows + 4) if dtype == "float32" else 0
    return (a_tiles * m + cfg.stages * 2 * cfg.rows) * ld * elem + 4 * (stat_floats + scratch)


def pipe_launch(kernel: str, batch: int, n_head: int, seq_len: int, head_dim: int, dtype: str,
                cfg: PipeConfig) -> Launch:
    """The launch of candidate `cfg` of kernel "fwd", "bwd_dq", "bwd_dkdv", "bwd_dkdv_ds",
    "bwd_dq_ds" or "bwd_fused" (the backward's "bwd_preprocess" is the production one, from
    attention_launches). The whole-head backward is a block per (batch, head), its shared memory
    sized by seq_len."""
    regular = attention_launches(batch, n_head, seq_len, head_dim, dtype)  # validates
    # dK/dV's key block (16*W keys) and dQ's key tile (N) must end inside a dS row
    if DS_STRIDE_MULTIPLE % {"bwd_dkdv_ds": 16 * cfg.warps, "bwd_dq_ds": cfg.rows}.get(kernel, 1):
        raise ValueError(f"{kernel} {cfg.label()}: its keys must divide {DS_STRIDE_MULTIPLE}")
    if cfg.wgmma and (kernel not in WGMMA_TEMPLATES or dtype == "float32" or cfg.warps % 4
                      or cfg.rows not in (32, 64, 128) or cfg.passes != 1):
        raise ValueError(f"{kernel} {cfg.label()} {dtype}: wgmma has {', '.join(WGMMA_TEMPLATES)}"
                         " in bf16 and fp16, whole warpgroups (W a multiple of 4), N 32, 64 or "
                         "128, one pass")
    if kernel == DQ_IN_ORDER and (not cfg.wgmma or cfg.warps != 4
                                  or cfg.rows != DQ_IN_ORDER_ROWS):
        raise ValueError(f"{kernel} {cfg.label()}: a wgmma kernel of one warpgroup (W 4), "
                         f"N {DQ_IN_ORDER_ROWS}")
    if cfg.overlap and (not cfg.wgmma or kernel not in OVERLAP_TEMPLATES
                        or cfg.stages < OVERLAP_MIN_STAGES):
        raise ValueError(f"{kernel} {cfg.label()}: overlap is a wgmma kernel's twin, of "
                         f"{', '.join(OVERLAP_TEMPLATES)}, at {OVERLAP_MIN_STAGES} stages or more")
    if kernel == FUSED_KERNEL:
        if cfg.stages != 1 or cfg.passes != 1:
            raise ValueError(f"{kernel} {cfg.label()}: one stage, one pass")
        smem = pipe_shared_bytes(kernel, dtype, head_dim, cfg, seq_len)
        if smem > max(DYNAMIC_SHARED_LIMIT.values()):
            raise ValueError(f"{kernel} {cfg.label()} {dtype}: {seq_len} positions need "
                             f"{smem} bytes of shared memory, more than any GPU's block has")
        return Launch(name=pipe_name_expression(kernel, dtype, head_dim, cfg),
                      grid=(1, regular["fwd"].grid[1], 1), block=(32 * cfg.warps, 1, 1),
                      dynamic_shared_bytes=smem)
    smem = pipe_shared_bytes(kernel, dtype, head_dim, cfg)
    return Launch(
        name=pipe_name_expression(kernel, dtype, head_dim, cfg),
        grid=(_ceil_div(seq_len, 16 * cfg.warps), regular["fwd"].grid[1], 1),
        block=(32 * cfg.warps, 1, 1),
        dynamic_shared_bytes=smem,
    )


def pipe_emulator_entries(names: list[tuple[str, str, int, PipeConfig]]) -> str:
    """The emulator's table rows (kernels/cpu/emu_entry.cpp's ANDREA_PIPE) for candidates given
    as (kernel, dtype, head_dim, cfg): C++ instantiates only what it is told."""
    kinds = {"fwd": "KIND_FWD", "bwd_dq": "KIND_DQ", "bwd_dkdv": "KIND_DKDV",
             "bwd_dkdv_ds": "KIND_DKDV", "bwd_dq_ds": "KIND_DQ_DS", DQ_IN_ORDER: "KIND_DKDV_DQ"}
    rows = []
    for kernel, dtype, head_dim, cfg in names:
        ctype = ELEMENT_TYPES[dtype][0]
        if kernel == FUSED_KERNEL:  # its shared memory at FUSED_MIN_SEQ_LEN positions
            name = pipe_name_expression(kernel, dtype, head_dim, cfg)
            rows.append(f'ANDREA_FUSED("{name}", {ctype}, {head_dim}, {cfg.warps}, {cfg.rows}, '
                        f"{cfg.min_blocks}, {FUSED_MIN_SEQ_LEN}),")
            continue
        dkdv = kernel in ("bwd_dkdv", "bwd_dkdv_ds")
        extra = f"{cfg.min_blocks}" + (f", {cfg.passes}" if dkdv else "")
        tile = f"{ctype}, {head_dim}, {cfg.warps}, {cfg.rows}, {cfg.stages}"
        layout = (f"HopperSmem<{ctype}, {head_dim}, {kinds[kernel]}, {cfg.warps}, {cfg.rows}, "
                  f"{cfg.stages}>" if cfg.wgmma
                  else f"DsSmem<{tile}>" if kernel == "bwd_dq_ds"
                  else f"PipeSmem<{ctype}, {head_dim}, {kinds[kernel]}, {cfg.warps}, {cfg.rows}, "
                       f"{cfg.stages}>")
        name = pipe_name_expression(kernel, dtype, head_dim, cfg)
        rows.append(f'ANDREA_PIPE("{name}", {name[: name.index("<")]}, ({layout}::bytes), {tile}, '
                    f"{extra}),")
    return "\n".join(rows) + "\n"


def tuned_launches(batch: int, n_head: int, seq_len: int, head_dim: int, dtype: str,
                   arch: str | None) -> dict[str, Launch]:
    """attention_launches with the kernels TUNED names for (arch, dtype, head_dim) in place of
    the production ones (arch None: the production kernels). Keys: "fwd", "bwd_preprocess",
    then the backward's: "bwd_dq" and "bwd_dkdv", or "bwd_dkdv_ds" and "bwd_dq_ds", or
    "bwd_dkdv_dq" alone (dQ added in order inside dK/dV), or "bwd_fused" alone where the
    sequence fits the architecture's shared memory (a longer one takes the backward the entry
    names beside it, or the production one)."""
    launches = attention_launches(batch, n_head, seq_len, head_dim, dtype)
    tuned = dict(TUNED.get((arch, dtype, head_dim), {})) if arch else {}
    fused = tuned.pop(FUSED_KERNEL, None)
    through_ds = [kernel for kernel in DS_KERNELS if kernel in tuned]
    others = {"bwd_dq", "bwd_dkdv"} & set(tuned)
    if through_ds:
        if len(through_ds) != len(DS_KERNELS) or others or DQ_IN_ORDER in tuned:
            raise ValueError(f"TUNED[{arch!r}, {dtype!r}, {head_dim}] names {sorted(tuned)}: the "
                             f"backward through dS is both of {DS_KERNELS} and nothing else")
        del launches["bwd_dq"], launches["bwd_dkdv"]
    if DQ_IN_ORDER in tuned:
        if others:
            raise ValueError(f"TUNED[{arch!r}, {dtype!r}, {head_dim}] names {sorted(tuned)}: "
                             f"{DQ_IN_ORDER} is the whole backward, with no other")
        del launches["bwd_dq"], launches["bwd_dkdv"]
    for kernel, cfg in tuned.items():
        launches[kernel] = pipe_launch(kernel, batch, n_head, seq_len, head_dim, dtype, cfg)
    if fused is not None and (pipe_shared_bytes(FUSED_KERNEL, dtype, head_dim, fused, seq_len)
                              <= block_shared_limit(arch)):
        for kernel in ("bwd_dq", "bwd_dkdv", *DS_KERNELS, DQ_IN_ORDER):
            launches.pop(kernel, None)
        launches[FUSED_KERNEL] = pipe_launch(FUSED_KERNEL, batch, n_head, seq_len, head_dim,
                                             dtype, fused)
    return launches
