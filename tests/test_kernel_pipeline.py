"""The pipelined candidate kernels (attn_fwd_pipe, attn_bwd_dq_pipe, attn_bwd_dkdv_pipe), the
backward through dS and a whole head's backward in one block (attn_bwd_fused) on the CPU
emulator: each against float64 on NaN-poisoned outputs, bit for bit against the production
kernels where their arithmetic is the same, dynamic shared memory past 48 KiB, the launch table
against the .cu file, and the emulated cp.async catching a missing wait_group.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import shutil
from pathlib import Path

import background
import pytest
import torch

from andrea.cuda import emulator as kernel_emulator
from andrea.cuda import launch as kernel_launch
from andrea.cuda.launch import PipeConfig

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="the CPU kernel emulator needs g++, which is not on PATH"
)

KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2.0**-9}
# (dtype, head_dim, config): the production tile synchronous and pipelined, deeper pipelines,
# other block sizes, N = 128 in the backward, and fp32 with 107 KiB of dynamic shared memory.
CONFIGS = [
    ("bfloat16", 32, PipeConfig(4, 64, 1)),
    ("bfloat16", 32, PipeConfig(4, 64, 2)),
    ("bfloat16", 32, PipeConfig(8, 32, 3)),
    ("bfloat16", 32, PipeConfig(2, 128, 2)),
    ("float16", 64, PipeConfig(4, 64, 2, 3, 2)),
    ("float16", 64, PipeConfig(8, 32, 3)),
    ("float32", 32, PipeConfig(8, 64, 2)),
]
# The backward through dS (attn_bwd_dkdv_ds, attn_bwd_dq_ds), (dtype, head_dim, dK/dV's config,
# dQ's): the production tile, deeper pipelines, dK/dV in two passes, fp32, 128-row blocks and
# key tiles (the dS row stride's multiple), head_dim 128, and dQ blocks taller than dK/dV's key
# blocks, so that dQ's tiles cross dS entries that dK/dV never wrote (NaN-poisoned there).
DS_KERNELS = kernel_launch.DS_KERNELS
DS_CONFIGS = [
    ("bfloat16", 32, PipeConfig(4, 64, 1), PipeConfig(4, 64, 1)),
    ("bfloat16", 32, PipeConfig(2, 32, 3), PipeConfig(8, 32, 3)),
    ("float16", 64, PipeConfig(4, 64, 2, 3, 2), PipeConfig(4, 64, 2)),
    ("float32", 32, PipeConfig(2, 32, 2), PipeConfig(4, 128, 2)),
    ("bfloat16", 64, PipeConfig(8, 128, 2), PipeConfig(2, 64, 3)),
    ("bfloat16", 128, PipeConfig(4, 16, 2), PipeConfig(4, 32, 2)),
]
# A whole head's backward in one block (attn_bwd_fused), (dtype, head_dim, config): the 12M
# preset's candidates (W 8 and 16, chunks of 64 and 16), fp16 at 64, fp32, head_dim 128.
FUSED = kernel_launch.FUSED_KERNEL
FUSED_CONFIGS = [
    ("bfloat16", 32, PipeConfig(8, 64, 1)),
    ("bfloat16", 32, PipeConfig(16, 16, 1)),
    ("float16", 64, PipeConfig(4, 32, 1)),
    ("float32", 32, PipeConfig(2, 16, 1)),
    ("bfloat16", 128, PipeConfig(4, 16, 1)),
]
PIPES = tuple(dict.fromkeys(
    [(kernel, dtype, d, cfg) for dtype, d, cfg in CONFIGS for kernel in KERNELS]
    + [(kernel, dtype, d, cfg) for dtype, d, dkdv, dq in DS_CONFIGS
       for kernel, cfg in (("fwd", dkdv), ("bwd_dkdv_ds", dkdv), ("bwd_dq_ds", dq))]
    + [(kernel, dtype, d, cfg) for dtype, d, cfg in FUSED_CONFIGS
       for kernel, cfg in (("fwd", kernel_launch.production_pipe_config("fwd", dtype, d)),
                           (FUSED, cfg))]))
SHAPES = [(1, (2, 3)), (17, (1, 2)), (129, (1, 2))]  # T, (B, H)

# The wait that lands tile it's K/V before the barrier of the forward's 2+-stage pipeline.
WAIT = "cp_async_wait<STAGES - 2 - LAG>();  // this thread's copies of tile it have landed\n"
NO_WAIT_CONFIG = ("bfloat16", 32, PipeConfig(4, 32, 2))


def no_wait_kernel() -> str:
    text = kernel_emulator.kernel_source()
    assert text.count(WAIT) == 1
    return text.replace(WAIT, "")


def no_wait_pipes() -> tuple:
    dtype, d, cfg = NO_WAIT_CONFIG
    return tuple((kernel, dtype, d, cfg) for kernel in KERNELS)


if shutil.which("g++"):
    background.declare("emulator-pipe", functools.partial(kernel_emulator.build_library,
                                                          pipes=PIPES),
                       wanted_by=["test_kernel_pipeline.py"])
    background.declare(
        "emulator-pipe-no-wait",
        lambda: kernel_emulator.build_library(no_wait_kernel(), pipes=no_wait_pipes()),
        wanted_by=["test_kernel_pipeline.py::test_a_missing_cp_async_wait_is_caught"])


@pytest.fixture(scope="module")
def emulator() -> kernel_emulator.Emulator:
    background.result("emulator-pipe")
    return kernel_emulator.Emulator(pipes=PIPES)


def random_inputs(b, h, t, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=gen).to(dtype) for _ in range(4)]


def configs_of(cfg: PipeConfig) -> dict[str, PipeConfig]:
    return dict.fromkeys(KERNELS, cfg)


def ds_configs_of(dkdv: PipeConfig, dq: PipeConfig) -> dict[str, PipeConfig]:
    return {"fwd": dkdv, "bwd_dkdv_ds": dkdv, "bwd_dq_ds": dq}


@pytest.mark.parametrize("dtype,head_dim,cfg", CONFIGS, ids=lambda x: str(x))
@pytest.mark.parametrize("seq_len,bh", SHAPES, ids=lambda x: str(x))
def test_candidates_match_float64(emulator, dtype, head_dim, cfg, seq_len, bh) -> None:
    b, h = bh
    tdt = getattr(torch, dtype)
    q, k, v, dout = random_inputs(b, h, seq_len, head_dim, tdt, seed=seq_len + head_dim)
    scale = 0.8 / math.sqrt(head_dim)  # not the default: the kernels must use the argument
    got = kernel_emulator.pipe_attention(q, k, v, dout, configs_of(cfg), emulator, scale)
    want = kernel_emulator.float64_reference(q, k, v, dout, scale)
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert not torch.isnan(g).any(), f"{name}: elements left unwritten (NaN poison)"
        err = kernel_emulator.max_error(g, w)
        tol = 1e-5 if name == "lse" else TOL[tdt]
        assert err <= tol, f"{cfg.label()} {name}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("dtype,head_dim,cfg,dq_cfg", DS_CONFIGS, ids=lambda x: str(x))
@pytest.mark.parametrize("seq_len,bh", SHAPES, ids=lambda x: str(x))
def test_backward_through_ds_matches_float64(emulator, dtype, head_dim, cfg, dq_cfg, seq_len,
                                             bh) -> None:
    """dK/dV writing dS, dQ from it: float64's gradients, with the dS buffer NaN-poisoned, so a
    dQ that reads an entry dK/dV never wrote (above the diagonal, past T) comes out NaN."""
    b, h = bh
    tdt = getattr(torch, dtype)
    q, k, v, dout = random_inputs(b, h, seq_len, head_dim, tdt, seed=seq_len + 2 * head_dim)
    scale = 0.7 / math.sqrt(head_dim)
    got = kernel_emulator.pipe_attention(q, k, v, dout, ds_configs_of(cfg, dq_cfg), emulator,
                                         scale)
    want = kernel_emulator.float64_reference(q, k, v, dout, scale)
    for name, g, w in list(zip(("o", "lse", "dq", "dk", "dv"), got, want, strict=True))[2:]:
        assert not torch.isnan(g).any(), f"{name}: NaN (unwritten output or unmasked dS)"
        err = kernel_emulator.max_error(g, w)
        assert err <= TOL[tdt], f"{cfg.label()} {name}: max error {err:.3g} > {TOL[tdt]:.3g}"


DS_SAME_ROWS = [c for c in DS_CONFIGS
                if c[2].rows == c[3].rows == kernel_launch.TILES[c[0], c[1]]["dq"][1]]


@pytest.mark.parametrize("dtype,head_dim,cfg,dq_cfg", DS_SAME_ROWS, ids=lambda x: str(x))
def test_backward_through_ds_gives_the_production_bits(emulator, dtype, head_dim, cfg,
                                                       dq_cfg) -> None:
    """dS rounded to the element type is the operand the production dQ product rounds to, and
    the products run over the keys in the same order, so with the production N, dQ through dS
    is bit for bit the production kernel's; so are dK and dV (the dK/dV body is the same)."""
    assert kernel_launch.TILES[dtype, head_dim]["dkdv"][1] == cfg.rows
    tdt = getattr(torch, dtype)
    q, k, v, dout = random_inputs(2, 2, 150, head_dim, tdt, seed=13)
    o, lse = kernel_emulator.attention_forward(q, k, v)
    want = kernel_emulator.attention_backward(q, k, v, o, lse, dout)
    got = kernel_emulator.pipe_attention(q, k, v, dout, ds_configs_of(cfg, dq_cfg), emulator)[2:]
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(g, w), f"{cfg.label()} {name} differs from the production kernel"


TUNED_ARCH = "sm_test"  # an architecture of this test's own, in andrea.cuda.launch.TUNED
TUNED_ENTRY = {"fwd": PipeConfig(4, 64, 2), "bwd_dkdv_ds": PipeConfig(2, 32, 3),
               "bwd_dq_ds": PipeConfig(8, 32, 3)}  # bf16 D=32 candidates of PIPES


def tuned_attention(emulator, q, k, v, dout, monkeypatch,
                    entry: dict[str, PipeConfig] = TUNED_ENTRY) -> tuple[list[str], tuple]:
    """cuda_attention through autograd with TUNED naming candidates (`entry`) for TUNED_ARCH:
    the names it launched, and (o, dq, dk, dv)."""
    from andrea.cuda import attention as ca

    monkeypatch.setitem(kernel_launch.TUNED, (TUNED_ARCH, "bfloat16", 32), entry)
    ca._launches.cache_clear()  # its entries are of TUNED as it was
    launcher = ca.EmulatorLauncher(emulator, arch=TUNED_ARCH)
    names: list[str] = []
    run = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda launch, *a: (names.append(launch.name),
                                                                 run(launch, *a)))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = ca.cuda_attention(*leaves, launcher=launcher)
    o.backward(dout)
    ca._launches.cache_clear()
    return names, (o.detach(), *(x.grad for x in leaves))


def test_tuned_kernels_run_in_place_of_the_production_ones(emulator, monkeypatch) -> None:
    """A TUNED entry makes the "cuda" backend launch its template instances on that
    architecture, the backward through dS included, through autograd; float64's gradients."""
    q, k, v, dout = random_inputs(3, 2, 17, 32, torch.bfloat16, seed=21)
    names, (o, dq, dk, dv) = tuned_attention(emulator, q, k, v, dout, monkeypatch)
    expect = {kernel: kernel_launch.pipe_name_expression(kernel, "bfloat16", 32, cfg)
              for kernel, cfg in TUNED_ENTRY.items()}
    assert names == [expect["fwd"], "attn_bwd_preprocess<bf16_t, 32>", expect["bwd_dkdv_ds"],
                     expect["bwd_dq_ds"]]
    want = kernel_emulator.float64_reference(q, k, v, dout, 32**-0.5)
    for name, g, w in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), (want[0], *want[2:]),
                          strict=True):
        assert kernel_emulator.max_error(g, w) <= TOL[torch.bfloat16], name
    # another architecture keeps the production kernels
    assert kernel_launch.tuned_launches(3, 2, 17, 32, "bfloat16", "sm_other") == (
        kernel_launch.attention_launches(3, 2, 17, 32, "bfloat16"))


def test_the_backward_through_ds_in_turns_gives_the_same_bits(emulator, monkeypatch) -> None:
    """A batch whose dS buffer would pass DS_BUFFER_BYTES goes through in turns of fewer
    sequences (here 2 and 1 of 3, views at aligned offsets): the same bits as in one turn."""
    from andrea.cuda import attention as ca

    q, k, v, dout = random_inputs(3, 2, 17, 32, torch.bfloat16, seed=22)
    _, whole = tuned_attention(emulator, q, k, v, dout, monkeypatch)
    monkeypatch.setattr(ca, "DS_BUFFER_BYTES", 1)
    names, turns = tuned_attention(emulator, q, k, v, dout, monkeypatch)
    assert sum("attn_bwd_dq_ds" in n for n in names) == 2
    for a, b in zip(whole, turns, strict=True):
        assert torch.equal(a, b)


def test_a_tuned_entry_takes_both_kernels_of_the_backward_through_ds(monkeypatch) -> None:
    monkeypatch.setitem(kernel_launch.TUNED, (TUNED_ARCH, "bfloat16", 32),
                        {"bwd_dq_ds": PipeConfig(4, 64, 2)})
    with pytest.raises(ValueError, match="both of"):
        kernel_launch.tuned_launches(1, 1, 8, 32, "bfloat16", TUNED_ARCH)
    # dQ added in order inside dK/dV is the whole backward: with another backward kernel, refused
    in_order = PipeConfig(4, 64, 2, wgmma=True)
    for other in ("bwd_dq", "bwd_dkdv"):
        monkeypatch.setitem(kernel_launch.TUNED, (TUNED_ARCH, "bfloat16", 32),
                            {kernel_launch.DQ_IN_ORDER: in_order, other: PipeConfig(4, 64, 2)})
        with pytest.raises(ValueError, match="is the whole backward"):
            kernel_launch.tuned_launches(1, 1, 8, 32, "bfloat16", TUNED_ARCH)
    monkeypatch.setitem(kernel_launch.TUNED, (TUNED_ARCH, "bfloat16", 32),
                        {kernel_launch.DQ_IN_ORDER: in_order})
    assert list(kernel_launch.tuned_launches(1, 1, 8, 32, "bfloat16", TUNED_ARCH)) == [
        "fwd", "bwd_preprocess", kernel_launch.DQ_IN_ORDER]


def fused_configs_of(dtype: str, head_dim: int, cfg: PipeConfig) -> dict[str, PipeConfig]:
    return {"fwd": kernel_launch.production_pipe_config("fwd", dtype, head_dim), FUSED: cfg}


@pytest.mark.parametrize("dtype,head_dim,cfg", FUSED_CONFIGS, ids=lambda x: str(x))
@pytest.mark.parametrize("seq_len,bh", [*SHAPES, (200, (1, 1))], ids=lambda x: str(x))
def test_whole_head_backward_matches_float64(emulator, dtype, head_dim, cfg, seq_len,
                                             bh) -> None:
    """One block per (batch, head), dS in shared memory: float64's gradients with the outputs
    NaN-poisoned, and the emulated shared memory filled with NaN at each launch, so a dQ that
    reads a dS entry phase 1 never wrote comes out NaN."""
    b, h = bh
    tdt = getattr(torch, dtype)
    q, k, v, dout = random_inputs(b, h, seq_len, head_dim, tdt, seed=seq_len + 3 * head_dim)
    scale = 0.9 / math.sqrt(head_dim)
    if kernel_launch.pipe_shared_bytes(FUSED, dtype, head_dim, cfg, seq_len) > 227 * 1024:
        with pytest.raises(ValueError, match="more than any GPU's block has"):  # 200 at D 128
            kernel_emulator.pipe_attention(q, k, v, dout, fused_configs_of(dtype, head_dim, cfg),
                                           emulator)
        return
    got = kernel_emulator.pipe_attention(q, k, v, dout, fused_configs_of(dtype, head_dim, cfg),
                                         emulator, scale)
    want = kernel_emulator.float64_reference(q, k, v, dout, scale)
    for name, g, w in list(zip(("o", "lse", "dq", "dk", "dv"), got, want, strict=True))[2:]:
        assert not torch.isnan(g).any(), f"{name}: NaN (unwritten output or dS)"
        err = kernel_emulator.max_error(g, w)
        assert err <= TOL[tdt], f"{cfg.label()} {name}: max error {err:.3g} > {TOL[tdt]:.3g}"


@pytest.mark.parametrize("dtype,head_dim,cfg", FUSED_CONFIGS, ids=lambda x: str(x))
def test_whole_head_backward_gives_the_production_bits(emulator, dtype, head_dim, cfg) -> None:
    """Each gradient sums its products in the production kernels' order, 16 at a time, whatever
    the chunk, and dS is rounded as the production dQ product rounds it: the same bits, at any
    W and N (the products past the diagonal that production adds are exact zeros)."""
    tdt = getattr(torch, dtype)
    q, k, v, dout = random_inputs(2, 2, 150, head_dim, tdt, seed=17)
    o, lse = kernel_emulator.attention_forward(q, k, v)
    want = kernel_emulator.attention_backward(q, k, v, o, lse, dout)
    got = kernel_emulator.pipe_attention(q, k, v, dout, fused_configs_of(dtype, head_dim, cfg),
                                         emulator)[2:]
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(g, w), f"{cfg.label()} {name} differs from the production kernel"


def test_a_tuned_whole_head_backward_runs_where_the_sequence_fits(emulator, monkeypatch) -> None:
    """A TUNED "bwd_fused" replaces the backward through autograd where the sequence fits the
    architecture's shared memory (48 KiB for an architecture the table does not know), and a
    longer sequence takes the backward the entry names beside it."""
    entry = {"fwd": PipeConfig(4, 64, 2), "bwd_dq": PipeConfig(4, 64, 2),
             "bwd_dkdv": PipeConfig(4, 64, 2), FUSED: PipeConfig(8, 64, 1)}
    name = {kernel: kernel_launch.pipe_name_expression(kernel, "bfloat16", 32, cfg)
            for kernel, cfg in entry.items()}
    assert name[FUSED] == "attn_bwd_fused<bf16_t, 32, 8, 64, 0>"
    for seq_len, backward in ((17, [name[FUSED]]), (129, [name["bwd_dq"], name["bwd_dkdv"]])):
        q, k, v, dout = random_inputs(2, 3, seq_len, 32, torch.bfloat16, seed=seq_len)
        names, (_, *grads) = tuned_attention(emulator, q, k, v, dout, monkeypatch, entry)
        assert names[2:] == backward, (seq_len, names)
        want = kernel_emulator.float64_reference(q, k, v, dout, 32**-0.5)
        for grad_name, g, w in zip(("dq", "dk", "dv"), grads, want[2:], strict=True):
            assert kernel_emulator.max_error(g, w) <= TOL[torch.bfloat16], (seq_len, grad_name)
    bytes_129 = kernel_launch.pipe_shared_bytes(FUSED, "bfloat16", 32, entry[FUSED], 129)
    assert bytes_129 > 48 * 1024 >= kernel_launch.pipe_shared_bytes(FUSED, "bfloat16", 32,
                                                                     entry[FUSED], 17)


def test_whole_head_backward_candidates_hold_the_12m_window() -> None:
    """Its candidates: the production dK/dV pass's chunk first, 256 positions within sm_90's
    227 KiB (bf16 and fp16 at head_dim 32 only); a sequence no GPU's block can hold is refused."""
    for dtype in ("bfloat16", "float16"):
        found = kernel_launch.pipe_candidates(FUSED, dtype, 32)
        assert found[0] == PipeConfig(8, 64, 1) and len(set(found)) == len(found) == 9
        for cfg in found:
            launch = kernel_launch.pipe_launch(FUSED, 32, 12, 256, 32, dtype, cfg)
            assert launch.grid == (1, 384, 1) and launch.block == (32 * cfg.warps, 1, 1)
            assert launch.dynamic_shared_bytes <= 227 * 1024
    assert kernel_launch.pipe_candidates(FUSED, "bfloat16", 64) == []
    with pytest.raises(ValueError, match="more than any GPU's block has"):
        kernel_launch.pipe_launch(FUSED, 1, 1, 512, 32, "bfloat16", PipeConfig(8, 64, 1))


SAME_ROWS = [c for c in CONFIGS if c[2].rows == kernel_launch.TILES[c[0], c[1]]["fwd"][1]]


@pytest.mark.parametrize("dtype,head_dim,cfg", SAME_ROWS, ids=lambda x: str(x))
def test_candidates_with_the_production_rows_give_its_bits(emulator, dtype, head_dim,
                                                           cfg) -> None:
    """Per output row the arithmetic depends on N only: W and the pipeline change who owns a
    row and when a tile arrives, so with production's N every output is bit for bit the same."""
    for kernel in KERNELS:
        assert kernel_launch.TILES[dtype, head_dim][kernel.removeprefix("bwd_")][1] == cfg.rows
    tdt = getattr(torch, dtype)
    q, k, v, dout = random_inputs(2, 2, 150, head_dim, tdt, seed=11)
    got = kernel_emulator.pipe_attention(q, k, v, dout, configs_of(cfg), emulator)
    o, lse = kernel_emulator.attention_forward(q, k, v)
    want = (o, lse, *kernel_emulator.attention_backward(q, k, v, o, lse, dout))
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(g, w), f"{cfg.label()} {name} differs from the production kernel"


def test_fibers_and_threads_agree_bit_for_bit(emulator) -> None:
    dtype, d, cfg = CONFIGS[2]
    q, k, v, dout = random_inputs(1, 2, 70, d, getattr(torch, dtype), seed=5)
    runs = [kernel_emulator.pipe_attention(q, k, v, dout, configs_of(cfg), emulator, mode=mode)
            for mode in ("fibers", "threads")]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_launch_table_matches_the_kernel_file(emulator) -> None:
    for kernel, dtype, d, cfg in PIPES:
        name = kernel_launch.pipe_name_expression(kernel, dtype, d, cfg)
        if kernel == FUSED:  # its shared memory holds the sequence: the table's is at 256
            smem = kernel_launch.pipe_shared_bytes(kernel, dtype, d, cfg,
                                                   kernel_launch.FUSED_MIN_SEQ_LEN)
            assert emulator.kernel_info(name) == (cfg.warps, cfg.rows, smem, 0, 1), name
            continue
        smem = kernel_launch.pipe_shared_bytes(kernel, dtype, d, cfg)
        # only dK/dV's templates have passes
        passes = cfg.passes if kernel in ("bwd_dkdv", "bwd_dkdv_ds") else 1
        assert emulator.kernel_info(name) == (cfg.warps, cfg.rows, smem, cfg.min_blocks,
                                              passes), name
        launch = kernel_launch.pipe_launch(kernel, 8, 12, 1000, d, dtype, cfg)
        assert launch.name == name and launch.dynamic_shared_bytes == smem
        assert launch.grid == (math.ceil(1000 / (16 * cfg.warps)), 96, 1)
        assert launch.block == (32 * cfg.warps, 1, 1)
    # the fp32 candidate's blocks need the opt-in beyond 48 KiB on a GPU
    assert kernel_launch.pipe_shared_bytes("bwd_dq", "float32", 32, CONFIGS[-1][2]) > 48 * 1024


@pytest.mark.parametrize("dtype,head_dim", list(kernel_launch.TILES))
def test_candidate_lists_start_with_the_production_tile(dtype, head_dim) -> None:
    for kernel in KERNELS:
        found = kernel_launch.pipe_candidates(kernel, dtype, head_dim)
        prod = kernel_launch.production_pipe_config(kernel, dtype, head_dim)
        w, n = kernel_launch.TILES[dtype, head_dim][kernel.removeprefix("bwd_")]
        assert found[0] == prod and (prod.warps, prod.rows, prod.stages) == (w, n, 1)
        assert found[1] == kernel_launch.production_pipe_config(kernel, dtype, head_dim, 2)
        assert len(set(found)) == len(found)
        for cfg in found[2:]:
            assert cfg.rows % 16 == 0 and (cfg.rows // cfg.passes) % 16 == 0
            assert kernel_launch.pipe_shared_bytes(kernel, dtype, head_dim, cfg) <= 227 * 1024


@pytest.mark.parametrize("dtype,head_dim", list(kernel_launch.TILES))
def test_ds_candidates_launch_and_fit(dtype, head_dim) -> None:
    """The backward through dS: dK/dV's list starts from the production tile; every candidate
    of both kernels has keys that end inside a dS row, and fits sm_90's shared memory."""
    dkdv = kernel_launch.pipe_candidates("bwd_dkdv_ds", dtype, head_dim)
    assert dkdv[0] == kernel_launch.production_pipe_config("bwd_dkdv", dtype, head_dim)
    for kernel in DS_KERNELS:
        found = kernel_launch.pipe_candidates(kernel, dtype, head_dim)
        assert found and len(set(found)) == len(found)
        for cfg in found:
            launch = kernel_launch.pipe_launch(kernel, 2, 3, 333, head_dim, dtype, cfg)
            assert launch.dynamic_shared_bytes <= 227 * 1024
    assert kernel_launch.ds_row_stride(333) == 384 and kernel_launch.ds_row_stride(256) == 256
    with pytest.raises(ValueError, match="divide 128"):
        kernel_launch.pipe_launch("bwd_dq_ds", 2, 3, 333, head_dim, dtype, PipeConfig(4, 48, 2))


def test_a_missing_cp_async_wait_is_caught() -> None:
    """The emulated cp.async lands its bytes only at the wait_group that completes its group
    (and its destination reads as NaN until then): a forward without its wait reads NaN where a
    GPU would read stale or half-written tiles."""
    background.result("emulator-pipe-no-wait")
    broken = kernel_emulator.Emulator(no_wait_kernel(), pipes=no_wait_pipes())
    dtype, d, cfg = NO_WAIT_CONFIG
    q, k, v, dout = random_inputs(1, 1, 70, d, getattr(torch, dtype), seed=2)
    o, lse, *_ = kernel_emulator.pipe_attention(q, k, v, dout, configs_of(cfg), broken)
    assert torch.isnan(o).any() and torch.isnan(lse).any()


def test_tune_script_dry_run_checks_candidates_on_the_emulator(tmp_path: Path) -> None:
    """scripts/gpu_tune_attention.py without a GPU: the emulator, one tiny shape, exit 0."""
    path = Path(__file__).parents[1] / "scripts" / "gpu_tune_attention.py"
    spec = importlib.util.spec_from_file_location("gpu_tune_attention", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    assert tune.main([str(tmp_path), "--dry-run", "--dry-limit", "1"]) == 0
    results = json.loads((tmp_path / "tune.json").read_text())["results"]
    assert results and all(r["ok"] for r in results)
    # every kernel; dQ in order (a wgmma kernel only) through its emulated wgmma
    assert {r["kernel"] for r in results} == {*KERNELS, *DS_KERNELS, FUSED,
                                              kernel_launch.DQ_IN_ORDER}
