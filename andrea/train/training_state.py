"""A training session's checkpointed state, with torch: `TrainingState`, everything a checkpoint
holds of a session gathered in one object that writes and restores itself, and the generator
states of every rank it carries. The files' tensors are andrea/train/checkpoint.py's; room on
disk for them, andrea/train/checkpoint_room.py's.

`TrainingState.save` and `restore` are collectives: every rank calls them. Rank 0 reads a whole
checkpoint and sends it to the others (so under ddp the run folder may be on node 0 alone);
under a sharded mode every rank writes and reads its own shards. The generator states go with
the state, not the files: each rank's are gathered to rank 0 to be written, and each rank takes
its own back (or a fresh seed of its own) on resume; to the files they are one more tensor file.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import fields
from pathlib import Path

import torch

from andrea.data.loader import TokenSplit, data_record
from andrea.data.tokenizer import kind_of
from andrea.errors import UserError
from andrea.fileio import free_bytes
from andrea.train.checkpoint import (
    apply_optimizer_state,
    load_weights,
    model_state,
    optimizer_state,
    read_model_checkpoint,
    read_safetensors,
    read_shards,
    save_checkpoint,
    sharded_state,
    write_shards,
)
from andrea.train.checkpoint_room import DiskFull, describe_failure, full_message
from andrea.train.collectives import (
    all_gather_bytes,
    all_reduce_sum,
    barrier,
    broadcast_tensors,
    from_rank0,
)
from andrea.train.device import device_name, precision_name
from andrea.train.rundir import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SHARDS_DIR,
    TrainerState,
    has_shards,
    partial_dir,
    read_state,
    step_dir_name,
    verify_file,
)
from andrea.train.session import Session
from andrea.train.spike import SpikeGuard
from andrea.train.torchrun import DistInfo

# trainer_state.json's keys that a Session attribute holds as they are: {key: attribute}.
SESSION_HELD = {key.name: key.metadata["session"] for key in fields(TrainerState)
                if key.metadata["session"] is not None}


class TrainingState:
    """Everything a checkpoint holds of a training session, gathered from the session in one
    object that writes (`save`) and restores itself (`restore` on resume, `roll_back` for the
    spike guard): the weights, the optimizer state, every rank's generator states, fp16's loss
    scaling, the spike guard's state (which keeps the data position past skipped windows) and
    the run's counters and records, trainer_state.json's `TrainerState` (`record` one way,
    `restore` the other: the one place each way; the keys a Session attribute holds as they
    are, SESSION_HELD, are copied from TrainerState's declaration)."""

    def __init__(self, s: Session) -> None:
        self.s = s

    def record(self) -> TrainerState:
        """What the checkpoint of the session's last completed step records besides tensors."""
        s = self.s
        return TrainerState(
            **{key: getattr(s, held) for key, held in SESSION_HELD.items()},
            data_position=s.guard.data_step(s.step), world_size=s.dist.world_size,
            seed=s.cfg.train.seed, preset=s.preset, micro_batch_size=s.micro_batch,
            parallel=s.parallel.name, tokens_per_step=s.tokens_per_step,
            device=device_name(s.device), attention=s.model.attention_backend,
            precision=precision_name(s.dtype), muon_ns_precision=s.ns_precision,
            max_steps=s.cfg.train.max_steps, data=data_record(s.train_split, s.val_split),
            spike_guard=s.guard.state_dict(), loss_scaling=s.scaling.state_dict(),
        )

    def save(self, rng: dict[str, torch.Tensor]) -> Path:
        """Checkpoint the session's last completed step, with this rank's generator states `rng`
        (as local_rng_states took them), the tokenizer's files (TokenizerKind.checkpoint_files)
        and `record()`, once rank 0's disk has room for it by the estimate; returns the
        checkpoint folder, on every rank. Every rank calls it (it gathers); rank 0 writes, and
        under a sharded mode every rank first writes its shards into rank 0's folder.

        DiskFull on every rank, with nothing left behind, when the disk has no room or a write
        fails on any rank (a full disk): raised once every rank is past its writes and rank 0
        has removed the partial folder, so `latest` and the older checkpoints are as they were."""
        s = self.s
        free = from_rank0(lambda: free_bytes(s.run_dir), s.dist)
        if free < s.checkpoint_nbytes:
            raise DiskFull(full_message(s, free, None))
        failure: OSError | None = None
        try:
            written = self._write(rng)
        except OSError as exc:
            failure = exc
        failed = torch.tensor([0.0 if failure is None else 1.0])
        if all_reduce_sum(failed, s.dist).item() == 0:  # every rank gets here: none waits alone
            return written

        def clean_up() -> tuple[str, bool | None]:
            shutil.rmtree(partial_dir(s.run_dir, s.step, os.getpid()), ignore_errors=True)
            return describe_failure(failure)

        cause, full = from_rank0(clean_up, s.dist)
        raise DiskFull(full_message(s, free, cause, full))

    def _write(self, rng: dict[str, torch.Tensor]) -> Path:
        s, dist = self.s, self.s.dist
        all_rng = all_rng_states(rng, dist)
        partial, optimizer_tensors = None, {}
        if s.parallel.sharded:
            # The weights are also gathered whole (for eval, generate, export), kept by rank 0.
            pid = torch.tensor([os.getpid()], dtype=torch.int64).view(torch.uint8)
            writer = int(all_gather_bytes(pid, dist)[0].view(torch.int64).item())
            partial = partial_dir(s.run_dir, s.step, writer)
            if dist.is_main and partial.exists():
                shutil.rmtree(partial)
            barrier(dist)
            shards = sharded_state(s.model, s.optimizer, s.param_names)
            write_shards(partial / SHARDS_DIR, shards, dist.rank)
            model_tensors = model_state(s.model, dist.is_main)
        elif dist.is_main:
            model_tensors = model_state(s.model)
            optimizer_tensors = optimizer_state(s.optimizer, s.param_names)
        if not dist.is_main:
            return s.run_dir / step_dir_name(s.step)
        identity = s.train_split.tokenizer_identity
        return save_checkpoint(
            s.run_dir, self.record(), s.cfg, identity, model=model_tensors,
            optimizer=optimizer_tensors, rng=all_rng, keep_last=s.cfg.train.keep_last,
            partial=partial, lock=s.locks.run,
            files=kind_of(identity).checkpoint_files(identity, s.train_split.data_dir),
        )

    def restore(self, checkpoint: Path, *, record: TrainerState, sharded: bool) -> None:
        """Resume from `checkpoint`: its weights, optimizer state and generator states, then
        the counters, records, spike guard and loss scaling of its trainer state `record` (as
        set-up's rank 0 read it, with whether it holds shards, to decide the run: every rank
        has them)."""
        self._load(checkpoint, sharded, record)
        s = self.s
        for key, held in SESSION_HELD.items():
            setattr(s, held, getattr(record, key))
        if record.preset is not None:
            s.preset = record.preset
        s.checkpoint, s.checkpoint_step = checkpoint, record.step
        s.guard = SpikeGuard(s.cfg.train, record.spike_guard)
        s.scaling.load_state_dict(record.loss_scaling)

    def roll_back(self, checkpoint: Path) -> None:
        """The spike guard's rollback to `checkpoint`, which every rank sees: its weights,
        optimizer and generator states, its step and tokens; the losses after it are forgotten.
        The spike guard, the loss scaling and the best val loss stay as they are: the guard
        goes on past the offending data (SpikeGuard.rolled_back)."""
        s = self.s
        record = self._load(checkpoint, has_shards(checkpoint))
        s.step, s.tokens_seen = record.step, record.tokens
        s.checkpoint_step = s.step
        s.losses = {k: v for k, v in s.losses.items() if k <= s.step}

    def start_fresh(self) -> None:
        """A new run's generators: each rank seeded its own way (seed_for_rank)."""
        torch.manual_seed(seed_for_rank(self.s.cfg.train.seed, self.s.dist.rank))

    def _load(
        self, ckpt: Path, sharded: bool, record: TrainerState | None = None
    ) -> TrainerState:
        """Load weights, optimizer state and generator states; returns the trainer state
        (`record` when the caller has it already). A whole checkpoint is read by rank 0 alone
        and sent to the others; a sharded one (fsdp) is read by every rank through its shards
        (set-up has checked that every rank sees it). Either fits the model as it is laid out
        now."""
        s, dist = self.s, self.s.dist
        model, optimizer, names = s.model, s.optimizer, s.param_names
        if sharded:
            # The weights come from the shards, and of the whole model file only its header is
            # read; but eval, generate and export open that file: checked against its checksum
            # as a whole checkpoint's resume checks it, so that a checkpoint they refuse as
            # damaged is not resumed from without a word.
            from_rank0(lambda: verify_file(ckpt / MODEL_FILE), dist)
            check_tokenizer(ckpt, read_model_checkpoint(ckpt, tensors=False)[2], s.train_split)
            read_shards(ckpt, model, optimizer, names)
            if record is None:
                record = read_state(ckpt)
            rng = read_safetensors(ckpt / RNG_FILE)[0]
        else:
            read: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optimizer": {}, "rng": {}}
            known = record

            def read_whole() -> TrainerState:
                read["model"], meta = read_model_checkpoint(ckpt)[::2]
                check_tokenizer(ckpt, meta, s.train_split)
                read["optimizer"] = read_safetensors(ckpt / OPTIMIZER_FILE)[0]
                read["rng"] = read_safetensors(ckpt / RNG_FILE)[0]
                return known if known is not None else read_state(ckpt)

            record = from_rank0(read_whole, dist)
            weights, moments, rng = (broadcast_tensors(read[k], dist) for k in read)
            load_weights(model, weights, ckpt / MODEL_FILE)
            apply_optimizer_state(optimizer, names, moments, ckpt)
        check_rng_states(rng, ckpt / RNG_FILE, record, s.device)
        try:
            restore_rng_states(rng, s.device, dist, seed_for_rank(record.seed, dist.rank))
        except (RuntimeError, ValueError) as exc:  # bytes of the right size, not a state
            raise UserError(f"{ckpt / RNG_FILE}: not a generator's state ({exc}); the "
                            f"checkpoint is damaged: resume from another step folder") from None
        return record


def check_tokenizer(checkpoint: Path, meta: dict[str, str], train_split: TokenSplit) -> None:
    """A checkpoint resumed on data of another tokenizer is refused in one line."""
    if meta.get("tokenizer") != train_split.tokenizer_identity:
        raise UserError(
            f"{checkpoint}: trained with tokenizer {meta.get('tokenizer')}, but the data in "
            f"{train_split.data_dir} uses {train_split.tokenizer_identity}"
        )


# ----------------------------------------------------------------------------- generators


def seed_for_rank(seed: int, rank: int) -> int:
    """The generator seed of `rank` in a run seeded `seed`: dropout differs per rank,
    deterministically."""
    return seed + rank


def local_rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's generator states now, by kind (cpu, cuda)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def all_rng_states(local: dict[str, torch.Tensor], dist: DistInfo) -> dict[str, torch.Tensor]:
    """Every rank's generator states, keyed '<kind>.rank<r>' (a collective)."""
    out = {}
    for kind, state in local.items():
        for rank, gathered in enumerate(all_gather_bytes(state, dist)):
            out[f"{kind}.rank{rank}"] = gathered
    return out


def check_rng_states(
    rng: dict[str, torch.Tensor], path: Path, record: TrainerState, device: torch.device
) -> None:
    """The generator states of checkpoint file `path` are those its writer's ranks had
    (record.world_size of them, CUDA's too where it ran on a GPU; record.device None: either),
    each a byte tensor of the size its generator takes; refused in one line naming the key
    otherwise, rather than failing inside torch or being taken as a fresh seed."""
    damaged = "the checkpoint is damaged: resume from another step folder"
    ranks = range(record.world_size)
    cpu = {f"cpu.rank{r}" for r in ranks}
    cuda = {f"cuda.rank{r}" for r in ranks}
    allowed = ([cpu] if record.device == "cpu" else [cpu | cuda] if record.device is not None
               else [cpu, cpu | cuda])
    if set(rng) not in allowed:
        expected = allowed[-1]
        missing, extra = sorted(expected - set(rng)), sorted(set(rng) - expected)
        what = (f"no '{missing[0]}'" if missing else f"'{extra[0]}' is no generator of the "
                f"{record.world_size} process{'es' if record.world_size != 1 else ''} that "
                f"wrote it")
        raise UserError(f"{path}: {what}; {damaged}")
    sizes = {"cpu": torch.get_rng_state().numel()}
    if device.type == "cuda":
        sizes["cuda"] = torch.cuda.get_rng_state(device).numel()
    for key, state in sorted(rng.items()):
        size = sizes.get(key.partition(".")[0])
        if state.dtype != torch.uint8 or state.dim() != 1 or size not in (None, state.numel()):
            bytes_ = f"{size} bytes" if size is not None else "bytes"
            raise UserError(
                f"{path}: '{key}' has dtype {str(state.dtype).removeprefix('torch.')} and shape "
                f"{list(state.shape)}, not the {bytes_} (uint8) of a generator's state; {damaged}")


def restore_rng_states(
    rng: dict[str, torch.Tensor], device: torch.device, dist: DistInfo, fresh_seed: int
) -> None:
    """This rank's generator states from the checkpoint; a rank the checkpoint has no state for
    (a run resumed with more processes than it had, or on a GPU after a CPU) is seeded anew
    with `fresh_seed`, its own, rather than keeping the state every such rank shares."""
    cpu = rng.get(f"cpu.rank{dist.rank}")
    if cpu is not None:
        torch.set_rng_state(cpu)
    else:
        torch.manual_seed(fresh_seed)  # seeds every CUDA device too
    if device.type == "cuda":
        cuda = rng.get(f"cuda.rank{dist.rank}")
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        else:
            torch.cuda.manual_seed(fresh_seed)
