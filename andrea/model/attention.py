"""Causal attention over all heads at once: model.attention's backends, one object each.

`BACKENDS` holds model.attention's values (its allowed values are this registry's names,
`register_choices`). A model resolves its backend once (`resolve`: `auto` to the one that runs
here, `cuda` refused where its kernels cannot run) and calls that backend's `run(q, k, v,
dropout_p)` with q, k, v of shape [B, n_head, T, head_dim], never knowing which implementation
runs:

- "sdpa": torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient / math,
  whichever PyTorch picks for the device).
- "math": the explicit formula softmax(q kᵀ / √head_dim + mask) v with the softmax in float32
  (float64 when the inputs are float64). The reference the others are checked against.
- "cuda": the project's own kernels (kernels/microgpt_cuda.cu) through CuPy; see cuda_attention.py.
- "auto": none of its own; which one runs here is `AutoAttention.resolve`'s (one place), by
  the measured table AUTO_TABLE.

With a key/value cache the queries are the last Tq of Tk positions, so the causal mask is aligned
to the bottom-right: query i may see keys 0 .. Tk - Tq + i.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from andrea.config import register_choices
from andrea.errors import UserError


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """Reference causal attention. q [B, H, Tq, D], k/v [B, H, Tk, D] -> [B, H, Tq, D]."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    tq, tk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    att = (q.to(compute) @ k.to(compute).transpose(-2, -1)) * scale  # [B, H, Tq, Tk]
    # Query i sits at absolute position tk - tq + i and sees keys up to and including it.
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
    att = att.masked_fill(~mask, float("-inf"))
    att = torch.softmax(att, dim=-1)
    if dropout_p > 0.0:
        att = F.dropout(att, p=dropout_p)
    return (att @ v.to(compute)).to(q.dtype)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    tq, tk = q.shape[-2], k.shape[-2]
    if tq == tk:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if tq == 1:  # one new token with a cache: it sees every key
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    # is_causal aligns the mask top-left; a cache needs it bottom-right.
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def cuda_or_sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """The "cuda" backend: andrea's kernels where they apply, else PyTorch's attention."""
    from andrea.cuda.attention import cuda_attention

    if q.shape[-2] != k.shape[-2] or dropout_p > 0.0:
        # The kernels cover full causal self-attention without dropout; cached decoding
        # and attention dropout take the PyTorch path.
        return sdpa_attention(q, k, v, dropout_p)
    # The kernels read row-major [B, n_head, T, head_dim]: the model's heads are strided views
    # of its QKV projection, and a prefill's k and v views of a longer cache.
    return cuda_attention(q.contiguous(), k.contiguous(), v.contiguous())


def cuda_unavailable_reason(head_dim: int, device: torch.device) -> str | None:
    """Why the CUDA kernels cannot run here, or None when they can."""
    if device.type != "cuda":
        return "no GPU: the CUDA kernels need one"
    from andrea.cuda.launch import SUPPORTED_HEAD_DIMS

    if head_dim not in SUPPORTED_HEAD_DIMS:
        dims = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
        return f"head_dim {head_dim} has no specialised CUDA kernel (supported: {dims})"
    try:
        import cupy
    except ImportError:
        return (
            "CuPy is not installed: pip install -e '.[cuda]' (cupy-cuda13x; "
            "CUDA 12 users: pip install cupy-cuda12x)"
        )
    try:
        import andrea.cuda.attention  # noqa: F401
    except ImportError as exc:
        return f"the CUDA attention runtime failed to import: {exc}"
    try:
        # A CuPy built for another CUDA major version imports fine and fails here.
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no GPU"
        nvrtc_major = cupy.cuda.nvrtc.getVersion()[0]
    except Exception as exc:  # CuPy raises its own CUDARuntimeError, or ImportError for a lib
        return (
            f"CuPy cannot use the GPU ({type(exc).__name__}: {exc}); install the CuPy wheel "
            "for this CUDA version (cupy-cuda13x, or cupy-cuda12x for CUDA 12)"
        )
    from andrea.cuda.attention import device_arch
    from andrea.cuda.launch import arch_problem

    return arch_problem(device_arch(device), nvrtc_major)


@dataclass(frozen=True)
class AttentionBackend:
    """One value of model.attention: the function it runs, [B, H, T, D] in and out."""

    name: str
    run: Callable[..., torch.Tensor]
    # Runs none of its own: `resolve` picks one of the others (auto).
    picks_another: ClassVar[bool] = False

    def unavailable(self, head_dim: int, device: torch.device) -> str | None:
        """Why this backend cannot run here, or None when it can."""
        return None

    def resolve(
        self, head_dim: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[AttentionBackend, str]:
        """The backend that runs for this value on `device` in `dtype`, and why; asked for by
        name, it runs or is refused in one line."""
        problem = self.unavailable(head_dim, device)
        if problem is not None:
            raise UserError(f"model.attention: {self.name} cannot run: {problem}")
        return self, "model.attention"


class CudaBackend(AttentionBackend):
    def unavailable(self, head_dim: int, device: torch.device) -> str | None:
        return cuda_unavailable_reason(head_dim, device)


def _unresolved(*args: object, **kwargs: object) -> torch.Tensor:
    raise ValueError("unknown attention backend 'auto'; expected sdpa, math or cuda")


@dataclass(frozen=True)
class Measured:
    """One entry of auto's table: the backend `auto` runs, and the measurement that chose it."""

    backend: str  # a name in BACKENDS that runs itself (not auto)
    kernels_vs_sdpa: float  # SDPA's forward + backward time over andrea's kernels' (>1: faster)
    date: str  # of the docs/log.md entry that records the measurement


# `auto`'s choice on a GPU by (architecture as andrea.cuda.attention.device_arch names it,
# dtype, head_dim): measured entries only; anything else runs SDPA, "not measured on this GPU".
# sm_90 is both the H100's and the H200's. The float16 and float32 entries at head_dim 32 were
# measured on an H200 by `andrea bench` (forward + backward, B 8, H 12, T 256): docs/log.md,
# 2026-12-04, "the CUDA path on a GPU for the first time"; the others on an H100 by
# scripts/gpu_tune_attention.py with TUNED's lines in place (B 8 x T 1024 at head_dim 64, B 32 x
# T 256 at 32): docs/log.md, 2026-12-06, "the first GPU run of the speed script".
#
# From `scripts/gpu_tune_attention.py OUT` on a GPU: it prints these entries last, ready to
# paste ("AUTO_TABLE entries"): per measured (dtype, head_dim), SDPA's forward + backward time
# over the kernels' through the custom op (what training runs; the table's row "ours production
# (autograd)", OUT/tune.json's sdpa.default.fb / production_autograd.fb; where the run also
# printed a TUNED line for andrea/cuda/launch.py, "ours tuned (autograd)", tuned_autograd.fb,
# and the two lines go in together), "cuda" from 1.0 up. The date is the run's, that of the
# docs/log.md entry that records it.
AUTO_TABLE: dict[tuple[str, str, int], Measured] = {
    ("sm_90", "bfloat16", 64): Measured("sdpa", 0.42, "2026-12-06"),
    ("sm_90", "bfloat16", 32): Measured("sdpa", 0.52, "2026-12-06"),
    ("sm_90", "float16", 64): Measured("sdpa", 0.26, "2026-12-06"),
    ("sm_90", "float16", 32): Measured("sdpa", 0.19, "2026-12-04"),
    ("sm_90", "float32", 32): Measured("sdpa", 0.29, "2026-12-04"),
}


class AutoAttention(AttentionBackend):
    """`auto` runs what AUTO_TABLE says for this GPU, dtype and head_dim (SDPA where it says
    nothing, and on a CPU), so the kernels run by default only where they were measured to win."""

    picks_another: ClassVar[bool] = True

    def resolve(
        self, head_dim: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[AttentionBackend, str]:
        if device.type != "cuda":
            return BACKENDS["sdpa"], "auto: no GPU"
        from andrea.cuda.attention import device_arch

        arch, dtype_name = device_arch(device), str(dtype).removeprefix("torch.")
        where = f"auto: {arch} {dtype_name} head_dim {head_dim}"
        entry = AUTO_TABLE.get((arch, dtype_name, head_dim))
        if entry is None:
            return BACKENDS["sdpa"], f"{where}: not measured on this GPU"
        why = (f"{where}: andrea's kernels at {entry.kernels_vs_sdpa:.2f}x SDPA, measured "
               f"{entry.date}")
        chosen = BACKENDS[entry.backend]
        problem = chosen.unavailable(head_dim, device)
        if problem is not None:
            return BACKENDS["sdpa"], f"{why}; {chosen.name} cannot run here: {problem}"
        return chosen, why


BACKENDS: dict[str, AttentionBackend] = {backend.name: backend for backend in (
    AutoAttention("auto", _unresolved),
    CudaBackend("cuda", cuda_or_sdpa_attention),
    AttentionBackend("sdpa", sdpa_attention),
    AttentionBackend("math", math_attention),
)}
register_choices("model.attention", BACKENDS)  # its names are the key's allowed values
# The backends a checkpoint records as having run (trainer_state.json's attention): never one
# that picks another.
register_choices("trainer_state.attention", {name: backend for name, backend in BACKENDS.items()
                                             if not backend.picks_another})


def resolve_backend(
    requested: str, head_dim: int, device: torch.device, dtype: torch.dtype
) -> tuple[str, str]:
    """model.attention -> (the name of the backend to run in `dtype` on `device`, why)."""
    backend, why = BACKENDS[requested].resolve(head_dim, device, dtype)
    return backend.name, why


def recorded_backend_problem(name: str, head_dim: int, device: torch.device) -> str | None:
    """Why the backend a checkpoint recorded as having run (`name`) cannot run here, or None."""
    backend = BACKENDS.get(name)
    if backend is None or backend.picks_another:
        return f"{name} is not a backend of this andrea"
    return backend.unavailable(head_dim, device)
