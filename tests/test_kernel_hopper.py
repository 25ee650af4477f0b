"""The sm_90a kernels (kernels/attn_hopper.cuh: the forward, the backward through dS and the
backward recomputing S and dP, on wgmma, the overlapped twins of all but dQ from dS, and the
backward adding dQ in order inside dK/dV) without a GPU: on the CPU emulator against float64
with NaN-poisoned outputs, bit for bit against their pipelined mma.sync twins of the same
tiles, through autograd from a TUNED entry; a missing wgmma wait, misread descriptor strides, a
stage refilled while an overlapped product still reads it, A fragments rewritten while in
flight and a turn of dQ's never passed on caught; their launch table and module target; NVRTC's
sm_90a build without spills or ptxas's wgmma notes. Whether the descriptors mean on a GPU what
the emulator reads them as is for the GPU check (scripts/gpu_tune_attention.py checks every
candidate against float64 there).
"""

from __future__ import annotations

import functools
import math
import shutil
import signal
import subprocess
import sys

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
    # overlapped: the softmax of a tile beside the product of the one before (3 and 4 stages)
    ("bfloat16", 64, PipeConfig(4, 64, 3, wgmma=True, overlap=True)),
    ("bfloat16", 32, PipeConfig(8, 128, 4, wgmma=True, overlap=True)),
    ("float16", 128, PipeConfig(8, 64, 3, wgmma=True, overlap=True)),
]
# The backward through dS, (dtype, head_dim, dK/dV's config, dQ's): one and two warpgroups
# each, dQ streaming 32 to 128 keys, dQ blocks taller than dK/dV's key blocks (dQ's tiles then
# cross dS entries dK/dV never wrote, NaN-poisoned), every head_dim.
HOPPER_DS = [
    ("bfloat16", 64, PipeConfig(4, 64, 2, wgmma=True), PipeConfig(4, 64, 2, wgmma=True)),
    ("bfloat16", 32, PipeConfig(8, 64, 2, wgmma=True), PipeConfig(4, 32, 3, wgmma=True)),
    ("bfloat16", 128, PipeConfig(4, 64, 3, wgmma=True), PipeConfig(8, 128, 2, wgmma=True)),
    ("float16", 64, PipeConfig(8, 64, 3, wgmma=True), PipeConfig(4, 128, 2, wgmma=True)),
    # dK/dV overlapped (dS stored while the tile before's products are in flight)
    ("bfloat16", 64, PipeConfig(8, 64, 3, wgmma=True, overlap=True),
     PipeConfig(4, 64, 2, wgmma=True)),
]
# The backward that recomputes S and dP in dQ (attn_bwd_dq_wgmma, attn_bwd_dkdv_wgmma),
# (dtype, head_dim, dK/dV's config, dQ's): one and two warpgroups, dQ streaming 64 and 128 keys,
# every head_dim.
HOPPER_RECOMPUTE = [
    ("bfloat16", 64, PipeConfig(4, 64, 2, wgmma=True), PipeConfig(8, 128, 2, wgmma=True)),
    ("bfloat16", 32, PipeConfig(8, 64, 2, wgmma=True), PipeConfig(4, 64, 2, wgmma=True)),
    ("float16", 128, PipeConfig(4, 64, 2, wgmma=True), PipeConfig(8, 64, 2, wgmma=True)),
    # overlapped, each beside the other's kind: dK/dV and dQ both, then dQ alone
    ("bfloat16", 64, PipeConfig(4, 64, 3, wgmma=True, overlap=True),
     PipeConfig(8, 128, 3, wgmma=True, overlap=True)),
    ("float16", 32, PipeConfig(8, 64, 2, wgmma=True), PipeConfig(4, 64, 3, wgmma=True,
                                                                  overlap=True)),
]
# dQ added in order inside dK/dV (attn_bwd_dkdv_dq_wgmma: one warpgroup, 64 queries a tile),
# (dtype, head_dim, its config): 2 and 3 stages, every head_dim, and overlapped (a tile's share
# added while the next tile's first products run).
HOPPER_DQ_IN_ORDER = [
    ("bfloat16", 64, PipeConfig(4, 64, 2, wgmma=True)),
    ("bfloat16", 32, PipeConfig(4, 64, 3, wgmma=True)),
    ("float16", 128, PipeConfig(4, 64, 2, wgmma=True)),
    ("float16", 64, PipeConfig(4, 64, 3, wgmma=True)),
    ("bfloat16", 64, PipeConfig(4, 64, 3, wgmma=True, overlap=True)),
    ("float16", 32, PipeConfig(4, 64, 3, wgmma=True, overlap=True)),
]
SHAPES = [(1, (2, 3)), (17, (1, 2)), (129, (1, 2)), (200, (1, 1))]  # T, (B, H)
# The overlapped kernels of one head_dim, as a TUNED entry would name them.
OVERLAPPED_FWD = HOPPER[5][2]
OVERLAPPED_RECOMPUTE = HOPPER_RECOMPUTE[3]
assert OVERLAPPED_FWD.overlap and HOPPER[5][:2] == OVERLAPPED_RECOMPUTE[:2]


def twin(cfg: PipeConfig) -> PipeConfig:
    return PipeConfig(cfg.warps, cfg.rows, cfg.stages)


def ds_configs(dkdv: PipeConfig, dq: PipeConfig, wgmma: bool = True) -> dict[str, PipeConfig]:
    """pipe_attention's configs: the mma.sync forward, the backward through dS on wgmma (or
    its twins)."""
    pick = (lambda c: c) if wgmma else twin
    return {"fwd": twin(dkdv), "bwd_dkdv_ds": pick(dkdv), "bwd_dq_ds": pick(dq)}


def recompute_configs(dkdv: PipeConfig, dq: PipeConfig,
                      wgmma: bool = True) -> dict[str, PipeConfig]:
    """pipe_attention's configs: the mma.sync forward, the recomputing backward on wgmma (or
    its twins)."""
    pick = (lambda c: c) if wgmma else twin
    return {"fwd": twin(dkdv), "bwd_dq": pick(dq), "bwd_dkdv": pick(dkdv)}


def in_order_configs(cfg: PipeConfig, dq_cfg: None = None,
                     wgmma: bool = True) -> dict[str, PipeConfig]:
    """pipe_attention's configs: the mma.sync forward, the backward in one kernel (or, for its
    overlapped twin, the plain kernel whose bits it must give)."""
    plain = PipeConfig(cfg.warps, cfg.rows, cfg.stages, wgmma=True)
    return {"fwd": twin(cfg), kernel_launch.DQ_IN_ORDER: cfg if wgmma else plain}


PIPES = tuple(dict.fromkeys(
    [("fwd", dtype, d, c) for dtype, d, cfg in HOPPER for c in (cfg, twin(cfg))]
    + [(kernel, dtype, d, c) for dtype, d, dkdv, dq in HOPPER_DS for wgmma in (True, False)
       for kernel, c in ds_configs(dkdv, dq, wgmma).items()]
    + [(kernel, dtype, d, c) for dtype, d, dkdv, dq in HOPPER_RECOMPUTE for wgmma in (True, False)
       for kernel, c in recompute_configs(dkdv, dq, wgmma).items()]
    + [(kernel, dtype, d, c) for dtype, d, cfg in HOPPER_DQ_IN_ORDER
       for kernel, c in in_order_configs(cfg).items()]
    + [(kernel, dtype, d, c) for dtype, d, cfg in HOPPER_DQ_IN_ORDER
       for kernel, c in in_order_configs(cfg, wgmma=False).items()]))
# The wait after S = Q K^T's wgmma group, and the descriptor strides (LBO, SBO) of every
# K-major operand (Q and K in the forward's S).
S_WAIT = "      issue_s(it);\n      wgmma_wait<0>();\n"
K_DESC = "return wgmma_desc(tile, 128, D / 8 * 64 * 2);"
BROKEN = ("bfloat16", 64, PipeConfig(4, 64, 2, wgmma=True))
# The overlapped forward: its pipeline's lag (V of tile it-1 read during tile it), and the wait
# for O += P V of tile it-1 before P's fragments are rewritten.
OVERLAP_LAG = "  constexpr int LAG = OVERLAP ? 1 : 0;  // V of tile it-1 is read during tile it"
PV_WAIT = ("      wgmma_wait<0>();  // O += P V of tile it-1 has landed; its P fragments are free "
           "again\n      wgmma_fence_operands(flat(acc));\n      rescale_rows<D>(acc, corr);\n")
BROKEN_OVERLAP = ("bfloat16", 64, PipeConfig(4, 64, 3, wgmma=True, overlap=True))
BROKEN_OVERLAP_SEQ_LEN = 300  # 5 key tiles: a stage is refilled while the block still runs


def edited(replace: str, by: str) -> str:
    text = kernel_emulator.kernel_source()
    assert text.count(replace) == 1, f"marker not found once in the kernel file: {replace!r}"
    return text.replace(replace, by)


def no_s_wait() -> str:
    return edited(S_WAIT, S_WAIT.replace("    wgmma_wait<0>();\n", ""))


def swapped_k_strides() -> str:
    return edited(K_DESC, "return wgmma_desc(tile, D / 8 * 64 * 2, 128);")


def overlap_without_lag() -> str:
    return edited(OVERLAP_LAG, "  constexpr int LAG = 0;")


def repack_before_the_wait() -> str:
    """P's fragments for tile it written while tile it-1's O += P V still reads them."""
    return edited(PV_WAIT + "      repack_a<T_, N>(pf, s);\n",
                  "      repack_a<T_, N>(pf, s);\n" + PV_WAIT)


BROKEN_BUILDS = {"emulator-wgmma-no-wait": no_s_wait,
                 "emulator-wgmma-swapped-strides": swapped_k_strides}
# dQ in order: the turn a block passes on to the next key block. (Not caught here: the barrier
# between every warp's dS^T stores and dQ's product removed. The fibers run each warp to its
# next collective in turn, so every warp has stored its rows before any product lands; the
# ThreadSanitizer program of tests/test_kernel_sanitizers.py reports the race.)
PASS_TURN = "  if (threadIdx.x == 0) pass_turn(count, j + 1);"
BROKEN_IN_ORDER = ("bfloat16", 64, PipeConfig(4, 64, 2, wgmma=True))


def in_order_pipes(case: tuple) -> tuple:
    dtype, d, cfg = case
    return tuple((kernel, dtype, d, c) for kernel, c in in_order_configs(cfg).items())


def turn_never_passed() -> str:
    return edited(PASS_TURN, "")


BROKEN_IN_ORDER_BUILDS = {"emulator-dq-in-order-no-turn": turn_never_passed}
BROKEN_OVERLAP_BUILDS = {"emulator-wgmma-overlap-no-lag": overlap_without_lag,
                         "emulator-wgmma-overlap-early-repack": repack_before_the_wait}
if shutil.which("g++"):
    background.declare("emulator-wgmma",
                       functools.partial(kernel_emulator.build_library, pipes=PIPES),
                       wanted_by=["test_kernel_hopper.py"])
    for _name, _text in BROKEN_BUILDS.items():
        background.declare(
            _name,
            lambda text=_text: kernel_emulator.build_library(text(), pipes=(("fwd", *BROKEN),)),
            wanted_by=["test_kernel_hopper.py::test_a_misused_wgmma_is_caught"])
    for _name, _text in BROKEN_OVERLAP_BUILDS.items():
        background.declare(
            _name,
            lambda text=_text: kernel_emulator.build_library(text(),
                                                             pipes=(("fwd", *BROKEN_OVERLAP),)),
            wanted_by=["test_kernel_hopper.py::test_a_misused_overlap_is_caught"])
    for _name, _text in BROKEN_IN_ORDER_BUILDS.items():
        background.declare(
            _name,
            lambda text=_text: kernel_emulator.build_library(
                text(), pipes=in_order_pipes(BROKEN_IN_ORDER)),
            wanted_by=["test_kernel_hopper.py::test_a_misused_dq_in_order_is_caught"])


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


# The backward routes on wgmma: (pipe_attention's configs of a route, dtype, head_dim, dK/dV's
# config, dQ's; dQ in order has one kernel for both).
BACKWARDS = ([(ds_configs, *case) for case in HOPPER_DS]
             + [(recompute_configs, *case) for case in HOPPER_RECOMPUTE]
             + [(in_order_configs, *case, None) for case in HOPPER_DQ_IN_ORDER])
# Each beside the kernels whose bits it must give: the mma.sync kernels of the same tiles, or
# for dQ in order's overlapped twin the plain kernel (the plain one sums in its own order).
BITS = [case for case in BACKWARDS if case[0] is not in_order_configs or case[3].overlap]


def case_id(x) -> str:
    return x.__name__.removesuffix("_configs") if callable(x) else str(x)


@needs_gxx
@pytest.mark.parametrize("configs_of,dtype,head_dim,cfg,dq_cfg", BACKWARDS, ids=case_id)
@pytest.mark.parametrize("seq_len,bh", SHAPES, ids=lambda x: str(x))
def test_wgmma_backward_matches_float64(emulator, configs_of, dtype, head_dim, cfg, dq_cfg,
                                        seq_len, bh) -> None:
    """Through dS (the buffer NaN-poisoned: dQ blocks taller than dK/dV's key blocks cross
    entries dK/dV never wrote), recomputing S and dP, or dQ's shares added into a NaN-poisoned
    float32 buffer one key block after the other: float64's gradients."""
    tdt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seq_len * head_dim)
    q, k, v, dout = (torch.randn(*bh, seq_len, head_dim, generator=gen).to(tdt)
                     for _ in range(4))
    scale = 0.7 / math.sqrt(head_dim)
    got = kernel_emulator.pipe_attention(q, k, v, dout, configs_of(cfg, dq_cfg), emulator, scale)
    want = kernel_emulator.float64_reference(q, k, v, dout, scale)
    for name, g, w in list(zip(("o", "lse", "dq", "dk", "dv"), got, want, strict=True))[2:]:
        assert not torch.isnan(g).any(), f"{name}: NaN (unwritten output or unmasked dS)"
        err = kernel_emulator.max_error(g, w)
        assert err <= TOL[tdt], f"{cfg.label()} {name}: max error {err:.3g} > {TOL[tdt]:.3g}"


@needs_gxx
@pytest.mark.parametrize("configs_of,dtype,head_dim,cfg,dq_cfg", BITS, ids=case_id)
def test_wgmma_backward_gives_the_pipelined_bits(emulator, configs_of, dtype, head_dim, cfg,
                                                 dq_cfg) -> None:
    gen = torch.Generator().manual_seed(9)
    q, k, v, dout = (torch.randn(2, 2, 150, head_dim, generator=gen).to(getattr(torch, dtype))
                     for _ in range(4))
    got = kernel_emulator.pipe_attention(q, k, v, dout, configs_of(cfg, dq_cfg), emulator)
    want = kernel_emulator.pipe_attention(q, k, v, dout, configs_of(cfg, dq_cfg, False),
                                          emulator)
    for name, g, w in list(zip(("o", "lse", "dq", "dk", "dv"), got, want, strict=True))[2:]:
        assert torch.equal(g, w), f"{cfg.label()} {name} differs from its twin"


TUNED_ARCH = "sm_test"  # an architecture of this test's own, in andrea.cuda.launch.TUNED


@needs_gxx
@pytest.mark.parametrize("route", ["through dS", "recomputing", "overlapped", "dQ in order"])
def test_tuned_wgmma_kernels_train_through_autograd(emulator, monkeypatch, route: str) -> None:
    """A TUNED entry naming the wgmma kernels makes the "cuda" backend launch them (forward and
    either backward, or the overlapped twins) through autograd, with float64's gradients."""
    from andrea.cuda import attention as ca

    if route == "through dS":
        _, d, dkdv, dq = HOPPER_DS[0]
        entry = {"fwd": HOPPER[0][2], "bwd_dkdv_ds": dkdv, "bwd_dq_ds": dq}
        expect = ["attn_bwd_dkdv_ds_wgmma", "attn_bwd_dq_ds_wgmma"]
    elif route == "recomputing":
        _, d, dkdv, dq = HOPPER_RECOMPUTE[0]
        entry = {"fwd": HOPPER[0][2], "bwd_dq": dq, "bwd_dkdv": dkdv}
        expect = ["attn_bwd_dq_wgmma", "attn_bwd_dkdv_wgmma"]
    elif route == "overlapped":
        (_, d, dkdv, dq), fwd = OVERLAPPED_RECOMPUTE, OVERLAPPED_FWD
        entry = {"fwd": fwd, "bwd_dq": dq, "bwd_dkdv": dkdv}
        expect = ["attn_bwd_dq_wgmma_overlap", "attn_bwd_dkdv_wgmma_overlap"]
    else:
        _, d, cfg = HOPPER_DQ_IN_ORDER[0]
        entry = {"fwd": HOPPER[0][2], kernel_launch.DQ_IN_ORDER: cfg}
        expect = ["attn_bwd_dkdv_dq_wgmma"]
    monkeypatch.setitem(kernel_launch.TUNED, (TUNED_ARCH, "bfloat16", d), entry)
    ca._launches.cache_clear()  # its entries are of TUNED as it was
    launcher = ca.EmulatorLauncher(emulator, arch=TUNED_ARCH)
    names: list[str] = []
    run = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda launch, *a: (names.append(launch.name),
                                                                 run(launch, *a)))
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(2, 2, 70, d, generator=gen).to(torch.bfloat16)
                     for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = ca.cuda_attention(*leaves, launcher=launcher)
    o.backward(dout)
    ca._launches.cache_clear()
    forward_kernel = "attn_fwd_wgmma_overlap" if route == "overlapped" else "attn_fwd_wgmma"
    assert [n[: n.index("<")] for n in names] == [forward_kernel, "attn_bwd_preprocess", *expect]
    want = kernel_emulator.float64_reference(q, k, v, dout, d**-0.5)
    for name, g, w in zip(("o", "dq", "dk", "dv"), (o.detach(), *(x.grad for x in leaves)),
                          (want[0], *want[2:]), strict=True):
        assert kernel_emulator.max_error(g, w) <= TOL[torch.bfloat16], name


@needs_gxx
@pytest.mark.parametrize("build", list(BROKEN_BUILDS))
def test_a_misused_wgmma_is_caught(build: str) -> None:
    """Without the wait after S's group its accumulator reads NaN (the emulated wgmma lands at
    its wait_group, as the registers are undefined until then on a GPU); with the K-major
    descriptors' strides swapped (Q's and K's), the product reads other elements and misses
    float64."""
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
@pytest.mark.parametrize("build", list(BROKEN_OVERLAP_BUILDS))
def test_a_misused_overlap_is_caught(build: str, tmp_path) -> None:
    """The overlapped forward reads tile it-1's V while tile it's softmax runs: refilling that
    stage a tile early (no pipeline lag) lands 0xff bytes (NaN) under the product still in
    flight. Writing P's fragments before its wait stops the emulator, as they are the
    instruction's registers until then (a race on a GPU): a process of its own, as it aborts."""
    background.result(build)
    dtype, d, cfg = BROKEN_OVERLAP
    t = BROKEN_OVERLAP_SEQ_LEN
    if build.endswith("no-lag"):
        broken = kernel_emulator.Emulator(BROKEN_OVERLAP_BUILDS[build](),
                                          pipes=(("fwd", *BROKEN_OVERLAP),))
        q, k, v = random_inputs(1, 1, t, d, getattr(torch, dtype), seed=2)
        o, _ = forward(broken, cfg, q, k, v, d**-0.5)
        assert torch.isnan(o).any()
        return
    (tmp_path / "kernel.cu").write_text(BROKEN_OVERLAP_BUILDS[build]())
    script = f"""
import math, pathlib, torch
from andrea.cuda import emulator as E, launch as L
from andrea.cuda.launch import PipeConfig
cfg = {cfg!r}
em = E.Emulator(pathlib.Path({str(tmp_path / "kernel.cu")!r}).read_text(),
                pipes=(("fwd", {dtype!r}, {d}, cfg),))
q, k, v = (torch.randn(1, 1, {t}, {d}).to(torch.{dtype}) for _ in range(3))
o, lse = torch.empty_like(q), torch.empty(1, 1, {t})
em.launch(L.pipe_launch("fwd", 1, 1, {t}, {d}, {dtype!r}, cfg), q, k, v, o, lse, {t}, 0.125)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])
    assert "A fragment registers written before the wait_group" in done.stderr


@needs_gxx
@pytest.mark.parametrize("build", list(BROKEN_IN_ORDER_BUILDS))
def test_a_misused_dq_in_order_is_caught(build: str, tmp_path) -> None:
    """A block that never passes its turn on stops the next key block's wait (the emulator runs
    blocks one at a time, so a wait there can never end; a GPU would hang): a process of its
    own, as it aborts."""
    background.result(build)
    dtype, d, cfg = BROKEN_IN_ORDER
    (tmp_path / "kernel.cu").write_text(BROKEN_IN_ORDER_BUILDS[build]())
    script = f"""
import pathlib, torch
from andrea.cuda import emulator as E
from andrea.cuda.launch import PipeConfig
cfg = {cfg!r}
em = E.Emulator(pathlib.Path({str(tmp_path / "kernel.cu")!r}).read_text(),
                pipes=(("fwd", {dtype!r}, {d}, PipeConfig(4, 64, 2)),
                       ("bwd_dkdv_dq", {dtype!r}, {d}, cfg)))
q, k, v, dout = (torch.randn(1, 1, 150, {d}).to(torch.{dtype}) for _ in range(4))
E.pipe_attention(q, k, v, dout, {{"fwd": PipeConfig(4, 64, 2), "bwd_dkdv_dq": cfg}}, em)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])
    assert "dQ in order: a block waits for a block not yet run" in done.stderr


@needs_gxx
def test_launch_table_matches_the_kernel_file(emulator) -> None:
    """pipe_shared_bytes against HopperSmem<...>::bytes as the emulated kernel file has them."""
    for kernel, dtype, d, cfg in PIPES:
        if not cfg.wgmma:
            continue
        name = kernel_launch.pipe_name_expression(kernel, dtype, d, cfg)
        templates = (kernel_launch.OVERLAP_TEMPLATES if cfg.overlap
                     else kernel_launch.WGMMA_TEMPLATES)
        assert name.startswith(templates[kernel] + "<")
        warps, rows, shared, _, _ = emulator.kernel_info(name)
        assert (warps, rows) == (cfg.warps, cfg.rows)
        assert shared == kernel_launch.pipe_shared_bytes(kernel, dtype, d, cfg)


def test_wgmma_kernels_build_for_sm_90a_alone() -> None:
    names = [kernel_launch.pipe_name_expression("fwd", dtype, d, cfg) for dtype, d, cfg in HOPPER]
    assert kernel_launch.module_arch("sm_90", names[:1]) == "sm_90a"
    assert kernel_launch.module_names(names[0]) == (names[0],)  # a module of its own
    plain = kernel_launch.name_expression("fwd", "bfloat16", 64)
    assert kernel_launch.module_arch("sm_90", [plain]) == "sm_90"
    assert kernel_launch.module_arch("sm_80", [plain]) == "sm_80"
    with pytest.raises(ValueError, match="only on sm_90"):
        kernel_launch.module_arch("sm_80", names[:1])
    for kernel in kernel_launch.WGMMA_TEMPLATES:
        for dtype, d in [("bfloat16", 64), ("float16", 128), ("float32", 64)]:
            found = kernel_launch.hopper_candidates(kernel, dtype, d)
            assert (found == []) == (dtype == "float32")
            for cfg in found:
                launch = kernel_launch.pipe_launch(kernel, 2, 3, 333, d, dtype, cfg)
                assert launch.block == (32 * cfg.warps, 1, 1) and cfg.warps % 4 == 0
                assert launch.dynamic_shared_bytes <= 227 * 1024
    assert kernel_launch.hopper_candidates("bwd_fused", "bfloat16", 32) == []
    for kernel, dtype, cfg in [("fwd", "float32", PipeConfig(4, 64, 2, wgmma=True)),
                               ("fwd", "bfloat16", PipeConfig(2, 64, 2, wgmma=True)),
                               ("bwd_fused", "bfloat16", PipeConfig(4, 64, 2, wgmma=True)),
                               ("bwd_dkdv_ds", "bfloat16", PipeConfig(4, 64, 2, 0, 2, True))]:
        with pytest.raises(ValueError, match="wgmma has"):
            kernel_launch.pipe_launch(kernel, 1, 1, 64, 64, dtype, cfg)
    # overlapped: a wgmma kernel's twin, of four kernels, with a stage for the lag
    for kernel, cfg in [("fwd", PipeConfig(4, 64, 2, wgmma=True, overlap=True)),
                        ("fwd", PipeConfig(4, 64, 3, overlap=True)),
                        ("bwd_dq_ds", PipeConfig(4, 64, 3, wgmma=True, overlap=True))]:
        with pytest.raises(ValueError, match="overlap is"):
            kernel_launch.pipe_launch(kernel, 1, 1, 64, 64, "bfloat16", cfg)
    for kernel in kernel_launch.OVERLAP_TEMPLATES:  # each wgmma candidate's twin, a stage deeper
        found = kernel_launch.hopper_candidates(kernel, "bfloat16", 64)
        for cfg in found:
            twin_cfg = PipeConfig(cfg.warps, cfg.rows, max(cfg.stages + 1, 3), wgmma=True,
                                  overlap=True)
            assert cfg.overlap or twin_cfg in found


# The 120M preset's head shape and the most registers (head_dim 128; dK/dV's four
# accumulators): what CuPy gives NVRTC on an H100/H200, its own -arch=sm_90 after ours.
NVRTC_CASES = [("fwd", "bfloat16", 64, PipeConfig(4, 64, 2, wgmma=True)),
               ("fwd", "float16", 128, PipeConfig(8, 128, 2, wgmma=True)),
               ("bwd_dkdv_ds", "bfloat16", 64, PipeConfig(8, 64, 2, wgmma=True)),
               ("bwd_dkdv_ds", "float16", 128, PipeConfig(4, 64, 2, wgmma=True)),
               ("bwd_dq_ds", "bfloat16", 64, PipeConfig(8, 128, 2, wgmma=True)),
               ("bwd_dq", "bfloat16", 64, PipeConfig(8, 128, 2, wgmma=True)),
               ("bwd_dkdv", "float16", 128, PipeConfig(4, 64, 2, wgmma=True)),
               # overlapped: the tile before's products in flight beside this tile's registers
               ("fwd", "bfloat16", 64, PipeConfig(8, 64, 3, wgmma=True, overlap=True)),
               ("fwd", "float16", 128, PipeConfig(4, 128, 3, wgmma=True, overlap=True)),
               ("bwd_dq", "bfloat16", 64, PipeConfig(8, 128, 3, wgmma=True, overlap=True)),
               ("bwd_dkdv", "bfloat16", 64, PipeConfig(4, 64, 3, wgmma=True, overlap=True)),
               ("bwd_dkdv_ds", "bfloat16", 64, PipeConfig(8, 64, 3, wgmma=True, overlap=True)),
               ("bwd_dkdv", "float16", 64, PipeConfig(8, 64, 3, wgmma=True, overlap=True)),
               # dQ in order: a third accumulator, dS^T through shared memory, the turns
               ("bwd_dkdv_dq", "bfloat16", 64, PipeConfig(4, 64, 2, wgmma=True)),
               ("bwd_dkdv_dq", "float16", 128, PipeConfig(4, 64, 3, wgmma=True)),
               ("bwd_dkdv_dq", "bfloat16", 64, PipeConfig(4, 64, 3, wgmma=True, overlap=True))]


def _nvrtc_sm90a_build() -> tuple[list[str], str]:
    names = [kernel_launch.pipe_name_expression(*case) for case in NVRTC_CASES]
    target = kernel_launch.module_arch("sm_90", names)
    options = kernel_launch.runtime_nvrtc_options(target, "sm_90")
    return names, Nvrtc(find_libnvrtc()).compile(kernel_launch.kernel_source(), names, options).log


if find_libnvrtc() is not None:
    background.declare("nvrtc-sm_90a", _nvrtc_sm90a_build,
                       wanted_by=["test_kernel_hopper.py::test_nvrtc_builds_wgmma_for_sm_90a"])


@pytest.mark.skipif(find_libnvrtc() is None, reason="the nvidia-cuda-nvrtc wheel is not installed")
def test_nvrtc_builds_wgmma_for_sm_90a() -> None:
    """Built for sm_90a although CuPy appends -arch=sm_90; no spills, and none of ptxas's
    wgmma notes (C75xx): a warpgroup wait or fence it injects, or products it serializes,
    because a register a wgmma reads or writes is touched while it may be in flight."""
    names, log = background.result("nvrtc-sm_90a")
    functions = [line for line in log.splitlines() if "Compiling entry function" in line]
    assert len(functions) == len(names) and all("for 'sm_90a'" in f for f in functions), log
    assert log.count("0 bytes spill stores, 0 bytes spill loads") == len(names), log
    assert "(C75" not in log and "warning" not in log.lower(), log
