"""`andrea eval`: loss, perplexity and bits per byte of a checkpoint over a prepared split.

The pass is sequential and deterministic. Each shard of the split is cut into non-overlapping
windows of block_size targets: window w predicts tokens [w*T + 1, (w+1)*T] of the shard from
the tokens just before them (x = tokens[w*T : (w+1)*T], y = x shifted by one), so every token but
the first of each shard is predicted exactly once, with the context that reaches back to its
window's start. The last window of a shard is shorter. `max_tokens` caps the number of targets
(the last window is cut). Windows never cross a shard boundary.

Bits per byte = total nats / ln 2 / bytes, where bytes is the number of UTF-8 bytes the
evaluated target tokens decode to, counted per token: every id of a byte-level tokenizer
(byte, gpt2, bpe) stands for a fixed byte string, and the per-token lengths add up to the
byte length of the decoded target stream whatever the token boundaries (no partial-UTF-8
miscounting). End-of-text stands for no text and counts 0 bytes. With the byte tokenizer,
bytes = targets that are not end-of-text.

Also here, shared with `generate` and `export`: finding a checkpoint (`find_checkpoint`),
loading it as a model (`load_model`), finding its tokenizer (`tokenizer_for_checkpoint`) and
preparing the run's data folder from its config when it has none yet (`prepare_run_data`: an
imported run, or a run evaluated from another working directory), as `andrea train` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from andrea.config import CHOICES, Config
from andrea.data.loader import TokenSplit
from andrea.data.prepare import SPLITS, data_dir_for, prepare_from_config, source_words
from andrea.data.shards import MANIFEST
from andrea.data.tokenizer import (
    BPE_FILE,
    BpeTokenizer,
    Tokenizer,
    load_tokenizer,
)
from andrea.errors import UserError
from andrea.model.attention import resolve_backend
from andrea.model.transformer import Andrea
from andrea.train import checkpoint as ckpt_io


def _say(message: str) -> None:
    """Notices go to stderr, so that stdout holds only the result (e.g. --json)."""
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- checkpoints


def most_recent_run(
    runs_dir: Path | str = "runs", use: str = "andrea eval --checkpoint {}"
) -> Path:
    """The checkpoint of the run under runs_dir whose latest checkpoint was written last (its
    model file's time, or its `latest` file's when that model is gone); a damaged one is
    refused naming its newest intact step (never silently another run's)."""
    runs_dir = Path(runs_dir)
    found: list[tuple[float, Path]] = []
    if runs_dir.is_dir():
        for run in runs_dir.iterdir():
            latest = ckpt_io.read_latest(run) if run.is_dir() else None
            for written in (latest / ckpt_io.MODEL_FILE if latest else None, run / ckpt_io.LATEST):
                if written is not None and written.is_file():
                    found.append((written.stat().st_mtime, run))
                    break
    if not found:
        raise UserError(
            f"no --checkpoint given and no run with a checkpoint under {runs_dir}/; "
            "pass --checkpoint runs/<name>[/step-N]"
        )
    return ckpt_io.resolve_checkpoint(max(found, key=lambda item: item[0])[1], use=use)


def find_checkpoint(
    checkpoint: str | Path | None, runs_dir: Path | str = "runs",
    use: str = "andrea eval --checkpoint {}",
) -> Path:
    """A run dir means its latest checkpoint, a step dir itself, None the most recent run.
    use: the command that takes another checkpoint ({} for it), for the error that refuses a
    damaged one and names the run's newest intact checkpoint."""
    if checkpoint is None:
        ckpt = most_recent_run(runs_dir, use)
        _say(f"checkpoint: {ckpt} (the most recent run under {runs_dir}/)")
        return ckpt
    return ckpt_io.resolve_checkpoint(checkpoint, use=use)


def load_model(
    ckpt: Path, device: torch.device | str = "cpu"
) -> tuple[Andrea, Config, dict[str, str]]:
    """The checkpoint's model in eval mode on `device` (float32 weights), config, metadata."""
    tensors, cfg, metadata = ckpt_io.read_model_checkpoint(ckpt)
    device = torch.device(device)
    # The CUDA kernels only where there is a GPU: a GPU-trained checkpoint still runs on a CPU.
    requested = cfg.model.attention if device.type == "cuda" else "auto"
    backend, _ = resolve_backend(requested, cfg.model.head_dim, device)
    model = Andrea(cfg.model, attention_backend=backend)
    ckpt_io.load_weights(model, tensors, ckpt / ckpt_io.MODEL_FILE)
    return model.to(device).eval(), cfg, metadata


def local_data_config(cfg: Config) -> Config:
    """A checkpoint's config with its data folder re-derived under ./data (data.dir cleared).

    A checkpoint is untrusted input: its data.dir may name any folder on this machine (the
    exporter's, or one chosen to do harm), so eval, generate and export never write there;
    they prepare the run's data in data/<source>-<tokenizer>[...] instead, the folder
    `andrea prepare` would derive from the same settings."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=""))


def prepare_run_data(ckpt: Path, cfg: Config, instead: str) -> Path:
    """The run's prepared data folder: the one its config names (data.dir) when that folder
    already holds prepared data (read only), else the folder derived under ./data
    (`local_data_config`), prepared from the config first, as `andrea train` does, when it
    holds no prepared data; says so in one line. Nothing is ever written in a folder named
    only by the checkpoint. `instead`: what the user can do when that fails (the end of the
    error message).

    Notices go to stderr (stdout may be --json or the generated text).
    """
    named = data_dir_for(cfg)
    if (named / MANIFEST).is_file():
        return named
    local = local_data_config(cfg)
    data_dir = data_dir_for(local)
    if (data_dir / MANIFEST).is_file():
        return data_dir
    d = cfg.data
    tokenizer = d.tokenizer_file or f"the {d.tokenizer} tokenizer"
    why = ("the run's data folder, not prepared yet" if named == data_dir else
           f"the run's config names {named}, which is not prepared; andrea writes data only "
           f"under ./data for a checkpoint")
    announce = (f"preparing {data_dir} ({why}) from {source_words(cfg)} with {tokenizer}, as "
                f"the run's config says")
    try:
        # prepare announces on stdout, as train's log; here stdout is the result.
        with contextlib.redirect_stdout(sys.stderr):
            return prepare_from_config(local, verbose=False, announce=announce)
    except UserError as exc:
        raise UserError(
            f"{ckpt}: cannot prepare the run's data in {data_dir} from its config ({exc}); "
            f"{instead}"
        ) from None


def _find_bpe(candidates: tuple[Path, ...], identity: str) -> BpeTokenizer | None:
    """The first candidate tokenizer.json that is a BPE of this identity. Only reading: a file
    of that name that is no BPE (the folder may not be the run's at all) is passed over."""
    for path in candidates:
        if path.is_file():
            try:
                tok = BpeTokenizer(path)
            except UserError:
                continue
            if tok.identity == identity:
                return tok
    return None


def tokenizer_for_checkpoint(
    ckpt: Path, cfg: Config, metadata: dict[str, str], prepare_missing: bool = False
) -> Tokenizer:
    """The tokenizer a checkpoint was trained with, checked by its identity.

    byte and gpt2 are rebuilt from the package. A trained BPE is read from the run's data dir
    (data.dir of its config), else from the one derived under ./data, else from a
    tokenizer.json beside the checkpoint or in its run directory (where `andrea import` puts
    one). With `prepare_missing`, a BPE found nowhere is made by preparing the run's data from
    its config (`prepare_run_data`, under ./data); its identity must still match.
    """
    identity = metadata.get("tokenizer", "")
    kind = identity.split(":", 1)[0]
    if kind in ("byte", "gpt2"):
        tok = load_tokenizer(kind)
        if tok.identity != identity:
            raise UserError(
                f"{ckpt}: trained with tokenizer {identity}, but this install's {kind} tokenizer "
                f"is {tok.identity}"
            )
        return tok
    if kind != "bpe":
        raise UserError(f"{ckpt}: unknown tokenizer identity {identity!r} in the metadata")
    data_dir = data_dir_for(cfg)
    local_dir = data_dir_for(local_data_config(cfg))
    candidates = (data_dir / BPE_FILE, local_dir / BPE_FILE, ckpt / BPE_FILE,
                  ckpt.parent / BPE_FILE)
    tok = _find_bpe(candidates, identity)
    if tok is None and prepare_missing:
        prepare_run_data(ckpt, cfg, f"copy the model's {BPE_FILE} into {ckpt.parent}")
        tok = _find_bpe(candidates, identity)
    if tok is not None:
        return tok
    searched = ", ".join(str(path.parent) for path in candidates)
    raise UserError(
        f"{ckpt}: trained with BPE tokenizer {identity}, which is in none of {searched}; "
        f"copy that tokenizer.json into {ckpt.parent}, or prepare the run's data "
        f"(`andrea prepare -c {ckpt.parent / 'config.yaml'} --set data.dir={local_dir}`)"
    )


# ----------------------------------------------------------------------------- bytes


# ----------------------------------------------------------------------------- eval


@dataclass
class EvalResult:
    loss: float  # mean nats per target token
    perplexity: float
    bits_per_byte: float | None  # None when the targets decode to no bytes
    tokens: int  # target tokens evaluated
    bytes: int
    checkpoint: str
    data_dir: str
    split: str
    precision: str
    device: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def summary(self) -> str:
        bpb = f"{self.bits_per_byte:.4f}" if self.bits_per_byte is not None else "n/a"
        return (
            f"{self.checkpoint} on {self.data_dir} ({self.split}): loss {self.loss:.4f}, "
            f"perplexity {self.perplexity:.3f}, bits/byte {bpb}, {self.tokens:,} tokens "
            f"({self.bytes:,} bytes), {self.precision}, {self.device}"
        )


def eval_windows(
    split: TokenSplit, block_size: int, max_tokens: int | None
) -> Iterator[tuple[int, int, int]]:
    """(shard, start, targets) of each window, in order; see the module doc."""
    left = max_tokens if max_tokens is not None else math.inf
    for shard, size in enumerate(split.shard_sizes.tolist()):
        for start in range(0, size - 1, block_size):
            n = int(min(block_size, size - 1 - start, left))
            if n <= 0:
                return
            yield shard, start, n
            left -= n


def _batches(
    split: TokenSplit, block_size: int, batch_size: int, max_tokens: int | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive windows of equal length stacked into (x, y) int64 batches of <= batch_size."""
    group: list[np.ndarray] = []
    for shard, start, n in eval_windows(split, block_size, max_tokens):
        window = np.asarray(split.shards[shard][start : start + n + 1], dtype=np.int64)
        if group and (len(group) == batch_size or len(group[0]) != len(window)):
            batch = torch.from_numpy(np.stack(group))
            yield batch[:, :-1], batch[:, 1:]
            group = []
        group.append(window)
    if group:
        batch = torch.from_numpy(np.stack(group))
        yield batch[:, :-1], batch[:, 1:]


@torch.no_grad()
def evaluate_model(
    model: Andrea,
    split: TokenSplit,
    byte_lengths: np.ndarray,
    *,
    max_tokens: int | None = None,
    dtype: torch.dtype = torch.float32,
    batch_size: int = 8,
    progress: bool = False,
) -> tuple[float, int, int]:
    """(total nats, target tokens, bytes) of `model` over `split`; sums in float64."""
    device = next(model.parameters()).device
    total_targets = sum(n for _, _, n in eval_windows(split, model.cfg.block_size, max_tokens))
    if total_targets == 0:
        raise UserError(f"{split.data_dir}: the {split.split} split has no tokens to evaluate")
    nats = torch.zeros((), dtype=torch.float64, device=device)
    n_tokens = n_bytes = 0
    bar = tqdm(total=total_targets, disable=not progress, unit="tok", unit_scale=True,
               dynamic_ncols=True, file=sys.stderr)
    autocast = dtype not in (torch.float32, torch.float64)
    for x, y in _batches(split, model.cfg.block_size, batch_size, max_tokens):
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            logits, _ = model(x.to(device))
        losses = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1),
            reduction="none",
        )
        nats += losses.double().sum()
        n_tokens += y.numel()
        n_bytes += int(byte_lengths[y.numpy()].sum())
        bar.update(y.numel())
    bar.close()
    return nats.item(), n_tokens, n_bytes


def evaluate_checkpoint(
    checkpoint: str | None,
    data: str | None = None,
    max_tokens: int | None = None,
    precision: str = "auto",
    device: str = "auto",
    batch_size: int = 8,
    progress: bool = True,
    split: str = "val",
    runs_dir: str = "runs",
) -> EvalResult:
    """What `andrea eval` does: see the module doc."""
    from andrea.train.device import pick_device, pick_dtype

    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"--max-tokens: must be a positive integer, got {max_tokens}")
    if batch_size < 1:
        raise UserError(f"--batch-size: must be a positive integer, got {batch_size}")
    if precision not in CHOICES["train.precision"]:
        raise UserError(f"--precision: '{precision}' is not one of auto, fp32, bf16")
    if split not in SPLITS:
        raise UserError(f"--split: '{split}' is not one of {', '.join(SPLITS)}")
    ckpt = find_checkpoint(checkpoint, runs_dir)
    dev = pick_device(device)
    dtype = pick_dtype(precision, dev)
    model, cfg, metadata = load_model(ckpt, dev)
    if data is not None:
        data_dir = Path(data)
        if not data_dir.is_dir():
            raise UserError(f"--data {data}: no such directory")
    else:
        data_dir = prepare_run_data(
            ckpt, cfg, "pass --data DIR (shards prepared with the checkpoint's tokenizer)"
        )
    tok = tokenizer_for_checkpoint(ckpt, cfg, metadata)
    token_split = TokenSplit(data_dir, split)
    if token_split.tokenizer_identity != tok.identity:
        raise UserError(
            f"{data_dir}: tokenized with {token_split.tokenizer_identity}, but {ckpt} was trained "
            f"with {tok.identity}; evaluate on data prepared with the checkpoint's tokenizer"
        )
    nats, n_tokens, n_bytes = evaluate_model(
        model, token_split, tok.token_byte_lengths(), max_tokens=max_tokens, dtype=dtype,
        batch_size=batch_size, progress=progress,
    )
    loss = nats / n_tokens
    return EvalResult(
        loss=loss,
        perplexity=math.exp(loss) if loss < 700 else math.inf,
        bits_per_byte=nats / math.log(2) / n_bytes if n_bytes else None,
        tokens=n_tokens,
        bytes=n_bytes,
        checkpoint=str(ckpt),
        data_dir=str(data_dir),
        split=split,
        precision=str(dtype).removeprefix("torch."),
        device=str(dev),
    )
