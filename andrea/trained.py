"""Open a trained model: the one service `andrea eval`, `generate`, `export` and `runs` share.

- which checkpoint: `find_checkpoint` (a run means its latest, a step folder itself, none the
  run under ./runs written last: `most_recent_run`); a damaged one is refused naming the run's
  newest intact checkpoint (train.rundir.resolve_checkpoint; `andrea runs` gives the same
  verdict without raising, train.rundir.latest_problem);
- the model and its tokenizer: `load_model`, `tokenizer_for_checkpoint` (a BPE's
  tokenizer.json is in the checkpoint: it opens from any directory, with no data folder),
  both at once: `open_trained`; each file checked against the checkpoint's checksums;
- its data: `open_data_split` (`--data`, or the run's own prepared folder, a mixture's
  sources), prepared from the run's text with the run's own tokenizer when it has none here
  (`prepare_run_data`: an imported run, or a run opened from another working directory), in
  one line, but only ever under ./data (`local_data_config`: a checkpoint is untrusted input);
  without that text, one line saying how to prepare it (train/rundata.py).

Notices go to stderr (`notice`): stdout holds a verb's result (--json, generated text).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from andrea.config import Config
from andrea.data.loader import TokenSplit, data_record, open_split
from andrea.data.prepare import data_dir_for, prepare_from_config, source_words
from andrea.data.shards import DamagedFolder
from andrea.data.tokenizer import BpeTokenizer, Tokenizer, kind_of
from andrea.errors import UserError
from andrea.model.attention import resolve_backend
from andrea.model.transformer import Andrea
from andrea.train import checkpoint as ckpt_io
from andrea.train import rundata
from andrea.train.rundir import (
    LATEST,
    MODEL_FILE,
    read_latest,
    read_state,
    resolve_checkpoint,
    run_path,
    verify_file,
)


def notice(message: str) -> None:
    """A notice on stderr, so that stdout holds only the result (e.g. --json)."""
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- which checkpoint


def most_recent_run(
    runs_dir: Path | str = "runs", use: str = "andrea eval --checkpoint {}"
) -> Path:
    """The checkpoint of the run under runs_dir whose latest checkpoint was written last (its
    model file's time, or its `latest` file's when that model is gone); a damaged one is
    refused naming its newest intact step (never silently another run's)."""
    runs_dir = Path(runs_dir)
    found: list[tuple[float, Path]] = []
    if runs_dir.is_dir():
        for run in runs_dir.iterdir():
            latest = read_latest(run) if run.is_dir() else None
            for written in (latest / MODEL_FILE if latest else None, run / LATEST):
                if written is not None and written.is_file():
                    found.append((written.stat().st_mtime, run))
                    break
    if not found:
        raise UserError(
            f"no --checkpoint given and no run with a checkpoint under {runs_dir}/; "
            "pass --checkpoint runs/<name>[/step-N]"
        )
    return resolve_checkpoint(max(found, key=lambda item: item[0])[1], use=use)


def find_checkpoint(
    checkpoint: str | Path | None, runs_dir: Path | str = "runs",
    use: str = "andrea eval --checkpoint {}",
) -> Path:
    """A run dir means its latest checkpoint, a step dir itself, None the most recent run; a
    bare name that is nothing here, the run of that name under runs_dir (as `andrea runs` lists
    it and --resume takes it). use: the command that takes another checkpoint ({} for it), for
    the error that refuses a damaged one and names the run's newest intact checkpoint."""
    if checkpoint is None:
        ckpt = most_recent_run(runs_dir, use)
        notice(f"checkpoint: {ckpt} (the most recent run under {runs_dir}/)")
        return ckpt
    return resolve_checkpoint(named_run(checkpoint, runs_dir), use=use)


def named_run(name: str | Path, runs_dir: str | Path = "runs") -> Path:
    """`name` as given where it exists (a folder here is never passed over for a run of that
    name: a copied step folder holds no run's files); else, a bare name, runs_dir/name."""
    path = Path(name)
    return path if path.exists() else run_path(name, runs_dir)


# ----------------------------------------------------------------------------- model, tokenizer


def load_model(
    ckpt: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Andrea, Config, dict[str, str]]:
    """The checkpoint's model in eval mode on `device` (float32 weights), config, metadata;
    `dtype`: what it will compute in (autocast, or weights cast), which `auto` picks its
    attention by."""
    tensors, cfg, metadata = ckpt_io.read_model_checkpoint(ckpt)
    device = torch.device(device)
    # The CUDA kernels only where there is a GPU: a GPU-trained checkpoint still runs on a CPU.
    requested = cfg.model.attention if device.type == "cuda" else "auto"
    backend, _ = resolve_backend(requested, cfg.model.head_dim, device, dtype)
    # The initial values, which the checkpoint's replace every one, drawn from a generator of
    # their own: from the caller's, they moved its draws. (Built on the meta device instead,
    # each init imports torch's compiler, 1.3 s: more than a small model's draws take.)
    with torch.random.fork_rng(devices=[]):
        model = Andrea(cfg.model, attention_backend=backend)
    ckpt_io.load_weights(model, tensors, ckpt / MODEL_FILE)
    return model.to(device).eval(), cfg, metadata


def _find_bpe(candidates: tuple[Path, ...], identity: str) -> BpeTokenizer | None:
    """The first candidate tokenizer.json that is a BPE of this identity. Only reading: a file
    of that name that is no BPE (the folder may not be the run's at all) is passed over."""
    for path in candidates:
        if path.is_file():
            try:
                tok = BpeTokenizer(path)
            except UserError:
                continue
            if tok.identity == identity:
                return tok
    return None


def tokenizer_for_checkpoint(
    ckpt: Path, cfg: Config, metadata: dict[str, str], prepare_missing: bool = False
) -> Tokenizer:
    """The tokenizer a checkpoint was trained with, checked by its identity.

    byte and gpt2 are rebuilt from the package. A trained BPE is the tokenizer.json the
    checkpoint carries (checked against its checksum). A checkpoint written before checkpoints
    carried their tokenizer: read from the run's data dir (data.dir of its config), else from
    the one derived under ./data, else from a tokenizer.json in its run directory (where
    `andrea import` put one). With `prepare_missing`, such a BPE found nowhere is made by
    preparing the run's data from its config (`prepare_run_data`, under ./data, one line); its
    identity must still match.
    """
    identity = metadata.get("tokenizer", "")
    kind = kind_of(identity)
    if kind is None:
        raise UserError(f"{ckpt}: unknown tokenizer identity {identity!r} in the metadata")
    if kind.file is None:
        tok = kind.open()
        if tok.identity != identity:
            raise UserError(
                f"{ckpt}: trained with tokenizer {identity}, but this install's {kind.name} "
                f"tokenizer is {tok.identity}"
            )
        return tok
    own = kind.in_checkpoint(ckpt)
    if own is not None:
        verify_file(own)
        tok = BpeTokenizer(own)
        if tok.identity != identity:
            raise UserError(f"{own}: is the BPE {tok.identity}, but {ckpt} was trained with "
                            f"{identity}; the checkpoint's files do not belong together")
        return tok
    data_dir = data_dir_for(cfg)
    local_dir = data_dir_for(local_data_config(cfg))
    candidates = (data_dir / kind.file, local_dir / kind.file, ckpt.parent / kind.file)
    tok = _find_bpe(candidates, identity)
    if tok is None and prepare_missing:
        prepare_run_data(ckpt, cfg, "its BPE (which checkpoints this old do not carry)")
        tok = _find_bpe(candidates, identity)
    if tok is not None:
        return tok
    searched = ", ".join(str(path.parent) for path in (ckpt / kind.file, *candidates))
    prepare = shlex.join(["andrea", "prepare", "-c", str(ckpt.parent / "config.yaml"),
                          "--set", f"data.dir={local_dir}"])
    raise UserError(
        f"{ckpt}: trained with BPE tokenizer {identity}, which is in none of {searched}; "
        f"copy that tokenizer.json into {ckpt}, or prepare the run's data "
        f"(`{prepare}`)"
    )


@dataclass
class TrainedModel:
    """An opened checkpoint: where it is, its model (eval mode), config, metadata, tokenizer."""

    checkpoint: Path
    model: Andrea
    cfg: Config
    metadata: dict[str, str]
    tokenizer: Tokenizer


def open_trained(
    ckpt: Path, device: torch.device | str = "cpu", prepare_missing: bool = False,
    dtype: torch.dtype = torch.float32,
) -> TrainedModel:
    """The model of a checkpoint folder (see find_checkpoint) on `device`, to compute in
    `dtype` (load_model), and its tokenizer (found, or with `prepare_missing` made from the
    run's config: tokenizer_for_checkpoint)."""
    model, cfg, metadata = load_model(ckpt, device, dtype)
    tok = tokenizer_for_checkpoint(ckpt, cfg, metadata, prepare_missing=prepare_missing)
    return TrainedModel(ckpt, model, cfg, metadata, tok)


# ----------------------------------------------------------------------------- data


def local_data_config(cfg: Config) -> Config:
    """A checkpoint's config with its data folder re-derived under ./data (data.dir cleared).

    A checkpoint is untrusted input: its data.dir may name any folder on this machine (the
    exporter's, or one chosen to do harm), so eval, generate and export never write there;
    they prepare the run's data in data/<source>-<tokenizer>[...] instead, the folder
    `andrea prepare` would derive from the same settings."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=""))


def prepare_run_data(ckpt: Path, cfg: Config, needs: str) -> Config:
    """The config whose data folders hold the run's prepared data: the ones its config names
    (data.dir) when they are prepared (read only), else those derived under ./data
    (`local_data_config`), else those prepared with the tokenizer the checkpoint carries
    (train/rundata.py), prepared first from the run's text with one line that says so.
    Nothing is ever written in a folder named only by the checkpoint. Without the text: a
    one-line error naming the data and the command that prepares it. `needs`: what needs the
    data, for that error (e.g. "the val loss")."""
    if rundata.is_prepared(cfg):
        return cfg
    local = local_data_config(cfg)
    if rundata.is_prepared(local):
        return local
    own = rundata.own_tokenizer_config(local, ckpt)
    if rundata.is_prepared(own):
        return own
    named, target = data_dir_for(cfg), data_dir_for(own)
    rundata.stop_without_text(own, ckpt, needs=needs, data=named,
                              command=rundata.prepare_command(own, ckpt, target),
                              otherwise=", or pass --data DIR (shards prepared with its tokenizer)")
    note = "" if named == target else " (andrea writes a checkpoint's data only under ./data)"
    _prepare(ckpt, own, rundata.prepare_line(own, ckpt, named, target, note))
    return own


def _prepare(ckpt: Path, cfg: Config, announce: str) -> None:
    """Prepare cfg's data (its folders under ./data), saying so on stderr: `announce` for a
    folder prepared for the first time, the reason for one prepared again."""
    try:
        # prepare announces on stdout, as train's log; here stdout is the result.
        with contextlib.redirect_stdout(sys.stderr):
            prepare_from_config(cfg, verbose=False, announce=announce)
    except UserError as exc:
        raise UserError(
            f"{ckpt}: cannot prepare the run's data in {data_dir_for(cfg)} from its config "
            f"({exc}); pass --data DIR (shards prepared with the checkpoint's tokenizer)"
        ) from None


def open_data_split(ckpt: Path, cfg: Config, data: str | None, split: str) -> TokenSplit:
    """--data's split, or the run's (a Mixture for data.sources), prepared first if missing,
    and checked to be the data the checkpoint records (rundata.check_same_data; a note on
    stderr for the run's folder prepared again since). The run's folder under ./data, damaged
    (a shard cut short or missing, its manifest unreadable), is prepared again first, as
    `andrea train` does, in one line saying why; a folder elsewhere (--data, or the data.dir a
    checkpoint names) is never written: its error names the command that prepares it again."""
    if data is not None:
        if not Path(data).is_dir():
            raise UserError(f"--data {data}: no such directory")
        return TokenSplit(Path(data), split)
    opened = _open_run_split(ckpt, cfg, split)
    try:
        recorded = read_state(ckpt).data
    except UserError:  # eval opens checkpoints a resume refuses: nothing recorded to compare
        recorded = None

    def take(folder: str) -> str:
        return shlex.join(["--data", folder]) + (" (that source alone)" if cfg.data.sources
                                                 else "")

    note = rundata.check_same_data(ckpt, recorded, data_record(opened), needs="the val loss",
                                   named=False, take=take)
    if note:
        notice(note)
    return opened


def _open_run_split(ckpt: Path, cfg: Config, split: str) -> TokenSplit:
    own = prepare_run_data(ckpt, cfg, "the val loss")
    try:
        return open_split(own, split)
    except DamagedFolder:
        if own.data.dir:  # a folder the checkpoint names: never written by eval
            raise
    _prepare(ckpt, own, f"preparing {data_dir_for(own)} from {source_words(own)}")
    return open_split(own, split)
