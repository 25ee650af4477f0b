"""The attention kernels of kernels/microgpt_cuda.cu, run unchanged on the CPU emulator, against
a float64 reference: forward (O, log-sum-exp) and backward (dQ, dK, dV), fp32, bf16 and fp16.

Output buffers are NaN-poisoned before each launch (andrea.cuda.emulator does it), so an
element a kernel fails to write fails the comparison. The bf16 and fp16 paths run the
tensor-core code (ldmatrix / mma.sync fragment bookkeeping) through its emulated
warp-collective bodies; fp16's sm_75 (two m16n8k8 a step) and sm_70 (scalar) paths run from
builds of their own. `python scripts/kernel_errors.py` prints the errors per case.
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
from andrea.cuda.attention import DTYPE_NAMES
from andrea.errors import UserError

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="the CPU kernel emulator needs g++, which is not on PATH"
)

# Relative to max(|reference|, 1). fp16 (unit roundoff u = 2^-11): an output element goes
# through at most two roundings to fp16 (P or dS into the A operand of the second product, then
# the result), each at most u relative; the dS-weighted sums of dQ and dK cancel, so their
# largest term can reach about twice the largest result: 2 x 2u = 2^-9. Inputs are fp16
# already (the reference uses them as rounded); float32 accumulation adds ~T x 2^-24. Measured:
# at most 1.8u (kernels/README.md). bf16's 1e-2 is 2.6 of its u = 2^-8 by the same reckoning.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2.0**-9}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SEQ_LENS = (1, 17, 64, 100, 129)
CASES = [
    (dtype, d, t, bh)
    for dtype in DTYPES
    for d in (32, 64)
    for t, bh in zip(SEQ_LENS, [(2, 3), (1, 2), (2, 1), (1, 3), (1, 2)], strict=True)
] + [(dtype, 128, 33, (1, 2)) for dtype in DTYPES] + [
    (dtype, 32, 5, (2, 16)) for dtype in DTYPES  # B*H = 32 blocks along grid.y
]


@pytest.fixture(scope="module")
def emulator() -> kernel_emulator.Emulator:
    background.result("emulator")
    return kernel_emulator.default_emulator()


reference = kernel_emulator.float64_reference

# The output rows' bounds check; a copy of the kernel file whose check stops a row short stores
# no last row.
ROW_BOUNDS = "if (row >= seq_len) continue;  // bounds: no rows past the sequence"


def row_skipping_kernel() -> str:
    text = kernel_emulator.kernel_source()
    assert text.count(ROW_BOUNDS) == 1
    return text.replace(ROW_BOUNDS, ROW_BOUNDS.replace("seq_len", "seq_len - 1"))


# Built on a low-priority thread from the session's start (tests/background.py).
if shutil.which("g++"):
    for _arch, _defines in kernel_emulator.HALF_ARCH_DEFINES.items():
        background.declare(
            f"emulator-half-{_arch}", functools.partial(kernel_emulator.build_library,
                                                        defines=_defines),
            wanted_by=["test_kernel_numerics.py::test_half_paths_of_older_archs_match_float64"])
    background.declare(
        "emulator-row-skipping", lambda: kernel_emulator.build_library(row_skipping_kernel()),
        wanted_by=["test_kernel_numerics.py::test_poisoned_outputs_expose_an_unwritten_row"])


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert not torch.isnan(got).any(), f"{name}: elements left unwritten (NaN poison)"
    err = kernel_emulator.max_error(got, want)
    assert err <= tol, f"{name}: max error {err:.3g} of max(|ref|, 1) > {tol:.3g}"


def random_inputs(b, h, t, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=gen).to(dtype) for _ in range(4)]


@pytest.mark.parametrize(
    "dtype,head_dim,seq_len,bh", CASES, ids=lambda x: str(x).replace("torch.", "")
)
def test_forward_backward_match_float64(emulator, dtype, head_dim, seq_len, bh) -> None:
    b, h = bh
    q, k, v, dout = random_inputs(b, h, seq_len, head_dim, dtype, seed=seq_len * 7 + head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    o, lse = kernel_emulator.attention_forward(q, k, v, emulator=emulator)
    dq, dk, dv = kernel_emulator.attention_backward(q, k, v, o, lse, dout, emulator=emulator)
    ro, rlse, rdq, rdk, rdv = reference(q, k, v, dout, scale)
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, h, seq_len)
    tol = TOL[dtype]
    assert_close("o", o, ro, tol)
    assert_close("lse", lse, rlse, 1e-5)  # float32 statistics in both paths
    assert_close("dq", dq, rdq, tol)
    assert_close("dk", dk, rdk, tol)
    assert_close("dv", dv, rdv, tol)


def test_custom_scale_and_reference_gradients_use_it(emulator) -> None:
    q, k, v, dout = random_inputs(1, 2, 40, 32, torch.float32, seed=3)
    o, lse = kernel_emulator.attention_forward(q, k, v, scale=0.3, emulator=emulator)
    dq, dk, dv = kernel_emulator.attention_backward(q, k, v, o, lse, dout, 0.3, emulator)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv),
                               reference(q, k, v, dout, 0.3), strict=True):
        assert_close(name, got, want, 1e-5)


def test_fibers_and_threads_agree_bit_for_bit(emulator) -> None:
    q, k, v, dout = random_inputs(1, 2, 70, 64, torch.bfloat16, seed=5)
    results = []
    for mode in ("fibers", "threads"):
        o, lse = kernel_emulator.attention_forward(q, k, v, emulator=emulator, mode=mode)
        grads = kernel_emulator.attention_backward(q, k, v, o, lse, dout, emulator=emulator,
                                                   mode=mode)
        results.append((o, lse, *grads))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_launch_config_matches_the_kernel_file(emulator) -> None:
    """TILES, PRODUCTION_MIN_BLOCKS and PRODUCTION_PASSES (the table's home) against what the
    compiler makes of kernels/attn_tiles.cuh: a change to one and not the other fails here."""
    names = emulator.kernel_names()
    assert sorted(names) == sorted(kernel_launch.all_name_expressions())
    for (dtype, d), kinds in kernel_launch.TILES.items():
        for kind, (warps, n) in kinds.items():
            kernel = kind if kind == "fwd" else f"bwd_{kind}"
            name = kernel_launch.name_expression(kernel, dtype, d)
            smem = kernel_launch.static_shared_bytes(kernel, dtype, d)
            min_blocks = kernel_launch.PRODUCTION_MIN_BLOCKS.get((dtype, d, kind), 0)
            passes = kernel_launch.PRODUCTION_PASSES.get((dtype, d), 1) if kind == "dkdv" else 1
            assert emulator.kernel_info(name) == (warps, n, smem, min_blocks, passes), name
            assert smem <= kernel_launch.STATIC_SHARED_LIMIT
    assert set(kernel_launch.PRODUCTION_PASSES) <= set(kernel_launch.TILES)
    assert {k[:2] for k in kernel_launch.PRODUCTION_MIN_BLOCKS} <= set(kernel_launch.TILES)
    launches = kernel_launch.attention_launches(8, 12, 1024, 64, "bfloat16")
    assert launches["fwd"].grid == (16, 96, 1) and launches["fwd"].block == (128, 1, 1)
    assert launches["bwd_preprocess"].grid == (768, 1, 1)
    assert list(launches) == ["fwd", "bwd_preprocess", "bwd_dq", "bwd_dkdv"]


NAIVE_CASES = [
    (dtype, d, t, bh)
    for dtype in DTYPES
    for d in (32, 64)
    for t, bh in ((1, (2, 2)), (17, (1, 2)), (100, (1, 1)))
]


@pytest.mark.parametrize(
    "dtype,head_dim,seq_len,bh", NAIVE_CASES, ids=lambda x: str(x).replace("torch.", "")
)
def test_naive_baseline_matches_float64(emulator, dtype, head_dim, seq_len, bh) -> None:
    """The naive one-block-per-(batch, head) kernels, through the launcher the GPU path uses."""
    from andrea.cuda.attention import EmulatorLauncher, attention_backward, attention_forward

    b, h = bh
    launcher = EmulatorLauncher(emulator)
    q, k, v, dout = random_inputs(b, h, seq_len, head_dim, dtype, seed=seq_len * 5 + head_dim)
    scale = 0.7 / math.sqrt(head_dim)  # not the default: the kernels must use the argument
    o, lse = attention_forward(q, k, v, scale, launcher, poison=True, naive=True)
    dq, dk, dv = attention_backward(q, k, v, o, lse, dout, scale, launcher, poison=True,
                                    naive=True)
    ro, rlse, rdq, rdk, rdv = reference(q, k, v, dout, scale)
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, h, seq_len)
    tol = TOL[dtype]
    assert_close("o", o, ro, tol)
    assert_close("lse", lse, rlse, 1e-5)
    assert_close("dq", dq, rdq, tol)
    assert_close("dk", dk, rdk, tol)
    assert_close("dv", dv, rdv, tol)


def test_naive_launches_are_one_block_per_batch_head(emulator) -> None:
    launches = kernel_launch.naive_attention_launches(8, 12, 1024, 64, "bfloat16")
    assert list(launches) == ["fwd", "bwd_preprocess", "bwd_dq", "bwd_dkdv"]
    for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        launch = launches[kernel]
        assert launch.grid == (96, 1, 1) and launch.block == (kernel_launch.NAIVE_THREADS, 1, 1)
        assert launch.name.endswith("_naive<bf16_t, 64>")
        assert emulator.kernel_info(launch.name) == (kernel_launch.NAIVE_THREADS // 32, 0, 0,
                                                     0, 1)
    regular = kernel_launch.attention_launches(8, 12, 1024, 64, "bfloat16")
    assert launches["bwd_preprocess"] == regular["bwd_preprocess"]


@pytest.mark.parametrize("head_dim", [16, 72, 96, 256])
def test_unsupported_head_dim_is_refused(head_dim) -> None:
    with pytest.raises(UserError, match=rf"head_dim={head_dim} .*32, 64, 128"):
        kernel_launch.check_head_dim(head_dim)
    with pytest.raises(UserError):
        kernel_launch.attention_launches(1, 1, 8, head_dim, "bfloat16")


def test_poisoned_outputs_expose_an_unwritten_row() -> None:
    background.result("emulator-row-skipping")
    emu = kernel_emulator.Emulator(row_skipping_kernel())
    q, k, v, _ = random_inputs(1, 1, 17, 32, torch.float32, seed=1)
    o, _ = kernel_emulator.attention_forward(q, k, v, emulator=emu)
    with pytest.raises(AssertionError, match="unwritten"):
        assert_close("o", o, reference(q, k, v, torch.zeros_like(q), 1 / math.sqrt(32))[0], 1e-5)
    assert torch.isnan(o[0, 0, -1]).all() and not torch.isnan(o[0, 0, :-1]).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("d", kernel_launch.SUPPORTED_HEAD_DIMS)
def test_preprocess_row_sums_match_float64(emulator, dtype, d) -> None:
    """delta = rowsum(dO * O) from the coalesced kernel (a group of threads per row, shuffle
    transpose-reduce): 300 rows = two full blocks of 128 and a tail, every row checked."""
    b, h, t = 1, 3, 100
    o, dout = random_inputs(b, h, t, d, dtype, seed=d)[:2]
    launch = kernel_launch.attention_launches(b, h, t, d, DTYPE_NAMES[dtype])
    delta = torch.full((b, h, t), math.nan)
    emulator.launch(launch["bwd_preprocess"], o, dout, delta, b * h * t)
    want = (o.double() * dout.double()).sum(-1)
    assert_close("delta", delta, want, 1e-6)


def conversion_inputs(dtype: torch.dtype, edge: list[float],
                      exponents: tuple[int, int]) -> torch.Tensor:
    """Floats where rounding to the 16-bit `dtype` decides: every finite value, the exact ties
    between neighbours (round to even) and a float ulp either side of each, the overflow edge
    (`edge`), random floats of every magnitude (times 2^e, e in `exponents`)."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = values[torch.isfinite(values)].double().unique()  # sorted, -0 folded into 0
    ties = ((finite[1:] + finite[:-1]) / 2).float()  # exact in float32
    near = [ties, torch.nextafter(ties, torch.tensor(math.inf)),
            torch.nextafter(ties, torch.tensor(-math.inf))]
    rand = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 2.0 ** torch.randint(
        *exponents, (100_000,), generator=torch.Generator().manual_seed(1))
    return torch.cat([finite.float(), *near, torch.tensor(edge), rand])


def half_conversion_inputs() -> torch.Tensor:
    return conversion_inputs(torch.float16, [65504.0, 65519.99, 65520.0, 65536.0, 1e30, math.inf,
                                             -math.inf, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26,
                                             2.0**-14, -0.0, 0.0], (-30, 20))


def float_bits(*bits: int) -> torch.Tensor:
    """float32 values of the given bit patterns."""
    return torch.tensor([b - 2**32 if b >= 2**31 else b for b in bits],
                        dtype=torch.int32).view(torch.float32)


def test_half_conversions_match_torch_bit_for_bit(emulator) -> None:
    """The .cu file's float -> fp16 (integer round to nearest even, overflow to inf, subnormals)
    and fp16 -> float against torch's conversions (IEEE), on every fp16 bit pattern and every
    rounding tie; NaN stays NaN."""
    x = half_conversion_inputs()
    got, want = emulator.to_half(x), x.to(torch.float16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    nan = emulator.to_half(torch.tensor([math.nan, -math.nan]))
    assert torch.isnan(nan).all()
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    back, want_back = emulator.from_half(every), every.float()
    is_nan = torch.isnan(want_back)
    assert torch.equal(torch.isnan(back), is_nan) and is_nan.sum() == 2 * 1023
    assert torch.equal(back[~is_nan].view(torch.int32), want_back[~is_nan].view(torch.int32))


def test_bf16_conversion_matches_torch_bit_for_bit(emulator) -> None:
    """The .cu file's float -> bf16 (bf16_bits: from_float<bf16_t>, the dS buffer's stores,
    and pack2 wherever it is not sm_80+'s cvt.rn.bf16x2, which must give the same bits: P, dS
    and every output on the emulator) against torch's round to nearest even, on every bf16
    value, every tie between neighbours and a float ulp either side of it, the overflow edge,
    subnormals and random floats of every magnitude; a NaN stays NaN whatever its payload. A
    tie rounded the wrong way moves an element by one ulp, which the float64 comparisons'
    tolerance does not see."""
    edge = [*float_bits(0x7F7F8000, 0x7F7F7FFF, 0x00008000, 0x00018000, 0x80008000).tolist(),
            3.4028234663852886e38, 1e-45, math.inf, -math.inf, -0.0, 0.0]
    x = conversion_inputs(torch.bfloat16, edge, (-140, 128))
    got, want = emulator.to_bf16(x), x.to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    nan = float_bits(0x7F800001, 0xFF800001, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF)
    assert torch.isnan(emulator.to_bf16(nan).float()).all()


@pytest.fixture(scope="module")
def half_path_results(emulator) -> dict:
    """fp16 fwd + bwd at three shapes (one per tile family) on the default build (sm_80's path)
    and on builds of sm_75's and sm_70's paths (ANDREA_HALF_ARCH)."""
    shapes = [(32, 17, (1, 2)), (64, 100, (1, 3)), (128, 33, (1, 2))]
    for arch in kernel_emulator.HALF_ARCH_DEFINES:
        background.result(f"emulator-half-{arch}")
    builds = {800: emulator, **{arch: kernel_emulator.Emulator(defines=defines)
                                for arch, defines in kernel_emulator.HALF_ARCH_DEFINES.items()}}
    results = {}
    for arch, emu in builds.items():
        for d, t, (b, h) in shapes:
            q, k, v, dout = random_inputs(b, h, t, d, torch.float16, seed=t * 7 + d)
            o, lse = kernel_emulator.attention_forward(q, k, v, emulator=emu)
            grads = kernel_emulator.attention_backward(q, k, v, o, lse, dout, emulator=emu)
            results[arch, d] = ((o, lse, *grads), reference(q, k, v, dout, d**-0.5))
    return results


@pytest.mark.parametrize("arch", sorted(kernel_emulator.HALF_ARCH_DEFINES))
def test_half_paths_of_older_archs_match_float64(half_path_results, arch) -> None:
    for d in kernel_launch.SUPPORTED_HEAD_DIMS:
        got, want = half_path_results[arch, d]
        for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want, strict=True):
            assert_close(f"sm_{arch // 10} D={d} {name}", g, w, 1e-5 if name == "lse" else
                         TOL[torch.float16])
        default = half_path_results[800, d][0]
        # sm_75's two k8 steps add in sm_80's k16 order: the same bits. sm_70's path keeps P and
        # dS in float: other bits (so that build really took its own path).
        same = all(torch.equal(a, b) for a, b in zip(got, default, strict=True))
        assert same == (arch == 750), f"sm_{arch // 10} D={d}"
