"""`andrea train`: the training loop.

The recipe, per optimizer step: set the scheduled learning rate; run accum_steps micro-batches
(forward under autocast, backward of loss / accum_steps; DDP all-reduces the gradients on the
last one); clip by global norm; check the loss and norm are finite; AdamW step; log, evaluate,
checkpoint. Everything a resumed run needs (weights, moments, RNG states, step) is in the
checkpoint, and batches depend only on (seed, step, rank), so a resume repeats the losses exactly.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from tqdm import tqdm

from andrea import checkpoint as ckpt_io
from andrea.attention import resolve_backend
from andrea.config import Config, load_config
from andrea.distributed import (
    DistInfo,
    all_gather_bytes,
    all_reduce_sum,
    barrier,
    init_distributed,
    shutdown,
)
from andrea.errors import UserError
from andrea.fileio import atomic_write_text
from andrea.flops import MfuMeter, flops_per_token, format_mfu
from andrea.loader import TokenSplit, mixture_report, open_split, train_batch, val_batches
from andrea.model import Andrea
from andrea.prepare import check_vocab, data_dir_for, ensure_prepared
from andrea.runs import run_path
from andrea.schedule import lr_at

EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class NonFiniteError(Exception):
    """A NaN or infinite loss or gradient norm stopped the run."""


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    tokens: int
    seconds: float
    state: str  # finished | interrupted | nonfinite
    best_val_loss: float | None
    best_val_step: int | None
    last_val_loss: float | None
    checkpoint: Path | None
    losses: dict[int, float] = field(default_factory=dict)  # step -> train loss
    exit_code: int = 0
    message: str = ""
    is_main: bool = True  # rank 0 (the one process that writes and speaks)


def pick_device(requested: str) -> torch.device:
    """'auto' (a GPU if PyTorch sees one, else the CPU), 'cpu', 'cuda' or 'cuda:N'."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = requested.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise UserError(f"device '{requested}': expected auto, cpu, cuda or cuda:N")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or int(index or 0) >= count:
            raise UserError(
                f"device '{requested}': PyTorch sees {count} GPU(s); use cpu or another index"
            )
    return torch.device(requested)


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_dtype(precision: str, device: torch.device) -> torch.dtype:
    """bf16 autocast where the hardware has fast bf16 matmuls, else fp32 (for 'auto')."""
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if precision != "auto":
        raise UserError(f"precision '{precision}': expected auto, bf16 or fp32")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def accumulation_steps(cfg: Config, world_size: int) -> int:
    per_micro = cfg.train.micro_batch_size * cfg.model.block_size
    if cfg.train.global_batch_tokens == 0:
        return 1
    per_round = per_micro * world_size
    if cfg.train.global_batch_tokens % per_round:
        raise UserError(
            f"{cfg.source}: train.global_batch_tokens: {cfg.train.global_batch_tokens} is not a "
            f"multiple of micro_batch_size * block_size * processes = "
            f"{cfg.train.micro_batch_size} * {cfg.model.block_size} * {world_size} = {per_round}"
        )
    return cfg.train.global_batch_tokens // per_round


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


class SignalWatch:
    """First Ctrl-C / SIGTERM: finish the step, checkpoint, exit. Second Ctrl-C: exit at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalWatch:
        for sig in EXIT_SIGNAL:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None and signum == signal.SIGINT:
            # Nothing more is written: the last complete checkpoint stays as it is.
            os.write(2, b"\nsecond interrupt: exiting now, the last checkpoint is untouched\n")
            os._exit(130)
        self.received = signum
        os.write(2, b"\nstopping after this step and writing a checkpoint "
                    b"(Ctrl-C again to exit at once)\n")


class MetricsLog:
    """metrics.jsonl: one JSON object a line, appended and flushed as it happens (rank 0)."""

    def __init__(self, path: Path | None, tensorboard: Any = None) -> None:
        self.file = open(path, "a", encoding="utf-8") if path is not None else None
        self.tensorboard = tensorboard

    def write(self, event: str, **fields: Any) -> None:
        if self.file is None:
            return
        record = {"event": event, **fields, "time": round(time.time(), 3)}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            self.tensorboard.log(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _check_resume_config(stored: Config, given: Config, run_dir: Path) -> None:
    changed = [
        f"model.{k}: {v} -> {getattr(given.model, k)}"
        for k, v in vars(stored.model).items()
        if k != "attention" and getattr(given.model, k) != v
    ]
    if changed:
        raise UserError(
            f"{run_dir}: the config changes the model on resume ({'; '.join(changed)}); "
            f"resume with the run's own config or start a new run"
        )


def _rng_tensors(device: torch.device, dist: DistInfo) -> dict[str, torch.Tensor]:
    out = {}
    for rank, state in enumerate(all_gather_bytes(torch.get_rng_state(), dist)):
        out[f"cpu.rank{rank}"] = state
    if device.type == "cuda":
        for rank, state in enumerate(all_gather_bytes(torch.cuda.get_rng_state(device), dist)):
            out[f"cuda.rank{rank}"] = state
    return out


def _restore_rng(rng: dict[str, torch.Tensor], device: torch.device, dist: DistInfo) -> None:
    cpu = rng.get(f"cpu.rank{dist.rank}")
    if cpu is not None:  # a run resumed with more processes than it had: fresh seeds there
        torch.set_rng_state(cpu)
    cuda = rng.get(f"cuda.rank{dist.rank}")
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


def config_for_run(config: str | None, overrides: list[str], resume: str | None) -> Config:
    """The config to train with: --config (+ --set), or a resumed run's own config.yaml."""
    if config is not None:
        return load_config(config, overrides)
    if resume is None or resume == "auto":
        raise UserError("andrea train needs --config (a path or a preset name) or --resume RUN_DIR")
    run_dir = find_run_to_resume(resume, None)
    assert run_dir is not None
    cfg = load_config(run_dir / "config.yaml", overrides)
    return cfg


def find_run_to_resume(resume: str, cfg: Config | None) -> Path | None:
    """`--resume runs/<name>` or `--resume auto` (the config's run, if it has a checkpoint)."""
    if resume == "auto":
        if cfg is None:
            raise UserError("--resume auto needs --config to know the run's name")
        run_dir = Path(cfg.train.runs_dir) / cfg.train.name
        return run_dir if ckpt_io.read_latest(run_dir) is not None else None
    run_dir = run_path(resume, cfg.train.runs_dir if cfg is not None else "runs")
    if not run_dir.is_dir():
        raise UserError(f"--resume {resume}: no such run directory")
    if not (run_dir / "config.yaml").is_file() or ckpt_io.read_latest(run_dir) is None:
        raise UserError(
            f"--resume {resume}: not a run with a checkpoint (needs config.yaml and 'latest')"
        )
    return run_dir


@torch.no_grad()
def evaluate(
    model: nn.Module,
    split: TokenSplit,
    cfg: Config,
    device: torch.device,
    dtype: torch.dtype,
    dist: DistInfo,
) -> float:
    """Mean loss over the first eval_batches sequential val batches, shared among the ranks."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    batches = val_batches(
        split,
        micro_batch_size=cfg.train.micro_batch_size,
        block_size=cfg.model.block_size,
        max_batches=cfg.train.eval_batches,
    )
    for i, (x, y) in enumerate(batches):
        if i % dist.world_size != dist.rank:
            continue
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(x.to(device), y.to(device))
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
        return _train(
            cfg, device, dist, resume=resume, overwrite=overwrite, progress=progress,
            stop_after=stop_after,
        )
    finally:
        shutdown(dist)


def _train(
    cfg: Config,
    device: torch.device,
    dist: DistInfo,
    *,
    resume: str | None,
    overwrite: bool,
    progress: bool,
    stop_after: int | None,
) -> TrainResult:
    t = cfg.train
    say = print if dist.is_main else (lambda *a, **k: None)

    # Where the run lives; on resume the run's own config is the base.
    resume_from: Path | None = None
    run_dir = Path(t.runs_dir) / t.name
    if resume is not None:
        found = find_run_to_resume(resume, cfg)
        if found is not None:
            run_dir = found
            stored = load_config(run_dir / "config.yaml")
            _check_resume_config(stored, cfg, run_dir)
            resume_from = ckpt_io.resolve_checkpoint(run_dir)
        elif resume == "auto":
            say(f"--resume auto: no checkpoint under {run_dir}, starting a new run")
    if resume_from is None and dist.is_main and ckpt_io.read_latest(run_dir) is not None:
        if not overwrite:
            raise UserError(
                f"{run_dir}: already holds a run; continue it with --resume {run_dir} "
                f"(or --resume auto), pick another name with --set train.name=..., "
                f"or replace it with --overwrite"
            )
        for old in ckpt_io.list_checkpoints(run_dir):
            shutil.rmtree(old)
        for stale in ("metrics.jsonl", ckpt_io.LATEST):
            (run_dir / stale).unlink(missing_ok=True)

    # Data: rank 0 prepares the shards if they are missing, the others wait for it.
    if dist.is_main:
        ensure_prepared(cfg)
    barrier(dist)
    data_dir = data_dir_for(cfg)
    train_split = open_split(cfg, "train")
    val_split = open_split(cfg, "val")
    tokenizer_identity = train_split.tokenizer_identity

    dtype = pick_dtype(t.precision, device)
    accum = accumulation_steps(cfg, dist.world_size)
    tokens_per_step = t.micro_batch_size * cfg.model.block_size * accum * dist.world_size

    backend, why = resolve_backend(cfg.model.attention, cfg.model.head_dim, device)
    torch.manual_seed(t.seed)  # identical initial weights on every rank
    model = Andrea(cfg.model, attention_backend=backend).to(device)
    n_params = model.num_params()
    optimizer = build_optimizer(model, cfg, device)
    names = {id(p): n for n, p in model.named_parameters()}

    start_step, tokens_seen, skipped = 0, 0, 0
    preset = Path(cfg.source).stem  # the config a run started from, kept across resumes
    best_val, best_step = None, None
    if resume_from is not None:
        tensors, _, meta = ckpt_io.read_model_checkpoint(resume_from)
        if meta.get("tokenizer") != tokenizer_identity:
            raise UserError(
                f"{resume_from}: trained with tokenizer {meta.get('tokenizer')}, but the data in "
                f"{data_dir} uses {tokenizer_identity}"
            )
        ckpt_io.load_weights(model, tensors, resume_from / ckpt_io.MODEL_FILE)
        ckpt_io.load_optimizer(optimizer, names, resume_from)
        state, rng = ckpt_io.read_trainer_state(resume_from)
        _restore_rng(rng, device, dist)
        start_step, tokens_seen = state["step"], state["tokens"]
        skipped = state.get("skipped_steps", 0)
        best_val, best_step = state.get("best_val_loss"), state.get("best_val_step")
        preset = state.get("preset", preset)
    else:
        torch.manual_seed(t.seed + dist.rank)  # dropout differs per rank, deterministically
    check_vocab(train_split.vocab_size, cfg.model.vocab_size, f"{cfg.source}: model.vocab_size")

    train_model: nn.Module = model
    if t.compile:
        train_model = torch.compile(model)
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        device_ids = [dist.local_rank] if device.type == "cuda" else None
        train_model = DDP(train_model, device_ids=device_ids)

    log = MetricsLog(None)
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt_io.clean_partials(run_dir)
        atomic_write_text(run_dir / "config.yaml", cfg.to_yaml())
        tensorboard = None
        if t.tensorboard:
            from andrea.tensorboard import open_tensorboard

            tensorboard = open_tensorboard(run_dir, True)
        log = MetricsLog(run_dir / "metrics.jsonl", tensorboard)
        log.write(
            "start", step=start_step, max_steps=t.max_steps, pid=os.getpid(),
            host=socket.gethostname(), resumed_from=str(resume_from) if resume_from else None,
            n_params=n_params, preset=preset, world_size=dist.world_size,
            precision=str(dtype).removeprefix("torch."), attention=backend,
        )
        say(f"attention: {backend} ({why})")
        say(
            f"{run_dir}: {n_params:,} parameters, {tokens_per_step:,} tokens/step "
            f"({t.micro_batch_size} x {cfg.model.block_size} x {accum} accumulation x "
            f"{dist.world_size} process{'es' if dist.world_size > 1 else ''}), "
            f"{str(dtype).removeprefix('torch.')}, {device}"
            + (f", resuming from {resume_from}" if resume_from else "")
        )
        mixture = mixture_report(
            train_split, seed=t.seed, start_step=start_step, max_steps=t.max_steps,
            per_step=t.micro_batch_size * accum * dist.world_size,
            block_size=cfg.model.block_size,
        )
        if mixture is not None:
            say(mixture[0])
            log.write("data_mixture", **mixture[1])

    model_flops_utilisation = MfuMeter(device, dtype, flops_per_token(cfg.model, n_params))
    last_ckpt = resume_from
    losses: dict[int, float] = {}
    throughput: list[float] = []
    last_val: float | None = None

    def save(step: int) -> Path:
        rng = _rng_tensors(device, dist)  # a collective: every rank takes part
        if not dist.is_main:
            return run_dir / ckpt_io.step_dir_name(step)
        state = {
            "step": step, "tokens": tokens_seen, "data_position": step,
            "best_val_loss": best_val, "best_val_step": best_step, "skipped_steps": skipped,
            "world_size": dist.world_size, "seed": t.seed, "preset": preset,
        }
        path = ckpt_io.save_checkpoint(
            run_dir, step, cfg, tokenizer_identity, ckpt_io.model_state(model),
            ckpt_io.optimizer_state(optimizer, names), rng, state, t.keep_last,
        )
        log.write("checkpoint", step=step, path=path.name)
        return path

    def stop_requested(flag: bool) -> bool:
        # Every rank must agree, or one would wait forever in the next all-reduce.
        if not dist.enabled:
            return flag
        t_flag = torch.tensor([1.0 if flag else 0.0], device=device)
        return all_reduce_sum(t_flag, dist).item() > 0

    def forward_backward(step: int) -> tuple[float, float]:
        """accum_steps micro-batches of this rank; returns (mean loss over all ranks, grad norm)."""
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = train_batch(
                train_split, seed=t.seed, step=step, micro_step=micro, rank=dist.rank,
                accum_steps=accum, world_size=dist.world_size,
                micro_batch_size=t.micro_batch_size, block_size=cfg.model.block_size,
            )
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # DDP all-reduces the gradients once, on the last micro-batch.
            last = micro == accum - 1
            sync = train_model.no_sync() if dist.enabled and not last else contextlib.nullcontext()
            with sync:
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    _, loss = train_model(x, y)
                (loss / accum).backward()
            loss_sum += loss.detach()
        loss_mean = all_reduce_sum(loss_sum / accum, dist) / dist.world_size
        clip = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if os.environ.get("ANDREA_TEST_NAN_AT_STEP") == str(step + 1):  # used only by tests
            loss_mean = loss_mean * float("nan")
        loss_value, norm_value = torch.stack([loss_mean.float(), grad_norm.float()]).tolist()
        return loss_value, norm_value

    bar = tqdm(
        total=t.max_steps, initial=start_step, disable=not (progress and dist.is_main),
        unit="step", dynamic_ncols=True, file=sys.stderr,
    )
    state_name, exit_code, message = "finished", 0, ""
    t_start = time.perf_counter()
    step = start_step
    train_model.train()
    with SignalWatch() as signals:
        try:
            while step < t.max_steps:
                t0 = time.perf_counter()
                lr = lr_at(step, t)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_value, norm_value = forward_backward(step)
                step += 1
                if math.isfinite(loss_value) and math.isfinite(norm_value):
                    optimizer.step()
                elif t.skip_nonfinite:
                    skipped += 1
                    log.write("skip", step=step, reason="non-finite loss or gradient norm",
                              skipped_total=skipped)
                else:
                    raise NonFiniteError(
                        f"non-finite loss or gradient norm at step {step} "
                        f"(loss {loss_value}, grad norm {norm_value})"
                    )
                optimizer.zero_grad(set_to_none=True)
                tokens_seen += tokens_per_step
                losses[step] = loss_value
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                tok_s = tokens_per_step / (time.perf_counter() - t0)
                throughput.append(tok_s)
                step_mfu = model_flops_utilisation(tok_s)
                last_of_run = step == t.max_steps
                if step % t.log_every == 0 or last_of_run:
                    log.write(
                        "train", step=step, tokens=tokens_seen, loss=loss_value, lr=lr,
                        grad_norm=norm_value, tokens_per_s=round(tok_s, 1),
                        mfu=None if step_mfu is None else round(step_mfu, 4),
                    )
                bar.set_postfix_str(
                    f"loss {loss_value:.4f} lr {lr:.2e} {tok_s:,.0f} tok/s "
                    f"mfu {format_mfu(step_mfu)}", refresh=False,
                )
                bar.update(1)
                if t.eval_every and (step % t.eval_every == 0 or last_of_run):
                    last_val = evaluate(train_model, val_split, cfg, device, dtype, dist)
                    if best_val is None or last_val < best_val:
                        best_val, best_step = last_val, step
                    log.write("eval", step=step, tokens=tokens_seen, val_loss=last_val)
                    if dist.is_main:
                        bar.write(f"step {step}: val loss {last_val:.4f}")
                stopping = stop_requested(signals.received is not None)
                pausing = stop_after is not None and step - start_step >= stop_after
                periodic = t.checkpoint_every and step % t.checkpoint_every == 0
                if periodic or last_of_run or stopping or pausing:
                    last_ckpt = save(step)
                if pausing and not last_of_run and not stopping:
                    state_name = "stopped"
                    message = f"paused after {stop_after} steps (--stop-after); {last_ckpt}"
                    break
                if stopping:
                    sig = signal.Signals(signals.received or signal.SIGTERM)
                    state_name, exit_code = "interrupted", EXIT_SIGNAL.get(sig, 130)
                    message = f"stopped by {sig.name} after step {step}; checkpoint {last_ckpt}"
                    break
        except NonFiniteError as exc:
            state_name, exit_code = "nonfinite", 1
            message = (
                f"{exc}; nothing was written over the last good checkpoint "
                f"({last_ckpt if last_ckpt else 'none yet'})"
            )
        except torch.cuda.OutOfMemoryError:
            log.write("end", step=step, tokens=tokens_seen, state="failed", signal=None,
                      message="out of GPU memory")
            raise UserError(
                f"out of GPU memory at train.micro_batch_size={t.micro_batch_size}, "
                f"model.block_size={cfg.model.block_size}: lower train.micro_batch_size "
                f"(train.global_batch_tokens stays; accumulation grows)"
            ) from None
        except BaseException as exc:
            # A user's mistake stops the run; anything else is a failure. Either way, say so.
            log.write("end", step=step, tokens=tokens_seen, signal=None,
                      state="stopped" if isinstance(exc, UserError) else "failed",
                      message=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            bar.close()
    seconds = time.perf_counter() - t_start
    log.write(
        "end", step=step, tokens=tokens_seen, state=state_name,
        signal=signal.Signals(signals.received).name if signals.received else None,
        message=message, best_val_loss=best_val, best_val_step=best_step,
        checkpoint=last_ckpt.name if last_ckpt else None,
        median_tokens_per_s=statistics.median(throughput) if throughput else None,
    )
    log.close()
    return TrainResult(
        run_dir=run_dir, steps=step, tokens=tokens_seen, seconds=seconds, state=state_name,
        best_val_loss=best_val, best_val_step=best_step, last_val_loss=last_val,
        checkpoint=last_ckpt, losses=losses, exit_code=exit_code, message=message,
        is_main=dist.is_main,
    )


def summary_line(result: TrainResult) -> str:
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
