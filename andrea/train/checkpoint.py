"""A checkpoint's files, with torch: the tensors written and read (safetensors, and under fsdp
each rank's shards through torch.distributed.checkpoint), `save_checkpoint` assembling a step
folder, and the size of one checkpoint on disk (`checkpoint_nbytes`). The folder's layout,
names, `latest`, partial folders and checksums record are andrea/train/rundir.py's; what a
session writes into them and restores from them is andrea/train/training_state.py's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from andrea import faults
from andrea.config import Config, config_from_dict
from andrea.errors import UserError
from andrea.fileio import atomic_write_bytes, atomic_write_text
from andrea.model.params import check_stored_shape
from andrea.train.optim import first_step_state, make_empty_state, state_size
from andrea.train.parallel import bare_name
from andrea.train.rundir import (
    FORMAT,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SHARD_INDEX,
    SHARDS_DIR,
    TRAINER_STATE,
    TrainerState,
    file_sha256,
    partial_dir,
    prune_checkpoints,
    publish,
    read_safetensors_header,
    read_state,
    shard_files,
    shards_problem,
    step_dir_name,
    tiling_problem,
    verify_file,
    write_checksums,
)
from andrea.train.runlock import RunLock, RunLost
from andrea.train.sharding import full_tensor, is_dtensor, shard_like

OPTIMIZER_PREFIX = "optimizer."  # the optimizer's keys among the shards' tensors
# The LM head is tied to the token embedding: stored once, re-tied on load.
TIED_KEYS = {"lm_head.weight": "tok_emb.weight"}
# Besides the tensors' bytes: the model file's metadata (the config as JSON, about 3 kB) and
# trainer_state.json, then each tensor's entry in a safetensors header.
FIXED_BYTES = 16_384
HEADER_BYTES_PER_TENSOR = 128
AMINMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DAMAGED = "the checkpoint is damaged: resume from another step folder"
EARLIER = "use another checkpoint (an earlier step of the run)"


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
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> dict[str, torch.Tensor]:
    """The per-parameter state (AdamW's, Muon's) keyed by `<param name>.<field>`, gathered
    whole as model_state is."""
    out = {}
    for key, value in _optimizer_tensors(optimizer, names).items():
        out[key] = full_tensor(value).to("cpu").contiguous()
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
    files: dict[str, bytes] | None = None, lock: RunLock | None = None,
) -> Path:
    """Write the checkpoint of step state.step into run_dir: the tensors `model`, `optimizer`
    and `rng` (as model_state, optimizer_state and all_rng_states key them), the trainer state
    and `files`, other files it carries by name (the tokenizer's:
    TokenizerKind.checkpoint_files); then point `latest` at it and prune to keep_last.
    partial: the folder every rank's shards were written into (see rundir.partial_dir); it then
    holds the optimizer state, and `optimizer` is ignored. Every file's sha256 goes into
    checksums.json, written last. lock: the training's run lock; RunLost, with nothing
    published, when it no longer holds the run."""
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
    try:
        if lock is not None:
            lock.check(step)  # `latest` is moved by the run's holder only
    except RunLost:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    final = publish(partial, run_dir, step)
    prune_checkpoints(run_dir, keep_last)
    return final


# ----------------------------------------------------------------------------- tensors read


def check_shards(ckpt: Path, expected: dict[str, torch.Tensor]) -> None:
    """Every file the index lists is there at its size, with a sound header and the sha256
    checksums.json recorded, and every tensor has the shape the model (and its optimizer
    state) has; a UserError naming the file or tensor if not."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    folder = ckpt / SHARDS_DIR
    if (folder / SHARD_INDEX).is_file():
        verify_file(folder / SHARD_INDEX)  # an index damaged on its way, named as such
    problem = shards_problem(ckpt)
    if problem is not None:
        raise UserError(f"{ckpt}: {problem}; {DAMAGED}")
    for name in shard_files(ckpt):
        verify_file(folder / name)  # on every rank: each hashes every shard once (docs/faults.md)
        try:
            with _open(folder / name):  # safetensors' own checks of the header DCP reads
                pass
        except UserError as exc:
            raise UserError(f"{exc}; {DAMAGED}") from None
    try:  # DCP parses each shard's own metadata (every slice's offsets) unchecked
        stored = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
    except (SafetensorError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise UserError(f"{folder}: the shards' metadata is damaged or forged ({exc!r}); "
                        f"{DAMAGED}") from None
    for key, value in expected.items():
        if key not in stored:
            raise UserError(f"{folder}: no tensor '{key}' in the shards; the checkpoint is of "
                            f"another model or optimizer")
        if tuple(stored[key].size) != tuple(value.shape):
            raise UserError(
                f"{folder}: tensor '{key}' has shape {list(stored[key].size)} in the checkpoint "
                f"but {list(value.shape)} in the model; the model config differs"
            )
        check_floating(key, stored[key].properties.dtype, folder, EARLIER)
        # Slices DCP finds no bytes for are left as they are (the model's fresh weights), and
        # one held twice is read from either: the slices must tile the tensor, each value once.
        slices = [(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in stored[key].chunks]
        problem = tiling_problem(slices, tuple(value.shape))
        if problem is not None:
            raise UserError(f"{folder}: the shards' slices of tensor '{key}' {problem}; "
                            f"{DAMAGED}")


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
    check_sharded_weights({key: value.detach() for key, value in state.items()
                           if not key.startswith(OPTIMIZER_PREFIX)}, ckpt / SHARDS_DIR, EARLIER)
    with torch.no_grad():  # dcp.load fills the tensors in place, except a 0-dim step count
        for group in optimizer.param_groups:
            for p in group["params"]:
                for field in optimizer.state[p]:
                    loaded = state[f"{OPTIMIZER_PREFIX}{names[id(p)]}.{field}"]
                    if optimizer.state[p][field] is not loaded:
                        optimizer.state[p][field].copy_(loaded)


def _open(path: Path):
    if not path.is_file():
        if not path.parent.is_dir():  # there when `latest` was read a moment ago
            raise UserError(f"{path.parent}: removed while being read (a training still writing "
                            f"the run prunes its older checkpoints: train.keep_last); run the "
                            f"command again for the run's newest")
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
        # An export's folder (or another Hugging Face model's) holds a model.safetensors too.
        hf = ("; it is a Hugging Face model folder: import it first, "
              f"{shlex.join(['andrea', 'import', '--format', 'hf', str(ckpt)])}"
              if (ckpt / "config.json").is_file() else "")
        raise UserError(f"{path}: not an andrea checkpoint (metadata format is "
                        f"{metadata.get('format')!r}, expected {FORMAT!r}){hf}")
    step = metadata.get("step", "0")  # save_checkpoint writes str(step); absent: step 0
    # isdigit alone takes "²" and other digits int() refuses; an export writes this step.
    if not (step.isascii() and step.isdigit()):
        raise UserError(f"{path}: the step in the metadata is {step!r}, not a whole number of "
                        f"at least 0 (damaged or forged?); use another checkpoint of the run")
    try:
        stored = json.loads(metadata["config"])
    except ValueError:
        raise UserError(f"{path}: the config in the metadata is not JSON (damaged?)") from None
    cfg = config_from_dict(stored, origin=f"{path} metadata")
    check_stored_shape(cfg.model, shapes, f"{path} metadata")
    weights = read_safetensors(path)[0] if tensors else {}
    return weights, cfg, metadata


def check_weights(
    tensors: dict[str, torch.Tensor], origin: Path | str, instead: str
) -> None:
    """Refuse weights that are not floating point or hold NaN or infinity, in one line naming
    the tensor, the file and `instead` (what to use). An integer or bool tensor would be
    converted silently into a model that was never trained (a forged or damaged file); one of
    NaNs samples nothing ('probability tensor contains either inf, nan') and evaluates to
    NaN. Floating types of another width (float16, bfloat16, float64) are converted as before.
    aminmax is one pass that allocates nothing and propagates NaN (documented), an infinity
    being its min or max: 0.2-0.3 s for GPT-2 small's 124M float32 weights on two busy CPU
    cores, where isfinite(t).all() took 1.4-2 s (beside the 0.5-0.7 s the model file's
    checksum takes)."""
    for key, value in tensors.items():
        check_floating(key, value.dtype, origin, instead)
        bad = _nonfinite_count(value)
        if bad:
            raise UserError(_nonfinite_line(origin, key, bad, value.numel(), instead))


def check_sharded_weights(
    tensors: dict[str, torch.Tensor], origin: Path | str, instead: str
) -> None:
    """check_weights' NaN and infinity refusal for weights sharded over the ranks (DTensors),
    called by every rank in the same order. Each rank counts its own slices' NaN and infinite
    values and one all-reduce sums the counts: every rank refuses alike, in check_weights'
    line, and no weight is gathered whole (each rank held each weight whole in turn: a 1.5B
    model's embedding is 0.2 GB in fp32). A tensor laid out otherwise than in slices (a
    replica on every rank, a plain tensor) is counted whole as it is gathered."""
    import torch.distributed as dist

    sliced = {k: v for k, v in tensors.items()
              if is_dtensor(v) and all(p.is_shard() for p in v.placements)}
    counts = {key: _nonfinite_count(value) for key, value in tensors.items()
              if key not in sliced}  # in the same order on every rank: full_tensor gathers
    if sliced:
        local = [value.to_local() for value in sliced.values()]
        summed = torch.tensor([_nonfinite_count(t) for t in local], device=local[0].device)
        if dist.is_initialized():
            dist.all_reduce(summed)
        counts.update(zip(sliced, summed.tolist(), strict=True))
    for key, value in tensors.items():
        if counts[key]:
            raise UserError(_nonfinite_line(origin, key, counts[key], value.numel(), instead))


def _nonfinite_count(value: torch.Tensor) -> int:
    """How many of `value`'s values are NaN or infinite (a DTensor gathered whole first):
    aminmax's one pass first, the count only where it finds one (check_weights' why)."""
    value = full_tensor(value)
    if value.numel() == 0:
        return 0  # aminmax refuses an empty tensor
    # float8 loads (converted) as before, but has no aminmax on the CPU: a float32 copy.
    low, high = (value if value.dtype in AMINMAX_DTYPES else value.float()).aminmax()
    if math.isfinite(low.item()) and math.isfinite(high.item()):
        return 0
    return value.numel() - int(torch.isfinite(value).sum())


def _nonfinite_line(origin: Path | str, key: str, bad: int, total: int, instead: str) -> str:
    return (f"{origin}: tensor '{key}' holds {bad:,} NaN or infinite value"
            f"{'s' if bad != 1 else ''} (of {total:,}): a diverged or damaged model; {instead}")


def check_floating(key: str, dtype: torch.dtype, origin: Path | str, instead: str) -> None:
    """check_weights' refusal of a stored tensor `key` whose dtype is not floating point, also
    for shards, whose stored dtype only their metadata says (DCP converts as it loads)."""
    if not dtype.is_floating_point:
        kind = str(dtype).removeprefix("torch.")
        raise UserError(f"{origin}: tensor '{key}' is {kind}, not floating point (float32, "
                        f"bfloat16, float16 or float64): a damaged or forged model; {instead}")


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], origin: Path) -> None:
    """Copy stored tensors into the model, naming any tensor whose name or shape differs,
    that is not floating point or whose values are not all finite."""
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
    check_weights(tensors, origin, EARLIER)
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
    checkpoint `ckpt`) into the optimizer, sharded like each parameter, once check_optimizer_state
    has found them to be what this optimizer writes."""
    fields = check_optimizer_state(optimizer, names, tensors, ckpt / OPTIMIZER_FILE)
    state = optimizer.state_dict()
    for index, (p, stored) in enumerate(fields):
        if stored:
            state["state"][index] = {k: shard_like(v, p) if k != "step" else v
                                     for k, v in stored.items()}
    optimizer.load_state_dict(state)


def check_optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str], tensors: dict[str, torch.Tensor],
    path: Path,
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Each parameter in the optimizer's order with its stored fields: exactly the fields its
    optimizer's first step makes (shape as there, a floating dtype) or none at all, where no
    parameter of its part has any (a part that never stepped: an import, every step skipped).
    Anything else (a field missing or left over, another shape or dtype) would be loaded and
    change how the run trains, or fail deep in the optimizer: refused in one line naming the
    key."""
    damaged = "the checkpoint is damaged: resume from another step folder"
    out, expected = [], set()
    for part in first_step_state(optimizer):
        held = []
        for p, planned in part:
            keys = {field: f"{names[id(p)]}.{field}" for field in planned}
            expected.update(keys.values())
            stored = {field: tensors[key] for field, key in keys.items() if key in tensors}
            held.append(bool(stored))
            for field, key in keys.items():
                if field not in stored:
                    if any(held):  # this parameter's, or an earlier one's of its part
                        raise UserError(f"{path}: no '{key}', which the optimizer holds for "
                                        f"every parameter once it has stepped; {damaged}")
                    continue
                value, want = stored[field], planned[field]
                if tuple(value.shape) != tuple(want.shape) or not value.is_floating_point():
                    raise UserError(
                        f"{path}: '{key}' has dtype {str(value.dtype).removeprefix('torch.')} "
                        f"and shape {list(value.shape)}, where the optimizer holds a floating "
                        f"tensor of shape {list(want.shape)}; {damaged}")
            out.append((p, stored))
        if any(held) and not all(held):
            p = part[held.index(False)][0]
            raise UserError(f"{path}: no state for '{names[id(p)]}', which the optimizer holds "
                            f"for every parameter once it has stepped; {damaged}")
    extra = sorted(set(tensors) - expected)
    if extra:
        raise UserError(f"{path}: '{extra[0]}' is no state of this optimizer's parameters"
                        f"{f' (nor {len(extra) - 1} more)' if len(extra) > 1 else ''}; {damaged}")
    return out


def read_trainer_state(ckpt: Path) -> tuple[TrainerState, dict[str, torch.Tensor]]:
    """The checkpoint's TrainerState and every rank's generator states."""
    return read_state(ckpt), read_safetensors(ckpt / RNG_FILE)[0]




# ----------------------------------------------------------------------------- size


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
