"""Muon for the block matrices (AdamW, andrea/train/optim.py, takes the rest).

`train.optimizer: muon` splits the parameters (`split_parameters`): the 2-D weights inside the
transformer blocks (QKV, W_O, MLP up and down) go to `torch.optim.Muon`; the embeddings (and so the
tied LM head), the norms and any bias stay with AdamW, because orthogonalising an embedding table
or a vector has no meaning.

torch.optim.Muon (torch 2.13) always runs its Newton-Schulz iterations in bfloat16. On a CPU
without bfloat16 units that is more than 10x slower than float32 (docs/model.md), so
`Float32Muon` is the same optimizer, the same update rule and the same state, with the iterations
in a chosen dtype; in bfloat16 `newton_schulz` reproduces torch's operation sequence exactly, and so
its bits; in float32 it runs wide matrices' iterations in their Gram space, the same arithmetic
in fewer multiply-adds.

Under several processes (`build_muon(..., world_size > 1)`) `SplitMuon` shares the Newton-Schulz
work: each rank orthogonalises whole matrices for its share of them (`assign_owners`) and the
updates are exchanged, whether each rank holds every matrix (DDP) or row shards of them (FSDP2);
docs/training.md says why it is built this way.

train.optimizer: muon drives Muon and AdamW as one optimizer (optim.CombinedOptimizer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from andrea.errors import UserError
from andrea.train.parallel import bare_name
from andrea.train.sharding import is_dtensor

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
    return bare_name(name).startswith("blocks.") and p.dim() == 2


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[tuple[str, nn.Parameter]]]:
    """(Muon's matrices, the rest as (name, parameter)) in the model's parameter order."""
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if is_muon_matrix(name, p):
            matrices.append(p)
        else:
            rest.append((name, p))
    return matrices, rest


@dataclass(frozen=True)
class NewtonSchulzSchedule:
    """The iterations newton_schulz runs: each one's quintic (a, b, c), in order, and the
    margin the Frobenius norm is multiplied by before the matrix is scaled by it (None: the
    norm as it is)."""

    coefficients: tuple[tuple[float, float, float], ...]
    norm_margin: float | None = None

    @classmethod
    def quintic(cls, coefficients: tuple[float, float, float], steps: int
                ) -> NewtonSchulzSchedule:
        """`steps` iterations of one quintic: torch.optim.Muon's ns_coefficients, ns_steps."""
        return cls((coefficients,) * steps)

    @property
    def steps(self) -> int:
        return len(self.coefficients)


# The Polar Express paper's (arXiv:2505.16932) minimax-optimal odd quintic for each of 5
# iterations: the early ones push small singular values up hard, the late ones settle them at 1.
# Its polynomials are tuned for singular values in (0, 1]: a margin on the normalisation keeps
# bf16's rounding of the Frobenius norm from putting the largest a little above 1.
POLAR_EXPRESS = NewtonSchulzSchedule((
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
), norm_margin=1.02)


def newton_schulz(grad: torch.Tensor, schedule: NewtonSchulzSchedule, *, eps: float,
                  dtype: torch.dtype, gram: bool | None = None) -> torch.Tensor:
    """Approximate U Vᵀ of grad = U S Vᵀ by the schedule's quintic iterations in `dtype`.

    The iteration is torch.optim._muon._zeropower_via_newtonschulz's (which fixes dtype to
    bfloat16): transpose a tall matrix, scale to Frobenius norm 1 (the norm taken with the
    schedule's margin, if any), iterate X <- a X + (b A + c A²) X with A = X Xᵀ, each time with
    the schedule's next (a, b, c): one quintic `steps` times (NewtonSchulzSchedule.quintic),
    or POLAR_EXPRESS.

    grad: one matrix [rows, cols], or a stack [n, rows, cols] of matrices of one shape, each
    orthogonalised on its own through batched products (`newton_schulz_each`): on a GPU one
    launch a product for the stack instead of one per matrix. On a CPU a stack gives each matrix
    the bits it gets alone (tests/test_muon.py).

    gram: the same iteration in the [m, m] Gram space of the wide [m, n] matrix (`gram_iteration`),
    cheaper when n >= GRAM_MIN_RATIO * m. None picks it for float32 at such shapes; bfloat16 keeps
    torch's operations in torch's order (and so its bits), float64 the plain iteration a reference
    wants.
    """
    x = grad.to(dtype, copy=True)  # never the caller's tensor: it is scaled in place
    tall = grad.size(-2) > grad.size(-1)
    if tall:
        x = x.mT
    margin = schedule.norm_margin
    norm = _frobenius_norm(x)
    if margin is not None:
        norm = norm * margin
    x.div_(norm.clamp(min=eps))  # spectral norm <= Frobenius norm = 1
    if gram is None:
        gram = gram_pays(grad.shape[-2:], dtype)
    if gram and schedule.steps:
        x = gram_iteration(x, schedule)
    else:
        for a, b, c in schedule.coefficients:
            a_mat = x @ x.mT
            poly = _addmm(a_mat, a_mat, a_mat, beta=b, alpha=c)
            x = _addmm(x, poly, x, beta=a)
    return x.mT if tall else x


def _frobenius_norm(x: torch.Tensor) -> torch.Tensor:
    """The norm of a matrix, or of each matrix of a stack (shaped [n, 1, 1] to divide it)."""
    if x.dim() == 2:
        return x.norm()
    return torch.stack(torch._foreach_norm(list(x.unbind(0)))).view(-1, 1, 1)


def _addmm(input: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float,
           alpha: float = 1.0) -> torch.Tensor:
    """beta * input + alpha * (a @ b) in one operation, for matrices or stacks of them."""
    fused = torch.baddbmm if a.dim() == 3 else torch.addmm
    return fused(input, a, b, beta=beta, alpha=alpha)


def by_stacks(fn: Callable[[torch.Tensor, list[int]], torch.Tensor],
              tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fn over the tensors, those of one shape (dtype, device) as one stack [n, ...]: fn gets a
    stack, or a lone tensor as it is, with the indices it holds, and returns results in the
    same form. The results come back in the tensors' order. A transformer's matrices come in a
    few shapes, one of each per block: at ANDREA-12M Muon's 24 are 4 stacks, so a GPU step
    launches each operation 4 times, not 24 (scripts/step_op_counts.py)."""
    out: list[torch.Tensor] = list(tensors)
    by_shape: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        by_shape.setdefault((tuple(t.shape), t.dtype, t.device), []).append(i)
    for indices in by_shape.values():
        if len(indices) == 1:
            out[indices[0]] = fn(tensors[indices[0]], indices)
            continue
        results = fn(_stack([tensors[i] for i in indices]), indices)
        for i, result in zip(indices, results.unbind(0), strict=True):
            out[i] = result
    return out


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, keeping a transposed matrix transposed within the stack: a reduction then
    walks each matrix in the order it does alone, and gives its bits."""
    first = tensors[0]
    if first.dim() == 2 and first.stride(0) == 1 and first.stride(1) != 1:
        return torch.stack([t.mT for t in tensors]).mT
    return torch.stack(tensors)


def newton_schulz_each(updates: list[torch.Tensor], schedule: NewtonSchulzSchedule, *,
                       eps: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """newton_schulz of every matrix, those of one shape as one stack (by_stacks)."""
    return by_stacks(lambda x, _: newton_schulz(x, schedule, eps=eps, dtype=dtype), updates)


# In multiply-adds, 5 plain iterations on [m, n] cost 5 (2 n/m + 1) m³, the Gram form 17 m³ in
# all plus 2 n/m m³ (G, then Q x): even at n/m = 1.5, 0.56 of the plain cost at the MLP's 4 and
# 1.27 times it for a square W_O (measured the same, scripts/bench_newton_schulz.py). Below
# n/m = 2 it would save under a sixth, not worth ten times the plain iteration's rounding error.
GRAM_MIN_RATIO = 2


def gram_pays(shape: torch.Size | tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether newton_schulz takes the Gram form: float32, long side >= GRAM_MIN_RATIO x short."""
    return dtype == torch.float32 and max(shape) >= GRAM_MIN_RATIO * min(shape)


def newton_schulz_macs(shape: torch.Size | tuple[int, int], dtype: torch.dtype,
                       steps: int = 5) -> int:
    """Multiply-adds of newton_schulz's `steps` iterations on a [rows, cols] matrix in `dtype`,
    in whichever form it takes there (gram_pays): what a matrix costs to orthogonalise."""
    m, n = sorted(shape[:2])
    if gram_pays(shape, dtype):
        # G and Q x; each iteration b A + c A² and (a I + poly) Q, all but the last the next
        # A = Q G Q, the first none of the Q product.
        return 2 * m * m * n + (steps + (steps - 1) + 2 * (steps - 1)) * m ** 3
    return steps * (2 * m * m * n + m ** 3)  # X Xᵀ, b A + c A², poly X


def gram_iteration(x: torch.Tensor, schedule: NewtonSchulzSchedule) -> torch.Tensor:
    """The quintic iteration on a wide x [m, n], m <= n (or a stack of them), through its Gram
    matrix G = x xᵀ [m, m].

    Every iterate is Q x with Q a polynomial in G, so all of them commute with G and
    X Xᵀ = Q G Q: the loop needs only [m, m] products, and x [m, n] is touched twice (G, then
    Q x) instead of twice per iteration. Same arithmetic, other rounding: in float32 it follows
    the plain iteration's float64 result to 1e-4 relative (Polar Express: 1e-3) over a spread
    of 10⁸ between the largest and smallest singular value (tests/test_muon.py), where the plain
    float32 iteration gives 1e-5 and torch's bfloat16 1e-1.
    """
    g = x @ x.mT  # [m, m]; the first A
    a_mat, q = g, None
    for i, (a, b, c) in enumerate(schedule.coefficients):
        poly = _addmm(a_mat, a_mat, a_mat, beta=b, alpha=c)  # b A + c A²
        if q is None:
            q = poly
            q.diagonal(dim1=-2, dim2=-1).add_(a)  # a I + poly
        else:
            q = _addmm(q, poly, q, beta=a)  # (a I + poly) Q
        if i + 1 < schedule.steps:
            a_mat = q @ g @ q  # the next iterate's X Xᵀ
    return q @ x


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
    """torch.optim.Muon with the Newton-Schulz iterations in `ns_dtype` (float32 by default).

    A step is three parts, so SplitMuon can replace the middle one: the momentum (element-wise,
    on whatever this rank holds of each matrix), the orthogonalisation (whole matrices), the
    update of the parameters (element-wise again)."""

    def __init__(self, params: Any, ns_dtype: torch.dtype = torch.float32,
                 polar_express: bool = False, neuron_beta2: float = 0.0,
                 cautious_weight_decay: bool = False, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.polar_express = polar_express
        self.neuron_beta2 = neuron_beta2  # NorMuon (normalise_neurons) when > 0
        self.cautious_weight_decay = cautious_weight_decay

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, updates = self._momentum_updates(group)
            updates = self._orthogonalise(group, params, updates)
            if self.neuron_beta2 > 0:
                updates = self._normalise_each(params, updates)
            self._apply(group, params, updates)
        return loss

    def _normalise_each(self, params: list[torch.Tensor],
                        updates: list[torch.Tensor]) -> list[torch.Tensor]:
        return by_stacks(lambda u, held: self._normalise_neurons([params[i] for i in held], u),
                         updates)

    def _normalise_neurons(self, params: list[torch.Tensor], update: torch.Tensor) -> torch.Tensor:
        """NorMuon (arXiv:2510.05491): each output neuron's (row's) orthogonalised update divided
        by the root of a running mean of its squares, then the whole update scaled back to its
        Frobenius norm before, so rows that keep getting large updates get smaller ones and the
        step's size is Muon's. Whole matrices only (one process, or DDP's gathered updates):
        `update` is params[0]'s, or a stack of those of `params` (by_stacks)."""
        update = update.to(torch.promote_types(update.dtype, torch.float32))
        moments = []
        for p in params:
            state = self.state[p]
            if "neuron_second_moment" not in state:
                state["neuron_second_moment"] = torch.zeros(
                    update.size(-2), 1, dtype=update.dtype, device=update.device)
            moments.append(state["neuron_second_moment"])
        mean_square = update.square().mean(dim=-1, keepdim=True)  # [..., rows, 1]
        if update.dim() == 2:
            moment = moments[0].lerp_(mean_square, 1 - self.neuron_beta2)
        else:
            torch._foreach_lerp_(moments, list(mean_square.unbind(0)), 1 - self.neuron_beta2)
            moment = torch.stack(moments)
        scaled = update * moment.clamp(min=1e-10).rsqrt()
        return scaled * (_frobenius_norm(update) / _frobenius_norm(scaled).clamp(min=1e-10))

    def _momentum_updates(self, group: dict[str, Any]) -> tuple[list[torch.Tensor],
                                                                 list[torch.Tensor]]:
        """(parameters with a gradient, their momentum updates), each as this rank holds it."""
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        self._init_group(group, params, grads, buffers)
        if not params:
            return params, []
        # torch's update rule, each matrix's element-wise arithmetic as there: momentum as a
        # lerp, Nesterov's look-ahead; as _foreach operators, one launch for all matrices.
        momentum = group["momentum"]
        grads, buffers = [local_tensor(g) for g in grads], [local_tensor(b) for b in buffers]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
        return params, list(updates)

    def _schedule(self, group: dict[str, Any]) -> NewtonSchulzSchedule:
        if self.polar_express:
            return POLAR_EXPRESS
        return NewtonSchulzSchedule.quintic(group["ns_coefficients"], group["ns_steps"])

    def _newton_schulz(self, group: dict[str, Any],
                       updates: list[torch.Tensor]) -> list[torch.Tensor]:
        return newton_schulz_each(updates, self._schedule(group), eps=group["eps"],
                                  dtype=self.ns_dtype)

    def _orthogonalise(self, group: dict[str, Any], params: list[torch.Tensor],
                       updates: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._newton_schulz(group, updates)

    def _apply(self, group: dict[str, Any], params: list[torch.Tensor],
               updates: list[torch.Tensor]) -> None:
        # Decoupled weight decay at the unscaled lr, the update at the shape-scaled lr (the
        # whole matrix's shape: a DTensor's shape is the global one).
        lr, wd = group["lr"], group["weight_decay"]
        mine = [local_tensor(p) for p in params]
        if not mine:
            return
        if self.cautious_weight_decay:
            for m, update in zip(mine, updates, strict=True):
                # Decay only the weights the update moves towards zero anyway (the same sign),
                # so the decay never fights the gradient (arXiv:2510.12402).
                m.sub_(m * (m * update > 0), alpha=lr * wd)
        else:
            torch._foreach_mul_(mine, 1 - lr * wd)
        by_lr: dict[float, list[int]] = {}  # one launch per shape-scaled lr
        for i, p in enumerate(params):
            by_lr.setdefault(adjusted_lr(lr, group["adjust_lr_fn"], p.shape), []).append(i)
        for shape_lr, indices in by_lr.items():
            torch._foreach_add_([mine[i] for i in indices], [updates[i] for i in indices],
                                alpha=-shape_lr)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: its shard of a DTensor (the same storage), else `t`."""
    return t.to_local() if is_dtensor(t) else t


def assign_owners(shapes: list[torch.Size], world_size: int,
                  dtype: torch.dtype = torch.float32, steps: int = 5) -> list[int]:
    """The rank that orthogonalises each matrix: in parameter order, the rank with the least
    Newton-Schulz work so far (newton_schulz_macs in `dtype`, which counts the Gram form where
    it is taken), the lower rank on a tie. A function of the shapes, the dtype and the world
    size only: every rank computes the same assignment, nothing of it is checkpointed, and a
    resume at another size assigns anew."""
    load = [0] * world_size
    owners = []
    for shape in shapes:
        owner = min(range(world_size), key=lambda r: (load[r], r))
        owners.append(owner)
        load[owner] += newton_schulz_macs(shape, dtype, steps)
    return owners


def shard_rows(rows: int, world_size: int) -> list[tuple[int, int]]:
    """(start, stop) of each rank's rows under FSDP2's Shard(0), which splits as torch.chunk."""
    chunk = -(-rows // world_size)
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(world_size)]


def _row_sharded_on_one_dim(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import Shard  # imported already: p is a DTensor

    return p.device_mesh.ndim == 1 and p.placements == (Shard(0),)


def _flat(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


class SplitMuon(Float32Muon):
    """Float32Muon over several processes, each orthogonalising only its share of the matrices
    (assign_owners); the momentum and the update stay where the parameter lives.

    Replicated parameters (DDP: every rank holds every whole matrix and the same all-reduced
    gradient): each rank orthogonalises its own matrices, then one all_gather gives every rank
    every update. Row-sharded parameters (FSDP2, Shard(0) on a 1-D mesh): one all_to_all brings
    each matrix's shards of the momentum update to its owner, which orthogonalises the whole
    matrix, and a second all_to_all returns each rank its rows of the result. Two collectives a
    step whatever the number of matrices; sizes and order follow from the shapes alone."""

    def _orthogonalise(self, group: dict[str, Any], params: list[torch.Tensor],
                       updates: list[torch.Tensor]) -> list[torch.Tensor]:
        if not params:
            return []
        sharded = is_dtensor(params[0])
        if sharded and not _row_sharded_on_one_dim(params[0]):
            # andrea builds only 1-D meshes (sharding.shard_model); hybrid sharding would
            # need the exchange per shard group.
            raise NotImplementedError(f"Muon over {params[0].placements} on a "
                                      f"{params[0].device_mesh.ndim}-D mesh; only Shard(0) on "
                                      f"a 1-D mesh is split")
        pg = params[0].device_mesh.get_group() if sharded else dist.group.WORLD
        owners = assign_owners([p.shape for p in params], dist.get_world_size(pg), self.ns_dtype,
                               self._schedule(group).steps)
        exchange = self._exchange_shards if sharded else self._gather_updates
        return exchange(group, params, updates, owners, pg)

    def _gather_updates(self, group: dict[str, Any], params: list[torch.Tensor],
                        updates: list[torch.Tensor], owners: list[int],
                        pg: Any) -> list[torch.Tensor]:
        """Whole matrices on every rank: orthogonalise my own, all-gather everyone's."""
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        device = updates[0].device
        owned = [[i for i, o in enumerate(owners) if o == r] for r in range(world)]
        sizes = [sum(updates[i].numel() for i in owned[r]) for r in range(world)]
        mine = self._newton_schulz(group, [updates[i] for i in owned[rank]])
        send = torch.zeros(max(sizes), dtype=self.ns_dtype, device=device)  # equal lengths
        send[:sizes[rank]] = _flat(mine, self.ns_dtype, device)
        parts = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(parts, send, group=pg)
        offsets, out = [0] * world, []
        for u, owner in zip(updates, owners, strict=True):
            out.append(parts[owner][offsets[owner]:offsets[owner] + u.numel()].view(u.shape))
            offsets[owner] += u.numel()
        return out

    def _exchange_shards(self, group: dict[str, Any], params: list[torch.Tensor],
                         updates: list[torch.Tensor], owners: list[int],
                         pg: Any) -> list[torch.Tensor]:
        """Row shards: all_to_all the shards to each matrix's owner, orthogonalise there,
        all_to_all each rank's rows back. Each buffer is ordered by the peer rank, then by
        parameter order, so both sides compute the same split sizes from the shapes."""
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        device = updates[0].device
        rows = [shard_rows(p.shape[0], world) for p in params]
        cols = [p.shape[1] for p in params]
        for i, u in enumerate(updates):
            if u.shape != (rows[i][rank][1] - rows[i][rank][0], cols[i]):
                raise RuntimeError(f"shard of {tuple(params[i].shape)} on rank {rank} is "
                                   f"{tuple(u.shape)}, not torch.chunk's rows {rows[i][rank]}")
        mine = [i for i, o in enumerate(owners) if o == rank]

        def numel(i: int, r: int) -> int:  # rank r's shard of matrix i
            return (rows[i][r][1] - rows[i][r][0]) * cols[i]

        # 1. Shards to owners, in the NS dtype (the iterations' first step casts to it anyway).
        by_owner = sorted(range(len(params)), key=lambda i: owners[i])  # stable: param order
        send = _flat([updates[i] for i in by_owner], self.ns_dtype, device)
        to_owner = [sum(numel(i, rank) for i in range(len(params)) if owners[i] == r)
                    for r in range(world)]
        from_ranks = [sum(numel(i, r) for i in mine) for r in range(world)]
        recv = torch.empty(sum(from_ranks), dtype=self.ns_dtype, device=device)
        dist.all_to_all_single(recv, send, from_ranks, to_owner, group=pg)
        pieces: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
        offset = 0
        for r in range(world):
            for i in mine:
                pieces[i].append(recv[offset:offset + numel(i, r)].view(-1, cols[i]))
                offset += numel(i, r)
        done = dict(zip(mine, self._newton_schulz(group, [torch.cat(pieces[i]) for i in mine]),
                        strict=True))

        # 2. Each rank its rows of every result.
        send = _flat([done[i][slice(*rows[i][r])] for r in range(world) for i in mine],
                     self.ns_dtype, device)
        recv = torch.empty(sum(to_owner), dtype=self.ns_dtype, device=device)
        dist.all_to_all_single(recv, send, to_owner, from_ranks, group=pg)
        out: list[torch.Tensor] = [recv[:0]] * len(params)
        offset = 0
        for i in by_owner:
            out[i] = recv[offset:offset + updates[i].numel()].view(updates[i].shape)
            offset += updates[i].numel()
        return out


def build_muon(params: list[nn.Parameter], *, lr: float, weight_decay: float, momentum: float,
               ns_dtype: torch.dtype, world_size: int = 1, polar_express: bool = False,
               neuron_beta2: float = 0.0, cautious_weight_decay: bool = False
               ) -> torch.optim.Optimizer:
    """torch.optim.Muon itself where its bfloat16 quintic iterations are wanted, else
    Float32Muon (another dtype, Polar Express's coefficients, NorMuon or cautious decay, which
    torch's Muon cannot do); with several processes SplitMuon (in bfloat16 it computes torch's
    bits, see newton_schulz)."""
    muon = require_muon()
    kwargs = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True)
    extra = dict(polar_express=polar_express, neuron_beta2=neuron_beta2,
                 cautious_weight_decay=cautious_weight_decay)
    if world_size > 1:
        return SplitMuon(params, ns_dtype=ns_dtype, **extra, **kwargs)
    if ns_dtype == torch.bfloat16 and not any(extra.values()):
        return muon(params, **kwargs)
    return Float32Muon(params, ns_dtype=ns_dtype, **extra, **kwargs)
