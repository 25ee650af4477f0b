"""The optimizer: AdamW with weight decay on matrices only."""

from __future__ import annotations

import torch

from andrea.config import Config
from andrea.model.transformer import Andrea


def build_optimizer(model: Andrea, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (embeddings too if train.decay_embeddings)."""
    embeddings = {"tok_emb.weight", "pos_emb.weight"}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        wants_decay = p.dim() >= 2 and (cfg.train.decay_embeddings or name not in embeddings)
        (decay if wants_decay else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), eps=cfg.train.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # no fused kernel for this device: one foreach kernel
        return torch.optim.AdamW(groups, foreach=True, **kwargs)
