"""The optimizer: AdamW with weight decay on matrices only, or Muon for the block matrices
beside AdamW for the rest (andrea/train/muon.py)."""

from __future__ import annotations

import torch

from andrea.config import Config
from andrea.errors import UserError
from andrea.model.transformer import Andrea
from andrea.train.device import pick_dtype
from andrea.train.muon import MuonAdamW, build_muon, split_parameters


def build_optimizer(model: Andrea, cfg: Config, device: torch.device,
                    world_size: int = 1, sharded: bool = False) -> torch.optim.Optimizer:
    """train.optimizer: AdamW with weight decay on matrices only (embeddings too if
    train.decay_embeddings), or Muon for the block matrices with AdamW for the rest.
    world_size > 1: the processes share Muon's Newton-Schulz work (muon.SplitMuon); the model
    must already be laid out as it will train (sharded under fsdp, and then `sharded`)."""
    t = cfg.train
    embeddings = {"tok_emb.weight", "pos_emb.weight"}
    if t.optimizer == "muon":
        if t.muon_neuron_beta2 and sharded:
            raise UserError(
                f"train.muon_neuron_beta2: {t.muon_neuron_beta2}: NorMuon is not supported under "
                "train.parallel: fsdp yet (its per-neuron state is not sharded); use "
                "train.parallel=ddp or train.muon_neuron_beta2=0")
        matrices, named = split_parameters(model)
        # Before AdamW is built, so a torch without Muon is refused first.
        muon = build_muon(matrices, t.muon_lr, t.muon_weight_decay, t.muon_momentum,
                          pick_dtype(t.muon_ns_precision, device), world_size,
                          polar_express=t.muon_ns_coefficients == "polar_express",
                          neuron_beta2=t.muon_neuron_beta2,
                          cautious_weight_decay=t.muon_cautious_weight_decay)
        for group in muon.param_groups:
            group["lr_ratio"] = t.muon_lr / t.lr  # one schedule drives both learning rates
    else:
        named = list(model.named_parameters())
    decay, no_decay = [], []
    for name, p in named:
        wants_decay = p.dim() >= 2 and (t.decay_embeddings or name not in embeddings)
        (decay if wants_decay else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    try:
        adamw = torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # no fused kernel for this device: one foreach kernel
        adamw = torch.optim.AdamW(groups, foreach=True, **kwargs)
    return MuonAdamW(muon, adamw) if t.optimizer == "muon" else adamw
