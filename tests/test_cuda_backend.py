"""The "cuda" attention backend (andrea/cuda/attention.py), the backend choice, `andrea bench`.

On the CPU the custom op runs end to end with the emulator launcher (the same kernels,
compiled by g++), against a float64 reference. The tests marked `gpu` run the real CuPy path; they
skip, with the reason, where there is no GPU or no CuPy (scripts/gpu_check.sh runs them, selected
by their names: every GPU test is named test_gpu_*, and no other test is).
"""

from __future__ import annotations

import json
import math
import shutil
import sys

import background
import pytest
import torch
from conftest import andrea_main, assert_user_error

from andrea.cuda import attention as ca
from andrea.cuda import launch as kernel_launch
from andrea.errors import UserError
from andrea.model.attention import (
    AUTO_TABLE,
    BACKENDS,
    CudaBackend,
    Measured,
    cuda_unavailable_reason,
    math_attention,
    resolve_backend,
    sdpa_attention,
)
from andrea.train.flops import CPU_NO_MFU

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2.0**-9}  # test_kernel_numerics
needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="the CPU kernel emulator needs g++, which is not on PATH"
)


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no GPU visible to PyTorch (scripts/gpu_check.sh runs these on a GPU machine)"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install -e '.[cuda]')"
    return None


GPU_REASON = _gpu_reason()
gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")


def inputs(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device).to(dtype) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    return q, k, v, dout


def reference(q, k, v, dout):
    """float64 outputs and gradients on the same (already rounded) inputs: o, lse, dq, dk, dv."""
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    o = math_attention(qr, kr, vr)
    o.backward(dout.double())
    t = q.shape[-2]
    s = (qr.detach() @ kr.detach().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), -math.inf)
    return o.detach(), torch.logsumexp(s, -1), qr.grad, kr.grad, vr.grad


def assert_close(name, got, want, tol):
    assert not torch.isnan(got).any(), f"{name}: NaN (an element left unwritten?)"
    err = (got.double() - want).abs().max().item()
    bound = tol * max(want.abs().max().item(), 1.0)
    assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"


def assert_model_backends_agree(model: torch.nn.Module, x: torch.Tensor, device_type: str) -> None:
    """The whole model under bf16 autocast: the cuda backend's loss and a weight gradient
    against SDPA's."""
    results = {}
    for backend in ("sdpa", "cuda"):
        model.set_attention_backend(backend)
        model.zero_grad()
        with torch.autocast(device_type, dtype=torch.bfloat16):
            _, loss = model(x, x)
        loss.backward()
        results[backend] = (loss.item(), model.blocks[0].attn.qkv.weight.grad.clone())
    assert results["cuda"][0] == pytest.approx(results["sdpa"][0], rel=1e-3)
    assert_close("qkv grad", results["cuda"][1], results["sdpa"][1].double(), 3e-2)


def run_function(q, k, v, dout, launcher):
    out = ca.cuda_attention(q, k, v, launcher=launcher)
    saved = out.grad_fn.saved_tensors
    out.backward(dout)
    return out, saved


# --- the autograd Function on the CPU, through the emulated kernels ------------------------


@pytest.fixture(scope="module")
def emu():
    background.result("emulator")
    return ca.EmulatorLauncher()


CPU_CASES = [  # dtype, (B, H, T, D): odd T everywhere, one T=1, both head dims of the presets
    (torch.float32, (1, 2, 17, 64)),
    (torch.bfloat16, (2, 1, 33, 64)),
    (torch.float32, (2, 3, 1, 32)),
    (torch.bfloat16, (1, 2, 71, 32)),
    (torch.float16, (1, 2, 40, 64)),
]


@needs_gxx
@pytest.mark.parametrize("dtype,shape", CPU_CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_function_forward_backward_match_float64(emu, dtype, shape) -> None:
    q, k, v, dout = inputs(shape, dtype, seed=sum(shape))
    out, saved = run_function(q, k, v, dout, emu)
    ro, rlse, rdq, rdk, rdv = reference(q, k, v, dout)
    assert out.dtype == dtype and out.shape == q.shape
    for name, got, want in (("o", out, ro), ("dq", q.grad, rdq), ("dk", k.grad, rdk),
                            ("dv", v.grad, rdv)):
        assert got.dtype == dtype
        assert_close(name, got.detach(), want, TOL[dtype])
    # Saved for the backward: q, k, v, O and the float32 log-sum-exp; nothing of size T x T.
    b, h, t, d = shape
    assert [tuple(s.shape) for s in saved] == [(b, h, t, d)] * 4 + [(b, h, t)]
    assert torch.equal(saved[3], out.detach()) and saved[4].dtype == torch.float32
    assert_close("lse", saved[4], rlse, 1e-5)


@needs_gxx
def test_function_matches_sdpa_and_strided_upstream_gradient(emu) -> None:
    # As in the model: heads merged by a transpose, so the incoming gradient is not contiguous.
    q, k, v, _ = inputs((2, 2, 40, 64), torch.float32, seed=5)
    w = torch.randn(2 * 64, 3, generator=torch.Generator().manual_seed(1))

    def loss(fn, q, k, v):
        y = fn(q, k, v).transpose(1, 2).reshape(2, 40, 2 * 64)
        return (y @ w).square().sum()

    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    loss(lambda *a: ca.cuda_attention(*a, launcher=emu), q, k, v).backward()
    ref = loss(sdpa_attention, qs, ks, vs)
    ref.backward()
    for name, got, want in (("dq", q.grad, qs.grad), ("dk", k.grad, ks.grad),
                            ("dv", v.grad, vs.grad)):
        assert_close(name, got, want.double(), 1e-5)


@needs_gxx
@pytest.mark.parametrize("via_op", [False, True], ids=["eager", "op"])
def test_upstream_gradient_at_an_unaligned_offset(emu, via_op) -> None:
    """The output concatenated after one float: its gradient arrives as a contiguous view 4 bytes
    into the concatenation's, a pointer the kernels cannot read 16 bytes at a time. The backward
    copies it rather than refusing the user's graph (it raised a ValueError before), in the eager
    path and in the op a compiled graph calls."""
    q, k, v, _ = inputs((1, 2, 24, 32), torch.float32, seed=7)
    w = torch.randn(1 + q.numel(), generator=torch.Generator().manual_seed(3)).double()

    def loss(fn, q, k, v):
        flat = torch.cat([q.new_ones(1), fn(q, k, v).reshape(-1)])
        return (flat.double() * w).sum()

    def ours(q, k, v):
        if via_op:
            return ca.causal_attention_op(q, k, v, 32 ** -0.5, ca._launcher_index(emu), False)[0]
        return ca.cuda_attention(q, k, v, launcher=emu)

    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    loss(ours, q, k, v).backward()
    loss(sdpa_attention, qs, ks, vs).backward()
    for name, got, want in (("dq", q.grad, qs.grad), ("dk", k.grad, ks.grad),
                            ("dv", v.grad, vs.grad)):
        assert_close(name, got, want.double(), 1e-5)


@needs_gxx
def test_eager_path_and_the_compiled_graphs_op_give_the_same_bits(emu) -> None:
    """Outside torch.compile the model's call skips the custom op's Python dispatch; inside, a
    compiled graph calls the op. Both must run the same launches: the same O and gradients to the
    bit, the default scale included (a run that compiles some steps is one run)."""
    q, k, v, _ = inputs((2, 3, 37, 32), torch.bfloat16, seed=11)
    dout = torch.randn(2, 37, 3, 32, generator=torch.Generator().manual_seed(2)).to(q.dtype)
    results = []
    for via_op in (False, True):
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
        if via_op:
            o, _ = ca.causal_attention_op(qs, ks, vs, 32 ** -0.5, ca._launcher_index(emu), False)
        else:
            o = ca.cuda_attention(qs, ks, vs, launcher=emu)
        o.backward(dout.transpose(1, 2))  # strided, as the head merge's gradient is
        results.append((o.detach(), qs.grad, ks.grad, vs.grad))
    for name, eager, op in zip(("o", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(eager, op), name


@needs_gxx
def test_poisoned_outputs_are_all_written(emu) -> None:
    q, k, v, dout = (x.detach() for x in inputs((1, 2, 50, 32), torch.bfloat16, seed=3))
    o, lse = ca.attention_forward(q, k, v, launcher=emu, poison=True)
    grads = ca.attention_backward(q, k, v, o, lse, dout, launcher=emu, poison=True)
    for t in (o, lse, *grads):
        assert torch.isfinite(t).all()


@needs_gxx
def test_model_trains_through_the_function_like_sdpa(emu, monkeypatch) -> None:
    """The whole model with attention "cuda" (emulated kernels) under bf16 autocast vs "sdpa"."""
    from andrea.config import load_config
    from andrea.model.transformer import Andrea

    monkeypatch.setattr(ca, "default_launcher", lambda device: emu)
    cfg = load_config("andrea-tiny", ["model.head_dim=32", "model.block_size=48"]).model
    torch.manual_seed(0)
    model = Andrea(cfg)
    x = torch.randint(cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    assert_model_backends_agree(model, x, "cpu")


@needs_gxx
def test_activation_checkpointing_recomputes_the_same_attention(emu, monkeypatch) -> None:
    """train.activation_checkpointing=blocks runs each block's forward again in the backward,
    the attention's saved tensors with it: the gradients are those of a plain backward, to the
    bit."""
    from andrea.config import load_config
    from andrea.model.transformer import Andrea

    monkeypatch.setattr(ca, "default_launcher", lambda device: emu)
    cfg = load_config("andrea-tiny", ["model.head_dim=32", "model.block_size=24"]).model
    torch.manual_seed(0)
    model = Andrea(cfg, attention_backend="cuda")
    x = torch.randint(cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    grads = []
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        model.checkpoint_blocks = recompute
        model(x, x)[1].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@needs_gxx
def test_cache_prefill_through_the_cuda_backend_matches_sdpa(emu, monkeypatch) -> None:
    """A prefill's k/v are the first T positions of a longer [B, H, max_len, D] cache: strided
    views, which the "cuda" backend must accept (generate on a GPU runs exactly this)."""
    from andrea.model.attention import BACKENDS

    monkeypatch.setattr(ca, "default_launcher", lambda device: emu)
    q, k, v, _ = (x.detach() for x in inputs((1, 2, 9, 32), torch.float32, seed=7))
    cache_k, cache_v = torch.zeros(1, 2, 24, 32), torch.zeros(1, 2, 24, 32)
    cache_k[:, :, :9], cache_v[:, :, :9] = k, v
    kv, vv = cache_k[:, :, :9], cache_v[:, :, :9]
    assert not kv.is_contiguous()
    got = BACKENDS["cuda"].run(q, kv, vv)
    assert_close("o", got, sdpa_attention(q, k, v).double(), 1e-5)


def _aligned(shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    "make,error,fragment",
    [
        (lambda: [_aligned((1, 2, 8, 72))] * 3, UserError, "model.head_dim=72"),
        (lambda: [_aligned((1, 2, 8, 64), torch.float64)] * 3, UserError, "float64"),
        (lambda: [_aligned((1, 2, 8, 64)), _aligned((1, 2, 9, 64)), _aligned((1, 2, 8, 64))],
         ValueError, "k has shape (1, 2, 9, 64)"),
        (lambda: [_aligned((1, 2, 8, 64)), _aligned((1, 2, 8, 64), torch.bfloat16),
                  _aligned((1, 2, 8, 64))], ValueError, "k is torch.bfloat16"),
        (lambda: [_aligned((1, 8, 2, 64)).transpose(1, 2)] * 3, ValueError, "not contiguous"),
        (lambda: [torch.zeros(1 + 2 * 8 * 64)[1:].view(1, 2, 8, 64)] * 3, ValueError, "aligned"),
        (lambda: [_aligned((65536, 1, 1, 32))] * 3, UserError, "batch*n_head=65536"),
        (lambda: [_aligned((2, 8, 64))] * 3, ValueError, "4-d"),
    ],
    ids=["head_dim", "dtype", "shape", "mixed-dtype", "strides", "alignment", "grid", "rank"],
)
def test_invalid_inputs_are_refused_before_any_launch(make, error, fragment) -> None:
    class NoLaunch:
        device_type = "cpu"

        def launch(self, *args):
            raise AssertionError("validation must fail before a launch")

    q, k, v = make()
    with pytest.raises(error) as info:
        ca.cuda_attention(q, k, v, launcher=NoLaunch())
    assert fragment in str(info.value)


def test_cpu_tensors_without_a_launcher_say_they_need_a_gpu(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # and CuPy is never imported for this
    q = torch.zeros(1, 1, 4, 64)
    with pytest.raises(ValueError, match="needs CUDA tensors, got device cpu"):
        ca.cuda_attention(q, q, q)


@pytest.mark.parametrize(("cupy_major", "raw_stream"), [(14, True), (14, False), (13, True)])
def test_cupy_launcher_compiles_once_and_launches_on_torch_stream(monkeypatch, cupy_major,
                                                                  raw_stream) -> None:
    """The CuPy launcher against a stand-in CuPy: options, name expressions, argument types,
    the in-process module cache and the stream (what a GPU run would get, minus the GPU).
    CuPy 14 wraps torch's stream with Stream.from_external (ExternalStream is deprecated there
    and warns at every launch); CuPy 13, which lacks it, with ExternalStream. The stream is
    torch's current one on the launcher's device, read as a raw handle where torch has that."""
    import numpy as np

    calls: dict[str, list] = {"modules": [], "launches": [], "streams": []}
    active: list[int] = []

    class Ctx:
        def __init__(self, value):
            self.value = value

        def __enter__(self):
            active.append(self.value)

        def __exit__(self, *exc):
            active.pop()

    class RawModule:
        def __init__(self, code, options, backend, name_expressions):
            calls["modules"].append((code, options, backend, tuple(name_expressions)))

        def compile(self):
            pass

        def get_function(self, name):
            def fn(grid, block, args, shared_mem, stream):
                calls["launches"].append((name, grid, block, args, shared_mem, list(active),
                                          stream.value))
            return fn

    fake = type(sys)("cupy")
    fake.RawModule = RawModule
    fake.cuda = type(sys)("cupy.cuda")
    fake.cuda.Device = lambda index: Ctx(("device", index))
    def external_stream(ptr):
        assert cupy_major == 13, "ExternalStream is deprecated in CuPy 14"
        calls["streams"].append(ptr)
        return Ctx(("stream", ptr))

    class Stream:
        @classmethod
        def from_external(cls, obj):
            version, ptr = obj.__cuda_stream__()  # the CUDA stream protocol
            assert version == 0
            calls["streams"].append(ptr)
            return Ctx(("stream", ptr))

    fake.cuda.ExternalStream = external_stream
    fake.cuda.Stream = Stream if cupy_major >= 14 else type("Stream", (), {})
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    if raw_stream:  # what torch has on a CUDA build: the handle without a Stream object
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                            lambda index: {1: 0xBEEF}[index], raising=False)
        monkeypatch.setattr(torch.cuda, "current_stream", None)
    else:
        monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type(
            "S", (), {"cuda_stream": {1: 0xBEEF}[device.index]})())
    monkeypatch.setattr(kernel_launch, "_MODULES", {})

    launches = kernel_launch.attention_launches(2, 3, 40, 64, "bfloat16")
    q = torch.zeros(2, 3, 40, 64, dtype=torch.bfloat16)
    for launcher in (ca.CupyLauncher(torch.device("cuda", 1)),
                     ca.CupyLauncher(torch.device("cuda", 1))):
        launcher.launch(launches["fwd"], q, q, q, q, q, 40, 0.125)
        launcher.launch(launches["bwd_dq"], q, q, q, q, q, q, q, 40, 0.125)
    (code, options, backend, names), = calls["modules"]  # compiled once for both launchers
    assert code == ca.kernel_source() and backend == "nvrtc"
    assert options == ("--std=c++17", "-arch=sm_90")
    assert names == ("attn_fwd<bf16_t, 64>", "attn_bwd_preprocess<bf16_t, 64>",
                     "attn_bwd_dq<bf16_t, 64>", "attn_bwd_dkdv<bf16_t, 64>")
    name, grid, block, args, shared, ctx, stream = calls["launches"][0]
    assert (name, grid, block, shared) == ("attn_fwd<bf16_t, 64>", launches["fwd"].grid,
                                           launches["fwd"].block, 0)
    assert ctx == [("device", 1)] and stream == ("stream", 0xBEEF)  # handed to the call
    assert [type(a) for a in args] == [int] * 5 + [np.int32, np.float32]
    assert int(args[0]) == q.data_ptr() and int(args[5]) == 40 and float(args[6]) == 0.125
    assert len(calls["launches"]) == 4
    assert calls["streams"] == [0xBEEF, 0xBEEF]  # one CuPy stream per launcher, not per launch
    for wrong in (True, "40", np.int32(40)):  # a bool or str is no kernel scalar; numpy's are
        with pytest.raises(TypeError, match="unsupported kernel argument"):  # converted by us
            launcher.launch(launches["fwd"], q, q, q, q, q, wrong, 0.125)


# --- backend choice ------------------------------------------------------------------------


def on_gpu(monkeypatch, capability: tuple[int, int]) -> torch.device:
    """A CUDA device of that compute capability, as far as backend choice asks (no GPU needed:
    nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return torch.device("cuda")


def test_auto_follows_the_measured_table(monkeypatch) -> None:
    """On a GPU `auto` runs what AUTO_TABLE says for its architecture, dtype and head_dim, with
    the measurement as its reason; today every entry (an H100's or an H200's) says SDPA."""
    h200 = on_gpu(monkeypatch, (9, 0))
    assert resolve_backend("auto", 64, h200, torch.bfloat16) == (
        "sdpa", "auto: sm_90 bfloat16 head_dim 64: andrea's kernels at 0.42x SDPA, "
                "measured 2026-12-06")
    assert resolve_backend("auto", 32, h200, torch.float32) == (
        "sdpa", "auto: sm_90 float32 head_dim 32: andrea's kernels at 0.29x SDPA, "
                "measured 2026-12-04")
    # An entry that says cuda runs the kernels where they can run, else SDPA with both reasons.
    monkeypatch.setitem(AUTO_TABLE, ("sm_90", "float16", 64), Measured("cuda", 1.25, "2027-01-01"))
    monkeypatch.setattr(CudaBackend, "unavailable", lambda self, head_dim, device: None)
    assert resolve_backend("auto", 64, h200, torch.float16) == (
        "cuda", "auto: sm_90 float16 head_dim 64: andrea's kernels at 1.25x SDPA, "
                "measured 2027-01-01")
    monkeypatch.setattr(CudaBackend, "unavailable", lambda self, head_dim, device: "no CuPy")
    backend, why = resolve_backend("auto", 64, h200, torch.float16)
    assert backend == "sdpa" and why.endswith("at 1.25x SDPA, measured 2027-01-01; cuda cannot "
                                              "run here: no CuPy")


def test_auto_runs_sdpa_where_nothing_was_measured(monkeypatch) -> None:
    assert resolve_backend("auto", 64, torch.device("cpu"), torch.bfloat16) == (
        "sdpa", "auto: no GPU")
    h200 = on_gpu(monkeypatch, (9, 0))
    assert resolve_backend("auto", 128, h200, torch.bfloat16) == (
        "sdpa", "auto: sm_90 bfloat16 head_dim 128: not measured on this GPU")
    a100 = on_gpu(monkeypatch, (8, 0))
    assert resolve_backend("auto", 64, a100, torch.bfloat16) == (
        "sdpa", "auto: sm_80 bfloat16 head_dim 64: not measured on this GPU")
    assert resolve_backend("math", 72, torch.device("cpu"), torch.float32) == (
        "math", "model.attention")


def test_every_auto_table_entry_is_a_backend_that_runs_itself() -> None:
    dtypes = {str(d).removeprefix("torch.") for d in TOL}
    for (arch, dtype, head_dim), entry in AUTO_TABLE.items():
        assert entry.backend in BACKENDS and not BACKENDS[entry.backend].picks_another, entry
        assert arch.startswith("sm_") and dtype in dtypes and head_dim > 0
        assert entry.kernels_vs_sdpa > 0 and len(entry.date) == len("2026-12-04")


def test_cuda_on_cpu_is_a_user_error_saying_no_gpu() -> None:
    with pytest.raises(UserError, match="model.attention: cuda cannot run: no GPU"):
        resolve_backend("cuda", 64, torch.device("cpu"), torch.float32)


def test_unsupported_head_dim_is_named() -> None:
    # device type "cuda" needs no real GPU here: the head_dim check comes before CuPy's.
    with pytest.raises(UserError, match=r"head_dim 72 has no specialised CUDA kernel"):
        resolve_backend("cuda", 72, torch.device("cuda"), torch.bfloat16)
    assert "head_dim 72" in cuda_unavailable_reason(72, torch.device("cuda"))


def test_missing_cupy_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(UserError) as info:
        resolve_backend("cuda", 64, torch.device("cuda"), torch.bfloat16)
    assert "pip install -e '.[cuda]'" in str(info.value) and "cupy-cuda12x" in str(info.value)
    assert "CuPy is not installed" in cuda_unavailable_reason(64, torch.device("cuda"))


def test_cupy_that_cannot_reach_the_gpu_is_reported(monkeypatch) -> None:
    class Runtime:
        @staticmethod
        def getDeviceCount():  # noqa: N802 (CuPy's name)
            raise RuntimeError("cudaErrorInsufficientDriver")

    fake = type(sys)("cupy")
    fake.cuda = type(sys)("cupy.cuda")
    fake.cuda.runtime = Runtime
    monkeypatch.setitem(sys.modules, "cupy", fake)
    why = cuda_unavailable_reason(64, torch.device("cuda"))
    assert "cudaErrorInsufficientDriver" in why and "cupy-cuda12x" in why


def test_a_gpu_older_than_cupys_nvrtc_falls_back_to_sdpa(monkeypatch) -> None:
    """A V100 (sm_70) with CuPy for CUDA 13, whose NVRTC has no sm_70 target any more."""
    fake = type(sys)("cupy")
    fake.cuda = type(sys)("cupy.cuda")
    fake.cuda.runtime = type("Runtime", (), {"getDeviceCount": staticmethod(lambda: 1)})
    fake.cuda.nvrtc = type("Nvrtc", (), {"getVersion": staticmethod(lambda: (13, 0))})
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    why = cuda_unavailable_reason(64, torch.device("cuda"))
    assert "NVRTC 13 cannot compile for sm_70" in why
    assert "cupy-cuda12x" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert cuda_unavailable_reason(64, torch.device("cuda")) is None  # a T4 is fine
    assert kernel_launch.arch_problem("sm_70", 12) is None  # CUDA 12's NVRTC still has it


# --- andrea bench --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_bench() -> str:
    """`andrea bench --quick --json` on the CPU, run once (about a minute on 2 cores): its
    stdout, for the JSON test and the table test alike."""
    proc = andrea_main("bench", "--quick", "--json", "--device", "cpu", "--shape", "andrea-12m",
                       "--preset", "andrea-tiny")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout


def test_bench_quick_json_on_cpu(quick_bench) -> None:
    from andrea.train.device import choose_precision

    result = json.loads(quick_bench)
    rows = {r["backend"]: r for r in result["attention"]}
    assert set(rows) == {"sdpa", "math"}
    for r in rows.values():
        assert (r["batch"], r["n_head"], r["seq_len"], r["head_dim"]) == (1, 12, 256, 32)
        # The dtype andrea-tiny trains in here (--quick times that one only).
        assert r["dtype"] == choose_precision("auto", torch.device("cpu")).name
        for mode in ("fwd", "bwd", "fwd_bwd"):
            assert 0 < r["ms"][mode] < 60_000
            assert 1 <= r["calls"][mode] <= 50  # back-to-back calls per timing
            # TFLOP/s is the causal FLOP count over the time: 2*B*H*T^2*D forward.
            flops = 2 * 12 * 256**2 * 32 * {"fwd": 1, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
            assert r["tflops"][mode] == pytest.approx(flops / (r["ms"][mode] * 1e-3) / 1e12)
    (train,) = result["train"]
    assert train["preset"] == "andrea-tiny" and train["backend"] == "sdpa"
    assert train["accumulation"] == 1  # --quick: one micro-batch a step, said in the docs
    assert train["tokens_per_s"] == pytest.approx(2 * 64 / (train["step_ms"] * 1e-3))
    assert any("cuda" in s and "no GPU" in s for s in result["skipped"])
    assert result["dtype_note"].startswith(f"attention dtype: {rows['sdpa']['dtype']}, ")


def test_bench_quick_table_on_cpu(quick_bench) -> None:
    """The default output form (the table) of the same measurement: what `andrea bench`
    prints without --json (cli.bench_cmd: format_table of the result)."""
    from andrea.bench import BenchResult, format_table

    lines = format_table(BenchResult.from_json(quick_bench)).splitlines()
    assert lines[0].startswith("device: cpu")
    rows = [line.split() for line in lines if line.startswith("andrea-12m ")]
    assert {row[3] for row in rows} == {"sdpa", "math"}
    # The sdpa row compares with itself: exactly 1.00x.
    assert next(row for row in rows if row[3] == "sdpa")[-1] == "1.00x"
    train = [line.split() for line in lines if line.startswith("andrea-tiny ")]
    assert len(train) == 1 and train[0][1] == "sdpa" and train[0][-1] == "n/a"
    assert float(train[0][-2].replace(",", "")) > 0  # tokens/s
    assert CPU_NO_MFU in lines  # why MFU is n/a, once
    assert any(line.startswith("skipped: ") and "cuda" in line for line in lines)


def test_bench_train_steps_the_optimizer_once_per_preset_batch(monkeypatch) -> None:
    """A benchmarked step is a training step of the preset: its global_batch_tokens as
    accumulated micro-batches, then one optimizer step (Muon's cost is per step)."""
    from andrea.bench import bench_train
    from andrea.config import load_config
    from andrea.model.transformer import Andrea
    from andrea.train import optim

    calls = {"forward": 0, "step": 0}
    forward, build = Andrea.forward, optim.build_optimizer

    def counted_forward(self, *args, **kwargs):
        calls["forward"] += 1
        return forward(self, *args, **kwargs)

    def counted_build(*args, **kwargs):
        optimizer = build(*args, **kwargs)
        step = optimizer.step

        def counted_step(*a, **k):
            calls["step"] += 1
            return step(*a, **k)

        optimizer.step = counted_step
        return optimizer

    monkeypatch.setattr(Andrea, "forward", counted_forward)
    monkeypatch.setattr(optim, "build_optimizer", counted_build)
    sets = ["train.optimizer=muon", "train.micro_batch_size=2", "train.global_batch_tokens=512",
            "train.precision=fp32"]
    cfg = load_config("andrea-tiny", sets)
    row = bench_train("andrea-tiny", "sdpa", torch.device("cpu"), 2, 1, sets)
    per_step = 512 // (2 * cfg.model.block_size)
    assert row.accumulation == per_step > 1
    assert calls["step"] >= 3 and calls["forward"] == per_step * calls["step"]
    assert row.tokens_per_s == pytest.approx(512 / (row.step_ms * 1e-3))


def test_bench_cuda_backend_on_cpu_is_a_one_line_error() -> None:
    proc = andrea_main("bench", "--backend", "cuda", "--device", "cpu")
    assert_user_error(proc, "--backend cuda", "no GPU")


# --- on a GPU: the real CuPy path ----------------------------------------------------------

GPU_CASES = [
    (dtype, shape)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for shape in ((2, 3, 1, 64), (2, 3, 129, 64), (1, 4, 1000, 64), (2, 2, 77, 32),
                  (1, 2, 300, 128))
]


@gpu
@pytest.mark.parametrize("dtype,shape", GPU_CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_gpu_matches_float64_and_sdpa(dtype, shape) -> None:
    q, k, v, dout = inputs(shape, dtype, device="cuda", seed=sum(shape))
    out, saved = run_function(q, k, v, dout, None)
    ro, rlse, rdq, rdk, rdv = reference(q, k, v, dout)
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    so = sdpa_attention(qs, ks, vs)
    so.backward(dout)
    for name, got, want, sdpa in (("o", out, ro, so), ("dq", q.grad, rdq, qs.grad),
                                  ("dk", k.grad, rdk, ks.grad), ("dv", v.grad, rdv, vs.grad)):
        assert_close(name, got.detach(), want, TOL[dtype])
        assert_close(f"{name} vs sdpa", got.detach(), sdpa.detach().double(), 2 * TOL[dtype])
    assert_close("lse", saved[4], rlse, 1e-5)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_gpu_poisoned_outputs_are_all_written(dtype) -> None:
    q, k, v, dout = (x.detach() for x in inputs((3, 2, 145, 64), dtype, device="cuda"))
    o, lse = ca.attention_forward(q, k, v, poison=True)
    grads = ca.attention_backward(q, k, v, o, lse, dout, poison=True)
    torch.cuda.synchronize()
    for t in (o, lse, *grads):
        assert torch.isfinite(t).all()


@gpu
def test_gpu_runs_on_the_current_torch_stream() -> None:
    q, k, v, _ = (x.detach() for x in inputs((4, 4, 512, 64), torch.bfloat16, device="cuda"))
    want = ca.cuda_attention(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = ca.cuda_attention(q, k, v)
        got2 = got * 1  # a torch op on the same stream reads the kernel's finished output
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(got2, want)


@gpu
def test_gpu_model_with_cuda_backend_matches_sdpa() -> None:
    from andrea.config import load_config
    from andrea.model.transformer import Andrea

    cfg = load_config("andrea-tiny", ["model.head_dim=64", "model.n_head=2"]).model
    torch.manual_seed(0)
    model = Andrea(cfg, attention_backend="sdpa").cuda()
    x = torch.randint(cfg.vocab_size, (4, cfg.block_size), device="cuda")
    assert_model_backends_agree(model, x, "cuda")
