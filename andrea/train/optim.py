"""The optimizers by name (train.optimizer): how each is built, and its per-parameter state.

`OPTIMIZERS` maps a name to its builder: adamw (AdamW with weight decay on matrices only), muon
(Muon for the block matrices beside AdamW for the rest, andrea/train/muon.py, as one
`CombinedOptimizer`). Every group's lr as built is its peak lr (recorded under PEAK_LR); each
step sets it to that peak times the schedule's multiplier (`set_learning_rates`).

`EMPTY_STATE` maps an optimizer class to the state of one parameter before its first step
(zeros), which a sharded checkpoint is read into; a class without an entry is refused there.
Adding an optimizer (say Lion) is its builder in OPTIMIZERS and, for a class of its own, its
state in EMPTY_STATE, here: train.optimizer's allowed values are OPTIMIZERS' names
(`register_choices`), in validation, `andrea config keys` and docs/config.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from andrea.config import Config, TrainConfig, register_choices
from andrea.errors import UserError
from andrea.model.transformer import Andrea
from andrea.train.device import Precision, choose_ns_precision
from andrea.train.muon import Float32Muon, build_muon, split_parameters
from andrea.train.schedule import Multiplier

# The param-group key holding the group's peak lr: the lr it was built with.
PEAK_LR = "peak_lr"
EMBEDDINGS = ("tok_emb.weight", "pos_emb.weight")

# (model, config, device, world size, whether the model is sharded) -> the optimizer
Builder = Callable[[Andrea, Config, torch.device, int, bool], Any]
StateMaker = Callable[[torch.optim.Optimizer, torch.Tensor, dict[str, Any]],
                      dict[str, torch.Tensor]]


def build_optimizer(model: Andrea, cfg: Config, device: torch.device,
                    world_size: int = 1, sharded: bool = False) -> torch.optim.Optimizer:
    """The optimizer train.optimizer names, each group's peak lr recorded. world_size > 1: the
    model must already be laid out as it will train (sharded under fsdp, and then `sharded`)."""
    optimizer = OPTIMIZERS[cfg.train.optimizer](model, cfg, device, world_size, sharded)
    for group in optimizer.param_groups:
        group[PEAK_LR] = group["lr"]
    return optimizer


def set_learning_rates(optimizer: torch.optim.Optimizer, multiplier: Multiplier) -> None:
    """Every group's lr: its peak lr times the schedule's multiplier."""
    for group in optimizer.param_groups:
        group["lr"] = multiplier.lr_for(group[PEAK_LR])


def build_adamw(model: Andrea, cfg: Config, device: torch.device, world_size: int,
                sharded: bool) -> torch.optim.AdamW:
    """AdamW for every parameter."""
    return _adamw_over(list(model.named_parameters()), cfg.train)


def _adamw_over(named: list[tuple[str, torch.nn.Parameter]], t: TrainConfig) -> torch.optim.AdamW:
    """AdamW at train.lr with weight decay on matrices only (embeddings too if
    train.decay_embeddings); fused where the device has the kernel."""
    decay, no_decay = [], []
    for name, p in named:
        wants_decay = p.dim() >= 2 and (t.decay_embeddings or name not in EMBEDDINGS)
        (decay if wants_decay else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # no fused kernel for this device: one foreach kernel
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def build_muon_with_adamw(model: Andrea, cfg: Config, device: torch.device, world_size: int,
                          sharded: bool) -> CombinedOptimizer:
    """Muon at train.muon_lr for the block matrices, AdamW for the rest. world_size > 1: the
    processes share Muon's Newton-Schulz work (muon.SplitMuon); NorMuon refused when sharded."""
    t = cfg.train
    if t.muon_neuron_beta2 and sharded:
        raise UserError(
            f"train.muon_neuron_beta2: {t.muon_neuron_beta2}: NorMuon is not supported under "
            "train.parallel: fsdp yet (its per-neuron state is not sharded); use "
            "train.parallel=ddp, or for a new run train.muon_neuron_beta2=0 (a resume keeps "
            "the run's optimizer)")
    matrices, named = split_parameters(model)
    # Before AdamW is built, so a torch without Muon is refused first.
    muon = build_muon(matrices, lr=t.muon_lr, weight_decay=t.muon_weight_decay,
                      momentum=t.muon_momentum,
                      ns_dtype=choose_ns_precision(t.muon_ns_precision, device).dtype,
                      world_size=world_size,
                      polar_express=t.muon_ns_coefficients == "polar_express",
                      neuron_beta2=t.muon_neuron_beta2,
                      cautious_weight_decay=t.muon_cautious_weight_decay)
    return CombinedOptimizer(muon=muon, adamw=_adamw_over(named, t))


OPTIMIZERS: dict[str, Builder] = {
    "adamw": build_adamw,
    "muon": build_muon_with_adamw,
}
register_choices("train.optimizer", OPTIMIZERS)  # its names are the key's allowed values


def muon_ns_precision(cfg: Config, device: torch.device) -> Precision | None:
    """The precision of Muon's Newton-Schulz iterations as the run's optimizer takes it on
    `device` (choose_ns_precision), for the checkpoint's record and a resume's line; None: the
    optimizer has no Muon."""
    if OPTIMIZERS[cfg.train.optimizer] is not build_muon_with_adamw:
        return None
    return choose_ns_precision(cfg.train.muon_ns_precision, device)


class CombinedOptimizer:
    """Several optimizers over disjoint parameters, driven as one: param_groups and state over
    all, step, zero_grad, state_dict and load_state_dict with one parameter numbering (in the
    order given, as torch numbers the parameters of one optimizer holding all the groups), so
    the trainer and the checkpoint code handle it like a single optimizer. `parts` by name."""

    def __init__(self, **parts: torch.optim.Optimizer) -> None:
        self.parts = parts
        self.optimizers = tuple(parts.values())

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """A merged copy, for reading; each part's own `state` is the one to write."""
        return {k: v for opt in self.optimizers for k, v in opt.state.items()}

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


def _adamw_state(opt: torch.optim.Optimizer, p: torch.Tensor,
                 group: dict[str, Any]) -> dict[str, torch.Tensor]:
    on = p.device if group.get("fused") else "cpu"  # the count is on the device only when fused
    return {
        "step": torch.zeros((), dtype=torch.float32, device=on),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


def _muon_state(opt: torch.optim.Optimizer, p: torch.Tensor,
                group: dict[str, Any]) -> dict[str, torch.Tensor]:
    state = {"momentum_buffer": torch.zeros_like(p)}
    if getattr(opt, "neuron_beta2", 0) > 0:  # NorMuon: one running mean per row (neuron)
        dtype = torch.promote_types(opt.ns_dtype, torch.float32)  # as _normalise_neurons
        state["neuron_second_moment"] = torch.zeros(p.shape[0], 1, dtype=dtype, device=p.device)
    return state


# By class; a subclass without an entry of its own keeps its base class's state.
EMPTY_STATE: dict[type, StateMaker] = {torch.optim.AdamW: _adamw_state, Float32Muon: _muon_state}
if hasattr(torch.optim, "Muon"):
    EMPTY_STATE[torch.optim.Muon] = _muon_state


def _state_maker(opt: torch.optim.Optimizer) -> StateMaker:
    maker = next((EMPTY_STATE[c] for c in type(opt).__mro__ if c in EMPTY_STATE), None)
    if maker is None:
        raise NotImplementedError(
            f"{type(opt).__name__}: its per-parameter state is not known, so a checkpoint "
            f"cannot be read into it; give it an entry in andrea/train/optim.py EMPTY_STATE")
    return maker


def make_empty_state(optimizer: torch.optim.Optimizer | CombinedOptimizer) -> None:
    """Every parameter's state (zeros) that the optimizer would make at its first step, made
    now so a checkpoint can be loaded into it: into each part's own state."""
    for opt in getattr(optimizer, "optimizers", (optimizer,)):
        maker = _state_maker(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state.get(p):
                    opt.state[p] = maker(opt, p, group)


def first_step_state(
    optimizer: torch.optim.Optimizer | CombinedOptimizer,
) -> list[list[tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    """Per part of the optimizer, each parameter with the state its first step makes: each
    field's shape and dtype, measured on a stand-in on the meta device (nothing is allocated)."""
    out = []
    for opt in getattr(optimizer, "optimizers", (optimizer,)):
        maker = _state_maker(opt)
        out.append([(p, maker(opt, torch.empty(p.shape, dtype=p.dtype, device="meta"), group))
                    for group in opt.param_groups for p in group["params"]])
    return out


def state_size(optimizer: torch.optim.Optimizer | CombinedOptimizer) -> tuple[int, int]:
    """(tensors, bytes) of every parameter's state, whole (a sharded tensor counts all its
    shards): the state as it is, or for a parameter without one yet, as its first step will
    make it."""
    count = total = 0
    for part, opt in zip(first_step_state(optimizer),
                         getattr(optimizer, "optimizers", (optimizer,)), strict=True):
        for p, planned in part:
            state = opt.state.get(p) or planned
            count += len(state)
            total += sum(v.numel() * v.element_size() if torch.is_tensor(v) else 8
                         for v in state.values())
    return count, total
