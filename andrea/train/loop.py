"""`andrea train`: the training loop.

The recipe, per optimizer step: set the scheduled learning rate; run accum_steps micro-batches
(forward under autocast, backward of loss / accum_steps; DDP all-reduces the gradients on the
last one); clip by global norm; check the loss and norm are finite; AdamW step; log, evaluate,
checkpoint. Everything a resumed run needs (weights, moments, RNG states, step) is in the
checkpoint, and batches depend only on (seed, step, rank), so a resume repeats the losses exactly.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from tqdm import tqdm

from andrea.config import Config, load_config
from andrea.data.loader import (
    TokenSplit,
    mixture_report,
    open_split,
    source_passes,
    train_batch,
    val_batches,
)
from andrea.data.prepare import check_vocab, ensure_prepared
from andrea.errors import UserError
from andrea.fileio import atomic_write_text
from andrea.model.attention import resolve_backend
from andrea.model.transformer import Andrea
from andrea.train import checkpoint as ckpt_io
from andrea.train.device import pick_device, pick_dtype
from andrea.train.distributed import (
    DistInfo,
    all_gather_bytes,
    all_reduce_sum,
    barrier,
    clip_grad_norm,
    init_distributed,
    shard_model,
    shutdown,
)
from andrea.train.flops import MfuMeter, flops_per_token, format_mfu
from andrea.train.memory import (
    CPU_MICRO_BATCH_TOKENS,
    GIB,
    available_memory,
    choose_micro_batch,
)
from andrea.train.metrics import MetricsLog
from andrea.train.optim import build_optimizer
from andrea.train.progress import RunBar, long_run_note
from andrea.train.resume import (
    check_resume_changes,
    find_run_to_resume,
)
from andrea.train.rundir import CONFIG, METRICS
from andrea.train.schedule import lr_at, replan
from andrea.train.signals import EXIT_SIGNAL, SetUpInterrupted, SignalWatch
from andrea.train.spike import (
    APPLY,
    ROLLBACK,
    SKIP,
    SpikeGuard,
    agree,
    garble,
    injected_spike,
    same_on_every_rank,
)


class NonFiniteError(Exception):
    """A NaN or infinite loss or gradient norm stopped the run."""


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    tokens: int
    seconds: float
    state: str  # finished | stopped | interrupted | nonfinite | nothing to do
    best_val_loss: float | None
    best_val_step: int | None
    last_val_loss: float | None
    checkpoint: Path | None
    losses: dict[int, float] = field(default_factory=dict)  # step -> train loss
    exit_code: int = 0
    message: str = ""
    is_main: bool = True  # rank 0 (the one process that writes and speaks)


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


def _local_rng(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _rng_tensors(local: dict[str, torch.Tensor], dist: DistInfo) -> dict[str, torch.Tensor]:
    """Every rank's generator states, keyed '<kind>.rank<r>' (a collective)."""
    out = {}
    for kind, state in local.items():
        for rank, gathered in enumerate(all_gather_bytes(state, dist)):
            out[f"{kind}.rank{rank}"] = gathered
    return out


def _restore_rng(rng: dict[str, torch.Tensor], device: torch.device, dist: DistInfo) -> None:
    cpu = rng.get(f"cpu.rank{dist.rank}")
    if cpu is not None:  # a run resumed with more processes than it had: fresh seeds there
        torch.set_rng_state(cpu)
    cuda = rng.get(f"cuda.rank{dist.rank}")
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    split: TokenSplit,
    cfg: Config,
    micro_batch: int,
    device: torch.device,
    dtype: torch.dtype,
    dist: DistInfo,
    lockstep: bool = False,
) -> float:
    """Mean loss over the first eval_batches sequential val batches, shared among the ranks.
    lockstep (sharded weights): every rank runs as many forwards as the busiest one, since each
    forward gathers the weights from all of them; a rank short of a batch repeats one and
    counts nothing."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    batches = list(val_batches(
        split,
        micro_batch_size=micro_batch,
        block_size=cfg.model.block_size,
        max_batches=cfg.train.eval_batches,
    ))
    rounds = math.ceil(len(batches) / dist.world_size)
    for i in range(rounds * dist.world_size)[dist.rank::dist.world_size]:
        if i >= len(batches) and not lockstep:
            break
        x, y = batches[min(i, len(batches) - 1)]
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(x.to(device), y.to(device))
        if i < len(batches):
            total += torch.tensor([loss.item() * y.numel(), y.numel()], device=device)
    all_reduce_sum(total, dist)
    model.train(was_training)
    return (total[0] / total[1]).item() if total[1] > 0 else float("nan")


def train(
    cfg: Config,
    *,
    resume: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
) -> TrainResult:
    """Train per cfg (or continue a run); returns what happened. Callable from Python.

    stop_after: run at most this many steps now, then checkpoint and stop (state "stopped"),
    e.g. to fit a job's time slot; `--resume` continues on the same schedule.
    """
    device = pick_device(cfg.train.device)
    dist = init_distributed(device.type)
    try:
        return run_training(
            cfg, device, dist, resume=resume, overwrite=overwrite, progress=progress,
            stop_after=stop_after,
        )
    finally:
        shutdown(dist)


@dataclass
class Session:
    """What one training process holds while it runs: set up once, then advanced step by step."""

    cfg: Config
    device: torch.device
    dist: DistInfo
    dtype: torch.dtype
    run_dir: Path
    model: Andrea
    train_model: nn.Module
    optimizer: torch.optim.Optimizer
    param_names: dict[int, str]
    train_split: TokenSplit
    val_split: TokenSplit
    micro_batch: int
    accum: int
    log: MetricsLog
    signals: SignalWatch
    mfu: MfuMeter
    preset: str
    guard: SpikeGuard
    parallel: str = "none"  # how the processes share the work: none (one), ddp or fsdp
    step: int = 0
    tokens_seen: int = 0
    skipped: int = 0
    best_val: float | None = None
    best_step: int | None = None
    last_val: float | None = None
    checkpoint: Path | None = None  # the newest complete checkpoint of the run
    checkpoint_step: int | None = None
    losses: dict[int, float] = field(default_factory=dict)
    throughput: list[float] = field(default_factory=list)
    schedule_anchor: dict[str, Any] | None = None  # the lr schedule re-planned on a resume

    @property
    def tokens_per_micro_batch(self) -> int:  # over all ranks
        return self.micro_batch * self.cfg.model.block_size * self.dist.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.tokens_per_micro_batch * self.accum

    def say(self, text: str) -> None:
        if self.dist.is_main:
            print(text, flush=True)


def run_training(
    cfg: Config,
    device: torch.device,
    dist: DistInfo,
    *,
    resume: str | None,
    overwrite: bool,
    progress: bool,
    stop_after: int | None,
) -> TrainResult:
    """Set up, then per step: forward/backward over the micro-batches, clip, optimizer step,
    log, evaluate, checkpoint; then record how the run ended."""
    t = cfg.train
    with SignalWatch() as signals:
        try:
            s = set_up(cfg, device, dist, signals, resume=resume, overwrite=overwrite)
        except SetUpInterrupted as stop:
            return set_up_interrupted(cfg, dist, signals, stop.signum, resume is not None)
        signals.setting_up = False
        if isinstance(s, TrainResult):
            return s  # nothing to do: the run was not touched
        bar = progress_bar(s, progress)
        start_step, t_start = s.step, time.perf_counter()
        state, exit_code, message = "finished", 0, ""
        s.train_model.train()
        try:
            with failures_recorded(s):
                while s.step < t.max_steps:
                    t0 = time.perf_counter()
                    lr = set_learning_rate(s)
                    rng_before_step = _local_rng(device)
                    outcome = forward_backward(s, bar)
                    if outcome is None:  # stopped inside the step: its gradients never apply
                        s.optimizer.zero_grad(set_to_none=True)
                        save_checkpoint(s, rng_before_step)
                        break
                    loss, grad_norm = outcome
                    if optimizer_step(s, loss, grad_norm) == ROLLBACK:
                        roll_back(s)
                        bar.n = s.step * s.tokens_per_step  # the bar goes back with the run
                        continue
                    log_step(s, lr, loss, grad_norm, time.perf_counter() - t0, bar)
                    maybe_evaluate(s, bar)
                    stopping = stop_agreed(s)
                    pausing = stop_after is not None and s.step - start_step >= stop_after
                    periodic = t.checkpoint_every and s.step % t.checkpoint_every == 0
                    if periodic or s.step == t.max_steps or stopping or pausing:
                        save_checkpoint(s, _local_rng(device))
                    if stopping:
                        break
                    if pausing and s.step < t.max_steps:
                        state = "stopped"
                        message = f"paused after {stop_after} steps (--stop-after); {s.checkpoint}"
                        break
        except NonFiniteError as exc:
            state, exit_code = "nonfinite", 1
            message = (
                f"{exc}; nothing was written over the last good checkpoint ({s.checkpoint})"
                if s.checkpoint else f"{exc}; no checkpoint had been written yet"
            )
        finally:
            bar.close()
        if signals.received is not None and state != "nonfinite" and s.step < t.max_steps:
            state, exit_code, message = interrupted_outcome(s)
        return finish(s, state, exit_code, message, time.perf_counter() - t_start)


@contextlib.contextmanager
def failures_recorded(s: Session) -> Iterator[None]:
    """Any failure other than a non-finite loss ends the run with an end event, then raises;
    out of GPU memory becomes a one-line error saying what to change."""
    try:
        yield
    except NonFiniteError:
        raise
    except torch.cuda.OutOfMemoryError:
        s.log.write("end", step=s.step, tokens=s.tokens_seen, state="failed", signal=None,
                    message="out of GPU memory")
        raise UserError(
            f"out of GPU memory at micro-batch {s.micro_batch} x {s.cfg.model.block_size}: "
            f"set train.micro_batch_size lower (or auto), or "
            f"train.activation_checkpointing=blocks (train.global_batch_tokens stays)"
        ) from None
    except BaseException as exc:
        # A user's mistake stops the run; anything else is a failure. Either way, say so.
        s.log.write("end", step=s.step, tokens=s.tokens_seen, signal=None,
                    state="stopped" if isinstance(exc, UserError) else "failed",
                    message=f"{type(exc).__name__}: {exc}")
        raise


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
            return TrainResult(
                run_dir=run_dir, steps=done, tokens=0, seconds=0.0, state="nothing to do",
                best_val_loss=None, best_val_step=None, last_val_loss=None,
                checkpoint=resume_from, is_main=dist.is_main,
                message=f"run {run_dir} is already at step {done} (max_steps {t.max_steps}): "
                        f"nothing to do",
            )

    # Data: rank 0 prepares the shards if they are missing, the others wait for it.
    if dist.is_main:
        ensure_prepared(cfg)
    barrier(dist)
    train_split, val_split = open_split(cfg, "train"), open_split(cfg, "val")
    check_vocab(train_split.vocab_size, cfg.model.vocab_size, f"{cfg.source}: model.vocab_size")

    dtype = pick_dtype(t.precision, device)
    backend, why = resolve_backend(cfg.model.attention, cfg.model.head_dim, device)
    torch.manual_seed(t.seed)  # identical initial weights on every rank
    model = Andrea(cfg.model, attention_backend=backend).to(device)
    model.checkpoint_blocks = t.activation_checkpointing == "blocks"
    n_params = model.num_params()
    parallel = t.parallel if dist.enabled else "none"
    if parallel == "fsdp":  # before the optimizer, which must hold the sharded parameters
        shard_model(model, dist, device, bf16_params=dtype == torch.bfloat16
                    and device.type == "cuda")
    optimizer = build_optimizer(model, cfg, device)
    names = {id(p): n for n, p in model.named_parameters()}

    trainer_state: dict[str, Any] = {}
    if resume_from is not None:
        trainer_state = restore(model, optimizer, names, resume_from, train_split, device, dist)
    else:
        torch.manual_seed(t.seed + dist.rank)  # dropout differs per rank, deterministically
    micro_batch, micro_batch_line = resolve_micro_batch(cfg, model, dtype, device, dist,
                                                        trainer_state)
    accum = accumulation_steps(cfg, micro_batch, dist.world_size)

    train_model: nn.Module = torch.compile(model) if t.compile else model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        device_ids = [dist.local_rank] if device.type == "cuda" else None
        train_model = DDP(train_model, device_ids=device_ids)

    s = Session(
        cfg=cfg, device=device, dist=dist, dtype=dtype, run_dir=run_dir, model=model,
        train_model=train_model, optimizer=optimizer, param_names=names,
        train_split=train_split, val_split=val_split, micro_batch=micro_batch, accum=accum,
        log=MetricsLog(None), signals=signals,
        mfu=MfuMeter(device, dtype, flops_per_token(cfg.model, n_params)),
        preset=trainer_state.get("preset", Path(cfg.source).stem), parallel=parallel,
        guard=SpikeGuard(t, trainer_state.get("spike_guard")),
        step=trainer_state.get("step", 0), tokens_seen=trainer_state.get("tokens", 0),
        skipped=trainer_state.get("skipped_steps", 0),
        best_val=trainer_state.get("best_val_loss"), best_step=trainer_state.get("best_val_step"),
        checkpoint=resume_from, checkpoint_step=trainer_state.get("step"),
    )
    signals.completed_step, signals.checkpoint = s.step, s.checkpoint
    # The max_steps the checkpoint was planned for (older checkpoints: the run's config).
    planned_max = trainer_state.get("max_steps", changes.get("train.max_steps", [t.max_steps])[0])
    s.schedule_anchor, schedule_lines = replan(s.step, t, planned_max,
                                               trainer_state.get("schedule_anchor"))
    if dist.is_main:
        if replace:
            clear_run(run_dir)
        start_run_files(s, resume_from, changes, backend)
        signals.metrics_path = run_dir / METRICS
        s.say(f"attention: {backend} ({why})")
        for key, (old, new) in changes.items():
            s.say(f"resume: {key} {old} -> {new}")
        for line in parallel_lines(t.parallel, parallel, dist, trainer_state) + schedule_lines:
            s.say(line)
        s.say(
            f"{run_dir}: {n_params:,} parameters, {s.tokens_per_step:,} tokens/step "
            f"({micro_batch} x {cfg.model.block_size} x {accum} accumulation x "
            f"{dist.world_size} process{'es' if dist.world_size > 1 else ''}), "
            f"{str(dtype).removeprefix('torch.')}, {device}"
            + (f", resuming from {resume_from}" if resume_from else "")
        )
        mixture = mixture_report(
            train_split, seed=t.seed, start_step=s.step, max_steps=t.max_steps,
            per_step=micro_batch * accum * dist.world_size, block_size=cfg.model.block_size,
        )
        if mixture is not None:
            s.say(mixture[0])
            s.log.write("data_mixture", **mixture[1])
        if micro_batch_line:
            s.say(micro_batch_line)
        for line in plan_lines(s):
            s.say(line)
    return s


def parallel_lines(asked: str, parallel: str, dist: DistInfo,
                   trainer_state: dict[str, Any]) -> list[str]:
    """What the processes share, and how a resumed checkpoint is laid out anew, if it is."""
    lines = []
    if asked == "fsdp" and not dist.enabled:
        lines.append("parallel: fsdp with 1 process: nothing to shard, the model runs whole")
    elif parallel == "fsdp":
        lines.append(f"parallel: fsdp, parameters, gradients and optimizer state sharded over "
                     f"{dist.world_size} processes")
    if trainer_state:
        was_world = trainer_state.get("world_size", 1)
        was = trainer_state.get("parallel", "ddp" if was_world > 1 else "none")
        if (was_world, was) != (dist.world_size, parallel):
            lines.append(f"resume: resharding the checkpoint written by {was_world} "
                         f"process{'es' if was_world > 1 else ''} ({was}) for "
                         f"{dist.world_size} ({parallel})")
    return lines


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


def start_run_files(
    s: Session, resume_from: Path | None, changes: dict[str, list[Any]], backend: str
) -> None:
    """Rank 0: the run folder, its config.yaml (with any resume changes) and the start event."""
    t = s.cfg.train
    s.run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_io.clean_partials(s.run_dir)
    atomic_write_text(s.run_dir / CONFIG, s.cfg.to_yaml())
    tensorboard = None
    if t.tensorboard:
        from andrea.train.tensorboard import open_tensorboard

        tensorboard = open_tensorboard(s.run_dir, True)
    s.log = MetricsLog(s.run_dir / METRICS, tensorboard)
    s.log.write(
        "start", step=s.step, max_steps=t.max_steps, pid=os.getpid(),
        host=socket.gethostname(), resumed_from=str(resume_from) if resume_from else None,
        n_params=s.model.num_params(), preset=s.preset, world_size=s.dist.world_size,
        precision=str(s.dtype).removeprefix("torch."), attention=backend,
        micro_batch_size=s.micro_batch, accum_steps=s.accum,
        tokens_per_step=s.tokens_per_step, micro_batch_auto=t.micro_batch_size == "auto",
        activation_checkpointing=t.activation_checkpointing, changed=changes or None,
    )


def plan_lines(s: Session) -> list[str]:
    """The run's size up front (a mixture: the passes over each source, drawn by weight), and
    a warning for data, or a source, repeated more than 100 times."""
    steps, per_step = s.cfg.train.max_steps, s.tokens_per_step
    total, prepared = steps * per_step, s.train_split.n_tokens
    passes = total / prepared if prepared else math.inf
    sources = source_passes(s.train_split, total)
    line = (f"plan: {steps:,} steps x {per_step:,} tokens/step = {total:,} tokens = "
            f"{_passes(passes)} passes over the {prepared:,} prepared training tokens")
    if len(sources) > 1:
        line += "; per source: " + ", ".join(
            f"{name} {_passes(p)} over {n:,}" for name, p, n in sources)
    lines = [line + (f" (resuming at step {s.step:,})" if s.step else "")]
    if len(sources) == 1 and passes > 100:
        lines.append(
            f"warning: {passes:,.0f} passes over the same training tokens: the model will "
            f"memorise them; prepare more data, or lower train.max_steps or "
            f"train.global_batch_tokens"
        )
    lines += [
        f"warning: mixture source {name}: {p:,.0f} passes over its {n:,} training tokens: the "
        f"model will memorise them; prepare more of it, lower its weight in data.sources, or "
        f"lower train.max_steps"
        for name, p, n in sources if len(sources) > 1 and p > 100
    ]
    return lines


def _passes(passes: float) -> str:
    return f"{passes:,.1f}" if passes >= 0.1 else f"{passes:.2g}"


def progress_bar(s: Session, enabled: bool) -> tqdm:
    """Counts tokens, advanced per micro-batch: rate and ETA for the whole run at once."""
    return RunBar(
        total=s.cfg.train.max_steps * s.tokens_per_step, initial=s.step * s.tokens_per_step,
        disable=not (enabled and s.dist.is_main), unit="tok", unit_scale=True,
        dynamic_ncols=True, file=sys.stderr,
    )


def set_learning_rate(s: Session) -> float:
    lr = lr_at(s.step, s.cfg.train, s.schedule_anchor) * s.guard.lr_scale(s.step)
    for group in s.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)
    return lr


def stop_agreed(s: Session) -> bool:
    """Whether a signal asks to stop; every rank must agree, or one would wait forever in the
    next all-reduce."""
    flag = s.signals.received is not None
    if not s.dist.enabled:
        return flag
    t_flag = torch.tensor([1.0 if flag else 0.0], device=s.device)
    return all_reduce_sum(t_flag, s.dist).item() > 0


def forward_backward(s: Session, bar: tqdm) -> tuple[float, float] | None:
    """The step's micro-batches on this rank; (mean loss over all ranks, grad norm after
    clipping's measurement), or None when a signal stops the run before the last one."""
    t, step = s.cfg.train, s.step
    data_step = s.guard.data_step(step)  # past any data window a rollback left behind
    spike_scale = injected_spike(data_step)  # None unless a test injects a spike
    loss_sum = torch.zeros((), device=s.device)
    for micro in range(s.accum):
        if stop_agreed(s):
            return None
        x, y = train_batch(
            s.train_split, seed=t.seed, step=data_step, micro_step=micro, rank=s.dist.rank,
            accum_steps=s.accum, world_size=s.dist.world_size,
            micro_batch_size=s.micro_batch, block_size=s.cfg.model.block_size,
        )
        if spike_scale is not None:
            x, y = garble(x, y, s.cfg.model.vocab_size, data_step)
        x, y = x.to(s.device, non_blocking=True), y.to(s.device, non_blocking=True)
        # DDP all-reduces (FSDP reduce-scatters) the gradients once, on the last micro-batch.
        last = micro == s.accum - 1
        no_sync = s.parallel == "ddp" and not last
        if s.parallel == "fsdp":
            s.model.set_requires_gradient_sync(last)
        with s.train_model.no_sync() if no_sync else contextlib.nullcontext():
            with torch.autocast(s.device.type, dtype=s.dtype,
                                enabled=s.dtype != torch.float32):
                _, loss = s.train_model(x, y)
            (loss * (spike_scale or 1.0) / s.accum).backward()
        loss_sum += loss.detach()
        bar.update(s.tokens_per_micro_batch)
        if os.environ.get("ANDREA_TEST_SIGNAL_AFTER") == f"{step}.{micro}":  # only for tests
            os.kill(os.getpid(), signal.SIGINT)  # as if Ctrl-C came during this micro-batch
    loss_mean = all_reduce_sum(loss_sum / s.accum, s.dist) / s.dist.world_size
    clip = t.grad_clip if t.grad_clip > 0 else math.inf
    if s.parallel == "fsdp":
        grad_norm = clip_grad_norm(list(s.model.parameters()), clip)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(s.model.parameters(), clip)
    if os.environ.get("ANDREA_TEST_NAN_AT_STEP") == str(step + 1):  # used only by tests
        loss_mean = loss_mean * float("nan")
    loss_value, norm_value = torch.stack([loss_mean.float(), grad_norm.float()]).tolist()
    return loss_value, norm_value


def optimizer_step(s: Session, loss: float, grad_norm: float) -> str:
    """Apply the step's gradients (or skip a non-finite one if allowed, or a spike the guard
    holds back); the step is done. Returns the guard's action: apply, skip or rollback."""
    s.step += 1
    action = guard_step(s, loss, grad_norm)
    if math.isfinite(loss) and math.isfinite(grad_norm):
        if action == APPLY:
            s.optimizer.step()
    elif s.cfg.train.skip_nonfinite:
        s.skipped += 1
        s.log.write("skip", step=s.step, reason="non-finite loss or gradient norm",
                    skipped_total=s.skipped)
    else:
        raise NonFiniteError(
            f"non-finite loss or gradient norm at step {s.step} "
            f"(loss {loss}, grad norm {grad_norm})"
        )
    s.optimizer.zero_grad(set_to_none=True)
    s.tokens_seen += s.tokens_per_step
    s.losses[s.step] = loss
    s.signals.completed_step = s.step
    return action


def guard_step(s: Session, loss: float, grad_norm: float) -> str:
    """The spike guard's verdict on the step just computed, the same on every rank; an
    outlier is a "spike" event."""
    if not s.guard.enabled:
        return APPLY
    verdict = agree(s.guard.judge(s.step, loss, grad_norm), s.device, all_reduce_sum, s.dist)
    if verdict.action == ROLLBACK:
        # Every rank must see the same checkpoint to go back to (node-local run folders may
        # not); else, or with none written yet, the step is skipped everywhere.
        target = rollback_checkpoint(s)
        found = int(target.name[5:]) if target is not None else -1
        agreed = same_on_every_rank(found, s.device, all_reduce_sum, s.dist)  # a collective
        if target is None or not agreed:
            verdict.action = SKIP
    if verdict.outlier:
        s.log.write("spike", step=s.step, tokens=s.tokens_seen + s.tokens_per_step, loss=loss,
                    grad_norm=grad_norm, loss_z=round(verdict.loss_z, 3),
                    grad_z=round(verdict.grad_z, 3), spikes_total=s.guard.spikes,
                    action=verdict.action if verdict.action != APPLY else "accepted")
    return verdict.action


def rollback_checkpoint(s: Session) -> Path | None:
    """The newest checkpoint from before the outliers began. Not simply the newest: a pause or
    a stop may have written one inside the streak, and the resumed run must go back where the
    uninterrupted one would."""
    before = s.step - s.cfg.train.spike_patience
    found = [c for c in ckpt_io.list_checkpoints(s.run_dir) if int(c.name[5:]) <= before]
    return found[-1] if found else None


def roll_back(s: Session) -> None:
    """The guard's rollback: the checkpoint's weights, optimizer and generator states, then on
    past the offending data at a cut learning rate."""
    checkpoint, from_step = rollback_checkpoint(s), s.step
    assert checkpoint is not None
    state = restore(s.model, s.optimizer, s.param_names, checkpoint, s.train_split,
                    s.device, s.dist)
    s.step, s.tokens_seen = state["step"], state["tokens"]
    s.checkpoint_step = s.signals.completed_step = s.step
    s.losses = {k: v for k, v in s.losses.items() if k <= s.step}
    s.guard.rolled_back(from_step, s.step)
    t = s.cfg.train
    s.log.write("rollback", step=s.step, tokens=s.tokens_seen, from_step=from_step,
                checkpoint=checkpoint.name, data_offset=s.guard.data_offset,
                lr_factor=t.spike_lr_factor, lr_cut_until=s.guard.lr_cut_until,
                rollbacks_total=s.guard.rollbacks)
    s.say(f"spike guard: {t.spike_patience} outliers in a row at step {from_step}: rolled back "
          f"to {checkpoint.name}, lr x {t.spike_lr_factor} until step "
          f"{s.guard.lr_cut_until}, data resumes after step {from_step}'s")


def log_step(
    s: Session, lr: float, loss: float, grad_norm: float, seconds: float, bar: tqdm
) -> None:
    t = s.cfg.train
    if s.device.type == "cuda":
        torch.cuda.synchronize(s.device)
    tok_s = s.tokens_per_step / seconds
    s.throughput.append(tok_s)
    if len(s.throughput) == 3 and s.dist.is_main:  # the first steps warm up; then say it once
        note = long_run_note((t.max_steps - s.step) * s.tokens_per_step,
                             statistics.median(s.throughput), s.device.type, s.preset)
        if note:
            bar.write(note, file=sys.stderr)
    step_mfu = s.mfu(tok_s)
    if s.step % t.log_every == 0 or s.step == t.max_steps:
        s.log.write(
            "train", step=s.step, tokens=s.tokens_seen, loss=loss, lr=lr,
            grad_norm=grad_norm, tokens_per_s=round(tok_s, 1),
            mfu=None if step_mfu is None else round(step_mfu, 4),
        )
    bar.set_postfix_str(
        f"step {s.step}/{t.max_steps} loss {loss:.4f} lr {lr:.2e} mfu {format_mfu(step_mfu)}",
        refresh=True,
    )


def maybe_evaluate(s: Session, bar: tqdm) -> None:
    t = s.cfg.train
    if not t.eval_every or (s.step % t.eval_every and s.step != t.max_steps):
        return
    s.last_val = evaluate(s.train_model, s.val_split, s.cfg, s.micro_batch, s.device, s.dtype,
                          s.dist, lockstep=s.parallel == "fsdp")
    if s.best_val is None or s.last_val < s.best_val:
        s.best_val, s.best_step = s.last_val, s.step
    s.log.write("eval", step=s.step, tokens=s.tokens_seen, val_loss=s.last_val)
    if s.dist.is_main:
        bar.write(f"step {s.step}: val loss {s.last_val:.4f}")


def save_checkpoint(s: Session, rng: dict[str, torch.Tensor]) -> None:
    """Checkpoint the last completed step, with the generator states `rng` it ended with,
    unless that step is already the newest checkpoint (or no step has been taken)."""
    if s.step == 0 or s.checkpoint_step == s.step:
        return
    all_rng = _rng_tensors(rng, s.dist)  # a collective: every rank takes part
    partial, optimizer_tensors = None, {}
    if s.parallel == "fsdp":
        # Every rank writes its shards of weights and optimizer state into rank 0's folder;
        # the weights are also gathered whole (for eval, generate, export), kept by rank 0.
        pid = torch.tensor([os.getpid()], dtype=torch.int64).view(torch.uint8)
        writer = int(all_gather_bytes(pid, s.dist)[0].view(torch.int64).item())
        partial = ckpt_io.partial_dir(s.run_dir, s.step, writer)
        if s.dist.is_main and partial.exists():
            shutil.rmtree(partial)
        barrier(s.dist)
        ckpt_io.write_shards(partial / ckpt_io.SHARDS_DIR,
                             ckpt_io.sharded_state(s.model, s.optimizer, s.param_names),
                             s.dist.rank)
        model_tensors = ckpt_io.model_state(s.model, s.dist.is_main)
    elif s.dist.is_main:
        model_tensors = ckpt_io.model_state(s.model)
        optimizer_tensors = ckpt_io.optimizer_state(s.optimizer, s.param_names)
    if s.dist.is_main:
        state = {
            "step": s.step, "tokens": s.tokens_seen,
            "data_position": s.guard.data_step(s.step),
            "best_val_loss": s.best_val, "best_val_step": s.best_step,
            "skipped_steps": s.skipped, "world_size": s.dist.world_size, "seed": s.cfg.train.seed,
            "preset": s.preset, "micro_batch_size": s.micro_batch, "parallel": s.parallel,
            "max_steps": s.cfg.train.max_steps, "schedule_anchor": s.schedule_anchor,
            "spike_guard": s.guard.state_dict(),
        }
        s.checkpoint = ckpt_io.save_checkpoint(
            s.run_dir, s.step, s.cfg, s.train_split.tokenizer_identity,
            model_tensors, optimizer_tensors, all_rng, state, s.cfg.train.keep_last, partial,
        )
        s.log.write("checkpoint", step=s.step, path=s.checkpoint.name)
    else:
        s.checkpoint = s.run_dir / ckpt_io.step_dir_name(s.step)
    s.checkpoint_step = s.step
    s.signals.checkpoint = s.checkpoint


def set_up_interrupted(
    cfg: Config, dist: DistInfo, signals: SignalWatch, signum: int, resuming: bool
) -> TrainResult:
    """A signal during set-up: stop there, with the message a stop in training would give."""
    sig = signal.Signals(signum)
    where = ("the run is as it was; --resume continues it" if resuming
             else "no checkpoint was written")
    message = f"stopped by {sig.name} during set-up, before the first step; {where}"
    signals.record_end(message, sig.name)  # only if the run's metrics.jsonl was begun
    return TrainResult(
        run_dir=Path(cfg.train.runs_dir) / cfg.train.name, steps=signals.completed_step,
        tokens=0, seconds=0.0, state="interrupted", best_val_loss=None, best_val_step=None,
        last_val_loss=None, checkpoint=signals.checkpoint, exit_code=EXIT_SIGNAL.get(sig, 130),
        message=message, is_main=dist.is_main,
    )


def interrupted_outcome(s: Session) -> tuple[str, int, str]:
    """(state, exit code, message) of a run a signal stopped."""
    sig = signal.Signals(s.signals.received or signal.SIGTERM)
    if s.step == 0:
        where = "before its first step; no checkpoint was written"
    else:
        where = f"after step {s.step}; checkpoint {s.checkpoint}"
    return "interrupted", EXIT_SIGNAL.get(sig, 130), f"stopped by {sig.name} {where}"


def finish(s: Session, state: str, exit_code: int, message: str, seconds: float) -> TrainResult:
    s.log.write(
        "end", step=s.step, tokens=s.tokens_seen, state=state,
        signal=signal.Signals(s.signals.received).name if s.signals.received else None,
        message=message, best_val_loss=s.best_val, best_val_step=s.best_step,
        checkpoint=s.checkpoint.name if s.checkpoint else None,
        median_tokens_per_s=statistics.median(s.throughput) if s.throughput else None,
    )
    s.log.close()
    return TrainResult(
        run_dir=s.run_dir, steps=s.step, tokens=s.tokens_seen, seconds=seconds, state=state,
        best_val_loss=s.best_val, best_val_step=s.best_step, last_val_loss=s.last_val,
        checkpoint=s.checkpoint, losses=s.losses, exit_code=exit_code, message=message,
        is_main=s.dist.is_main,
    )


def summary_line(result: TrainResult) -> str:
    if result.state == "nothing to do":
        return result.message
    best = (
        f"best val loss {result.best_val_loss:.4f} at step {result.best_val_step}"
        if result.best_val_loss is not None
        else "no evaluation"
    )
    where = f"checkpoint {result.checkpoint}" if result.checkpoint else "no checkpoint"
    return (
        f"{result.state}: {result.steps} steps, {result.tokens:,} tokens in "
        f"{result.seconds:.1f} s; {best}; {where}"
    )
