"""How much memory a training process needs, and the micro-batch that fits (micro_batch_size: auto).

The estimate is a formula, calibrated against peaks measured with scripts/bench_memory.py
(see docs/training.md): a fixed part (weights, gradients, AdamW's two moments, the bf16 weight
copies autocast keeps, the loss's chunk of logits, the process itself) plus activations that grow
with the tokens of one micro-batch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from andrea.config import ModelConfig
from andrea.model.transformer import WEIGHT_GRAD_GROUP
from andrea.model.transformer import loss_chunk_rows as chunk_rows_for

GIB = 2**30
# Activation bytes kept per token and layer, in units of d_model elements of the compute dtype
# (4 bytes in fp32, 2 under bf16 autocast, whose fp32 norms and residuals count double):
# slopes of peak RSS against micro-batch, ANDREA-120M at 1 and 2 x 1024 on the CPU with SDPA
# (fp32: +0.91 GiB a sequence, bf16: +0.51), the same 28 in ANDREA-12M at 4 and 16 x 256.
# fp16 autocast keeps the same tensors as bf16 (not measured apart: no fp16 units here).
ACTIVATION_WIDTHS = {torch.float32: 26, torch.bfloat16: 28, torch.float16: 28}
HALF = (torch.bfloat16, torch.float16)
# With activation checkpointing each block's input stays, plus one block's activations while
# it is recomputed: ANDREA-120M bf16 grew by 0.15 GiB a sequence, 6 units per layer.
CHECKPOINTED_WIDTH = 6
# Python and torch's libraries, measured before the model exists (0.22 GiB).
PROCESS_BYTES = GIB // 4
# Leave this share of the available memory to everything else on the machine.
HEADROOM = 0.85
# On a CPU, auto stops at this many tokens per micro-batch: the matmuls already run at the
# CPU's rate with a few thousand rows, and a micro-batch of 16 x 1024 (ANDREA-120M) takes
# minutes there, so the progress bar would sit still that long.
CPU_MICRO_BATCH_TOKENS = 4096


# The least a parameter holds in the machine's memory while a CPU trains it, by
# train.optimizer: float32 weights and gradients (4 + 4 bytes) and the optimizer's state
# (AdamW: two float32 moments; Muon: one momentum for the block matrices, AdamW's two for the
# rest, so at least one). An optimizer not named here counts the weights and gradients alone.
# Lower bounds, since the check that uses them must never refuse a model that fits.
CPU_TRAINING_BYTES = {"adamw": 16, "muon": 12}
WEIGHTS_AND_GRADIENTS_BYTES = 8
# The model is built in float32 in the machine's memory on any device, then moved (or sharded).
BUILD_BYTES = 4


def _meminfo(*keys: str) -> int:
    """The sum of /proc/meminfo's lines `keys` ("MemTotal:") in bytes; 0 where unreadable."""
    total = 0
    try:
        for line in PROC_MEMINFO.read_text().splitlines():
            if line.startswith(keys):
                total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def machine_memory() -> int:
    """All the memory this machine can give a process, RAM and swap (/proc/meminfo's MemTotal
    + SwapTotal), or its physical pages where there is no /proc. Deliberately the most it could
    ever have, not what is free now: a check against it refuses only the impossible."""
    total = _meminfo("MemTotal:", "SwapTotal:")
    return total or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_ceiling() -> tuple[int, str]:
    """The most memory this process could ever have, and what sets it, in words: the machine's
    (machine_memory), or a container's memory limit (its cgroup's) and the machine's swap where
    that is less. A container's process that goes past its limit is killed by the kernel
    without a word, however much the machine has."""
    machine, limit = machine_memory(), cgroup_memory_limit()
    contained = limit + _meminfo("SwapTotal:") if limit is not None else None
    if contained is not None and contained < machine:
        return contained, "this container's memory limit (cgroup)"
    return machine, "this machine's memory"


@dataclass
class HostNeed:
    """What building and training a model takes of the machine's memory at the least."""

    needed: int  # bytes
    held: str  # what those bytes are, for a message
    total: int  # the most this process could have (memory_ceiling)
    where: str  # what sets `total`, for a message

    @property
    def fits(self) -> bool:
        return self.needed <= self.total


def host_need(n_params: int, device: torch.device, optimizer: str, sharded: bool) -> HostNeed:
    """The least memory of this machine `n_params` parameters take, known before a model is
    built. Building one too big for it does not fail: the allocations grow (10^6 layers: 11 GB
    after a minute and on) until the machine swaps or its OOM killer steps in. Training on the
    CPU keeps the weights, gradients and optimizer state there; on a GPU (or sharded, where each
    process keeps a share after the model is laid out) the float32 weights built there first
    are all that is certain."""
    if device.type == "cpu" and not sharded:
        per = CPU_TRAINING_BYTES.get(optimizer, WEIGHTS_AND_GRADIENTS_BYTES)
        held = ("float32 weights, gradients and " +
                ("AdamW's two moments" if optimizer == "adamw" else "the optimizer's state"))
    else:
        per, held = BUILD_BYTES, "float32 weights, built in this machine's memory first"
    return HostNeed(per * n_params, held, *memory_ceiling())


@dataclass
class MicroBatchChoice:
    micro_batch: int
    estimated_bytes: int
    available_bytes: int

    @property
    def fits(self) -> bool:
        return self.estimated_bytes <= self.available_bytes * HEADROOM


def available_memory(device: torch.device, processes_here: int = 1) -> int:
    """Bytes this process may still use: free GPU memory, or on the CPU the machine's
    MemAvailable, or what the container's memory limit (cgroup) leaves if that is less, shared
    among the `processes_here` processes of this machine."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = _meminfo("MemAvailable:")
    if not available:  # no /proc: free pages as the OS counts them
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limited = cgroup_memory_left()
    if limited is not None:
        available = min(available, limited)
    return available // max(1, processes_here)


# Where the kernel shows this process's control groups; module constants so a test can point
# them at a made-up container.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MEMINFO = Path("/proc/meminfo")
# cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages).
_UNLIMITED = 2**60
# (limit, usage, memory.stat key of reclaimable page cache): cgroup v2, then v1.
_CGROUP_FILES = (
    ("memory.max", "memory.current", "inactive_file"),
    ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
)


def cgroup_memory_limit() -> int | None:
    """The container's memory limit in bytes, or None where no limit is set or none can be
    read."""
    return next((limit for _, _, limit in _cgroup_limits()), None)


def cgroup_memory_left() -> int | None:
    """Bytes the container's memory limit still allows (limit - usage + the page cache the
    kernel would reclaim first), or None where no limit is set or none can be read."""
    for folder, (_, usage_name, cache_key), limit in _cgroup_limits():
        try:
            usage = int((folder / usage_name).read_text())
        except (OSError, ValueError):
            continue
        if limit is None:
            return None
        cache = 0
        try:
            for line in (folder / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == cache_key:
                    cache = int(value)
        except (OSError, ValueError):
            pass
        return max(0, limit - usage + cache)
    return None


def _cgroup_limits() -> Iterator[tuple[Path, tuple[str, str, str], int | None]]:
    """Each control group folder whose memory limit can be read, with its version's file names
    and the limit in bytes (None: "max" (v2) or v1's equivalent, no limit). The process's own
    group (from /proc/self/cgroup) comes first, then the root one (a container sees its own
    group there)."""
    for folder, names in _cgroup_folders():
        try:
            text = (folder / names[0]).read_text().strip()
        except OSError:
            continue
        yield folder, names, int(text) if text.isdigit() and int(text) < _UNLIMITED else None


def _cgroup_folders() -> list[tuple[Path, tuple[str, str, str]]]:
    """Candidate folders, each with its version's file names: the own group first."""
    own_v2, own_v1 = None, None
    try:
        for line in PROC_CGROUP.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                own_v2 = path.lstrip("/")
            elif "memory" in controllers.split(","):
                own_v1 = path.lstrip("/")
    except (OSError, ValueError):
        pass
    v2, v1 = _CGROUP_FILES
    folders = []
    if own_v2:
        folders.append((CGROUP_ROOT / own_v2, v2))
    folders.append((CGROUP_ROOT, v2))
    if own_v1:
        folders.append((CGROUP_ROOT / "memory" / own_v1, v1))
    folders.append((CGROUP_ROOT / "memory", v1))
    return folders


def estimate_peak_bytes(
    model: ModelConfig, n_params: int, micro_batch: int, dtype: torch.dtype, checkpointing: bool,
    loss_chunk_rows: int | str = "auto",
) -> int:
    """Estimated peak memory of one process training `model` at `micro_batch` sequences, its
    loss in the chunks of train.loss_chunk_rows = `loss_chunk_rows` (0: the whole logits at
    once)."""
    d, n_layer, tokens = model.d_model or 0, model.n_layer, micro_batch * model.block_size
    element = 2 if dtype in HALF else 4
    fixed = 16 * n_params  # float32 weights, gradients, AdamW exp_avg and exp_avg_sq
    if dtype in HALF:
        fixed += 2 * n_params  # autocast's cached half copies of the weights
    # One chunk of the loss: float32 logits turned softmax in place, the matmul's own output
    # and the gradient in the compute dtype; and the float32 gradient of the tied weight, with,
    # in half precision, a group of its products in the compute dtype waiting to be added to it
    # (a compiled model's; an eager one holds one at a time).
    # Unchunked, autograd holds the logits and their gradient in the compute dtype, and a
    # float32 copy, the saved log-softmax and the float32 gradient, at once.
    logits, rows = tokens * model.vocab_size, chunk_rows_for(model.vocab_size, loss_chunk_rows)
    if rows is None:
        fixed += (12 + 2 * element) * logits
    else:
        fixed += 8 * min(logits, rows * model.vocab_size) + 4 * model.vocab_size * d
        if dtype in HALF:
            fixed += element * WEIGHT_GRAD_GROUP * model.vocab_size * d
    width = ACTIVATION_WIDTHS.get(dtype, ACTIVATION_WIDTHS[torch.float32])
    if checkpointing:
        per_token = (n_layer * CHECKPOINTED_WIDTH + width) * d * element
    else:
        per_token = n_layer * width * d * element
    return PROCESS_BYTES + fixed + tokens * per_token


def choose_micro_batch(
    model: ModelConfig,
    n_params: int,
    sequences_per_rank: int,
    dtype: torch.dtype,
    *,
    checkpointing: bool,
    available: int,
    max_sequences: int | None = None,
    loss_chunk_rows: int | str = "auto",
) -> MicroBatchChoice:
    """The largest divisor of sequences_per_rank, at most max_sequences, whose estimate fits
    `available` (with headroom), so the global batch stays exact; 1 if none fits (the choice
    then says so)."""
    choice = MicroBatchChoice(1, 0, available)
    for size in range(min(sequences_per_rank, max_sequences or sequences_per_rank), 0, -1):
        if sequences_per_rank % size:
            continue
        choice = MicroBatchChoice(
            size, estimate_peak_bytes(model, n_params, size, dtype, checkpointing,
                                      loss_chunk_rows), available
        )
        if choice.fits:
            break
    return choice
