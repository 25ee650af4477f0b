"""Setting up a training process: the run folder (new, replaced or resumed), the data, the model
and optimizer (restored on resume), the micro-batch. `set_up` is the recipe; each piece is one
function below. Rank 0 then writes the run's files and says the plan (andrea/train/plan.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from andrea.config import Config, load_config
from andrea.data.loader import TokenSplit, open_split
from andrea.data.prepare import check_vocab, ensure_prepared
from andrea.errors import UserError
from andrea.model.attention import resolve_backend
from andrea.model.transformer import Andrea
from andrea.train import checkpoint as ckpt_io
from andrea.train.device import pick_dtype
from andrea.train.distributed import DistInfo, all_reduce_sum, barrier, shard_model
from andrea.train.flops import MfuMeter, flops_per_token
from andrea.train.memory import (
    CPU_MICRO_BATCH_TOKENS,
    GIB,
    available_memory,
    choose_micro_batch,
)
from andrea.train.metrics import MetricsLog
from andrea.train.optim import build_optimizer
from andrea.train.plan import announce, start_run_files
from andrea.train.resume import check_resume_changes, find_run_to_resume
from andrea.train.rundir import CONFIG, METRICS
from andrea.train.session import Session, TrainResult
from andrea.train.signals import SignalWatch


def set_up(
    cfg: Config,
    device: torch.device,
    dist: DistInfo,
    signals: SignalWatch,
    *,
    resume: str | None,
    overwrite: bool,
) -> Session | TrainResult:
    """Find or make the run, the data, the model and optimizer (restored on resume), the
    micro-batch; write the run's config and start record; print the plan. A TrainResult
    instead when a resumed run is already at max_steps."""
    t = cfg.train
    run_dir, resume_from, changes, replace = open_run(cfg, dist, resume, overwrite)
    if resume_from is not None:
        done = ckpt_io.read_trainer_state(resume_from)[0]["step"]
        if done >= t.max_steps:
            return nothing_to_do(run_dir, resume_from, done, t.max_steps, dist)
    train_split, val_split = prepare_data(cfg, dist)
    dtype = pick_dtype(t.precision, device)
    backend, why = resolve_backend(cfg.model.attention, cfg.model.head_dim, device)
    model, optimizer, names, parallel = build_model(cfg, device, dist, dtype, backend)

    trainer_state: dict[str, Any] = {}
    if resume_from is not None:
        trainer_state = restore(model, optimizer, names, resume_from, train_split, device, dist)
    else:
        torch.manual_seed(t.seed + dist.rank)  # dropout differs per rank, deterministically
    micro_batch, micro_batch_line = resolve_micro_batch(cfg, model, dtype, device, dist,
                                                        trainer_state)
    accum = accumulation_steps(cfg, micro_batch, dist.world_size)

    s = Session(
        cfg=cfg, device=device, dist=dist, dtype=dtype, run_dir=run_dir, model=model,
        train_model=wrap_for_training(model, cfg, device, dist, parallel), optimizer=optimizer,
        param_names=names, train_split=train_split, val_split=val_split,
        micro_batch=micro_batch, accum=accum, log=MetricsLog(None), signals=signals,
        mfu=MfuMeter(device, dtype, flops_per_token(cfg.model, model.num_params())),
        preset=trainer_state.get("preset", Path(cfg.source).stem), parallel=parallel,
        step=trainer_state.get("step", 0), tokens_seen=trainer_state.get("tokens", 0),
        skipped=trainer_state.get("skipped_steps", 0),
        best_val=trainer_state.get("best_val_loss"), best_step=trainer_state.get("best_val_step"),
        checkpoint=resume_from, checkpoint_step=trainer_state.get("step"),
    )
    signals.completed_step, signals.checkpoint = s.step, s.checkpoint
    if dist.is_main:
        if replace:
            clear_run(run_dir)
        start_run_files(s, resume_from, changes, backend)
        signals.metrics_path = run_dir / METRICS
        announce(s, backend, why, changes, trainer_state, resume_from, micro_batch_line)
    return s


def nothing_to_do(
    run_dir: Path, checkpoint: Path, done: int, max_steps: int, dist: DistInfo
) -> TrainResult:
    """A resumed run already at max_steps: untouched."""
    return TrainResult(
        run_dir=run_dir, steps=done, tokens=0, seconds=0.0, state="nothing to do",
        best_val_loss=None, best_val_step=None, last_val_loss=None,
        checkpoint=checkpoint, is_main=dist.is_main,
        message=f"run {run_dir} is already at step {done} (max_steps {max_steps}): "
                f"nothing to do",
    )


def prepare_data(cfg: Config, dist: DistInfo) -> tuple[TokenSplit, TokenSplit]:
    """The train and val splits: rank 0 prepares the shards if they are missing, the others
    wait for it."""
    if dist.is_main:
        ensure_prepared(cfg)
    barrier(dist)
    train_split, val_split = open_split(cfg, "train"), open_split(cfg, "val")
    check_vocab(train_split.vocab_size, cfg.model.vocab_size, f"{cfg.source}: model.vocab_size")
    return train_split, val_split


def build_model(
    cfg: Config, device: torch.device, dist: DistInfo, dtype: torch.dtype, backend: str
) -> tuple[Andrea, torch.optim.Optimizer, dict[int, str], str]:
    """(model, optimizer, parameter names by id, parallel mode: none, ddp or fsdp). The model
    is sharded first under fsdp, since the optimizer must hold the sharded parameters."""
    t = cfg.train
    torch.manual_seed(t.seed)  # identical initial weights on every rank
    model = Andrea(cfg.model, attention_backend=backend).to(device)
    model.checkpoint_blocks = t.activation_checkpointing == "blocks"
    parallel = t.parallel if dist.enabled else "none"
    if parallel == "fsdp":
        shard_model(model, dist, device, bf16_params=dtype == torch.bfloat16
                    and device.type == "cuda")
    optimizer = build_optimizer(model, cfg, device)
    names = {id(p): n for n, p in model.named_parameters()}
    return model, optimizer, names, parallel


def wrap_for_training(
    model: Andrea, cfg: Config, device: torch.device, dist: DistInfo, parallel: str
) -> nn.Module:
    """The module the steps call: compiled if asked, inside DDP under ddp."""
    train_model: nn.Module = torch.compile(model) if cfg.train.compile else model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        device_ids = [dist.local_rank] if device.type == "cuda" else None
        train_model = DDP(train_model, device_ids=device_ids)
    return train_model


def open_run(
    cfg: Config, dist: DistInfo, resume: str | None, overwrite: bool
) -> tuple[Path, Path | None, dict[str, list[Any]], bool]:
    """(run dir, checkpoint to resume from or None, allowed config changes on resume, whether
    an old run is to be replaced: --overwrite)."""
    run_dir = Path(cfg.train.runs_dir) / cfg.train.name
    if resume is not None:
        found = find_run_to_resume(resume, cfg)
        if found is not None:
            stored = load_config(found / CONFIG)
            checkpoint = ckpt_io.resolve_checkpoint(found)
            trained = ckpt_io.read_trainer_state(checkpoint)[0]["step"] > 0
            changes = check_resume_changes(stored, cfg, found, trained)
            cfg.train.name = stored.train.name  # the run keeps its name in its config.yaml
            return found, checkpoint, changes, False
        if resume == "auto" and dist.is_main:
            print(f"--resume auto: no checkpoint under {run_dir}, starting a new run")
    replace = dist.is_main and ckpt_io.read_latest(run_dir) is not None
    if replace and not overwrite:
        raise UserError(
            f"{run_dir}: already holds a run; continue it with --resume {run_dir} "
            f"(or --resume auto), pick another name with --set train.name=..., "
            f"or replace it with --overwrite"
        )
    return run_dir, None, {}, replace


def clear_run(run_dir: Path) -> None:
    """--overwrite: remove the old run's checkpoints and metrics. Called only once every set-up
    check has passed, so a bad config or missing data never costs the old run."""
    for old in ckpt_io.list_checkpoints(run_dir):
        shutil.rmtree(old)
    for stale in (METRICS, ckpt_io.LATEST):
        (run_dir / stale).unlink(missing_ok=True)


def restore(
    model: Andrea,
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    checkpoint: Path,
    train_split: TokenSplit,
    device: torch.device,
    dist: DistInfo,
) -> dict[str, Any]:
    """Load weights, optimizer state and generator states; returns the trainer state.
    A sharded checkpoint (fsdp) is read through its shards, whole tensors otherwise; either
    fits the model as it is laid out now."""
    sharded = ckpt_io.has_shards(checkpoint)
    tensors, meta = ckpt_io.read_model_checkpoint(checkpoint, tensors=not sharded)[::2]
    if meta.get("tokenizer") != train_split.tokenizer_identity:
        raise UserError(
            f"{checkpoint}: trained with tokenizer {meta.get('tokenizer')}, but the data in "
            f"{train_split.data_dir} uses {train_split.tokenizer_identity}"
        )
    if sharded:
        ckpt_io.read_shards(checkpoint, model, optimizer, names)
    else:
        ckpt_io.load_weights(model, tensors, checkpoint / ckpt_io.MODEL_FILE)
        ckpt_io.load_optimizer(optimizer, names, checkpoint)
    state, rng = ckpt_io.read_trainer_state(checkpoint)
    _restore_rng(rng, device, dist)
    return state


def _restore_rng(rng: dict[str, torch.Tensor], device: torch.device, dist: DistInfo) -> None:
    cpu = rng.get(f"cpu.rank{dist.rank}")
    if cpu is not None:  # a run resumed with more processes than it had: fresh seeds there
        torch.set_rng_state(cpu)
    cuda = rng.get(f"cuda.rank{dist.rank}")
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


def resolve_micro_batch(
    cfg: Config,
    model: Andrea,
    dtype: torch.dtype,
    device: torch.device,
    dist: DistInfo | None = None,
    trainer_state: dict[str, Any] | None = None,
) -> tuple[int, str]:
    """(micro-batch, the line that explains an automatic choice or ''). An integer is obeyed;
    'auto' reuses the value a resumed run recorded, else the largest that fits the memory
    (on a CPU, of at most CPU_MICRO_BATCH_TOKENS tokens).
    Without dist: for one process (e.g. `andrea bench`)."""
    t, dist, trainer_state = cfg.train, dist or DistInfo(), trainer_state or {}
    if isinstance(t.micro_batch_size, int):
        return t.micro_batch_size, ""
    block = cfg.model.block_size
    if "micro_batch_size" in trainer_state:
        recorded = trainer_state["micro_batch_size"]
        return recorded, f"micro-batch: auto -> {recorded} x {block} (the run's recorded choice)"
    sequences = t.global_batch_tokens // (block * dist.world_size)
    if sequences < 1:
        raise UserError(
            f"{cfg.source}: train.micro_batch_size: auto needs train.global_batch_tokens of at "
            f"least block_size x processes = {block * dist.world_size}; set it, or give "
            f"micro_batch_size as a number"
        )
    cap = max(1, CPU_MICRO_BATCH_TOKENS // block) if device.type == "cpu" else None
    choice = choose_micro_batch(
        cfg.model, model.num_params(), sequences, dtype,
        t.activation_checkpointing == "blocks", available_memory(device), cap,
    )
    # Ranks measure their memory at slightly different moments: all take the smallest choice.
    votes = torch.zeros(dist.world_size, device=device)
    votes[dist.rank] = choice.micro_batch
    micro_batch = int(all_reduce_sum(votes, dist).min().item())
    accum = sequences // micro_batch
    line = (
        f"micro-batch: auto -> {micro_batch} x {block} ({accum} accumulation step"
        f"{'s' if accum != 1 else ''}), estimated {choice.estimated_bytes / GIB:.1f} of "
        f"{choice.available_bytes / GIB:.1f} GiB available"
    )
    if cap is not None and cap < sequences:
        line += f" (on a CPU at most {CPU_MICRO_BATCH_TOKENS:,} tokens a micro-batch)"
    if not choice.fits:
        line += (" (does not fit even at 1: expect to run out of memory; try "
                 "train.activation_checkpointing=blocks)")
    return micro_batch, line


def accumulation_steps(cfg: Config, micro_batch: int, world_size: int) -> int:
    per_micro = micro_batch * cfg.model.block_size
    if cfg.train.global_batch_tokens == 0:
        return 1
    per_round = per_micro * world_size
    if cfg.train.global_batch_tokens % per_round:
        raise UserError(
            f"{cfg.source}: train.global_batch_tokens: {cfg.train.global_batch_tokens} is not a "
            f"multiple of micro_batch_size * block_size * processes = "
            f"{micro_batch} * {cfg.model.block_size} * {world_size} = {per_round}"
        )
    return cfg.train.global_batch_tokens // per_round
