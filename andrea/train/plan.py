"""What rank 0 writes and says when a run starts: the run folder's config and start event,
and the lines that tell the user what the run will do (attention, resume changes, processes,
batch, mixture, micro-batch, plan)."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from typing import Any

from andrea.data.loader import mixture_report, source_passes
from andrea.fileio import atomic_write_text, free_bytes
from andrea.train.checkpoint import start_warning
from andrea.train.device import precision_warning
from andrea.train.metrics import MetricsLog
from andrea.train.rundir import CONFIG, METRICS, TrainerState, clean_partials
from andrea.train.session import Session
from andrea.train.tensorboard import open_tensorboard
from andrea.train.wandb_log import open_wandb


def start_run_files(
    s: Session, resume_from: Path | None, changes: dict[str, list[Any]], backend: str
) -> None:
    """Rank 0: the run folder, its config.yaml (with any resume changes) and the start event."""
    t = s.cfg.train
    wandb = open_wandb(s.cfg, s.run_dir)  # first: a missing package stops before any write
    s.run_dir.mkdir(parents=True, exist_ok=True)
    clean_partials(s.run_dir)
    atomic_write_text(s.run_dir / CONFIG, s.cfg.to_yaml())
    tensorboard = open_tensorboard(s.run_dir, t.tensorboard)
    s.log = MetricsLog(s.run_dir / METRICS, [x for x in (tensorboard, wandb) if x is not None])
    if wandb is not None:
        s.say(wandb.line)
    s.log.write(
        "start", step=s.step, max_steps=t.max_steps, pid=os.getpid(),
        host=socket.gethostname(), resumed_from=str(resume_from) if resume_from else None,
        n_params=s.model.num_params(), preset=s.preset, world_size=s.dist.world_size,
        precision=str(s.dtype).removeprefix("torch."), attention=backend,
        micro_batch_size=s.micro_batch, accum_steps=s.accum,
        tokens_per_step=s.tokens_per_step, micro_batch_auto=t.micro_batch_size == "auto",
        activation_checkpointing=t.activation_checkpointing, changed=changes or None,
    )


def announce(
    s: Session,
    backend: str,
    why: str,
    changes: dict[str, list[Any]],
    *,
    trainer_state: TrainerState | None,
    resume_from: Path | None,
    micro_batch_line: str,
    schedule_lines: list[str],
) -> None:
    """Rank 0: the lines that say what the run will do, before its first step."""
    t, dist, cfg = s.cfg.train, s.dist, s.cfg
    s.say(f"precision: {str(s.dtype).removeprefix('torch.')} ({s.precision_why})")
    costly = precision_warning(s.dtype, s.device)
    if costly:
        s.say(costly)
    s.say(f"attention: {backend} ({why})")
    for key, (old, new) in changes.items():
        s.say(f"resume: {key} {old} -> {new}")
    resharding = (s.parallel.resharding_line(trainer_state) if trainer_state is not None
                  else None)
    for line in s.parallel.lines() + ([resharding] if resharding else []) + schedule_lines:
        s.say(line)
    s.say(
        f"{s.run_dir}: {s.model.num_params():,} parameters, {s.tokens_per_step:,} tokens/step "
        f"({s.micro_batch} x {cfg.model.block_size} x {s.accum} accumulation x "
        f"{dist.world_size} process{'es' if dist.world_size > 1 else ''}), "
        f"{str(s.dtype).removeprefix('torch.')}, {s.device}"
        + (f", resuming from {resume_from}" if resume_from else "")
    )
    if t.batch_warmup_tokens and not s.warmup_accum and s.step < t.batch_warmup_steps:
        s.say(f"batch warm-up: off (train.batch_warmup_tokens {t.batch_warmup_tokens:,} is not "
              f"below train.global_batch_tokens {t.global_batch_tokens:,})")
    if s.step < s.batch_warmup_steps:
        s.say(f"batch warm-up: steps 1-{s.batch_warmup_steps:,} take "
              f"{s.tokens_at(0):,} tokens ({s.warmup_accum} accumulation), then "
              f"{s.tokens_per_step:,}")
    if t.seq_warmup_length and not s.seq_warmup_steps and s.step < t.seq_warmup_steps:
        s.say(f"sequence warm-up: off (train.seq_warmup_length {t.seq_warmup_length} is not "
              f"below model.block_size {cfg.model.block_size})")
    if s.step < s.seq_warmup_steps:
        windows, length = s.windows_at(0)
        s.say(f"sequence warm-up: steps 1-{s.seq_warmup_steps:,} train on windows of {length} "
              f"tokens ({windows} x {length} a micro-batch), then {cfg.model.block_size}")
        if s.seq_warmup_steps >= t.max_steps:
            s.say(f"warning: the sequence warm-up covers all {t.max_steps:,} steps: no step "
                  f"trains on windows of {cfg.model.block_size} tokens, which evaluation and "
                  f"generation use; lower train.seq_warmup_steps below train.max_steps")
    mixture = mixture_report(
        s.train_split, seed=t.seed, start_step=s.step, max_steps=t.max_steps,
        per_step=lambda step: s.windows_at(step)[0] * s.accum_at(step) * dist.world_size,
        block_size=lambda step: s.windows_at(step)[1],
    )
    if mixture is not None:
        s.say(mixture[0])
        s.log.write("data_mixture", **mixture[1])
    if micro_batch_line:
        s.say(micro_batch_line)
    room = start_warning(s, free_bytes(s.run_dir))  # the disk's room for the checkpoints
    for line in plan_lines(s) + ([room] if room else []):
        s.say(line)


def plan_lines(s: Session) -> list[str]:
    """The run's size up front (a mixture: the passes over each source, drawn by weight), and
    a warning for data, or a source, repeated more than 100 times."""
    steps, per_step = s.cfg.train.max_steps, s.tokens_per_step
    # A resumed run's steps so far may have had another size (global_batch_tokens: 0 on
    # another number of processes): they count as trained.
    total = s.tokens_seen + s.tokens_through(steps) - s.tokens_through(s.step)
    prepared = s.train_split.n_tokens
    passes = total / prepared if prepared else math.inf
    sources = source_passes(s.train_split, total)
    size = f"{steps:,} steps x {per_step:,} tokens/step"
    if s.step < s.batch_warmup_steps:
        warm = min(s.batch_warmup_steps, steps) - s.step
        size = (f"{warm:,} steps x {s.tokens_at(0):,} + {steps - s.step - warm:,} steps x "
                f"{per_step:,} tokens/step")
        if s.step:
            size = f"{s.tokens_seen:,} tokens in {s.step:,} steps + {size}"
    elif s.tokens_seen != s.step * per_step:
        size = (f"{s.tokens_seen:,} tokens in {s.step:,} steps + {steps - s.step:,} steps x "
                f"{per_step:,} tokens/step")
    line = (f"plan: {size} = {total:,} tokens = "
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
