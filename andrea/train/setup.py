"""Setting up a training process, up to rank 0's start files and plan lines.

The run folder (new, replaced or resumed), the data, the model and optimizer (restored on
resume), the micro-batch, then rank 0's start: the run folder's config and start event, and the
lines that tell the user what the run will do. `set_up` is the recipe; each piece is one
function below.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shlex
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from andrea.config import Config, load_run_config, value_text
from andrea.data.loader import (
    ORDERS,
    TokenSplit,
    check_enough,
    check_in_background,
    data_record,
    mixture_report,
    open_split,
    source_passes,
)
from andrea.data.prepare import (
    check_vocab,
    data_dir_for,
    ensure_prepared,
    prepare_from_config,
    run_sources,
)
from andrea.data.shards import MANIFEST
from andrea.errors import UserError, counted
from andrea.fileio import atomic_write_text, free_bytes, size_text
from andrea.model.attention import recorded_backend_problem, resolve_backend
from andrea.model.params import closed_form_total
from andrea.model.transformer import Andrea, loss_chunk_rows
from andrea.train import rundata
from andrea.train.batch import accumulation_steps, batch_warmup_accumulation, resolve_micro_batch
from andrea.train.checkpoint import checkpoint_nbytes
from andrea.train.checkpoint_room import check_room_at_start, start_warning
from andrea.train.collectives import (
    all_gather_objects,
    all_reduce_sum,
    from_rank0,
    on_every_rank,
)
from andrea.train.compiled import choose_compile, compile_line
from andrea.train.device import Precision, choose_precision, precision_warning
from andrea.train.flops import MfuMeter
from andrea.train.memory import host_need
from andrea.train.metrics import MetricsLog, open_tensorboard, open_wandb
from andrea.train.optim import build_optimizer, muon_ns_precision
from andrea.train.parallel import Parallel, parallel_for
from andrea.train.restarts import attempt
from andrea.train.resume import (
    change_text,
    check_checkpoint_shape,
    check_resume_changes,
    check_run_config,
    config_changes,
    find_run_to_resume,
    locate_run,
    new_val_set,
    new_val_set_line,
    passed_over,
    restart_resume,
    resume_checkpoint,
    trained_config,
)
from andrea.train.rundir import (
    CONFIG,
    LATEST,
    METRICS,
    TrainerState,
    checkpoint_problem,
    clean_partials,
    describe_run,
    discard,
    has_shards,
    linked_entries,
    newest_intact,
    not_a_run,
    put_back,
    read_latest,
    read_state,
    recover_overwrite,
    run_path,
    set_aside,
    set_aside_run,
    step_dirs,
    step_of_dir,
)
from andrea.train.runlock import TrainingLocks
from andrea.train.scaling import loss_scaling_for
from andrea.train.schedule import replan
from andrea.train.session import Session, TrainResult
from andrea.train.signals import SignalWatch
from andrea.train.spike import SpikeGuard
from andrea.train.torchrun import DistInfo
from andrea.train.training_state import TrainingState
from andrea.train.validation import val_sources


def set_up(
    cfg: Config,
    device: torch.device,
    dist: DistInfo,
    signals: SignalWatch,
    locks: TrainingLocks,
    *,
    resume: str | None,
    overwrite: bool,
) -> Session | TrainResult:
    """Find or make the run, the data, the model and optimizer (restored on resume), the
    micro-batch; write the run's config and start record; print the plan. A TrainResult
    instead when a resumed run is already at max_steps."""
    t = cfg.train
    run = decide_run(cfg, dist, locks, resume, overwrite)
    run_dir, resume_from, changes, replace = run.run_dir, run.resume_from, run.changes, run.replace
    if resume_from is not None and run.trainer_state.step >= t.max_steps:
        return nothing_to_do(run_dir, resume_from, run.trainer_state.step, t.max_steps, dist)
    if resume_from is not None:  # before the data is prepared or a model is built
        trained = run.trainer_state.step > 0
        from_rank0(lambda: (check_checkpoint_shape(cfg.model, resume_from, run_dir),
                            check_run_config(run.stored, resume_from, run_dir, trained,
                                             run.trainer_state)), dist)
    parallel = parallel_for(t.parallel, dist)
    check_shared_storage(run, parallel, device, dist)
    train_split, val_split = prepare_data(cfg, dist, locks, run_dir, resume_from)
    val_causes: list[str] = []  # why a resume evaluates on a new val set: none, the same set
    if resume_from is not None:
        from_rank0(lambda: check_resumed_data(cfg, run, train_split, val_split), dist)
    if resume_from is not None and run.trainer_state.step > 0:  # an import has no val losses
        val_causes = from_rank0(lambda: new_val_set(
            run.stored, trained_config(resume_from), cfg,
            run.trainer_state.data,
            data_record(train_split, val_split)), dist)
    precision = choose_precision(t.precision, device)
    dtype = precision.dtype
    ns_precision = muon_ns_precision(cfg, device)
    trainer_state = run.trainer_state  # the checkpoint's, as every rank has it; None: a new run
    precision_line = "\n".join(line for line in (
        resumed_precision_line("train.precision", t.precision, precision,
                               trainer_state.precision if trainer_state else None, "trained"),
        resumed_precision_line("train.muon_ns_precision", t.muon_ns_precision, ns_precision,
                               trainer_state.muon_ns_precision if trainer_state else None,
                               "iterated"),
    ) if line)
    backend, why, attention_line = resolve_attention(cfg, device, dtype, trainer_state, changes)
    model, optimizer, names = build_model(cfg, device, parallel, dtype, backend)
    s = Session(
        cfg=cfg, device=device, dtype=dtype, run_dir=run_dir, model=model, optimizer=optimizer,
        param_names=names, train_split=train_split, val_split=val_split, log=MetricsLog(None),
        signals=signals, locks=locks,
        mfu=MfuMeter(device, dtype, devices=dist.world_size), n_params=model.num_params(),
        preset=Path(cfg.source).stem, parallel=parallel, guard=SpikeGuard(t),
        scaling=loss_scaling_for(dtype, device), precision_why=precision.why,
        ns_precision=ns_precision.name if ns_precision is not None else None,
    )
    if resume_from is not None:
        TrainingState(s).restore(resume_from, record=trainer_state, sharded=run.sharded)
        if val_causes:  # the best so far is a loss on the old set: compared with none of the new
            s.best_val = s.best_step = None
    else:
        TrainingState(s).start_fresh()
    s.micro_batch, micro_batch_line = resolve_micro_batch(cfg, model, dtype, device, dist=dist,
                                                          trainer_state=trainer_state)
    s.accum, batch_line = accumulation_steps(cfg, s.micro_batch, dist.world_size, trainer_state)
    s.warmup_accum = batch_warmup_accumulation(cfg, s.micro_batch, dist.world_size)
    compile_mode, compile_why = choose_compile(cfg.train.compile, cfg.train.compile_mode,
                                               device, dist)
    s.train_model = parallel.wrap(model, compile_mode, device)
    s.checkpoint_nbytes = checkpoint_nbytes(model, optimizer, parallel.sharded, dist.world_size,
                                            device.type)
    signals.completed_step, signals.completed_tokens = s.step, s.tokens_seen
    signals.checkpoint = s.checkpoint
    schedule_lines = plan_schedule(s, trainer_state, changes)
    check_data_fits(s)
    check_room_at_start(s, replace, changes)
    if dist.is_main:
        with replacing(run_dir, replace, signals):
            start_run_files(s, resume_from, changes, backend, val_causes)
            signals.metrics_path = run_dir / METRICS
            announce(s, backend, why, changes, trainer_state=trainer_state,
                     resume_from=resume_from, attention_line=attention_line,
                     compile_line=compile_line(compile_mode, compile_why),
                     micro_batch_line="\n".join(line for line in (micro_batch_line, batch_line)
                                                 if line),
                     schedule_lines=schedule_lines,
                     val_line=new_val_set_line(val_causes, s.step) if val_causes else "",
                     precision_line=precision_line)
    return s


@dataclass
class RunDecision:
    """Which run this is, as rank 0 found it; every rank trains by it."""

    run_dir: Path
    resume_from: Path | None  # the checkpoint to continue from, None for a new run
    changes: dict[str, list[Any]]  # the config keys a resume changes: {key: [old, new]}
    replace: bool  # --overwrite of an old run (done by rank 0 once set-up has passed)
    name: str  # the run's name (a resumed run keeps its own)
    trainer_state: TrainerState | None  # the checkpoint's, None for a new run
    sharded: bool  # whether the checkpoint holds fsdp shards (every rank reads its own)
    stored: Config | None  # the run's config.yaml as rank 0 found it, None for a new run


def decide_run(
    cfg: Config, dist: DistInfo, locks: TrainingLocks, resume: str | None, overwrite: bool
) -> RunDecision:
    """Rank 0 decides whether this is a new, replaced or resumed run, and from which
    checkpoint; every rank takes that decision before any step. So ranks that cannot see rank 0's
    run folder (node-local storage) resume the same run at the same step instead of starting
    another, and rank 0's one-line error on a bad resume stops every rank."""

    check_same_config(cfg, dist)
    run = from_rank0(lambda: open_run(cfg, dist, locks, resume, overwrite), dist)
    cfg.train.name = run.name
    return run


# Keys that may differ between the processes of a run: rank 0 alone writes the metrics a logger
# sends, and each process waits for the others as long as its own join_timeout says.
EACH_PROCESS_OWN = ("train.tensorboard", "train.wandb", "train.wandb_project", "train.wandb_name",
                    "train.wandb_entity", "train.join_timeout")


def check_same_config(cfg: Config, dist: DistInfo) -> None:
    """Every process of a run trains one config. Each node reads its own copy of the file, and
    a stale copy trained silently: another lr made each rank's weights their own, another
    n_layer failed in DDP's constructor with a traceback. Where the run lives (train.name,
    train.runs_dir) may differ: a resume names it; so may EACH_PROCESS_OWN's keys."""
    configs = all_gather_objects(cfg, dist)
    for rank, other in enumerate(configs[1:], start=1):
        changes = {key: values for key, values in config_changes(configs[0], other).items()
                   if key not in EACH_PROCESS_OWN}
        if changes:
            differ = "; ".join(f"{key} {value_text(new)} where rank 0 has {value_text(old)}"
                               for key, (old, new) in changes.items())
            raise UserError(
                f"rank {rank} was given another config than rank 0: {differ}; give every "
                f"process of the run the same config file and --set options"
            )


def check_shared_storage(
    run: RunDecision, parallel: Parallel, device: torch.device, dist: DistInfo
) -> None:
    """Under fsdp every rank writes its shards into rank 0's run folder, and a sharded
    checkpoint is read by every rank: then every rank must see that folder. Rank 0 writes a
    file there that every rank looks for; a rank that cannot find it is a one-line error on
    every rank, before any step (instead of a hang at the first checkpoint)."""
    if not dist.enabled or not (parallel.sharded or run.sharded):
        return
    folder = run.run_dir if run.resume_from is not None else run.run_dir.parent

    def write_marker() -> str:
        folder.mkdir(parents=True, exist_ok=True)
        name = f".andrea-shared-{secrets.token_hex(8)}"
        atomic_write_text(folder / name, name)
        return name

    marker = from_rank0(write_marker, dist)
    blind = torch.zeros(dist.world_size, device=device)
    blind[dist.rank] = 0.0 if (folder / marker).is_file() else 1.0
    blind = all_reduce_sum(blind, dist)
    if dist.is_main:
        (folder / marker).unlink(missing_ok=True)
    missing = [rank for rank, flag in enumerate(blind.tolist()) if flag]
    if missing:
        why = (f"for {parallel.name}" if parallel.sharded else
               f"to resume {run.resume_from}, whose shards (written under fsdp) every rank reads")
        raise UserError(
            f"{folder}: the run folder must be shared by every node {why}, and rank"
            f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} cannot see it; "
            f"put train.runs_dir on storage every node mounts at the same path, or use "
            f"train.parallel=ddp"
        )


def plan_schedule(
    s: Session, state: TrainerState | None, changes: dict[str, list[Any]]
) -> list[str]:
    """Re-plan the lr schedule when a resume changes max_steps (see schedule.replan); the
    lines that say so. The max_steps it was planned for: the checkpoint's record, else (older
    checkpoints) the run's config.yaml's."""
    t = s.cfg.train
    planned = changes.get("train.max_steps", [t.max_steps])[0]
    if state is not None and state.max_steps is not None:
        planned = state.max_steps
    try:
        kept = [step_of_dir(d) or 0 for d in step_dirs(s.run_dir)]
        s.schedule_anchor, lines = replan(s.step, t, planned, s.schedule_anchor, kept)
    except UserError as exc:  # name the run the resume cannot extend
        raise UserError(f"{s.run_dir}: {exc}") from None
    return lines


def nothing_to_do(
    run_dir: Path, checkpoint: Path, done: int, max_steps: int, dist: DistInfo
) -> TrainResult:
    """A resumed run already at max_steps: untouched, but for a `latest` that eval cannot read
    when the resume named the newest checkpoint a resume takes (as the refusal of the damaged
    one said to): it then names the newest eval and generate can read, which no later
    checkpoint would otherwise ever put right."""
    message = f"run {run_dir} is already at step {done} (max_steps {max_steps}): nothing to do"
    latest = read_latest(run_dir)
    # Damaged as eval and generate see it: a newest checkpoint that only a resume refuses (its
    # optimizer state lost) still serves them, and stays `latest`.
    damaged = latest is None or checkpoint_problem(latest) is not None
    if dist.is_main and damaged and newest_intact(run_dir, for_resume=True) == checkpoint:
        was = (run_dir / LATEST).read_text(errors="replace").strip() \
            if (run_dir / LATEST).is_file() else ""
        serves = newest_intact(run_dir) or checkpoint  # the newest eval and generate can read
        atomic_write_text(run_dir / LATEST, serves.name + "\n")
        message += (f"; its '{LATEST}' file, which named {was!r} (damaged or missing), now names "
                    f"{serves.name}")
    return TrainResult(
        run_dir=run_dir, steps=done, tokens=0, seconds=0.0, state="nothing to do",
        best_val_loss=None, best_val_step=None, last_val_loss=None,
        checkpoint=checkpoint, is_main=dist.is_main, message=message,
    )


def prepare_data(
    cfg: Config, dist: DistInfo, locks: TrainingLocks, run_dir: Path,
    resume_from: Path | None = None,
) -> tuple[TokenSplit, TokenSplit]:
    """The train and val splits: rank 0 prepares the shards if they are missing, the others
    wait for it. A resume whose data folder is not here takes them from rank 0's
    `resume_data`. Every rank then holds the data folders it reads until the training ends
    (`locks`): a prepare that would rewrite them is refused meanwhile."""
    if resume_from is not None:
        cfg = from_rank0(lambda: resume_data(cfg, resume_from), dist)
    else:  # rank 0 prepares; the others wait, and stop with its one line if it fails
        from_rank0(lambda: ensure_prepared(cfg), dist)
    locks.read_data([folder for _, folder, _ in run_sources(cfg)], run_dir)

    def open_splits() -> tuple[TokenSplit, TokenSplit]:  # on nodes of their own, each its copy
        missing = [str(folder) for _, folder, _ in run_sources(cfg)
                   if not (folder / MANIFEST).is_file()]
        if missing and not dist.is_main:  # rank 0 prepared on its own disk alone
            raise UserError(
                f"{', '.join(missing)}: no prepared data on this node; rank 0 prepares only on "
                f"its own: run {shlex.join(['andrea', 'prepare', '--config', cfg.source])} on "
                f"this node first (the same config), or put the data folder on storage every "
                f"node shares"
            )
        train_split, val_split = open_split(cfg, "train"), open_split(cfg, "val")
        check_vocab(train_split.vocab_size, cfg.model.vocab_size,
                    f"{cfg.source}: model.vocab_size")
        return train_split, val_split

    train_split, val_split = on_every_rank(open_splits, dist)
    check_in_background(train_split, val_split)  # their checksums, not waited for here
    return train_split, val_split


def check_resumed_data(
    cfg: Config, run: RunDecision, train_split: TokenSplit, val_split: TokenSplit
) -> None:
    """Rank 0, resuming: the data about to be read is the data the checkpoint records
    (rundata.check_same_data), else a UserError, or a note when it is the run's data
    prepared again."""
    def take(folder: str) -> str:  # data.dir holds a mixture's folders
        value = Path(folder).parent if cfg.data.sources else folder
        return shlex.join(["--set", f"data.dir={value}"])

    recorded, found = run.trainer_state.data, data_record(train_split, val_split)
    note = rundata.check_same_data(run.resume_from, recorded, found, needs="resuming",
                                   named="data.dir" in run.changes, take=take)
    if note:  # a val split that changed with it is new_val_set's to say
        print(note, flush=True)


def resume_data(cfg: Config, checkpoint: Path) -> Config:
    """Rank 0, resuming from `checkpoint`: the config whose data folders the run trains on,
    prepared. The run's own folders when they are here (kept current, as for any run, while
    the text they were prepared from is here too); else
    those prepared with the tokenizer the checkpoint carries (train/rundata.py), prepared
    first from the run's text with one line that says so, or a one-line error with the
    command that prepares them when that text is not here either."""
    if rundata.is_prepared(cfg):
        gone = rundata.missing_text(cfg)
        if not gone:
            ensure_prepared(cfg, fixed=True)  # data.dir may change on resume, data.source not
        else:  # nothing to keep it current against: the data as prepared, as eval scores it
            print(f"note: {gone[0]}, the text the run's data was prepared from, is not here; "
                  f"resuming on {data_dir_for(cfg)} as it was prepared", flush=True)
        return cfg
    own = rundata.own_tokenizer_config(cfg, checkpoint)
    if own is not cfg and rundata.is_prepared(own):
        ensure_prepared(own)
        return own
    data, target = data_dir_for(cfg), data_dir_for(own)
    rundata.stop_without_text(own, checkpoint, needs="resuming", data=data,
                              command=rundata.prepare_command(own, checkpoint))
    prepare_from_config(own, verbose=False,
                        announce=rundata.prepare_line(own, checkpoint, data, target))
    return own


# The words of resumed_precision_line for each key whose `auto` is a precision the run records.
RESOLVED_PRECISIONS = {"train.precision": "precision",
                       "train.muon_ns_precision": "Muon's Newton-Schulz precision"}


def resumed_precision_line(
    key: str, requested: str, precision: Precision | None, recorded: str | None, verb: str
) -> str:
    """A line when `key` (RESOLVED_PRECISIONS), `requested` as `auto`, resolves here to another
    `precision` than the one the resumed run `recorded` (a run moved from a CPU with bf16
    units, or a GPU, to one without): its losses from here are another precision's, and a pin
    keeps the run's; `verb`: what the run did in it. Else '' (`precision` None: nothing to
    resolve, as Muon's where the optimizer has no Muon)."""
    if (requested != "auto" or precision is None or recorded is None
            or recorded == precision.name):
        return ""
    return (f"resume: {RESOLVED_PRECISIONS[key]} {recorded} -> {precision.name} "
            f"({precision.why}); the run {verb} in {recorded} until now: --set "
            f"{key}={recorded} keeps it")


def resolve_attention(
    cfg: Config,
    device: torch.device,
    dtype: torch.dtype,
    trainer_state: TrainerState | None,
    changes: dict[str, list[Any]],
) -> tuple[str, str, str]:
    """(the attention backend to run, why, a line when a resume changes the backend the run
    recorded, else ''). model.attention resolves as for a new run (resolve_backend), except
    that a resumed run whose model.attention stays `auto` keeps the backend it ran where that
    can run here: a resume never changes it silently (another GPU, a newer auto table). It
    changes when the recorded one cannot run here or the resume sets model.attention, and the
    line says so. A checkpoint without the record resolves afresh."""
    requested, head_dim = cfg.model.attention, cfg.model.head_dim
    backend, why = resolve_backend(requested, head_dim, device, dtype)
    recorded = trainer_state.attention if trainer_state is not None else None
    if recorded is None or recorded == backend:
        return backend, why, ""
    if "model.attention" in changes:
        old, new = changes["model.attention"]
        cause = change_text("model.attention", old, new)
    elif requested == "auto":
        problem = recorded_backend_problem(recorded, head_dim, device)
        if problem is None:
            return recorded, f"auto: the run's recorded choice; a new run would take {backend}", ""
        cause = f"{recorded} cannot run here: {problem}"
    else:
        cause = f"model.attention: {requested}"
    return backend, why, f"resume: attention {recorded} -> {backend} ({cause})"


def build_model(
    cfg: Config, device: torch.device, parallel: Parallel, dtype: torch.dtype, backend: str
) -> tuple[Andrea, torch.optim.Optimizer, dict[int, str]]:
    """(model, optimizer, parameter names by id). The model is laid out over the processes
    first (sharded under fsdp), since the optimizer must hold the parameters as they train."""
    t = cfg.train
    n = closed_form_total(cfg.model)

    def check_room() -> None:
        # Before anything is allocated: a model far too big (model.n_layer 10^6) does not fail
        # to build, it takes memory without end while the machine swaps.
        need = host_need(n, device, t.optimizer, parallel.sharded)
        if not need.fits:
            raise UserError(_does_not_fit(
                cfg, n, f"{size_text(need.needed)} of {need.held}",
                f"{need.where} ({size_text(need.total)})"))

    # Every rank hears of one that refuses (nodes differ), rather than wait for it in DDP's set-up.
    on_every_rank(check_room, parallel.dist)
    torch.manual_seed(t.seed)  # identical initial weights on every rank
    try:
        model = Andrea(cfg.model, attention_backend=backend).to(device)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if isinstance(exc, RuntimeError) and not (isinstance(exc, torch.OutOfMemoryError)
                                                  or "can't allocate memory" in str(exc)):
            raise
        # The model is built in the machine's memory first, then moved to the GPU.
        where = "the GPU's memory" if isinstance(exc, torch.OutOfMemoryError) else \
            "this machine's memory"
        raise UserError(_does_not_fit(cfg, n, f"{size_text(4 * n)} of float32 weights alone",
                                      where)) from None
    model.loss_chunk_rows = loss_chunk_rows(cfg.model.vocab_size, t.loss_chunk_rows)
    if t.zero_init_output:
        model.zero_output_projections()
    model.checkpoint_blocks = t.activation_checkpointing == "blocks"
    parallel.shard(model, device, bf16_params=dtype == torch.bfloat16 and device.type == "cuda")
    optimizer = build_optimizer(model, cfg, device, parallel.dist.world_size,
                                sharded=parallel.sharded)
    names = {id(p): n for n, p in model.named_parameters()}
    return model, optimizer, names


def _does_not_fit(cfg: Config, n: int, size: str, where: str) -> str:
    """The one line for a model that does not fit in `where`, naming the keys that size it."""
    m = cfg.model
    return (f"model: {n:,} parameters ({size}) do not fit in {where}; make the model smaller "
            f"(model.n_layer {m.n_layer}, model.n_head {m.n_head}, model.head_dim {m.head_dim}, "
            f"model.vocab_size {m.vocab_size:,}, model.block_size {m.block_size:,})")


def open_run(
    cfg: Config, dist: DistInfo, locks: TrainingLocks, resume: str | None, overwrite: bool
) -> RunDecision:
    """Rank 0's decision: a resumed run (its checkpoint's trainer state read here, once), a new
    one, or an old one to replace (--overwrite). It takes the run folder's lock first, so that
    a second training on a run in use is refused before it decides anything about it."""
    run_dir = Path(cfg.train.runs_dir) / cfg.train.name
    resume, overwrite = restart_resume(resume, overwrite)
    if dist.is_main:
        folder = run_dir
        if resume is not None and resume != "auto":  # a run named by its path
            # An --overwrite stopped half-way left the run set aside: found once put back.
            folder = (set_aside_run(run_path(resume, cfg.train.runs_dir))
                      or locate_run(resume, cfg))
        if folder.is_dir() and (links := linked_entries(folder)) is not None:
            raise UserError(
                f"{folder}: holds symbolic links where a run keeps its own files ({links}); "
                f"training would write through them, outside the run: replace each with the "
                f"file or folder it points to, or remove it")
        locks.take_run(folder)
        if recover_overwrite(folder):
            print(f"{folder}: an --overwrite stopped during its set-up (its process ended) had "
                  f"set the old run aside; it is back as it was", flush=True)
    if resume is not None:
        found = find_run_to_resume(resume, cfg)
        if found is not None:
            stored = load_run_config(found / CONFIG)
            checkpoint = resume_checkpoint(resume, found)
            say_restart(checkpoint, found)
            state = read_state(checkpoint)
            changes = check_resume_changes(stored, cfg, found, state.step > 0, state)
            cfg.train.name = stored.train.name  # the run keeps its name in its config.yaml
            # and says where it is: a runs_dir given to `--resume RUN` (which names the run by
            # its folder) written there made a later `--config RUN/config.yaml --resume auto`
            # look for it elsewhere, find none and start a new run.
            cfg.train.runs_dir = str(found.parent)
            return RunDecision(found, checkpoint, changes, False, cfg.train.name, state,
                               has_shards(checkpoint), stored)
        if resume == "auto" and dist.is_main and not say_restart(None, run_dir):
            print(f"--resume auto: no checkpoint under {run_dir}, starting a new run")
    if dist.is_main and run_dir.is_dir() and (problem := not_a_run(run_dir)) is not None:
        raise UserError(
            f"{run_dir}: {problem}; a run is written only into a new folder, or over an andrea "
            f"run with --overwrite: move those files away, or pick another name with --set "
            f"train.name=... (or another train.runs_dir)")
    # Checkpoints without `latest` (deleted, or a copy without it) are a run all the same.
    replace = dist.is_main and (read_latest(run_dir) is not None or bool(step_dirs(run_dir)))
    if replace and not overwrite:
        raise UserError(
            f"{run_dir}: already holds a run; continue it with "
            f"{shlex.join(['--resume', str(run_dir)])} (or --resume auto), pick another name "
            f"with --set train.name=..., or replace it with --overwrite"
        )
    return RunDecision(run_dir, None, {}, replace, cfg.train.name, None, False, None)


def say_restart(checkpoint: Path | None, run_dir: Path) -> bool:
    """The one line of a worker torchrun restarted (rank 0's: only it decides the run), naming
    the damaged checkpoint it passed over, if any; whether this is one."""
    restart = attempt().number
    if not restart:
        return False
    if checkpoint is None:
        print(f"torchrun restart {restart}: no checkpoint under {run_dir} yet, starting the run "
              f"again", flush=True)
        return True
    why = passed_over(run_dir, checkpoint)
    print(f"torchrun restart {restart}: continuing from {checkpoint}, the run's newest intact "
          f"checkpoint" + (f"; {why}" if why else ""), flush=True)
    return True


@contextlib.contextmanager
def replacing(run_dir: Path, replace: bool, signals: SignalWatch) -> Iterator[None]:
    """--overwrite (`replace`): the new run's start files are written with the old run set
    aside, which is deleted once they are, or put back when anything stops the start (a
    missing package for train.wandb, a full disk, a signal). Entered only once every set-up
    check has passed (check_data_fits, check_room_at_start), so a bad config or missing data
    never moves the old run."""
    if not replace:
        yield
        return
    print(f"--overwrite: deleting the run in {run_dir} ({describe_run(run_dir)})", flush=True)
    try:
        set_aside(run_dir)  # in here: a signal may stop it half-way, and put_back undoes that
        yield
    except BaseException:
        signals.metrics_path = None  # the old run's again: a stop records nothing in it
        put_back(run_dir)
        print(f"--overwrite: this run did not start; the run in {run_dir} is back as it was",
              flush=True)
        raise
    discard(run_dir)


def check_data_fits(s: Session) -> None:
    """The checks the first batch and the first evaluation would make, made before the run
    folder is touched: every step's windows fit the train split (each size a batch-size or
    sequence-length warm-up gives them), and the val set exists and has its tokenizer."""
    t = s.cfg.train
    for step in sorted({s.step, s.batch_warmup_steps, s.seq_warmup_steps}):
        if s.step <= step < t.max_steps:
            windows, length = s.windows_at(step)
            check_enough(s.train_split, windows * s.accum_at(step) * s.dist.world_size, length)
    if t.eval_every:
        s.val_set = val_sources(s.val_split, s.cfg.model.block_size, t.eval_tokens or None)


# ------------------------------------------------- rank 0's start: the run's files, the plan lines


def start_run_files(
    s: Session, resume_from: Path | None, changes: dict[str, list[Any]], backend: str,
    val_causes: list[str],
) -> None:
    """Rank 0: the run folder, its config.yaml (with any resume changes) and the start event,
    which records a new val set's causes (`andrea runs` starts its best val again there)."""
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
        host=socket.gethostname(), run_dir=str(s.run_dir),  # where messages name it
        resumed_from=str(resume_from) if resume_from else None,
        n_params=s.model.num_params(), preset=s.preset, world_size=s.dist.world_size,
        precision=str(s.dtype).removeprefix("torch."), attention=backend,
        micro_batch_size=s.micro_batch, accum_steps=s.accum,
        tokens_per_step=s.tokens_per_step, micro_batch_auto=t.micro_batch_size == "auto",
        activation_checkpointing=t.activation_checkpointing, changed=changes or None,
        new_val_set=val_causes or None,
    )


def announce(
    s: Session,
    backend: str,
    why: str,
    changes: dict[str, list[Any]],
    *,
    trainer_state: TrainerState | None,
    resume_from: Path | None,
    attention_line: str,
    compile_line: str,
    micro_batch_line: str,
    schedule_lines: list[str],
    val_line: str,
    precision_line: str,
) -> None:
    """Rank 0: the lines that say what the run will do, before its first step; `val_line`: a
    resume's new val set (new_val_set_line), `precision_line`: a resume's other precisions
    (resumed_precision_line, a line each), each else ''."""
    t, dist, cfg = s.cfg.train, s.dist, s.cfg
    s.say(f"precision: {str(s.dtype).removeprefix('torch.')} ({s.precision_why})")
    costly = precision_warning(s.dtype, s.device)
    if costly:
        s.say(costly)
    if precision_line:
        s.say(precision_line)
    s.say(f"attention: {backend} ({why})")
    s.say(compile_line)
    for key, (old, new) in changes.items():
        if key == "model.attention" and attention_line:
            continue  # the attention line says it, with the backend it changes
        said = any(line.startswith(f"resume: {key} ") for line in schedule_lines) or (
            change_text(key, old, new) in val_line)
        if not said:  # else the schedule's line says it, or the val set's
            s.say(f"resume: {change_text(key, old, new)}")
    if val_line:
        s.say(val_line)
    if attention_line:
        s.say(attention_line)
    layout_change = (s.parallel.layout_change_line(trainer_state) if trainer_state is not None
                     else None)
    for line in s.parallel.lines() + ([layout_change] if layout_change else []) + schedule_lines:
        s.say(line)
    if resume_from is not None:
        newer = [d.name for d in step_dirs(s.run_dir) if (step_of_dir(d) or 0) > s.step]
        if newer:  # a resume from an older step of this run: its newer checkpoints are left
            names = newer[0] if len(newer) == 1 else f"{newer[0]} to {newer[-1]}"
            them = "it" if len(newer) == 1 else "them"
            s.say(f"resume: {resume_from.name} is older than this run's {names}, which stay "
                  f"until this resume trains past {them}, each then replaced or pruned "
                  f"(train.keep_last); copy the run folder first to keep {them}")
    if micro_batch_line:  # before the line that uses it, and the warm-ups that depart from it
        s.say(micro_batch_line)
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
    size = f"{counted(steps, 'step')} x {per_step:,} tokens/step"
    if s.step < s.batch_warmup_steps:
        warm = min(s.batch_warmup_steps, steps) - s.step
        size = (f"{counted(warm, 'step')} x {s.tokens_at(0):,} + "
                f"{counted(steps - s.step - warm, 'step')} x {per_step:,} tokens/step")
        if s.step:
            size = f"{s.tokens_seen:,} tokens in {counted(s.step, 'step')} + {size}"
    elif s.tokens_seen != s.step * per_step:
        size = (f"{s.tokens_seen:,} tokens in {counted(s.step, 'step')} + "
                f"{counted(steps - s.step, 'step')} x {per_step:,} tokens/step")
    line = (f"plan: {size} = {total:,} tokens = "
            f"{_passes(passes)} passes over the {prepared:,} prepared training tokens")
    line += ORDERS[s.cfg.data.order].plan_note
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
    # A BPE trained on a small text reaches fewer ids than model.vocab_size asks for, and the
    # rows past them (of the embedding and the LM head, its largest matmul) train nothing.
    ids, rows = s.train_split.vocab_size, s.cfg.model.vocab_size
    fit = -(-ids // 64) * 64  # a multiple of 64, as the presets pad theirs
    if not s.step and rows > fit:
        lines.append(
            f"note: the tokenizer has {ids:,} ids and model.vocab_size is {rows:,}: "
            f"{rows - ids:,} embedding rows ({(rows - ids) * s.cfg.model.d_model:,} parameters) "
            f"no token uses; a new run with --set model.vocab_size={fit} trains without them"
        )
    return lines


def _passes(passes: float) -> str:
    return f"{passes:,.1f}" if passes >= 0.1 else f"{passes:.2g}"
