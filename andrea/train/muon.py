"""Muon for the block matrices, AdamW for the rest, as one optimizer the trainer drives.

`train.optimizer: muon` splits the parameters (`split_parameters`): the 2-D weights inside the
transformer blocks (QKV, W_O, MLP up and down) go to `torch.optim.Muon`; the embeddings (and so the
tied LM head), the norms and any bias stay with AdamW, because orthogonalising an embedding table
or a vector has no meaning.

torch.optim.Muon (torch 2.13) always runs its Newton-Schulz iterations in bfloat16. On a CPU
without bfloat16 units that is more than 10x slower than float32 (DESIGN.md section 6), so
`Float32Muon` is the same optimizer, the same update rule and the same state, with the iterations
in a chosen dtype; `newton_schulz` reproduces torch's operation sequence exactly, so in bfloat16
it gives torch's bits.

`MuonAdamW` presents the two optimizers as one: param_groups and state over both, step,
zero_grad, state_dict and load_state_dict with one parameter numbering, so the checkpoint code
(checkpoint.optimizer_state / load_optimizer) handles it like a single AdamW.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from andrea.errors import UserError

MUON_MIN_TORCH = "2.9"


def require_muon() -> type[torch.optim.Optimizer]:
    """torch.optim.Muon, or a UserError naming this torch's version."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise UserError(
            f"train.optimizer: muon needs torch >= {MUON_MIN_TORCH} (this is "
            f"{torch.__version__}); upgrade torch or set train.optimizer=adamw"
        )
    return muon


def is_muon_matrix(name: str, p: nn.Parameter) -> bool:
    """A 2-D weight inside a transformer block: QKV, W_O, MLP up, MLP down."""
    name = name.replace("_orig_mod.", "").removeprefix("module.")
    return name.startswith("blocks.") and p.dim() == 2


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[tuple[str, nn.Parameter]]]:
    """(Muon's matrices, the rest as (name, parameter)) in the model's parameter order."""
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if is_muon_matrix(name, p):
            matrices.append(p)
        else:
            rest.append((name, p))
    return matrices, rest


def newton_schulz(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Approximate U Vᵀ of grad = U S Vᵀ by `steps` quintic iterations in `dtype`.

    The same operations in the same order as torch.optim._muon._zeropower_via_newtonschulz (which
    fixes dtype to bfloat16): transpose a tall matrix, scale to Frobenius norm 1, iterate
    X <- a X + (b A + c A²) X with A = X Xᵀ.
    """
    a, b, c = coefficients
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm = 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate scaling for a [rows, cols] matrix."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _muon_base() -> type[torch.optim.Optimizer]:
    # Without Muon in torch, a plain Optimizer base keeps this module importable; require_muon
    # refuses before any Float32Muon is built.
    return getattr(torch.optim, "Muon", torch.optim.Optimizer)


class Float32Muon(_muon_base()):  # type: ignore[misc]
    """torch.optim.Muon with the Newton-Schulz iterations in `ns_dtype` (float32 by default)."""

    def __init__(self, params: Any, ns_dtype: torch.dtype = torch.float32, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)
            lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p, grad, buf in zip(params, grads, buffers, strict=True):
                # torch's update rule, line for line: momentum as a lerp, Nesterov's look-ahead,
                # decoupled weight decay at the unscaled lr, the update at the shape-scaled lr.
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"],
                                       group["eps"], self.ns_dtype)
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def build_muon(params: list[nn.Parameter], lr: float, weight_decay: float, momentum: float,
               ns_dtype: torch.dtype) -> torch.optim.Optimizer:
    """torch.optim.Muon itself where its bfloat16 iterations are wanted, else Float32Muon."""
    muon = require_muon()
    kwargs = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True)
    if ns_dtype == torch.bfloat16:
        return muon(params, **kwargs)
    return Float32Muon(params, ns_dtype=ns_dtype, **kwargs)


class MuonAdamW:
    """Two optimizers, one interface. Parameters are numbered Muon's first, then AdamW's, as
    torch numbers the parameters of one optimizer holding both sets of groups."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw
        self.optimizers = (muon, adamw)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return {**self.muon.state, **self.adamw.state}

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def _count(self, opt: torch.optim.Optimizer) -> int:
        return sum(len(g["params"]) for g in opt.param_groups)

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]}
                       for g in sd["param_groups"]]
            offset += self._count(opt)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        offset = 0
        for opt in self.optimizers:
            count, n_groups = self._count(opt), len(opt.param_groups)
            own = groups[:n_groups]
            groups = groups[n_groups:]
            opt.load_state_dict({
                "state": {i - offset: s for i, s in state_dict["state"].items()
                          if offset <= i < offset + count},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in own],
            })
            offset += count
