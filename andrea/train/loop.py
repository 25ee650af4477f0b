"""`andrea train`: the training loop.

The recipe, per optimizer step: set the scheduled learning rate; run accum_steps micro-batches
(forward under autocast, backward of loss / accum_steps; DDP all-reduces the gradients on the
last one); clip by global norm; check the loss and norm are finite; AdamW step; log, evaluate,
checkpoint. Everything a resumed run needs (weights, moments, RNG states, step) is in the
checkpoint, and batches depend only on (seed, step, rank), so a resume repeats the losses exactly.
Setting up (run folder, data, model, optimizer, micro-batch) is andrea/train/setup.py; the
micro-batch and accumulation steps, andrea/train/batch.py.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from andrea import faults
from andrea.config import Config
from andrea.data.encode import refuse_in_a_starting_worker
from andrea.data.loader import train_batch, wait_checked
from andrea.data.shards import ShardChanged
from andrea.errors import UserError, counted
from andrea.train.checkpoint_room import DiskFull
from andrea.train.collectives import all_reduce_sum, barrier
from andrea.train.device import pick_device
from andrea.train.metrics import format_mfu, median_tokens_per_s
from andrea.train.optim import set_learning_rates
from andrea.train.process_group import init_distributed, shutdown
from andrea.train.progress import RunBar, plan_note_for
from andrea.train.restarts import lost_peer_line
from andrea.train.rundir import step_dirs, step_of_dir
from andrea.train.runlock import RunLost, TrainingLocks
from andrea.train.scaling import MIN_SCALE
from andrea.train.schedule import multiplier
from andrea.train.session import Session, TrainResult
from andrea.train.setup import set_up
from andrea.train.signals import EXIT_SIGNAL, SetUpInterrupted, SignalWatch
from andrea.train.spike import APPLY, ROLLBACK, same_on_every_rank
from andrea.train.torchrun import DistInfo
from andrea.train.training_state import TrainingState, local_rng_states
from andrea.train.validation import score_val, val_sources


class NonFiniteError(Exception):
    """A NaN or infinite loss or gradient norm stopped the run."""


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
    e.g. to fit a job's time slot; `--resume` continues on the same schedule. A script that
    calls it must do so under `if __name__ == "__main__":` (docs/python.md).
    """
    refuse_in_a_starting_worker("andrea's train()")
    check_run_choice(resume, overwrite)
    if stop_after is not None and stop_after < 1:  # the command's --stop-after has min=1
        raise UserError(f"--stop-after {stop_after}: expected a number of steps, at least 1")
    device = pick_device(cfg.train.device, "train.device")
    dist = init_distributed(device.type, cfg.train.join_timeout)
    try:
        with TrainingLocks() as locks, callers_generators(device):
            result = run_training(
                cfg, device, dist, locks, resume=resume, overwrite=overwrite, progress=progress,
                stop_after=stop_after,
            )
        if result.exit_code and result.state in ("stopped", "nonfinite"):
            # Every rank stopped together, alive. torchrun stops the other workers as soon as
            # one exits non-zero: rank 0 says why before any rank may leave.
            result.say()
            barrier(dist)
        return result
    finally:
        shutdown(dist)


def callers_generators(device: torch.device) -> contextlib.AbstractContextManager:
    """The caller's global generators put back as they were when the run ends, however it
    ends: the run seeds torch's CPU generator and its GPU's (train.seed, a checkpoint's states)
    and draws from them, and left as the run's, a script's own draws after train() repeated
    in every run of a sweep. The run's numbers do not change: it seeds them before any draw.
    Python's `random` and numpy's global generator are never touched (the loader draws from
    numpy Generators of its own)."""
    gpus = [] if device.type != "cuda" else [
        device.index if device.index is not None else torch.cuda.current_device()]
    return torch.random.fork_rng(devices=gpus, device_type="cuda")


def check_run_choice(resume: str | None, overwrite: bool) -> None:
    """--resume continues a run, --overwrite deletes it: both at once is refused (the command
    says so before it reads any config; train() for a caller from Python)."""
    if resume is not None and overwrite:
        raise UserError(f"--resume {resume} --overwrite: give one; --resume continues the run, "
                        "--overwrite deletes it and starts a new one")


def run_training(
    cfg: Config,
    device: torch.device,
    dist: DistInfo,
    locks: TrainingLocks,
    *,
    resume: str | None,
    overwrite: bool,
    progress: bool,
    stop_after: int | None,
) -> TrainResult:
    """Set up (taking the run's and its data's locks into `locks`), then per step:
    forward/backward over the micro-batches, clip, optimizer step, log, evaluate, checkpoint;
    then record how the run ended."""
    t = cfg.train
    with SignalWatch() as signals:
        s = start_session(cfg, device, dist, signals, locks, resume=resume, overwrite=overwrite)
        if isinstance(s, TrainResult):
            return s  # nothing to do, or a signal during set-up: the run was not touched
        bar = progress_bar(s, progress)
        start_step, t_start = s.step, time.perf_counter()
        state, exit_code, message = "finished", 0, ""
        s.train_model.train()
        try:
            with failures_recorded(s):
                while s.step < t.max_steps:
                    t0 = time.perf_counter()
                    lr = set_learning_rate(s)
                    rng_before_step = local_rng_states(device)
                    outcome = forward_backward(s, bar)
                    if outcome is None:  # stopped inside the step: its gradients never apply
                        s.optimizer.zero_grad(set_to_none=True)
                        save_checkpoint(s, rng_before_step)
                        break
                    loss, grad_norm = outcome.loss, outcome.grad_norm
                    if optimizer_step(s, loss, grad_norm) == ROLLBACK:
                        roll_back(s)
                        bar.n = s.tokens_through(s.step)  # the bar goes back with the run
                        continue
                    s.locks.check(s.step)  # the run still ours before the step writes to it
                    log_step(s, bar, lr=lr, loss=loss, grad_norm=grad_norm,
                             seconds=time.perf_counter() - t0)
                    maybe_evaluate(s, bar)
                    stopping = stop_after_step(s, outcome)
                    pausing = stop_after is not None and s.step - start_step >= stop_after
                    periodic = t.checkpoint_every and s.step % t.checkpoint_every == 0
                    if periodic or s.step == t.max_steps or stopping or pausing:
                        save_checkpoint(s, local_rng_states(device))
                    if stopping:
                        break
                    if pausing and s.step < t.max_steps:
                        state = "stopped"
                        message = (f"paused after {counted(stop_after, 'step')} (--stop-after); "
                                   f"{s.checkpoint}")
                        break
        except (NonFiniteError, DiskFull) as exc:
            state, exit_code, message = stopped_outcome(s, exc)
        except ShardChanged as exc:
            state, exit_code, message = shard_changed_outcome(s, exc, rng_before_step)
        finally:
            bar.close()
        if signals.received is not None and exit_code == 0 and s.step < t.max_steps:
            state, exit_code, message = interrupted_outcome(s)
        return finish(s, state, exit_code, message, time.perf_counter() - t_start, start_step)


def start_session(
    cfg: Config, device: torch.device, dist: DistInfo, signals: SignalWatch,
    locks: TrainingLocks, *, resume: str | None, overwrite: bool,
) -> Session | TrainResult:
    """set_up; a TrainResult instead when there is nothing to do or a signal came during it."""
    try:
        s = set_up(cfg, device, dist, signals, locks, resume=resume, overwrite=overwrite)
    except SetUpInterrupted as stop:
        return set_up_interrupted(cfg, dist, signals, stop.signum, resume is not None)
    signals.setting_up = False
    return s


@contextlib.contextmanager
def failures_recorded(s: Session) -> Iterator[None]:
    """Any failure other than a non-finite loss ends the run with an end event, then raises;
    out of GPU memory becomes a one-line error saying what to change."""
    try:
        yield
    except (NonFiniteError, DiskFull):  # the loop's own stops: it records their end
        raise
    except ShardChanged as exc:
        if not s.dist.enabled:  # one process checkpoints and records it (shard_changed_outcome)
            raise
        write_end(s, "stopped", str(exc))
        raise
    except RunLost:  # the run is no longer this training's: nothing more is written there
        raise
    except torch.cuda.OutOfMemoryError:
        write_end(s, "failed", "out of GPU memory")
        raise UserError(
            f"out of GPU memory at micro-batch {s.micro_batch} x {s.cfg.model.block_size}: "
            f"set train.micro_batch_size lower (or auto), or "
            f"train.activation_checkpointing=blocks (train.global_batch_tokens stays)"
        ) from None
    except BaseException as exc:
        # A user's mistake stops the run; anything else is a failure. Either way, say so: a
        # lost peer as the way on, not the transport's message.
        lost = lost_peer_line(s.dist, exc, s.step, s.checkpoint, s.run_dir)
        write_end(s, "stopped" if isinstance(exc, UserError) else "failed",
                  str(lost) if lost else f"{type(exc).__name__}: {exc}")
        if lost is not None:
            raise lost from None
        raise


def progress_bar(s: Session, enabled: bool) -> RunBar:
    """Counts tokens, advanced per micro-batch: rate and ETA for the whole run at once."""
    total, done = s.tokens_through(s.cfg.train.max_steps), s.tokens_through(s.step)
    bar = RunBar(total=total, initial=done, disable=not (enabled and s.dist.is_main),
                 unit="tok", unit_scale=True, dynamic_ncols=True, file=sys.stderr)
    if s.dist.is_main:  # a plan of days said once, with or without the bar
        bar.plan_note = plan_note_for(total - done, s.device, s.dist.world_size,
                                      s.model.num_params(), quiet=not enabled)
    return bar


def set_learning_rate(s: Session) -> float:
    """Every group's peak lr x the schedule x the spike guard's cut; the lr to log: AdamW's."""
    factor = multiplier(s.step, s.cfg.train, s.schedule_anchor).cut(s.guard.lr_scale(s.step))
    set_learning_rates(s.optimizer, factor)
    return factor.lr


class StepOutcome(NamedTuple):
    loss: float  # the mean over the step's micro-batches and every rank
    grad_norm: float  # before clipping
    signalled: bool  # a signal came while some rank ran the step: stop after it


def stop_after_step(s: Session, outcome: StepOutcome) -> bool:
    """Whether a signal asks to stop after this step. One process asks its own flag; several
    take what the step's loss reduction carried, the same on every rank (a signal later than
    that is seen in the next step's micro-batches), so no rank waits for another here."""
    if not s.dist.enabled:
        return s.signals.received is not None
    return outcome.signalled


def forward_backward(s: Session, bar: tqdm) -> StepOutcome | None:
    """The step's micro-batches on this rank, or None when a signal stops the run before the
    last one began (its gradients never apply).

    A micro-batch reads nothing from the device and waits on no other rank: the stop flags
    travel in the step's one reduction, with its loss, and the step's numbers reach Python in
    one read. A signalled rank stops computing at once: alone, it returns; under torchrun it
    goes on to the step's last micro-batch, whose backward every rank joins to share the
    gradients (FSDP's ranks gather weights in every micro-batch, so there it runs them all),
    and then every rank drops the step together."""
    t, step = s.cfg.train, s.step
    data_step = s.guard.data_step(step)  # past any data window a rollback left behind
    spike_scale = faults.spike_scale(data_step)  # None unless a test injects a spike
    factor = (spike_scale or 1.0) * faults.overflow_factor(step + 1, s.dist.rank)
    accum = s.accum_at(step)  # fewer during a batch-size warm-up
    windows, length = s.windows_at(step)  # shorter ones during a sequence-length warm-up
    loss_sum = torch.zeros((), device=s.device)
    dropped = False  # a signal came before this rank's last micro-batch began
    for micro in range(accum):
        last = micro == accum - 1
        if s.signals.received is not None:
            if not s.dist.enabled:
                return None
            dropped = True
            if not last and not s.parallel.sharded:
                continue
        x, y = train_batch(
            s.train_split, seed=t.seed, step=data_step, micro_step=micro, rank=s.dist.rank,
            accum_steps=accum, world_size=s.dist.world_size,
            micro_batch_size=windows, block_size=length,
            order=s.cfg.data.order, tokens_before=s.tokens_through(data_step),
        )
        if spike_scale is not None:
            x, y = faults.garble(x, y, s.cfg.model.vocab_size, data_step)
        x, y = x.to(s.device, non_blocking=True), y.to(s.device, non_blocking=True)
        # The processes share the gradients once, on the last micro-batch of the step.
        with s.parallel.gradient_sync(s.model, s.train_model, last=last):
            with torch.autocast(s.device.type, dtype=s.dtype,
                                enabled=s.dtype != torch.float32):
                _, loss = s.train_model(x, y)
            s.scaling.scale(loss * factor / accum).backward()
        loss_sum += loss.detach()
        bar.update(s.tokens_per_micro_batch)
        faults.after_micro_batch(step, micro)
    # [mean loss, ranks that drop the step, ranks a Ctrl-C reached by now, ranks another signal
    # reached by now], summed over the ranks. The flags are filled on the device (new_full): a
    # copy from the host would wait for it.
    received = s.signals.received
    reduced = all_reduce_sum(torch.stack([
        (loss_sum / accum).float(), loss_sum.new_full((), float(dropped)),
        loss_sum.new_full((), float(received == signal.SIGINT)),
        loss_sum.new_full((), float(received not in (None, signal.SIGINT)))]), s.dist)
    clip = t.grad_clip if t.grad_clip > 0 else math.inf
    s.scaling.unscale(s.optimizer)  # the clip, the guard and the optimizer see true gradients
    grad_norm = s.parallel.clip(s.model, clip)
    loss_mean = faults.poison_loss(reduced[0] / s.dist.world_size, step + 1)
    loss_value, norm_value, dropping, interrupted, terminated = torch.stack(
        [loss_mean, grad_norm.float(), *reduced[1:]]).tolist()  # the step's one read
    if interrupted + terminated > 0:  # every rank ends as stopped by it, not only the one it hit
        s.signals.adopt(signal.SIGINT if interrupted > 0 else signal.SIGTERM)
    if dropping > 0:
        return None
    return StepOutcome(loss_value, norm_value, interrupted + terminated > 0)


def optimizer_step(s: Session, loss: float, grad_norm: float) -> str:
    """Apply the step's gradients (or skip a non-finite one if allowed, an fp16 overflow, or a
    spike the guard holds back); the step is done. Returns the guard's action: apply, skip or
    rollback."""
    s.step += 1
    action = guard_step(s, loss, grad_norm)
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    overflow = s.scaling.overflowed(loss, grad_norm)
    if not (finite or overflow or s.cfg.train.skip_nonfinite):
        raise NonFiniteError(
            f"non-finite loss or gradient norm at step {s.step} "
            f"(loss {loss}, grad norm {grad_norm})"
        )
    s.scaling.step(s.optimizer, apply=finite and action == APPLY)
    if overflow:
        record_overflow(s, loss)
    elif not finite:
        s.skipped += 1
        s.log.write("skip", step=s.step, reason="non-finite loss or gradient norm",
                    skipped_total=s.skipped)
    s.optimizer.zero_grad(set_to_none=True)
    s.tokens_seen += s.tokens_at(s.step - 1)
    s.losses[s.step] = loss
    s.signals.completed_step, s.signals.completed_tokens = s.step, s.tokens_seen
    return action


def record_overflow(s: Session, loss: float) -> None:
    """An fp16 step whose gradients overflowed: not applied, the scale halved; counted. A scale
    fallen below MIN_SCALE means fp16 cannot hold these gradients at all: the run stops."""
    s.scaling.overflows += 1
    s.log.write("overflow", step=s.step, tokens=s.tokens_seen + s.tokens_at(s.step - 1),
                loss=loss, loss_scale=s.scaling.value, overflows_total=s.scaling.overflows)
    if s.scaling.value is not None and s.scaling.value < MIN_SCALE:
        raise NonFiniteError(
            f"the fp16 loss scale fell to {s.scaling.value:g} after {s.scaling.overflows} "
            f"overflowing steps at step {s.step}: the gradients do not fit fp16 even unscaled; "
            f"train with train.precision=bf16 or fp32"
        )


def guard_step(s: Session, loss: float, grad_norm: float) -> str:
    """The spike guard's verdict on the step just computed, the same on every rank; an
    outlier is a "spike" event."""
    if not s.guard.enabled:
        return APPLY
    if s.seq_warmup_steps and s.step == s.seq_warmup_steps + 1:
        s.guard.restart()  # the first step on whole windows: a planned jump, not a spike
    # No vote: every rank judges the same reduced loss and norm with the same history, so
    # every rank reaches the same verdict.
    verdict = s.guard.judge(s.step, loss, grad_norm)
    if verdict.action == ROLLBACK:
        # Every rank must see the same checkpoint to go back to (node-local run folders may
        # not); else, or with none written yet, the streak is a lasting shift everywhere.
        target = rollback_checkpoint(s)
        found = step_of_dir(target) if target is not None else -1
        agreed = same_on_every_rank(found, s.device, all_reduce_sum, s.dist)  # a collective
        if target is None or not agreed:
            verdict.action = s.guard.take_as_shift(loss, grad_norm)
    if verdict.outlier:
        s.log.write("spike", step=s.step, tokens=s.tokens_seen + s.tokens_at(s.step - 1), loss=loss,
                    grad_norm=grad_norm, loss_z=round(verdict.loss_z, 3),
                    grad_z=round(verdict.grad_z, 3), spikes_total=s.guard.spikes,
                    action=verdict.action if verdict.action != APPLY else "accepted")
    return verdict.action


def rollback_checkpoint(s: Session) -> Path | None:
    """The newest checkpoint from before the outliers began. Not simply the newest: a pause or
    a stop may have written one inside the streak, and the resumed run must go back where the
    uninterrupted one would."""
    before = s.step - s.cfg.train.spike_patience
    found = [c for c in step_dirs(s.run_dir) if step_of_dir(c) <= before]
    return found[-1] if found else None


def roll_back(s: Session) -> None:
    """The guard's rollback: the checkpoint's weights, optimizer and generator states, then on
    past the offending data at a cut learning rate."""
    checkpoint, from_step = rollback_checkpoint(s), s.step
    assert checkpoint is not None
    TrainingState(s).roll_back(checkpoint)
    s.signals.completed_step, s.signals.completed_tokens = s.step, s.tokens_seen
    s.guard.rolled_back(from_step, s.step)
    t = s.cfg.train
    s.log.write("rollback", step=s.step, tokens=s.tokens_seen, from_step=from_step,
                checkpoint=checkpoint.name, data_offset=s.guard.data_offset,
                lr_factor=t.spike_lr_factor, lr_cut_until=s.guard.lr_cut_until,
                rollbacks_total=s.guard.rollbacks)
    s.say(f"spike guard: {counted(t.spike_patience, 'outlier')} in a row at step {from_step}: "
          f"rolled back to {checkpoint.name}, lr x {t.spike_lr_factor} until step "
          f"{s.guard.lr_cut_until}, data resumes after step {from_step}'s")


def log_step(
    s: Session, bar: RunBar, *, lr: float, loss: float, grad_norm: float, seconds: float
) -> None:
    """The step's train record (every log_every steps) and the bar's state. A record's
    tokens_per_s and mfu are the step's own; the run's figure is train_tokens / train_seconds,
    the same the bar shows (train.metrics.Throughput), without the warm-up steps."""
    t = s.cfg.train
    step_tokens = s.tokens_at(s.step - 1)
    tok_s = step_tokens / seconds
    shape = s.windows_at(s.step - 1)
    warmup = shape not in s.timed_shapes  # this process's first step of this window length
    s.timed_shapes.add(shape)
    if not warmup:
        s.throughput.append(tok_s)
    step_flops = s.flops_at(s.step - 1)
    s.speed.add(step_tokens, seconds, flops=step_flops, warmup=warmup)
    step_mfu = s.mfu(step_flops / seconds)
    scaling = ({"loss_scale": s.scaling.value, "overflows": s.scaling.overflows}
               if s.scaling.enabled else {})
    if s.step % t.log_every == 0 or s.step == t.max_steps:
        s.log.write(
            "train", step=s.step, tokens=s.tokens_seen, loss=loss, lr=lr,
            grad_norm=grad_norm, tokens_per_s=round(tok_s, 1),
            mfu=None if step_mfu is None else round(step_mfu, 4), **s.speed.fields(),
            train_mfu=run_mfu(s), **scaling,
        )
    run_tok_s = s.speed.tokens_per_s
    bar.set_rate(run_tok_s)
    bar.set_postfix_str(
        f"step {s.step}/{t.max_steps} loss {loss:.4f} lr {lr:.2e} "
        f"mfu {format_mfu(run_mfu(s))}"
        + "".join(f" {k.replace('_', ' ')} {v:g}" for k, v in scaling.items()),
        refresh=True,
    )


def run_mfu(s: Session) -> float | None:
    """The run's MFU: the model FLOP/s of the steps its tokens/s counts (Throughput) against
    the device's peak, as recorded."""
    flops_per_s = s.speed.flops_per_s
    value = s.mfu(flops_per_s) if flops_per_s else None
    return None if value is None else round(value, 4)


def maybe_evaluate(s: Session, bar: tqdm) -> None:
    t = s.cfg.train
    if not t.eval_every or (s.step % t.eval_every and s.step != t.max_steps):
        return
    if s.val_set is None:
        s.val_set = val_sources(s.val_split, s.cfg.model.block_size, t.eval_tokens or None)
    score = score_val(s.train_model, s.val_set, batch_size=s.micro_batch, device=s.device,
                      dtype=s.dtype, dist=s.dist, lockstep=s.parallel.sharded)
    s.last_val = score.loss  # a mixture's: the sources' average by weight
    # A NaN val loss is never the best (nor, kept first, would any later one beat it).
    if math.isfinite(s.last_val) and (s.best_val is None or s.last_val < s.best_val):
        s.best_val, s.best_step = s.last_val, s.step
    s.log.write("eval", step=s.step, tokens=s.tokens_seen, **score.record())
    if s.dist.is_main:
        line = f"step {s.step}: val loss {s.last_val:.4f}"
        if score.bits_per_byte is not None:
            line += f", {score.bits_per_byte:.4f} bits/byte"
        if len(score.sources) > 1:
            line += " (weighted; " + ", ".join(
                f"{src.name} {src.loss:.4f}" for src in score.sources) + ")"
        bar.write(line)


def save_checkpoint(s: Session, rng: dict[str, torch.Tensor]) -> None:
    """Checkpoint the last completed step, with the generator states `rng` it ended with,
    unless that step is already the newest checkpoint (or no step has been taken)."""
    if s.step == 0 or s.checkpoint_step == s.step:
        return
    # No checkpoint from a shard not yet found intact, unless a signal asks to stop now.
    wait_checked(s.train_split, wait=s.signals.received is None)
    s.checkpoint = TrainingState(s).save(rng)
    if s.dist.is_main:
        s.log.write("checkpoint", step=s.step, path=s.checkpoint.name)
    s.checkpoint_step = s.step
    s.signals.checkpoint = s.checkpoint
    faults.after_checkpoint(s.dist.rank, str(s.checkpoint))


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


def stopped_outcome(s: Session, exc: NonFiniteError | DiskFull) -> tuple[str, int, str]:
    """(state, exit code, message) of a run the loop stopped itself: a non-finite loss, or a
    checkpoint that did not fit on the disk (a stop the user can act on: exit code 2)."""
    if isinstance(exc, DiskFull):
        return "stopped", UserError.exit_code, str(exc)
    message = (f"{exc}; nothing was written over the last good checkpoint ({s.checkpoint})"
               if s.checkpoint else f"{exc}; no checkpoint had been written yet")
    return "nonfinite", 1, message


def shard_changed_outcome(
    s: Session, exc: ShardChanged, rng_before_step: dict[str, torch.Tensor]
) -> tuple[str, int, str]:
    """(state, exit code, message) of a run stopped by a shard that changed under it, after
    checkpointing its last completed step: a train shard is read inside a step, which is
    dropped as a signal drops it (checkpointed with the generator states it began with), a val
    shard in an evaluation after its step. Under torchrun the other ranks are inside the step:
    this rank stops with the data layer's line and they as for a lost rank."""
    if s.dist.enabled:
        raise exc
    s.optimizer.zero_grad(set_to_none=True)
    try:
        save_checkpoint(s, rng_before_step if exc.split == "train" else local_rng_states(s.device))
    except UserError as damaged:  # the checksums found a shard damaged: no checkpoint from it
        return "stopped", UserError.exit_code, str(damaged)
    return "stopped", UserError.exit_code, exc.training_line(s.step, s.checkpoint, s.run_dir)


def interrupted_outcome(s: Session) -> tuple[str, int, str]:
    """(state, exit code, message) of a run a signal stopped."""
    sig = signal.Signals(s.signals.received or signal.SIGTERM)
    if s.signals.elsewhere:
        sig_words = f"{sig.name} (sent to another process of the run)"
    else:
        sig_words = sig.name
    if s.step == 0:
        where = "before its first step; no checkpoint was written"
    else:
        where = f"after step {s.step}; checkpoint {s.checkpoint}"
    return "interrupted", EXIT_SIGNAL.get(sig, 130), f"stopped by {sig_words} {where}"


def write_end(s: Session, state: str, message: str) -> None:
    """The run's end record, whatever ended it: the state, the best val loss, the newest
    checkpoint and the segment's speed (docs/metrics.md)."""
    s.log.write(
        "end", step=s.step, tokens=s.tokens_seen, state=state,
        signal=signal.Signals(s.signals.received).name if s.signals.received else None,
        message=message, best_val_loss=s.best_val, best_val_step=s.best_step,
        checkpoint=s.checkpoint.name if s.checkpoint else None,
        median_tokens_per_s=median_tokens_per_s(s.throughput),
        tokens_per_s=s.speed.tokens_per_s, mfu=run_mfu(s), **s.speed.fields(),
        **({"overflow_steps": s.scaling.overflows} if s.scaling.enabled else {}),
    )


def finish(s: Session, state: str, exit_code: int, message: str, seconds: float,
           start_step: int) -> TrainResult:
    write_end(s, state, message)
    s.log.close()
    return TrainResult(
        run_dir=s.run_dir, steps=s.step, tokens=s.tokens_seen, seconds=seconds, state=state,
        best_val_loss=s.best_val, best_val_step=s.best_step, last_val_loss=s.last_val,
        checkpoint=s.checkpoint, losses=s.losses, exit_code=exit_code, message=message,
        is_main=s.dist.is_main, start_step=start_step, skipped=s.skipped,
    )

