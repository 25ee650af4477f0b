"""Checkpoints: safetensors and JSON only (no pickle), written so a crash never leaves a bad one.

A run directory `runs/<name>/` holds `step-NNNNNN/` checkpoints and a `latest` file naming the
newest complete one. Each checkpoint holds:

- `model.safetensors`: the weights (the tied LM head stored once, as the token embedding), with the
  resolved config, step and tokenizer identity in the safetensors metadata;
- `optimizer.safetensors`: AdamW's moments and step counts, keyed by parameter name;
- `rng.safetensors`: every generator's state (the CPU generator of each rank, and CUDA's);
- `trainer_state.json`: step, tokens seen, data position, best val loss, skipped steps.

A checkpoint is assembled in `step-NNNNNN.partial-<pid>/` (each file flushed and fsynced), the
folder is renamed into place, and only then is `latest` replaced (write, fsync, rename). A crash at
any moment therefore leaves `latest` pointing at a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from andrea.config import Config, config_from_dict
from andrea.errors import UserError
from andrea.fileio import atomic_write_bytes, atomic_write_text, fsync_dir
from andrea.train.distributed import full_tensor, shard_like
from andrea.train.rundir import LATEST
from andrea.train.rundir import TRAINER_STATE as STATE_FILE

FORMAT = "andrea-checkpoint/1"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
# The LM head is tied to the token embedding: stored once, re-tied on load.
TIED_KEYS = {"lm_head.weight": "tok_emb.weight"}


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def model_state(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The weights to store: no wrapper prefixes, tied tensors once, contiguous CPU copies,
    sharded ones gathered whole. Sharded, every rank must call it; keep=False (the ranks that
    write nothing) drops each gathered tensor at once instead of holding the whole model."""
    state = {}
    for key, value in model.state_dict().items():
        key = key.replace("_orig_mod.", "").removeprefix("module.")
        if key in TIED_KEYS:
            continue
        whole = full_tensor(value.detach())
        if keep:
            state[key] = whole.to("cpu").contiguous()
    return state


def optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str], keep: bool = True
) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state keyed by `<param name>.<field>`, gathered whole as
    model_state is (and with its `keep`)."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for field, value in optimizer.state.get(p, {}).items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                whole = full_tensor(tensor.detach())
                if keep:
                    out[f"{names[id(p)]}.{field}"] = whole.to("cpu").contiguous()
    return out


def save_checkpoint(
    run_dir: Path,
    step: int,
    cfg: Config,
    tokenizer_identity: str,
    model_tensors: dict[str, torch.Tensor],
    optimizer_tensors: dict[str, torch.Tensor],
    rng_tensors: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write checkpoint `step` into run_dir, point `latest` at it, prune to keep_last."""
    final = run_dir / step_dir_name(step)
    partial = run_dir / f"{final.name}.partial-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    metadata = {
        "format": FORMAT,
        "step": str(step),
        "tokenizer": tokenizer_identity,
        "config": json.dumps(cfg.to_dict()),
    }
    # Used only by the tests, to kill the process while a checkpoint is half written.
    delay = float(os.environ.get("ANDREA_TEST_CHECKPOINT_DELAY", "0"))
    atomic_write_bytes(partial / MODEL_FILE, safetensors_bytes(model_tensors, metadata))
    if delay:
        time.sleep(delay)
    atomic_write_bytes(
        partial / OPTIMIZER_FILE, safetensors_bytes(optimizer_tensors, {"format": FORMAT})
    )
    atomic_write_bytes(partial / RNG_FILE, safetensors_bytes(rng_tensors, {"format": FORMAT}))
    atomic_write_text(partial / STATE_FILE, json.dumps(trainer_state, indent=1))
    if final.exists():  # the same step written by an earlier segment of this run
        stale = run_dir / f"{final.name}.stale-{os.getpid()}"
        final.rename(stale)
        shutil.rmtree(stale)
    partial.rename(final)
    fsync_dir(run_dir)
    atomic_write_text(run_dir / LATEST, final.name + "\n")
    prune_checkpoints(run_dir, keep_last)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    found = [p for p in run_dir.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    latest = read_latest(run_dir)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        if latest is None or old.resolve() != latest.resolve():
            shutil.rmtree(old, ignore_errors=True)


def clean_partials(run_dir: Path) -> None:
    """Remove folders a crashed writer left behind (never a complete checkpoint)."""
    for leftover in list(run_dir.glob("step-*.partial-*")) + list(run_dir.glob("step-*.stale-*")):
        shutil.rmtree(leftover, ignore_errors=True)


def read_latest(run_dir: Path) -> Path | None:
    try:
        name = (run_dir / LATEST).read_text().strip()
    except OSError:
        return None
    return run_dir / name if name else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory means its latest checkpoint; a step directory means itself."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such checkpoint or run directory")
    if (path / MODEL_FILE).is_file():
        return path
    latest = read_latest(path)
    if latest is not None and (latest / MODEL_FILE).is_file():
        return latest
    if latest is not None:
        raise UserError(f"{path}: 'latest' names {latest.name}, which holds no {MODEL_FILE}")
    raise UserError(
        f"{path}: not a checkpoint (no {MODEL_FILE}) and not a run directory (no '{LATEST}' file)"
    )


def _open(path: Path):
    if not path.is_file():
        raise UserError(f"{path}: missing; the checkpoint is incomplete")
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(
            f"{path}: not a valid safetensors file (truncated or damaged?): {exc}"
        ) from None


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with _open(path) as f:
        metadata = f.metadata() or {}
        try:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(f"{path}: damaged tensor data (truncated?): {exc}") from None
    return tensors, metadata


def read_model_checkpoint(ckpt: Path) -> tuple[dict[str, torch.Tensor], Config, dict[str, str]]:
    """Weights, the config they were trained with, and the metadata."""
    path = ckpt / MODEL_FILE
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT or "config" not in metadata:
        raise UserError(f"{path}: not an andrea checkpoint (metadata format is "
                        f"{metadata.get('format')!r}, expected {FORMAT!r})")
    cfg = config_from_dict(json.loads(metadata["config"]), origin=f"{path} metadata")
    return tensors, cfg, metadata


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
    tensors, _ = read_safetensors(ckpt / OPTIMIZER_FILE)
    state = optimizer.state_dict()
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = names[id(p)] + "."
            fields = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if fields:
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in fields and fields[k].shape != p.shape:
                        raise UserError(
                            f"{ckpt / OPTIMIZER_FILE}: '{prefix}{k}' has shape "
                            f"{list(fields[k].shape)}, the parameter {list(p.shape)}"
                        )
                state["state"][index] = {k: shard_like(v, p) if k != "step" else v
                                         for k, v in fields.items()}
            index += 1
    optimizer.load_state_dict(state)


def read_trainer_state(ckpt: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    path = ckpt / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable trainer state: {exc}") from None
    rng, _ = read_safetensors(ckpt / RNG_FILE)
    return state, rng
