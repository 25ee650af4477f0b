"""Batches from prepared shards: random windows for training, a fixed pass for evaluation.

Training (`train_batch`): optimizer step `step` consumes G = accum_steps * world_size
micro-batches of B windows of block_size + 1 tokens (x = window[:-1], y = window[1:]). All
G * B windows come from ONE generator seeded by (seed, step):
  1. an offset o in [0, block_size);
  2. the candidate windows: in every shard, those starting at o + i * block_size that fit
     entirely inside the shard (windows never cross a shard boundary), numbered globally in
     shard order;
  3. G * B distinct candidate numbers, drawn without replacement.
Micro-batch g = rank * accum_steps + micro_step takes windows [g * B, (g + 1) * B). So a batch
depends only on (seed, step, rank, micro_step, sizes): resuming at a step sees exactly the
batches an uninterrupted run would, 1 process x 2 accumulation steps sees the same data as
2 processes x 1, and different ranks' windows at a step are disjoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from andrea import shards
from andrea.errors import UserError
from andrea.prepare import SPLITS, read_manifest


class TokenSplit:
    """One split ("train" | "val") of a prepared data dir: all its shards as np.memmap."""

    def __init__(self, data_dir: Path, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.data_dir, self.split = Path(data_dir), split
        manifest = read_manifest(self.data_dir)
        self.tokenizer_identity: str = manifest["tokenizer"]["identity"]
        self.vocab_size: int = manifest["tokenizer"]["vocab_size"]
        self.eot_id: int = manifest["tokenizer"]["eot_id"]
        self.shards: list[np.ndarray] = []
        for entry in manifest["shards"][split]:
            tokens = shards.open_shard(self.data_dir / entry["file"], self.tokenizer_identity)
            if len(tokens) != entry["tokens"]:
                raise UserError(
                    f"{self.data_dir / entry['file']}: {len(tokens)} tokens, manifest says "
                    f"{entry['tokens']}; re-run `andrea prepare --force`"
                )
            self.shards.append(tokens)
        self.shard_sizes = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.n_tokens: int = int(self.shard_sizes.sum())

    def window_counts(self, block_size: int, offset: int) -> np.ndarray:
        """Per shard: how many windows of block_size + 1 start at offset + i * block_size."""
        room = self.shard_sizes - offset - (block_size + 1)
        return np.where(room >= 0, room // block_size + 1, 0)

    def window(self, index: int, cum: np.ndarray, block_size: int, offset: int) -> np.ndarray:
        """Global window number `index` (cum = cumulative window counts) as int64 tokens."""
        shard = int(np.searchsorted(cum, index, side="right"))
        local = index - (int(cum[shard - 1]) if shard else 0)
        start = offset + local * block_size
        return np.asarray(self.shards[shard][start : start + block_size + 1], dtype=np.int64)


def sample_distinct(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """k distinct integers from [0, n) in random order, without materialising [0, n) when
    k is small next to n (rejection of repeats; order of first appearance)."""
    if 2 * k > n:
        return rng.permutation(n)[:k]
    chosen: dict[int, None] = {}
    while len(chosen) < k:
        for v in rng.integers(0, n, size=k - len(chosen)).tolist():
            chosen.setdefault(v, None)
    return np.fromiter(chosen, dtype=np.int64, count=k)


def _stack(windows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.from_numpy(np.stack(windows))
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def train_batch(
    split: TokenSplit,
    *,
    seed: int,
    step: int,
    micro_step: int,
    rank: int,
    accum_steps: int,
    world_size: int,
    micro_batch_size: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch (x, y), int64 [B, T], for (step, rank, micro_step); see the module doc."""
    if not (0 <= rank < world_size and 0 <= micro_step < accum_steps):
        raise ValueError(f"rank {rank}/{world_size}, micro_step {micro_step}/{accum_steps}")
    per_step = accum_steps * world_size * micro_batch_size
    # The smallest count over all offsets, so the check does not depend on the step.
    if int(split.window_counts(block_size, block_size - 1).sum()) < per_step:
        raise UserError(
            f"{split.data_dir}: the {split.split} split has {split.n_tokens:,} tokens, too few "
            f"for one global batch of {per_step} windows of {block_size + 1} tokens (needs about "
            f"{per_step * block_size + 2 * block_size:,} in a single shard); add data or lower "
            "the batch size or block_size"
        )
    rng = np.random.default_rng([seed, step])
    offset = int(rng.integers(0, block_size))
    cum = np.cumsum(split.window_counts(block_size, offset))
    chosen = sample_distinct(rng, int(cum[-1]), per_step)
    g = rank * accum_steps + micro_step
    mine = chosen[g * micro_batch_size : (g + 1) * micro_batch_size]
    return _stack([split.window(int(i), cum, block_size, offset) for i in mine])


def val_batches(
    split: TokenSplit, *, micro_batch_size: int, block_size: int, max_batches: int | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Sequential non-overlapping windows from the start of the split, in batches of B; the
    same every call. A last partial batch is dropped unless it would be the only one."""
    cum = np.cumsum(split.window_counts(block_size, 0))
    total = int(cum[-1]) if len(cum) else 0
    if total == 0:
        raise UserError(
            f"{split.data_dir}: the {split.split} split has {split.n_tokens:,} tokens, fewer "
            f"than one window of {block_size + 1}; add data or lower block_size"
        )
    n_batches = max(1, total // micro_batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        index = range(b * micro_batch_size, min((b + 1) * micro_batch_size, total))
        yield _stack([split.window(i, cum, block_size, 0) for i in index])
