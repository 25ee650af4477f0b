"""A training session's whole state at a step: the weights, the optimizer state, every rank's
generator states and the `TrainerState`. `write_session` writes it as a checkpoint,
`restore_session` reads one back into a session's model and optimizer (on resume, and on the
spike guard's rollback); andrea/train/checkpoint.py holds the checkpoint's files and format.

Both are collectives: every rank calls them. Rank 0 reads a whole checkpoint and sends it to the
others; under a sharded mode every rank writes and reads its own shards.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from andrea.config import Config
from andrea.data.loader import TokenSplit
from andrea.errors import UserError
from andrea.train import checkpoint as ckpt_io
from andrea.train.collectives import (
    all_gather_bytes,
    all_reduce_sum,
    barrier,
    broadcast_tensors,
    from_rank0,
)
from andrea.train.diskspace import WriteFailed, describe
from andrea.train.state import TrainerState
from andrea.train.torchrun import DistInfo


def write_session(
    run_dir: Path, cfg: Config, tokenizer_identity: str, model: torch.nn.Module,
    optimizer: torch.optim.Optimizer, names: dict[int, str], rng: dict[str, torch.Tensor],
    state: TrainerState, dist: DistInfo, sharded: bool, files: dict[str, bytes] | None = None,
) -> Path:
    """Checkpoint step state.step: weights, optimizer state, every rank's generator states
    (`rng`: this rank's, as local_rng_states took them), the trainer state and `files` (the
    tokenizer's, TokenizerKind.checkpoint_files). Every rank calls
    it (it gathers); rank 0 writes, and under a sharded mode every rank first writes its
    shards into rank 0's folder. Returns the checkpoint folder, on every rank.

    A write that fails on any rank (a full disk) raises WriteFailed on every rank, once every
    rank is past its writes and rank 0 has removed the partial folder: `latest` and the older
    checkpoints are as they were."""
    failure: OSError | None = None
    try:
        written = _write(run_dir, cfg, tokenizer_identity, model, optimizer, names, rng, state,
                         dist, sharded, files)
    except OSError as exc:
        failure = exc
    failed = torch.tensor([0.0 if failure is None else 1.0])
    if all_reduce_sum(failed, dist).item() == 0:  # every rank reaches this: no one waits alone
        return written

    def clean_up() -> tuple[str, bool]:
        shutil.rmtree(ckpt_io.partial_dir(run_dir, state.step, os.getpid()), ignore_errors=True)
        return describe(failure)

    raise WriteFailed(*from_rank0(clean_up, dist))


def _write(
    run_dir: Path, cfg: Config, tokenizer_identity: str, model: torch.nn.Module,
    optimizer: torch.optim.Optimizer, names: dict[int, str], rng: dict[str, torch.Tensor],
    state: TrainerState, dist: DistInfo, sharded: bool, files: dict[str, bytes] | None,
) -> Path:
    all_rng = all_rng_states(rng, dist)
    partial, optimizer_tensors = None, {}
    if sharded:
        # The weights are also gathered whole (for eval, generate, export), kept by rank 0.
        pid = torch.tensor([os.getpid()], dtype=torch.int64).view(torch.uint8)
        writer = int(all_gather_bytes(pid, dist)[0].view(torch.int64).item())
        partial = ckpt_io.partial_dir(run_dir, state.step, writer)
        if dist.is_main and partial.exists():
            shutil.rmtree(partial)
        barrier(dist)
        shards = ckpt_io.sharded_state(model, optimizer, names)
        ckpt_io.write_shards(partial / ckpt_io.SHARDS_DIR, shards, dist.rank)
        model_tensors = ckpt_io.model_state(model, dist.is_main)
    elif dist.is_main:
        model_tensors = ckpt_io.model_state(model)
        optimizer_tensors = ckpt_io.optimizer_state(optimizer, names)
    if not dist.is_main:
        return run_dir / ckpt_io.step_dir_name(state.step)
    return ckpt_io.save_checkpoint(run_dir, state.step, cfg, tokenizer_identity, model_tensors,
                                   optimizer_tensors, all_rng, state, cfg.train.keep_last,
                                   partial, files)


def restore_session(
    ckpt: Path, sharded: bool, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    names: dict[int, str], train_split: TokenSplit, device: torch.device, dist: DistInfo,
    state: TrainerState | None = None,
) -> TrainerState:
    """Load weights, optimizer state and generator states; returns the trainer state (`state`
    when the caller has it already, as every rank has it: set-up's rank 0 read it to decide
    the run). A whole checkpoint is read by rank 0 alone and sent to the others (so under ddp
    the run folder may be on node 0 alone); a sharded one (fsdp) is read by every rank through
    its shards (set-up has checked that every rank sees it). Either fits the model as it is
    laid out now."""
    if sharded:
        check_tokenizer(ckpt, ckpt_io.read_model_checkpoint(ckpt, tensors=False)[2], train_split)
        ckpt_io.read_shards(ckpt, model, optimizer, names)
        if state is None:
            state = ckpt_io.read_state(ckpt)
        rng = ckpt_io.read_safetensors(ckpt / ckpt_io.RNG_FILE)[0]
    else:
        read: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optimizer": {}, "rng": {}}
        known = state

        def read_whole() -> TrainerState:
            read["model"], meta = ckpt_io.read_model_checkpoint(ckpt)[::2]
            check_tokenizer(ckpt, meta, train_split)
            read["optimizer"] = ckpt_io.read_safetensors(ckpt / ckpt_io.OPTIMIZER_FILE)[0]
            read["rng"] = ckpt_io.read_safetensors(ckpt / ckpt_io.RNG_FILE)[0]
            return known if known is not None else ckpt_io.read_state(ckpt)

        state = from_rank0(read_whole, dist)
        weights, moments, rng = (broadcast_tensors(read[k], dist) for k in read)
        ckpt_io.load_weights(model, weights, ckpt / ckpt_io.MODEL_FILE)
        ckpt_io.apply_optimizer_state(optimizer, names, moments, ckpt)
    restore_rng_states(rng, device, dist, seed_for_rank(state.seed, dist.rank))
    return state


def check_tokenizer(checkpoint: Path, meta: dict[str, str], train_split: TokenSplit) -> None:
    if meta.get("tokenizer") != train_split.tokenizer_identity:
        raise UserError(
            f"{checkpoint}: trained with tokenizer {meta.get('tokenizer')}, but the data in "
            f"{train_split.data_dir} uses {train_split.tokenizer_identity}"
        )


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
