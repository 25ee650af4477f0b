"""A training's checkpoints, with torch: `TrainingState`, everything a checkpoint holds of a
session gathered in one object that writes and restores itself; the files' tensors written and
read (safetensors, and under fsdp each rank's shards through torch.distributed.checkpoint); a
checkpoint's size, and room for it on the run folder's disk. The folder's layout, names,
`latest`, partial folders and checksums record are andrea/train/rundir.py's.

`TrainingState.save` and `restore` are collectives: every rank calls them. Rank 0 reads a whole
checkpoint and sends it to the others (so under ddp the run folder may be on node 0 alone);
under a sharded mode every rank writes and reads its own shards.

Room: a checkpoint's size is estimated from the byte counts of the weights and the optimizer
state (`checkpoint_nbytes`, once a session: `Session.checkpoint_nbytes`). At start, a disk that
cannot hold even one checkpoint stops the run before its first step, with a command that trains
on another disk (`check_room_at_start`); one that cannot hold the checkpoints the run will keep
at once is a warning (`start_warning`); before each checkpoint, too little room for one stops
the run before anything is written, and a write that fails anyway (ENOSPC above all) stops it
the same way once the partial folder is removed (`TrainingState.save`): one line, exit code 2,
`latest` and the older checkpoints untouched, every rank stopping together.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import shutil
import tempfile
import warnings
from dataclasses import fields
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from andrea import faults
from andrea.config import Config, config_from_dict, load_config
from andrea.data.loader import TokenSplit
from andrea.data.tokenizer import kind_of
from andrea.errors import UserError
from andrea.fileio import (
    DISK_FULL_ERRNOS,
    atomic_write_bytes,
    atomic_write_text,
    free_bytes,
    size_text,
)
from andrea.model.params import check_stored_shape
from andrea.resources import configs_dir
from andrea.train.collectives import (
    all_gather_bytes,
    all_reduce_sum,
    barrier,
    broadcast_tensors,
    from_rank0,
)
from andrea.train.device import device_name
from andrea.train.optim import make_empty_state, state_size
from andrea.train.parallel import bare_name
from andrea.train.rundir import (
    CONFIG,
    FORMAT,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SHARD_INDEX,
    SHARDS_DIR,
    TRAINER_STATE,
    TrainerState,
    file_sha256,
    has_shards,
    partial_dir,
    prune_checkpoints,
    publish,
    read_latest,
    read_safetensors_header,
    read_state,
    step_dir_name,
    step_dirs,
    verify_file,
    write_checksums,
)
from andrea.train.session import Session
from andrea.train.sharding import full_tensor, shard_like
from andrea.train.spike import SpikeGuard
from andrea.train.torchrun import DistInfo

OPTIMIZER_PREFIX = "optimizer."  # the optimizer's keys among the shards' tensors
# The LM head is tied to the token embedding: stored once, re-tied on load.
TIED_KEYS = {"lm_head.weight": "tok_emb.weight"}
# Besides the tensors' bytes: the model file's metadata (the config as JSON, about 3 kB) and
# trainer_state.json, then each tensor's entry in a safetensors header.
FIXED_BYTES = 16_384
HEADER_BYTES_PER_TENSOR = 128


# trainer_state.json's keys that a Session attribute holds as they are: {key: attribute}.
SESSION_HELD = {key.name: key.metadata["session"] for key in fields(TrainerState)
                if key.metadata["session"] is not None}


class DiskFull(Exception):
    """A checkpoint did not fit (or its write failed): the run stops with this one line."""


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
            device=device_name(s.device), max_steps=s.cfg.train.max_steps,
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

        def clean_up() -> tuple[str, bool]:
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
            partial=partial,
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
        restore_rng_states(rng, s.device, dist, seed_for_rank(record.seed, dist.rank))
        return record


# ----------------------------------------------------------------------------- tensors written


def model_state(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The weights to store: no wrapper prefixes, tied tensors once, contiguous CPU copies,
    sharded ones gathered whole. Sharded, every rank must call it; keep=False (the ranks that
    write nothing) drops each gathered tensor at once instead of holding the whole model."""
    state = {}
    for key, value in model.state_dict().items():
        key = bare_name(key)
        if key in TIED_KEYS:
            continue
        whole = full_tensor(value.detach())
        if keep:
            state[key] = whole.to("cpu").contiguous()
    return state


def optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str], keep: bool = True
) -> dict[str, torch.Tensor]:
    """The per-parameter state (AdamW's, Muon's) keyed by `<param name>.<field>`, gathered
    whole as model_state is (and with its `keep`)."""
    out = {}
    for key, value in _optimizer_tensors(optimizer, names).items():
        whole = full_tensor(value)
        if keep:
            out[key] = whole.to("cpu").contiguous()
    return out


def _optimizer_tensors(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> dict[str, torch.Tensor]:
    """This rank's per-parameter optimizer state keyed by `<param name>.<field>`."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for field, value in optimizer.state.get(p, {}).items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                out[f"{names[id(p)]}.{field}"] = tensor.detach()
    return out


def sharded_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> dict[str, torch.Tensor]:
    """Weights (tied ones once) and optimizer state as this rank holds them, for the shards."""
    state = {k: v.detach() for k, v in model.state_dict().items() if k not in TIED_KEYS}
    for key, value in _optimizer_tensors(optimizer, names).items():
        state[OPTIMIZER_PREFIX + key] = value
    return state


def write_shards(folder: Path, state: dict[str, torch.Tensor], rank: int) -> None:
    """Every rank writes its slices of `state` into folder (a collective: all ranks call it and
    it returns when every rank's files are written); then rank 0 writes the index."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    folder.mkdir(parents=True, exist_ok=True)
    try:
        dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(folder),
                                                                    save_distributed=True))
    except CheckpointException as exc:  # raised on every rank when any rank's write failed
        lost = [inner for inner, _ in exc.failures.values() if isinstance(inner, OSError)]
        if lost:
            raise lost[0] from None  # a full disk, as a plain write would say it
        raise
    faults.after_shards_written(rank, folder.parent.name[:11])
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        files = {f.name: f.stat().st_size for f in sorted(folder.glob("*.safetensors"))}
        atomic_write_text(folder / SHARD_INDEX,
                          json.dumps({"format": FORMAT, "files": files}, indent=1))


def save_checkpoint(
    run_dir: Path, state: TrainerState, cfg: Config, tokenizer_identity: str, *,
    model: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor],
    rng: dict[str, torch.Tensor], keep_last: int, partial: Path | None = None,
    files: dict[str, bytes] | None = None,
) -> Path:
    """Write the checkpoint of step state.step into run_dir: the tensors `model`, `optimizer`
    and `rng` (as model_state, optimizer_state and all_rng_states key them), the trainer state
    and `files`, other files it carries by name (the tokenizer's:
    TokenizerKind.checkpoint_files); then point `latest` at it and prune to keep_last.
    partial: the folder every rank's shards were written into (see rundir.partial_dir); it then
    holds the optimizer state, and `optimizer` is ignored. Every file's sha256 goes into
    checksums.json, written last."""
    step = state.step
    sharded = partial is not None
    if partial is None:
        partial = partial_dir(run_dir, step, os.getpid())
        if partial.exists():
            shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": FORMAT,
        "step": str(step),
        "tokenizer": tokenizer_identity,
        "config": json.dumps(cfg.to_dict()),
    }
    sums: dict[str, str] = {}

    def write(name: str, blob: bytes) -> None:
        atomic_write_bytes(partial / name, blob)
        sums[name] = hashlib.sha256(blob).hexdigest()  # the bytes in hand: no second read

    write(MODEL_FILE, safetensors_bytes(model, metadata))
    faults.after_model_file()
    faults.disk_full("checkpoint", step_dir_name(step))
    if not sharded:
        write(OPTIMIZER_FILE, safetensors_bytes(optimizer, {"format": FORMAT}))
    write(RNG_FILE, safetensors_bytes(rng, {"format": FORMAT}))
    write(TRAINER_STATE, state.to_json())
    for name, blob in (files or {}).items():
        write(name, blob)
    if sharded:  # written by torch.distributed.checkpoint: hashed from their files
        for shard in sorted((partial / SHARDS_DIR).iterdir()):
            sums[f"{SHARDS_DIR}/{shard.name}"] = file_sha256(shard)
    write_checksums(partial, sums)
    final = publish(partial, run_dir, step)
    prune_checkpoints(run_dir, keep_last)
    return final


# ----------------------------------------------------------------------------- tensors read


def check_shards(ckpt: Path, expected: dict[str, torch.Tensor]) -> None:
    """Every file the index lists is there at its size, and every tensor has the shape the
    model (and its optimizer state) has; a UserError naming the file or tensor if not."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    folder = ckpt / SHARDS_DIR
    try:
        verify_file(folder / SHARD_INDEX)
        files = json.loads((folder / SHARD_INDEX).read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{folder / SHARD_INDEX}: unreadable shard index: {exc}") from None
    if not isinstance(files, dict):
        raise UserError(f"{folder / SHARD_INDEX}: 'files' is not a mapping of file names to sizes")
    for name, size in files.items():
        # Only plain names inside shards/: an index is untrusted, '../x' or '/x' lead out.
        if Path(name).name != name or name in ("", ".", "..") or not name.endswith(".safetensors"):
            raise UserError(f"{folder / SHARD_INDEX}: lists {name!r}, which is not a .safetensors "
                            f"file name inside {SHARDS_DIR}/ (a damaged or forged checkpoint); "
                            f"resume from another checkpoint")
        path = folder / name
        if not path.is_file():
            raise UserError(f"{path}: missing (listed in {SHARD_INDEX}); the checkpoint's shards "
                            f"are incomplete: resume from another checkpoint")
        if path.stat().st_size != size:
            raise UserError(f"{path}: {path.stat().st_size} bytes, {SHARD_INDEX} says {size} "
                            f"(truncated or damaged?)")
        verify_file(path)  # on every rank: each hashes every shard once (docs/faults.md)
    stored = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
    for key, value in expected.items():
        if key not in stored:
            raise UserError(f"{folder}: no tensor '{key}' in the shards; the checkpoint is of "
                            f"another model or optimizer")
        if tuple(stored[key].size) != tuple(value.shape):
            raise UserError(
                f"{folder}: tensor '{key}' has shape {list(stored[key].size)} in the checkpoint "
                f"but {list(value.shape)} in the model; the model config differs"
            )


def read_shards(
    ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> None:
    """Load weights and optimizer state from the shards into the model as it is laid out now
    (sharded over any number of ranks, or whole): DCP reads each rank's slices."""
    import torch.distributed.checkpoint as dcp

    make_empty_state(optimizer)  # loaded into in place
    state = sharded_state(model, optimizer, names)
    check_shards(ckpt, state)
    import torch.distributed as dist

    with warnings.catch_warnings():  # one process reading: DCP warns that it is alone
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(ckpt / SHARDS_DIR)),
                 no_dist=not dist.is_initialized())
    with torch.no_grad():  # dcp.load fills the tensors in place, except a 0-dim step count
        for group in optimizer.param_groups:
            for p in group["params"]:
                for field in optimizer.state[p]:
                    loaded = state[f"{OPTIMIZER_PREFIX}{names[id(p)]}.{field}"]
                    if optimizer.state[p][field] is not loaded:
                        optimizer.state[p][field].copy_(loaded)


def _open(path: Path):
    if not path.is_file():
        raise UserError(f"{path}: missing; the checkpoint is incomplete")
    try:
        read_safetensors_header(path)  # a forged header length is refused before safetensors
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(
            f"{path}: not a valid safetensors file (truncated or damaged?): {exc}"
        ) from None


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A checkpoint's safetensors file whole, checked against its checksum first."""
    verify_file(path)
    with _open(path) as f:
        metadata = f.metadata() or {}
        try:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(f"{path}: damaged tensor data (truncated?): {exc}") from None
    return tensors, metadata


def read_model_checkpoint(
    ckpt: Path, tensors: bool = True
) -> tuple[dict[str, torch.Tensor], Config, dict[str, str]]:
    """Weights (none with tensors=False), the config they were trained with, the metadata.
    The config must describe the stored tensors (checked from the header, before any tensor
    is read or any model built from it: a checkpoint is untrusted input)."""
    path = ckpt / MODEL_FILE
    with _open(path) as f:
        metadata = f.metadata() or {}
        shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}
    if metadata.get("format") != FORMAT or "config" not in metadata:
        raise UserError(f"{path}: not an andrea checkpoint (metadata format is "
                        f"{metadata.get('format')!r}, expected {FORMAT!r})")
    try:
        stored = json.loads(metadata["config"])
    except ValueError:
        raise UserError(f"{path}: the config in the metadata is not JSON (damaged?)") from None
    cfg = config_from_dict(stored, origin=f"{path} metadata")
    check_stored_shape(cfg.model, shapes, f"{path} metadata")
    weights = read_safetensors(path)[0] if tensors else {}
    return weights, cfg, metadata


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], origin: Path) -> None:
    """Copy stored tensors into the model, naming any tensor whose name or shape differs."""
    current = model.state_dict()
    expected = {k: v for k, v in current.items() if k not in TIED_KEYS}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise UserError(
            f"{origin}: tensors do not match the model (missing: {', '.join(missing) or '-'}; "
            f"unexpected: {', '.join(extra) or '-'})"
        )
    for key, value in tensors.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise UserError(
                f"{origin}: tensor '{key}' has shape {list(value.shape)} in the checkpoint but "
                f"{list(expected[key].shape)} in the model; the model config differs"
            )
    whole = {**tensors, **{k: tensors[v] for k, v in TIED_KEYS.items()}}
    model.load_state_dict({k: shard_like(v, current[k]) for k, v in whole.items()})


def load_optimizer(
    optimizer: torch.optim.Optimizer, names: dict[int, str], ckpt: Path
) -> None:
    apply_optimizer_state(optimizer, names, read_safetensors(ckpt / OPTIMIZER_FILE)[0], ckpt)


def apply_optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str], tensors: dict[str, torch.Tensor],
    ckpt: Path,
) -> None:
    """Put the stored per-parameter state `tensors` (as optimizer_state keys them, read from
    checkpoint `ckpt`) into the optimizer, sharded like each parameter."""
    state = optimizer.state_dict()
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = names[id(p)] + "."
            fields = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if fields:
                for k in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                    if k in fields and fields[k].shape != p.shape:
                        raise UserError(
                            f"{ckpt / OPTIMIZER_FILE}: '{prefix}{k}' has shape "
                            f"{list(fields[k].shape)}, the parameter {list(p.shape)}"
                        )
                state["state"][index] = {k: shard_like(v, p) if k != "step" else v
                                         for k, v in fields.items()}
            index += 1
    optimizer.load_state_dict(state)


def read_trainer_state(ckpt: Path) -> tuple[TrainerState, dict[str, torch.Tensor]]:
    """The checkpoint's TrainerState and every rank's generator states."""
    return read_state(ckpt), read_safetensors(ckpt / RNG_FILE)[0]


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


# ----------------------------------------------------------------------------- size and room


def checkpoint_nbytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool, world_size: int,
    device_type: str,
) -> int:
    """About how many bytes one checkpoint of this model and optimizer takes on disk: the
    weights (tied ones once), the optimizer state, every rank's generator states and the
    headers; a sharded checkpoint also holds the weights a second time, in its shards."""
    weights = {k: v for k, v in model.state_dict().items()
               if bare_name(k) not in TIED_KEYS}
    weight_bytes = sum(v.numel() * v.element_size() for v in weights.values())
    n_state, state_bytes = state_size(optimizer)
    rng_bytes = world_size * (torch.get_rng_state().numel() + (16 if device_type == "cuda" else 0))
    tensors = len(weights) + n_state + 2 * world_size
    total = weight_bytes + state_bytes + rng_bytes + FIXED_BYTES
    if sharded:
        total += weight_bytes + world_size * FIXED_BYTES
        tensors += len(weights) + n_state
    return total + tensors * HEADER_BYTES_PER_TENSOR


def checkpoints_ahead(step: int, max_steps: int, every: int) -> int:
    """How many checkpoints a run at `step` still writes on its way to max_steps."""
    periodic = (max_steps // every - step // every) if every else 0
    return periodic + (0 if every and max_steps % every == 0 else 1)


def peak_checkpoints(s: Session) -> tuple[int, int]:
    """(the run's checkpoints on disk now, the most it holds at once: its existing ones, up to
    train.keep_last, and the one being written)."""
    t = s.cfg.train
    existing = len(step_dirs(s.run_dir))
    ahead = checkpoints_ahead(s.step, t.max_steps, t.checkpoint_every)
    return existing, max(existing + 1, min(t.keep_last + 1, existing + ahead))


def start_warning(s: Session, free: int) -> str | None:
    """The warning line when the disk cannot hold the checkpoints the run keeps at once (its
    existing ones, up to train.keep_last, and the one being written), or None."""
    t, per = s.cfg.train, s.checkpoint_nbytes
    existing, peak = peak_checkpoints(s)
    needed = (peak - existing) * per
    if free >= needed:
        return None
    held = f"{peak} at once, {size_text(per)} each" + (
        f": train.keep_last {t.keep_last} and the one being written"
        if peak == t.keep_last + 1 else "")
    return (f"warning: {s.run_dir}: {size_text(free)} free on its disk, but the checkpoints need "
            f"about {size_text(needed)} more ({held}); the run will stop cleanly at the first "
            f"checkpoint that does not fit: free space, lower train.keep_last, or set "
            f"train.runs_dir to a disk with room")


def check_room_at_start(s: Session, replaced: bool) -> None:
    """Every rank, before the first step: a UserError when the run folder's disk (as rank 0
    sees it) cannot hold even one checkpoint, rather than training up to the first one to stop
    there. replaced: the run folder is an --overwrite's, whose files make room as they go."""

    def measure() -> None:
        free = free_bytes(s.run_dir)
        if replaced and s.run_dir.is_dir():
            free += sum(f.stat().st_size for f in s.run_dir.rglob("*") if f.is_file())
        if free < s.checkpoint_nbytes:
            raise UserError(no_room_message(s, free))

    from_rank0(measure, s.dist)


def no_room_message(s: Session, free: int) -> str:
    """The one line of a run whose disk cannot hold one checkpoint: the size, the room, where,
    and the command that trains on a disk with room for every checkpoint the run keeps."""
    existing, peak = peak_checkpoints(s)
    needed = (peak - existing) * s.checkpoint_nbytes
    head = (f"{s.run_dir}: a checkpoint of this run needs about "
            f"{size_text(s.checkpoint_nbytes)}, its disk has {size_text(free)} free; nothing "
            f"was trained or written")
    folder = folder_with_room(needed, s.run_dir)
    dest = str(folder) if folder else "DIR"
    where = ("" if folder else
             f"; DIR: a folder on a disk with about {size_text(needed)} free")
    if s.checkpoint is not None:  # a resume: the run folder moves with its checkpoints
        moved = Path(dest) / s.run_dir.name
        return (f"{head}; move the run to a disk with room and continue there: "
                f"{shlex.join(['mv', str(s.run_dir), dest])} && "
                f"{shlex.join(['andrea', 'train', '--resume', str(moved)])}{where}")
    return (f"{head}; train on a disk with room: "
            f"{shlex.join(train_command(s.cfg, {'train.runs_dir': dest}))}{where}")


def folder_with_room(needed: int, run_dir: Path) -> Path | None:
    """A runs folder on another disk with `needed` bytes free: under the home directory, else
    the temporary one; None when neither has the room."""
    for folder in (Path.home() / "andrea-runs", Path(tempfile.gettempdir()) / "andrea-runs"):
        if folder.resolve() != run_dir.parent.resolve() and free_bytes(folder) >= needed:
            return folder
    return None


def train_command(cfg: Config, changed: dict[str, str]) -> list[str]:
    """`andrea train` that trains cfg, as argv: its config file (a preset by name) and a --set
    for each key it differs from it by, then for each of `changed`'s {dotted key: value}."""
    base = load_config(None if cfg.source == "<defaults>" else cfg.source)
    sets = {f"{section}.{key}": value
            for section, keys in cfg.to_dict().items()
            for key, value in keys.items() if value != base.to_dict()[section][key]}
    sets.update(changed)
    source = Path(cfg.source)
    name = source.stem if source.parent.resolve() == configs_dir().resolve() else cfg.source
    argv = ["andrea", "train"] + ([] if cfg.source == "<defaults>" else ["--config", name])
    for key, value in sets.items():
        argv += ["--set", f"{key}={_yaml_value(value) if key not in changed else value}"]
    return argv


def _yaml_value(value: object) -> str:
    """value as --set reads it back (a YAML scalar or flow list)."""
    if value == "":
        return ""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf)
    return text.removesuffix("\n...\n").strip()


def full_message(s: Session, free: int, cause: str | None, full: bool = True) -> str:
    """The one line of a checkpoint that was not written. cause: why the write failed, None
    when the free-space check stopped it before writing anything."""
    folder, per = s.run_dir / step_dir_name(s.step), size_text(s.checkpoint_nbytes)
    if cause is None:
        what = (f"{folder} was not written: a checkpoint needs about {per}, the disk has "
                f"{size_text(free)} free")
    else:
        what = (f"writing {folder} failed ({cause}; it needs about {per}, {size_text(free)} was "
                f"free); its partial folder is removed")
    latest = read_latest(s.run_dir)
    if latest is None:
        how = (f"no checkpoint was written before it; free space there, or set train.runs_dir "
               f"to a disk with room, then start over: andrea train --config "
               f"{s.run_dir / CONFIG}")
    else:
        how = (f"latest is still {latest}; free space there, or move {s.run_dir} to a disk with "
               f"room, then continue: andrea train --resume {s.run_dir} (its new path if moved)")
    head = "disk full" if full else "checkpoint write failed"
    return f"{head} at step {s.step}: {what}; {how}"


def describe_failure(exc: OSError | None) -> tuple[str, bool]:
    """(what failed, in a few words; whether the disk was full) for a failed write: rank 0's
    OSError, or None when only another rank's write failed."""
    if exc is None:
        return "a write failed on another rank", False
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}", exc.errno in DISK_FULL_ERRNOS

