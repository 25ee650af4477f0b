"""The validation loss, shared by the trainer and `andrea eval`.

One fixed set of windows per source, scored by summed negative log-likelihood over summed
target tokens.

The windows (`data.loader.val_windows`) depend only on the val split, block_size and the token
budget (train.eval_tokens, `andrea eval --max-tokens`), so the figure does not move with the
micro-batch, the number of processes or a resume. A mixture gets the budget in every source;
each source's loss and bits per byte are its own nats over its own targets (and bytes), and
the run's val loss is their average weighted by data.sources' weights (so is its bits per byte).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from tqdm import tqdm

from andrea.data.inputs import source_last_part
from andrea.data.loader import (
    TokenSplit,
    read_batch,
    token_byte_lengths,
    val_windows,
    window_groups,
)
from andrea.errors import UserError
from andrea.train.collectives import all_reduce_sum
from andrea.train.torchrun import DistInfo


@dataclass
class SourceScore:
    """One source's sums over its val windows."""

    name: str
    weight: float  # normalised: the weights of a run's sources add up to 1
    nats: float = 0.0
    tokens: int = 0
    bytes: int = 0

    @property
    def loss(self) -> float:
        return self.nats / self.tokens if self.tokens else math.nan

    @property
    def bits_per_byte(self) -> float | None:
        return self.nats / math.log(2) / self.bytes if self.bytes else None


@dataclass
class ValScore:
    """Every source's score; `loss` and `bits_per_byte` are their weighted average."""

    sources: list[SourceScore] = field(default_factory=list)

    @property
    def loss(self) -> float:
        return sum(s.weight * s.loss for s in self.sources)

    @property
    def bits_per_byte(self) -> float | None:
        if any(s.bits_per_byte is None for s in self.sources):
            return None
        return sum(s.weight * s.bits_per_byte for s in self.sources)  # type: ignore[misc]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sources)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.sources)

    def record(self) -> dict[str, Any]:
        """The fields of a metrics.jsonl eval event: val_loss, val_bpb, val_tokens, and for a
        mixture val_sources {name: {loss, bpb, tokens, weight}}."""
        out: dict[str, Any] = {"val_loss": self.loss, "val_bpb": self.bits_per_byte,
                               "val_tokens": self.tokens}
        if len(self.sources) > 1:
            out["val_sources"] = {
                s.name: {"loss": s.loss, "bpb": s.bits_per_byte, "tokens": s.tokens,
                         "weight": round(s.weight, 6)}
                for s in self.sources
            }
        return out


@dataclass
class ValSource:
    """One source's fixed val windows and what its tokens weigh in bytes."""

    name: str
    weight: float
    split: TokenSplit
    windows: list[tuple[int, int, int]]
    byte_lengths: np.ndarray


def val_sources(
    split: TokenSplit, block_size: int, max_tokens: int | None, only: str | None = None
) -> list[ValSource]:
    """The val set of `split`: one entry per source (a data dir is one, named by its folder),
    at most max_tokens targets each; `only`: the one source of that name (its path as
    configured, or the last part of it)."""
    parts = list(zip(split.names, split.weights.tolist(), split.parts, strict=True))
    if only is not None:
        chosen = [p for p in parts if only in (p[0], source_last_part(p[0]))]
        if not chosen:
            raise UserError(f"--source {only}: no such source; the sources are "
                            f"{', '.join(p[0] for p in parts)}")
        if len(chosen) > 1:  # a/*.jsonl and b/*.jsonl end alike: the first was scored alone
            raise UserError(f"--source {only}: names {len(chosen)} sources, "
                            f"{', '.join(p[0] for p in chosen)}; give the whole path of one")
        parts = [(chosen[0][0], 1.0, chosen[0][2])]
    out = []
    for name, weight, part in parts:
        windows = val_windows(part, block_size, max_tokens)
        if not windows:
            raise UserError(
                f"{part.data_dir}: the {part.split} split has {part.n_tokens:,} tokens, "
                "nothing to evaluate; prepare more text or raise data.val_fraction"
            )
        out.append(ValSource(name, weight, part, windows, token_byte_lengths(part)))
    return out


@torch.no_grad()
def score_val(
    model: nn.Module,
    sources: list[ValSource],
    *,
    batch_size: int,
    device: torch.device,
    dtype: torch.dtype,
    dist: DistInfo | None = None,
    lockstep: bool = False,
    progress: bool = False,
) -> ValScore:
    """Summed nats, targets and bytes of every source, the batches shared among the ranks
    (batch i on rank i % world_size), summed in float64 and all-reduced. lockstep (sharded
    weights): every rank runs as many forwards as the busiest one, since each forward gathers
    the weights from all of them; a rank short of a batch repeats one and counts nothing."""
    dist = dist or DistInfo()
    was_training = model.training
    model.eval()
    totals = torch.zeros(len(sources), 3, dtype=torch.float64, device=device)
    bar = tqdm(total=sum(n for s in sources for _, _, n in s.windows), unit="tok",
               unit_scale=True, dynamic_ncols=True, file=sys.stderr,
               disable=not (progress and dist.is_main))
    for i, source in enumerate(sources):
        # Read batch by batch, this rank's alone: memory stays one batch whatever the split.
        groups = window_groups(source.windows, batch_size)
        rounds = math.ceil(len(groups) / dist.world_size)
        for b in range(rounds * dist.world_size)[dist.rank::dist.world_size]:
            if b >= len(groups) and not lockstep:
                break
            x, y = read_batch(source.split, groups[min(b, len(groups) - 1)])
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                _, loss = model(x.to(device), y.to(device))
            if b < len(groups):
                n_bytes = int(source.byte_lengths[y.numpy()].sum())
                totals[i] += torch.tensor([loss.double().item() * y.numel(), y.numel(),
                                           n_bytes], dtype=torch.float64, device=device)
                bar.update(y.numel() * dist.world_size)
    bar.close()
    all_reduce_sum(totals, dist)
    model.train(was_training)
    return ValScore([
        SourceScore(s.name, s.weight, float(t[0]), int(t[1]), int(t[2]))
        for s, t in zip(sources, totals.tolist(), strict=True)
    ])
