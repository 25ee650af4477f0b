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

Every split is a mixture: a data dir is a mixture of one source (itself, weight 1), and
data.sources makes one of several. After the offset, the same generator draws the source of each
of the G * B windows (probability weight / sum of weights), then per source, in source order,
that many distinct windows among the source's own; window j takes the next one of its source.
A data dir draws no source choice (every window is its own), so its windows are step 3's draw
over all its candidates; data.sources draws one per window even when it lists one source (as it
always has: the same config draws the same batches). All of the above holds for every split.

That is data.order `random`: each step draws afresh, so over a run of P passes a token is read
about Poisson(P) times (at 3 passes some 5% never, some 8% six times or more). data.order
`epochs` (a data dir only) instead reads the split pass by pass: pass k has its own generator,
seeded by (seed, block_size, k), which draws an offset o_k and then one permutation of the
candidate windows at o_k (the first N of them, N the fewest any offset has, so every pass has as
many); the run's windows are those permutations one after another, and a step takes the next G * B
of them, starting at window tokens_before // block_size of the sequence (tokens_before: the tokens
of the run's earlier steps). So every window of a pass comes once before any comes again, and a
batch is still a function of (seed, tokens_before, rank, micro_step, sizes).
"""

from __future__ import annotations

import hashlib
import json
import math
import shlex
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from andrea.config import register_choices
from andrea.data import (
    request,  # noqa: F401  (shards' prepare_again: a damaged folder's message)
    shards,
)
from andrea.data.prepare import SPLITS, check_one_tokenizer, data_dir_for, source_dirs
from andrea.data.shards import MANIFEST, DamagedFolder, DamagedShard, ShardFile, read_manifest
from andrea.data.tokenizer import load_tokenizer
from andrea.data.verify import BackgroundCheck, range_problem, remedy
from andrea.errors import UserError

if TYPE_CHECKING:
    from andrea.config import Config

# The realised mixture share that train prints covers at most this many steps (it costs one
# generator per step).
SHARE_STEPS = 20_000


class TokenSplit:
    """One split ("train" | "val") of a prepared data dir: all its shards, each a ShardFile
    (read with os.pread: a shard changed under the run is named, never a SIGBUS). It is
    a mixture of one source: `parts`, `names`, `weights` and `shard_ranges` describe its
    sources as a Mixture's do (itself, named by its folder, weight 1, every shard), and
    `draws_sources` is False: a window's source is not drawn, nor is a share reported."""

    draws_sources = False

    def __init__(self, data_dir: Path, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.data_dir, self.split = Path(data_dir), split
        manifest = read_manifest(self.data_dir)
        self.tokenizer_identity: str = manifest["tokenizer"]["identity"]
        self.vocab_size: int = manifest["tokenizer"]["vocab_size"]
        self.eot_id: int = manifest["tokenizer"]["eot_id"]
        self.shards: list[ShardFile] = []
        self.entries: list[dict] = manifest["shards"][split]  # file, tokens, checksum
        self.paths: list[Path] = [self.data_dir / e["file"] for e in self.entries]
        self.check: BackgroundCheck | None = None  # the checksums, once check_in_background
        self.read_since_check: set[int] = set()  # the shards check_unchanged looks at next
        for path, entry in zip(self.paths, self.entries, strict=True):
            tokens = shards.open_shard(path, self.tokenizer_identity, split)
            if len(tokens) != entry["tokens"]:
                raise DamagedShard(path, f"{len(tokens):,} tokens, {MANIFEST} says "
                                         f"{entry['tokens']}")
            self.shards.append(tokens)
        self.shard_sizes = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.n_tokens: int = int(self.shard_sizes.sum())
        self.parts: list[TokenSplit] = [self]
        self.names: list[str] = [self.data_dir.name]
        self.weights: np.ndarray = np.ones(1)
        self.shard_ranges: list[tuple[int, int]] = [(0, len(self.shards))]
        self.pass_orders: dict[tuple[int, int, int], tuple[int, np.ndarray, np.ndarray]] = {}

    def window_counts(self, block_size: int, offset: int) -> np.ndarray:
        """Per shard: how many windows of block_size + 1 start at offset + i * block_size."""
        room = self.shard_sizes - offset - (block_size + 1)
        return np.where(room >= 0, room // block_size + 1, 0)

    def fewest_windows(self, block_size: int) -> int:
        """The fewest windows any offset has (offset block_size - 1 starts latest)."""
        return int(self.window_counts(block_size, block_size - 1).sum())

    def window(self, index: int, cum: np.ndarray, block_size: int, offset: int) -> np.ndarray:
        """Global window number `index` (cum = cumulative window counts) as int64 tokens."""
        shard = int(np.searchsorted(cum, index, side="right"))
        local = index - (int(cum[shard - 1]) if shard else 0)
        start = offset + local * block_size
        return self.tokens(shard, start, block_size + 1)

    def pass_order(self, seed: int, block_size: int, k: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Pass k of data.order epochs: (its offset, cumulative window counts at that offset,
        the permutation of its windows). The last two passes asked for are kept: a step spans
        at most a pass boundary, and a permutation holds 8 bytes a window."""
        key = (seed, block_size, k)
        if key not in self.pass_orders:
            rng = np.random.default_rng([seed, block_size, k])
            offset = int(rng.integers(0, block_size))
            per_pass = self.fewest_windows(block_size)
            cum = np.cumsum(self.window_counts(block_size, offset))
            for old in list(self.pass_orders)[:-1]:
                del self.pass_orders[old]
            self.pass_orders[key] = (offset, cum, rng.permutation(per_pass))
        return self.pass_orders[key]

    def tokens(self, shard: int, start: int, length: int) -> np.ndarray:
        """`length` tokens of a shard from `start`, as int64, every id checked to be one the
        tokenizer has (on the host: an id out of range must never reach the embedding)."""
        window = self.shards[shard].read(start, length).astype(np.int64)
        self.read_since_check.add(shard)
        problem = range_problem(window, self.vocab_size, start)
        if problem is not None:
            path = self.paths[shard]
            raise UserError(f"{path}: {problem}; {remedy(path)}")
        return window

    def check_unchanged(self) -> None:
        """A ShardChanged when a shard read since the last check is no longer the file this
        split opened (cut short, replaced, deleted, or its size or modification time moved):
        one os.stat per shard a batch read. Called once a batch is read, so a batch is only
        ever used when its shards were unchanged after it was read."""
        for shard in sorted(self.read_since_check):
            self.shards[shard].check_unchanged()
        self.read_since_check.clear()


class Mixture(TokenSplit):
    """One split of the prepared data dirs of data.sources, which share a tokenizer: `shards`
    are all of theirs in source order (val batches read them all); training windows are drawn
    per source by weight (`train_batch`)."""

    draws_sources = True

    def __init__(self, parts: list[tuple[str, Path, float]], split: str) -> None:
        splits = [TokenSplit(d, split) for _, d, _ in parts]
        identities: dict[str, Path] = {}
        for part in splits:
            identities.setdefault(part.tokenizer_identity, part.data_dir)
        check_one_tokenizer(identities)
        first = splits[0]
        self.data_dir, self.split = first.data_dir, split
        self.tokenizer_identity = first.tokenizer_identity
        self.vocab_size = max(part.vocab_size for part in splits)
        self.eot_id = first.eot_id
        self.parts = splits
        self.names = [name for name, _, _ in parts]
        self.weights = mixture_shares([w for _, _, w in parts])
        self.shards = [shard for part in splits for shard in part.shards]
        self.entries = [entry for part in splits for entry in part.entries]
        self.paths = [path for part in splits for path in part.paths]
        self.check = None
        self.read_since_check = set()
        ends = np.cumsum([len(part.shards) for part in splits])
        self.shard_ranges = list(zip([0, *ends[:-1].tolist()], ends.tolist(), strict=True))
        self.shard_sizes = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.n_tokens = int(self.shard_sizes.sum())
        self.pass_orders = {}


def mixture_shares(weights: list[float]) -> np.ndarray:
    """Each source's share of a mixture's windows (and of its val loss): weight / sum."""
    shares = np.array(weights, dtype=np.float64)
    if shares.max() > np.finfo(np.float64).max / len(shares):
        # Weights near the float maximum (1e308 each) may add up to inf, and then the shares
        # are nan. Scaled to the largest first, they keep their ratios. Only then, so every
        # other mixture draws the batches it always has.
        shares = shares / shares.max()
    return shares / shares.sum()


def open_split(cfg: Config, split: str) -> TokenSplit:
    """The split `cfg.data` names: one data dir, or a Mixture of data.sources."""
    if cfg.data.sources:
        return Mixture(source_dirs(cfg), split)
    return TokenSplit(data_dir_for(cfg), split)


def data_record(*splits: TokenSplit) -> list[dict[str, str]]:
    """What a checkpoint records of the data its run reads, a source at a time: the folder
    (absolute: the derived data.dir, relative, names another folder from another working
    directory) and, for each of `splits`, a digest of its tokenizer and shards (each one's
    tokens and checksum: none in an older manifest), which a resume or eval compares with
    the data it finds (train/rundata.check_same_data)."""
    record = []
    for parts in zip(*(split.parts for split in splits), strict=True):
        entry = {"dir": str(parts[0].data_dir.resolve())}
        for part in parts:
            content = [part.tokenizer_identity,
                       [[e["tokens"], e.get("checksum")] for e in part.entries]]
            entry[part.split] = hashlib.sha256(json.dumps(content).encode()).hexdigest()[:16]
        record.append(entry)
    return record


def check_in_background(*splits: TokenSplit) -> BackgroundCheck:
    """Start checking the checksums of every shard of `splits` on a thread (each shard once);
    the splits' batches look at its verdict (`train_batch`), `wait_checked` waits for it."""
    shards_: dict[Path, dict] = {}
    for split in splits:
        shards_.update(zip(split.paths, split.entries, strict=True))
    check = BackgroundCheck(list(shards_.items()))
    for split in splits:
        split.check = check
    return check


def wait_checked(split: TokenSplit, wait: bool = True) -> None:
    """Wait until every shard the run reads is checked; a damaged one stops here (before a
    checkpoint: none is written from a shard not found intact). `wait=False` (a stop asked
    for by a signal, which may have seconds left): only a damage already found stops."""
    if split.check is not None:
        split.check.wait() if wait else split.check.raise_if_damaged()


def _source_choice(rng: np.random.Generator, split: TokenSplit, per_step: int) -> np.ndarray:
    """Each window's source; a data dir's are not drawn (see the module doc)."""
    if not split.draws_sources:
        return np.zeros(per_step, dtype=np.int64)
    return rng.choice(len(split.weights), size=per_step, p=split.weights)


def _draw_windows(
    split: TokenSplit, rng: np.random.Generator, cum: np.ndarray, per_step: int
) -> np.ndarray:
    """per_step global window numbers: each window's source by weight, then distinct windows
    within each source."""
    choice = _source_choice(rng, split, per_step)
    chosen = np.empty(per_step, dtype=np.int64)
    for s, (lo, hi) in enumerate(split.shard_ranges):
        slots = np.flatnonzero(choice == s)
        base = int(cum[lo - 1]) if lo else 0
        chosen[slots] = base + sample_distinct(rng, int(cum[hi - 1]) - base, len(slots))
    return chosen


def realised_share(
    split: TokenSplit, *, seed: int, steps: range, per_step: int | Callable[[int], int],
    block_size: int | Callable[[int], int],
) -> np.ndarray:
    """The fraction of training tokens each source gets over `steps` (the same draws as
    train_batch makes); per_step: windows a step, block_size: tokens a window, each a number or
    a function of the step (a batch-size or sequence-length warm-up)."""
    counts = np.zeros(len(split.weights), dtype=np.int64)
    for step in steps:
        rng = np.random.default_rng([seed, step])
        length = block_size(step) if callable(block_size) else block_size
        rng.integers(0, length)
        windows = per_step(step) if callable(per_step) else per_step
        counts += length * np.bincount(_source_choice(rng, split, windows),
                                       minlength=len(counts))
    return counts / max(1, counts.sum())


def mixture_report(
    split: TokenSplit, *, seed: int, start_step: int, max_steps: int,
    per_step: int | Callable[[int], int], block_size: int | Callable[[int], int],
) -> tuple[str, dict] | None:
    """For data.sources: the line train prints and the metrics record of the realised share of
    each source over the run's steps (at most SHARE_STEPS of them); None for a data dir."""
    if not split.draws_sources:
        return None
    steps = range(start_step, max(start_step + 1, min(max_steps, start_step + SHARE_STEPS)))
    share = realised_share(split, seed=seed, steps=steps, per_step=per_step,
                           block_size=block_size)
    parts = [
        f"{name} {100 * s:.1f}% (weight {100 * w:.1f}%)"
        for name, s, w in zip(split.names, share, split.weights, strict=True)
    ]
    # Steps as training numbers them: the step that draws data index i is step i + 1.
    first, last = steps.start + 1, steps.stop
    line = f"data mixture, realised share of tokens over steps {first}-{last}: " + ", ".join(parts)
    record = {
        "steps": [first, last],
        "share": {n: round(float(s), 6) for n, s in zip(split.names, share, strict=True)},
        "weight": {n: round(float(w), 6) for n, w in zip(split.names, split.weights, strict=True)},
    }
    return line, record


def source_passes(split: TokenSplit, total_tokens: int) -> list[tuple[str, float, int]]:
    """(name, passes, training tokens) per source over `total_tokens` drawn by weight (a data
    dir's one entry is named by its folder)."""
    return [
        (name, total_tokens * float(w) / part.n_tokens if part.n_tokens else math.inf,
         part.n_tokens)
        for name, w, part in zip(split.names, split.weights, split.parts, strict=True)
    ]


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
    order: str = "random",
    tokens_before: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch (x, y), int64 [B, T], for (step, rank, micro_step), its windows chosen by the
    data.order `order` (ORDERS); epochs places the step in the passes by tokens_before, the
    tokens of the run's earlier steps (module doc)."""
    if not (0 <= rank < world_size and 0 <= micro_step < accum_steps):
        raise ValueError(f"rank {rank}/{world_size}, micro_step {micro_step}/{accum_steps}")
    if split.check is not None and world_size == 1:
        # Not waited for: a damage found so far stops here. Several ranks find it at different
        # steps, so they stop together where they all wait for it (wait_checked).
        split.check.raise_if_damaged()
    per_step = accum_steps * world_size * micro_batch_size
    check_enough(split, per_step, block_size)
    chosen = ORDERS[order].windows(split, seed, step, tokens_before, per_step, block_size)
    g = rank * accum_steps + micro_step
    mine = chosen[g * micro_batch_size : (g + 1) * micro_batch_size]
    batch = _stack([split.window(i, cum, block_size, offset) for i, cum, offset in mine])
    split.check_unchanged()
    return batch


# A step's windows: (number, cumulative window counts, offset) each.
Windows = list[tuple[int, np.ndarray, int]]


class WindowOrder:
    """One value of data.order: which windows each step takes, and what it asks of the config."""

    name: ClassVar[str]
    plan_note: ClassVar[str] = ""  # what the plan line adds about the order

    def windows(self, split: TokenSplit, seed: int, step: int, tokens_before: int,
                per_step: int, block_size: int) -> Windows:
        """The step's per_step windows."""
        raise NotImplementedError

    def check_config(self, cfg: Config, origin: str) -> None:
        """Refuse a config this order cannot read (validation calls it)."""


class RandomOrder(WindowOrder):
    """data.order random: each step draws its windows afresh (module doc)."""

    name: ClassVar[str] = "random"

    def windows(self, split: TokenSplit, seed: int, step: int, tokens_before: int,
                per_step: int, block_size: int) -> Windows:
        rng = np.random.default_rng([seed, step])
        offset = int(rng.integers(0, block_size))
        cum = np.cumsum(split.window_counts(block_size, offset))
        return [(int(i), cum, offset) for i in _draw_windows(split, rng, cum, per_step)]


class EpochOrder(WindowOrder):
    """data.order epochs: every window of one data dir once a pass, pass by pass, placed by
    tokens_before, the tokens of the run's earlier steps (module doc)."""

    name: ClassVar[str] = "epochs"
    plan_note: ClassVar[str] = ", each window once a pass (data.order epochs)"

    def windows(self, split: TokenSplit, seed: int, step: int, tokens_before: int,
                per_step: int, block_size: int) -> Windows:
        # The next per_step windows of the passes' permutations.
        per_pass = split.fewest_windows(block_size)
        k, j = divmod(tokens_before // block_size, per_pass)
        chosen: Windows = []
        while len(chosen) < per_step:
            offset, cum, permutation = split.pass_order(seed, block_size, k)
            chosen += [(int(i), cum, offset) for i in permutation[j : j + per_step - len(chosen)]]
            k, j = k + 1, 0
        return chosen

    def check_config(self, cfg: Config, origin: str) -> None:
        sources = cfg.data.sources
        if sources:  # the one refusal of a mixture: its windows are drawn by weight
            # A list of one is a mixture too, so "use one source" told it nothing: its path as
            # data.source reads the same folder pass by pass.
            one = (f", or read its one source as data.source: --set data.source="
                   f"{shlex.quote(sources[0]['path'])} --set 'data.sources=[]'"
                   if len(sources) == 1 else ", or use one source as data.source")
            raise UserError(
                f"{origin}: data.order: epochs passes over one data dir, and data.sources is a "
                f"mixture (its windows are drawn by weight); set data.order=random{one}"
            )


ORDERS: dict[str, WindowOrder] = {order.name: order for order in (RandomOrder(), EpochOrder())}
register_choices("data.order", ORDERS)  # its names are the key's allowed values


def check_enough(split: TokenSplit, per_step: int, block_size: int) -> None:
    """Refuse a split (each source of a mixture) with fewer windows of block_size + 1 tokens
    than one step takes (per_step, over every rank and micro-batch): train calls it at set-up,
    before it touches the run folder, and each batch again."""
    for name, part in zip(split.names, split.parts, strict=True):
        what = f" (mixture source {name})" if split.draws_sources else ""
        _check_enough(part, per_step, block_size, what)


def _check_enough(split: TokenSplit, per_step: int, block_size: int, what: str) -> None:
    # The smallest count over all offsets, so the check does not depend on the step.
    # A shard of n tokens holds (n - 2T) // T + 1 windows at the latest offset, T - 1.
    if split.fewest_windows(block_size) < per_step:
        raise UserError(
            f"{split.data_dir}: the {split.split} split{what} has {split.n_tokens:,} tokens, "
            f"too few for one global batch of {per_step:,} windows of {block_size:,} tokens "
            f"(block_size; each reads one more, its last target), which needs at least "
            f"{(per_step + 1) * block_size:,} tokens in one shard; add data"
            + (", hold less out for validation (data.val_fraction, prepared anew)"
               if split.split == "train" else "")
            + " or lower the batch size or block_size"
        )


Window = tuple[int, int, int]  # (shard, start, targets), as val_windows makes them


def val_windows(
    split: TokenSplit, block_size: int, max_tokens: int | None = None
) -> list[Window]:
    """The fixed validation windows of one split: (shard, start, targets) each, in order.

    Every window predicts tokens [start + 1, start + targets] of its shard from the tokens just
    before them, back to the window's start. The split's whole pass cuts each shard into
    non-overlapping windows of block_size targets from its start (the last of a shard is
    shorter), so every token but a shard's first is a target exactly once. With `max_tokens`
    below that pass, the windows are ceil(max_tokens / block_size) full ones spread evenly
    over the whole split (window j of the W full ones is number j * W // k), the last cut so
    the targets are exactly max_tokens; a split with too few full windows (shards shorter
    than a block) takes its windows from the start instead. The set depends only on the
    split, block_size and max_tokens, never on a batch size or the number of processes.
    """
    sizes = split.shard_sizes.tolist()

    def every() -> Iterator[Window]:
        for shard, size in enumerate(sizes):
            for start in range(0, size - 1, block_size):
                yield shard, start, min(block_size, size - 1 - start)

    if max_tokens is None or max_tokens >= sum(max(0, size - 1) for size in sizes):
        return list(every())
    # A budget's windows are found by number, without listing the split's (a list that took
    # 0.6 GB for the train split of a 1 GB corpus at block_size 64).
    k = -(-max_tokens // block_size)
    # The full windows up to each shard's end: a shard's are its first (size - 1) // T.
    ends = np.cumsum([max(0, size - 1) // block_size for size in sizes]).tolist()
    chosen: Iterable[Window] = every()
    if ends[-1] >= k:
        numbers = [j * ends[-1] // k for j in range(k)]
        shards = np.searchsorted(ends, numbers, side="right").tolist()
        chosen = [(shard, (number - (ends[shard - 1] if shard else 0)) * block_size, block_size)
                  for number, shard in zip(numbers, shards, strict=True)]
    out, left = [], max_tokens
    for shard, start, n in chosen:
        if left <= 0:
            break
        out.append((shard, start, min(n, left)))
        left -= out[-1][2]
    return out


def window_groups(windows: list[Window], batch_size: int) -> list[list[Window]]:
    """Consecutive windows of equal length, at most batch_size a group: the batches, unread
    (`read_batch` reads one). Evaluation reads them one at a time, since the whole split's
    windows as tensors take 16 bytes a token (0.9 GB for a 1 GB corpus's val split)."""
    groups: list[list[Window]] = []
    for window in windows:
        last = groups[-1] if groups else None
        if last is None or len(last) == batch_size or last[0][2] != window[2]:
            groups.append([window])
        else:
            last.append(window)
    return groups


def read_batch(split: TokenSplit, group: list[Window]) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's windows stacked into (x, y) int64 tensors, its shards then checked unchanged
    (a batch is used only when they were unchanged after it was read)."""
    batch = _stack([split.tokens(shard, start, n + 1) for shard, start, n in group])
    split.check_unchanged()
    return batch


def token_byte_lengths(split: TokenSplit) -> np.ndarray:
    """UTF-8 bytes each token id of the split's tokenizer stands for (end-of-text: 0), for
    bits per byte; the tokenizer is the one the shards name (a BPE from the data dir)."""
    tok = load_tokenizer(split.tokenizer_identity.split(":", 1)[0], split.data_dir)
    if tok.identity != split.tokenizer_identity:
        raise DamagedFolder(split.data_dir, f"shards tokenized with "
                            f"{split.tokenizer_identity}, but its tokenizer is {tok.identity}",
                            split.data_dir)
    return tok.token_byte_lengths()
