"""The sm_90a forward (attn_fwd_wgmma, kernels/attn_hopper.cuh) without a GPU: on the CPU
emulator against float64 with NaN-poisoned outputs, bit for bit against the pipelined mma.sync
forward of the same tiles, a missing wgmma wait and misread descriptor strides caught; its
launch table and module target; NVRTC's sm_90a build without spills or injected warpgroup
waits. Whether the descriptors mean on a GPU what the emulator reads them as is for the GPU
check (scripts/gpu_tune_attention.py checks every candidate against float64 there).
"""

from __future__ import annotations

import functools
import math
import shutil

import background
import pytest
import torch

from andrea.cuda import emulator as kernel_emulator
from andrea.cuda import launch as kernel_launch
from andrea.cuda.launch import PipeConfig
from andrea.cuda.nvrtc import Nvrtc, find_libnvrtc

needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="the CPU kernel emulator needs g++, which is not on PATH"
)

TOL = {torch.bfloat16: 1e-2, torch.float16: 2.0**-9}
# (dtype, head_dim, config): a warpgroup and two, 64 and 128 keys a tile (wgmma's N), 2 and 3
# stages, every head_dim; each beside its mma.sync twin (the same W, N, STAGES).
HOPPER = [
    ("bfloat16", 64, PipeConfig(4, 64, 2, wgmma=True)),
    ("bfloat16", 32, PipeConfig(8, 128, 3, wgmma=True)),
    ("bfloat16", 128, PipeConfig(8, 64, 2, wgmma=True)),
    ("float16", 64, PipeConfig(4, 128, 2, wgmma=True)),
    ("float16", 128, PipeConfig(4, 64, 3, wgmma=True)),
]
SHAPES = [(1, (2, 3)), (17, (1, 2)), (129, (1, 2)), (200, (1, 1))]  # T, (B, H)


def twin(cfg: PipeConfig) -> PipeConfig:
    return PipeConfig(cfg.warps, cfg.rows, cfg.stages)


PIPES = tuple(("fwd", dtype, d, c) for dtype, d, cfg in HOPPER for c in (cfg, twin(cfg)))
# The wait after S = Q K^T's wgmma group, and the K descriptor's strides (LBO, SBO).
S_WAIT = "    wgmma_commit();\n    wgmma_wait<0>();\n    wgmma_fence_operands(flat(s));\n"
K_DESC = "wgmma_desc(ks + kk * 128, CM_BYTES, ROW8_BYTES)"
BROKEN = ("bfloat16", 64, PipeConfig(4, 64, 2, wgmma=True))


def edited(replace: str, by: str) -> str:
    text = kernel_emulator.kernel_source()
    assert text.count(replace) == 1, f"marker not found once in the kernel file: {replace!r}"
    return text.replace(replace, by)


def no_s_wait() -> str:
    return edited(S_WAIT, S_WAIT.replace("    wgmma_wait<0>();\n", ""))


def swapped_k_strides() -> str:
    return edited(K_DESC, "wgmma_desc(ks + kk * 128, ROW8_BYTES, CM_BYTES)")


BROKEN_BUILDS = {"emulator-wgmma-no-wait": no_s_wait,
                 "emulator-wgmma-swapped-strides": swapped_k_strides}
if shutil.which("g++"):
    background.declare("emulator-wgmma",
                       functools.partial(kernel_emulator.build_library, pipes=PIPES),
                       wanted_by=["test_kernel_hopper.py"])
    for _name, _text in BROKEN_BUILDS.items():
        background.declare(
            _name,
            lambda text=_text: kernel_emulator.build_library(text(), pipes=(("fwd", *BROKEN),)),
            wanted_by=["test_kernel_hopper.py::test_a_misused_wgmma_is_caught"])


@pytest.fixture(scope="module")
def emulator() -> kernel_emulator.Emulator:
    background.result("emulator-wgmma")
    return kernel_emulator.Emulator(pipes=PIPES)


def random_inputs(b, h, t, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=gen).to(dtype) for _ in range(3)]


def forward(emulator, cfg, q, k, v, scale) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, t, d = q.shape
    dtype = str(q.dtype).removeprefix("torch.")
    launch = kernel_launch.pipe_launch("fwd", b, h, t, d, dtype, cfg)
    o, lse = torch.full_like(q, math.nan), torch.full((b, h, t), math.nan)
    emulator.launch(launch, q, k, v, o, lse, t, scale)
    return o, lse


@needs_gxx
@pytest.mark.parametrize("dtype,head_dim,cfg", HOPPER, ids=lambda x: str(x))
@pytest.mark.parametrize("seq_len,bh", SHAPES, ids=lambda x: str(x))
def test_wgmma_forward_matches_float64(emulator, dtype, head_dim, cfg, seq_len, bh) -> None:
    tdt = getattr(torch, dtype)
    q, k, v = random_inputs(*bh, seq_len, head_dim, tdt, seed=seq_len + head_dim)
    scale = 0.8 / math.sqrt(head_dim)  # not the default: the kernel must use the argument
    o, lse = forward(emulator, cfg, q, k, v, scale)
    want = kernel_emulator.float64_reference(q, k, v, torch.zeros_like(q), scale)
    for name, got, ref, tol in (("o", o, want[0], TOL[tdt]), ("lse", lse, want[1], 1e-5)):
        assert not torch.isnan(got).any(), f"{name}: elements left unwritten (NaN poison)"
        err = kernel_emulator.max_error(got, ref)
        assert err <= tol, f"{cfg.label()} {name}: max error {err:.3g} > {tol:.3g}"


@needs_gxx
@pytest.mark.parametrize("dtype,head_dim,cfg", HOPPER, ids=lambda x: str(x))
def test_wgmma_forward_gives_the_pipelined_forwards_bits(emulator, dtype, head_dim,
                                                         cfg) -> None:
    """Each wgmma sums its 16 k in order onto the accumulator, as the mma.sync steps of the
    pipelined forward do, and P is rounded alike: with the same tiles, the same bits, so the
    operand layouts, descriptors and fragments are what the mma.sync path computes with."""
    q, k, v = random_inputs(2, 2, 150, head_dim, getattr(torch, dtype), seed=5)
    got = forward(emulator, cfg, q, k, v, head_dim**-0.5)
    want = forward(emulator, twin(cfg), q, k, v, head_dim**-0.5)
    for name, g, w in zip(("o", "lse"), got, want, strict=True):
        assert torch.equal(g, w), f"{cfg.label()} {name} differs from the mma.sync forward"


@needs_gxx
@pytest.mark.parametrize("build", list(BROKEN_BUILDS))
def test_a_misused_wgmma_is_caught(build: str) -> None:
    """Without the wait after S's group its accumulator reads NaN (the emulated wgmma lands at
    its wait_group, as the registers are undefined until then on a GPU); with K's descriptor
    strides swapped, the product reads other elements and misses float64."""
    background.result(build)
    broken = kernel_emulator.Emulator(BROKEN_BUILDS[build](), pipes=(("fwd", *BROKEN),))
    dtype, d, cfg = BROKEN
    q, k, v = random_inputs(1, 1, 70, d, getattr(torch, dtype), seed=2)
    o, lse = forward(broken, cfg, q, k, v, d**-0.5)
    if build.endswith("no-wait"):
        assert torch.isnan(o).all() and torch.isnan(lse).all()
    else:
        want = kernel_emulator.float64_reference(q, k, v, torch.zeros_like(q), d**-0.5)
        assert not torch.isnan(o).any()
        assert kernel_emulator.max_error(o, want[0]) > 10 * TOL[torch.bfloat16]


@needs_gxx
def test_launch_table_matches_the_kernel_file(emulator) -> None:
    """pipe_shared_bytes against HopperSmem<...>::bytes as the emulated kernel file has them."""
    for dtype, d, cfg in HOPPER:
        name = kernel_launch.pipe_name_expression("fwd", dtype, d, cfg)
        assert name.startswith("attn_fwd_wgmma<")
        warps, rows, shared, _, _ = emulator.kernel_info(name)
        assert (warps, rows) == (cfg.warps, cfg.rows)
        assert shared == kernel_launch.pipe_shared_bytes("fwd", dtype, d, cfg)


def test_wgmma_kernels_build_for_sm_90a_alone() -> None:
    names = [kernel_launch.pipe_name_expression("fwd", dtype, d, cfg) for dtype, d, cfg in HOPPER]
    assert kernel_launch.module_arch("sm_90", names[:1]) == "sm_90a"
    assert kernel_launch.module_names(names[0]) == (names[0],)  # a module of its own
    plain = kernel_launch.name_expression("fwd", "bfloat16", 64)
    assert kernel_launch.module_arch("sm_90", [plain]) == "sm_90"
    assert kernel_launch.module_arch("sm_80", [plain]) == "sm_80"
    with pytest.raises(ValueError, match="only on sm_90"):
        kernel_launch.module_arch("sm_80", names[:1])
    for dtype, d in [("bfloat16", 64), ("float16", 128), ("float32", 64)]:
        found = kernel_launch.hopper_candidates("fwd", dtype, d)
        assert (found == []) == (dtype == "float32")
        for cfg in found:
            launch = kernel_launch.pipe_launch("fwd", 2, 3, 333, d, dtype, cfg)
            assert launch.block == (32 * cfg.warps, 1, 1) and cfg.warps % 4 == 0
            assert launch.dynamic_shared_bytes <= 227 * 1024
    assert kernel_launch.hopper_candidates("bwd_dq", "bfloat16", 64) == []
    for kernel, dtype, cfg in [("fwd", "float32", PipeConfig(4, 64, 2, wgmma=True)),
                               ("fwd", "bfloat16", PipeConfig(2, 64, 2, wgmma=True)),
                               ("bwd_dq", "bfloat16", PipeConfig(4, 64, 2, wgmma=True))]:
        with pytest.raises(ValueError, match="wgmma has"):
            kernel_launch.pipe_launch(kernel, 1, 1, 64, 64, dtype, cfg)


# The 120M preset's head shape and the widest accumulators (fp16, D 128, two warpgroups, 128
# keys): what CuPy gives NVRTC on an H100/H200, its own -arch=sm_90 after ours.
NVRTC_CASES = [("bfloat16", 64, PipeConfig(4, 64, 2, wgmma=True)),
               ("float16", 128, PipeConfig(8, 128, 2, wgmma=True))]


def _nvrtc_sm90a_build() -> tuple[list[str], str]:
    names = [kernel_launch.pipe_name_expression("fwd", *case) for case in NVRTC_CASES]
    target = kernel_launch.module_arch("sm_90", names)
    options = kernel_launch.runtime_nvrtc_options(target, "sm_90")
    return names, Nvrtc(find_libnvrtc()).compile(kernel_launch.kernel_source(), names, options).log


if find_libnvrtc() is not None:
    background.declare("nvrtc-sm_90a", _nvrtc_sm90a_build,
                       wanted_by=["test_kernel_hopper.py::test_nvrtc_builds_wgmma_for_sm_90a"])


@pytest.mark.skipif(find_libnvrtc() is None, reason="the nvidia-cuda-nvrtc wheel is not installed")
def test_nvrtc_builds_wgmma_for_sm_90a() -> None:
    """Built for sm_90a although CuPy appends -arch=sm_90; no spills, and no warpgroup wait
    that ptxas injects because a register wgmma reads was written inside the async region."""
    names, log = background.result("nvrtc-sm_90a")
    functions = [line for line in log.splitlines() if "Compiling entry function" in line]
    assert len(functions) == len(names) and all("for 'sm_90a'" in f for f in functions), log
    assert log.count("0 bytes spill stores, 0 bytes spill loads") == len(names), log
    assert "C7519" not in log and "warning" not in log.lower(), log
