"""`andrea eval`: val loss, perplexity and bits per byte of one or more checkpoints over a
prepared split (every source of a mixture, and their weighted total), and downstream tasks.

The val set is the trainer's (andrea.train.validation, data.loader.val_windows): the whole
split cut into non-overlapping windows of block_size targets, every token but a shard's first
predicted once with the context back to its window's start; with `--max-tokens N`, N targets
in windows spread evenly over the split, exactly the set a run with train.eval_tokens = N
scores, so the figure is the trainer's. Windows never cross a shard boundary. Tasks
(`--task`, andrea.tasks) are scored on the same model; several checkpoints get the same val
set and tasks, one row each.

Bits per byte = total nats / ln 2 / bytes, where bytes is the number of UTF-8 bytes the
evaluated target tokens decode to, counted per token: every id of a byte-level tokenizer
(byte, gpt2, bpe) stands for a fixed byte string, and the per-token lengths add up to the
byte length of the decoded target stream whatever the token boundaries (no partial-UTF-8
miscounting). End-of-text stands for no text and counts 0 bytes. With the byte tokenizer,
bytes = targets that are not end-of-text.

Also here, shared with `generate` and `export`: finding a checkpoint (`find_checkpoint`),
loading it as a model (`load_model`), finding its tokenizer (`tokenizer_for_checkpoint`) and
preparing the run's data folder from its config when it has none yet (`prepare_run_data`: an
imported run, or a run evaluated from another working directory), as `andrea train` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from andrea.config import PRECISIONS, Config
from andrea.data.loader import TokenSplit, open_split
from andrea.data.prepare import (
    SPLITS,
    data_dir_for,
    prepare_from_config,
    source_dirs,
    source_words,
)
from andrea.data.shards import MANIFEST
from andrea.data.tokenizer import (
    BPE_FILE,
    BpeTokenizer,
    Tokenizer,
    load_tokenizer,
)
from andrea.errors import UserError
from andrea.model.attention import resolve_backend
from andrea.model.transformer import Andrea
from andrea.tasks import TaskFile, TaskResult, read_task, run_task
from andrea.train import checkpoint as ckpt_io
from andrea.train.rundir import step_of_dir
from andrea.train.validation import ValScore, score_val, val_sources


def _say(message: str) -> None:
    """Notices go to stderr, so that stdout holds only the result (e.g. --json)."""
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- checkpoints


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
            latest = ckpt_io.read_latest(run) if run.is_dir() else None
            for written in (latest / ckpt_io.MODEL_FILE if latest else None, run / ckpt_io.LATEST):
                if written is not None and written.is_file():
                    found.append((written.stat().st_mtime, run))
                    break
    if not found:
        raise UserError(
            f"no --checkpoint given and no run with a checkpoint under {runs_dir}/; "
            "pass --checkpoint runs/<name>[/step-N]"
        )
    return ckpt_io.resolve_checkpoint(max(found, key=lambda item: item[0])[1], use=use)


def find_checkpoint(
    checkpoint: str | Path | None, runs_dir: Path | str = "runs",
    use: str = "andrea eval --checkpoint {}",
) -> Path:
    """A run dir means its latest checkpoint, a step dir itself, None the most recent run.
    use: the command that takes another checkpoint ({} for it), for the error that refuses a
    damaged one and names the run's newest intact checkpoint."""
    if checkpoint is None:
        ckpt = most_recent_run(runs_dir, use)
        _say(f"checkpoint: {ckpt} (the most recent run under {runs_dir}/)")
        return ckpt
    return ckpt_io.resolve_checkpoint(checkpoint, use=use)


def load_model(
    ckpt: Path, device: torch.device | str = "cpu"
) -> tuple[Andrea, Config, dict[str, str]]:
    """The checkpoint's model in eval mode on `device` (float32 weights), config, metadata."""
    tensors, cfg, metadata = ckpt_io.read_model_checkpoint(ckpt)
    device = torch.device(device)
    # The CUDA kernels only where there is a GPU: a GPU-trained checkpoint still runs on a CPU.
    requested = cfg.model.attention if device.type == "cuda" else "auto"
    backend, _ = resolve_backend(requested, cfg.model.head_dim, device)
    model = Andrea(cfg.model, attention_backend=backend)
    ckpt_io.load_weights(model, tensors, ckpt / ckpt_io.MODEL_FILE)
    return model.to(device).eval(), cfg, metadata


def local_data_config(cfg: Config) -> Config:
    """A checkpoint's config with its data folder re-derived under ./data (data.dir cleared).

    A checkpoint is untrusted input: its data.dir may name any folder on this machine (the
    exporter's, or one chosen to do harm), so eval, generate and export never write there;
    they prepare the run's data in data/<source>-<tokenizer>[...] instead, the folder
    `andrea prepare` would derive from the same settings."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=""))


def prepare_run_data(ckpt: Path, cfg: Config, instead: str) -> Path:
    """The run's prepared data folder: the one its config names (data.dir) when that folder
    already holds prepared data (read only), else the folder derived under ./data
    (`local_data_config`), prepared from the config first, as `andrea train` does, when it
    holds no prepared data; says so in one line. Nothing is ever written in a folder named
    only by the checkpoint. `instead`: what the user can do when that fails (the end of the
    error message).

    Notices go to stderr (stdout may be --json or the generated text).
    """
    named = data_dir_for(cfg)
    if (named / MANIFEST).is_file():
        return named
    local = local_data_config(cfg)
    data_dir = data_dir_for(local)
    if (data_dir / MANIFEST).is_file():
        return data_dir
    d = cfg.data
    tokenizer = d.tokenizer_file or f"the {d.tokenizer} tokenizer"
    why = ("the run's data folder, not prepared yet" if named == data_dir else
           f"the run's config names {named}, which is not prepared; andrea writes data only "
           f"under ./data for a checkpoint")
    announce = (f"preparing {data_dir} ({why}) from {source_words(cfg)} with {tokenizer}, as "
                f"the run's config says")
    try:
        # prepare announces on stdout, as train's log; here stdout is the result.
        with contextlib.redirect_stdout(sys.stderr):
            return prepare_from_config(local, verbose=False, announce=announce)
    except UserError as exc:
        raise UserError(
            f"{ckpt}: cannot prepare the run's data in {data_dir} from its config ({exc}); "
            f"{instead}"
        ) from None


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

    byte and gpt2 are rebuilt from the package. A trained BPE is read from the run's data dir
    (data.dir of its config), else from the one derived under ./data, else from a
    tokenizer.json beside the checkpoint or in its run directory (where `andrea import` puts
    one). With `prepare_missing`, a BPE found nowhere is made by preparing the run's data from
    its config (`prepare_run_data`, under ./data); its identity must still match.
    """
    identity = metadata.get("tokenizer", "")
    kind = identity.split(":", 1)[0]
    if kind in ("byte", "gpt2"):
        tok = load_tokenizer(kind)
        if tok.identity != identity:
            raise UserError(
                f"{ckpt}: trained with tokenizer {identity}, but this install's {kind} tokenizer "
                f"is {tok.identity}"
            )
        return tok
    if kind != "bpe":
        raise UserError(f"{ckpt}: unknown tokenizer identity {identity!r} in the metadata")
    data_dir = data_dir_for(cfg)
    local_dir = data_dir_for(local_data_config(cfg))
    candidates = (data_dir / BPE_FILE, local_dir / BPE_FILE, ckpt / BPE_FILE,
                  ckpt.parent / BPE_FILE)
    tok = _find_bpe(candidates, identity)
    if tok is None and prepare_missing:
        prepare_run_data(ckpt, cfg, f"copy the model's {BPE_FILE} into {ckpt.parent}")
        tok = _find_bpe(candidates, identity)
    if tok is not None:
        return tok
    searched = ", ".join(str(path.parent) for path in candidates)
    raise UserError(
        f"{ckpt}: trained with BPE tokenizer {identity}, which is in none of {searched}; "
        f"copy that tokenizer.json into {ckpt.parent}, or prepare the run's data "
        f"(`andrea prepare -c {ckpt.parent / 'config.yaml'} --set data.dir={local_dir}`)"
    )


# ----------------------------------------------------------------------------- eval


@dataclass
class EvalResult:
    """One checkpoint's figures: the val loss (a mixture's: weighted over its sources, each of
    which is in `sources`) and the tasks' results."""

    checkpoint: str
    step: int | None
    precision: str
    device: str
    split: str = "val"
    data_dir: str | None = None
    loss: float | None = None  # mean nats per target token (weighted over the sources)
    perplexity: float | None = None
    bits_per_byte: float | None = None  # None when the targets decode to no bytes
    tokens: int = 0  # target tokens evaluated
    bytes: int = 0
    # A mixture's sources (or the one --source names): name, weight, loss, bits_per_byte,
    # tokens, bytes.
    sources: list[dict[str, Any]] = field(default_factory=list)
    tasks: list[dict[str, Any]] = field(default_factory=list)  # tasks.TaskResult.as_dict()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def summary(self) -> str:
        """The val line (and one per source of a mixture), then one line per task."""
        if self.loss is None:
            lines = [f"{self.checkpoint}: {self.precision}, {self.device}"]
        else:
            ppl = f"{self.perplexity:.3f}" if self.perplexity is not None else "n/a"
            what = "weighted over the sources: " if len(self.sources) > 1 else ""
            lines = [
                f"{self.checkpoint} on {self.data_dir} ({self.split}): {what}loss "
                f"{self.loss:.4f}, perplexity {ppl}, bits/byte {_fmt(self.bits_per_byte)}, "
                f"{self.tokens:,} tokens ({self.bytes:,} bytes), {self.precision}, {self.device}"
            ]
        if len(self.sources) > 1:
            lines += [
                f"  {src['name']} (weight {src['weight']:.3f}): loss {src['loss']:.4f}, "
                f"bits/byte {_fmt(src['bits_per_byte'])}, {src['tokens']:,} tokens"
                for src in self.sources
            ]
        lines += [TaskResult(**task).line() for task in self.tasks]
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4f}"


def val_figures(score: ValScore, list_sources: bool) -> dict[str, Any]:
    """EvalResult's val fields from a ValScore; its sources listed with `list_sources`."""
    loss = score.loss
    return dict(
        loss=loss, perplexity=math.exp(loss) if loss < 700 else math.inf,
        bits_per_byte=score.bits_per_byte, tokens=score.tokens, bytes=score.bytes,
        sources=[
            {"name": s.name, "weight": s.weight, "loss": s.loss,
             "bits_per_byte": s.bits_per_byte, "tokens": s.tokens, "bytes": s.bytes}
            for s in score.sources
        ] if list_sources else [],
    )


def open_val_split(ckpt: Path, cfg: Config, data: str | None, split: str) -> TokenSplit:
    """--data's split, or the run's (a Mixture for data.sources), prepared first if missing."""
    if data is not None:
        if not Path(data).is_dir():
            raise UserError(f"--data {data}: no such directory")
        return TokenSplit(Path(data), split)
    instead = "pass --data DIR (shards prepared with the checkpoint's tokenizer)"
    if not cfg.data.sources:
        return TokenSplit(prepare_run_data(ckpt, cfg, instead), split)
    # A mixture: the sources under the checkpoint's data.dir when all are prepared there (read
    # only), else under ./data, prepared there first if missing (never where the checkpoint says).
    if all((d / MANIFEST).is_file() for _, d, _ in source_dirs(cfg)):
        return open_split(cfg, split)
    local = local_data_config(cfg)
    if not all((d / MANIFEST).is_file() for _, d, _ in source_dirs(local)):
        prepare_run_data(ckpt, cfg, instead)
    return open_split(local, split)


@dataclass
class EvalSettings:
    """What `andrea eval` does to each checkpoint: the same val set and tasks for all."""

    data: str | None = None
    max_tokens: int | None = None
    precision: str = "auto"
    device: str = "auto"
    batch_size: int = 8
    progress: bool = True
    split: str = "val"
    source: str | None = None
    val: bool = True
    tasks: list[TaskFile] = field(default_factory=list)

    def check(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError(f"--max-tokens: must be a positive integer, got {self.max_tokens}")
        if self.batch_size < 1:
            raise UserError(f"--batch-size: must be a positive integer, got {self.batch_size}")
        if self.precision not in PRECISIONS:
            raise UserError(f"--precision: '{self.precision}' is not one of auto, fp32, bf16")
        if self.split not in SPLITS:
            raise UserError(f"--split: '{self.split}' is not one of {', '.join(SPLITS)}")


def evaluate_one(ckpt: Path, settings: EvalSettings) -> EvalResult:
    """One checkpoint's val loss (per source) and tasks."""
    from andrea.train.device import pick_device, pick_dtype

    dev = pick_device(settings.device)
    dtype = pick_dtype(settings.precision, dev)
    model, cfg, metadata = load_model(ckpt, dev)
    tok = tokenizer_for_checkpoint(ckpt, cfg, metadata)
    result = EvalResult(checkpoint=str(ckpt), step=step_of_dir(ckpt), split=settings.split,
                        precision=str(dtype).removeprefix("torch."), device=str(dev))
    if settings.val:
        split = open_val_split(ckpt, cfg, settings.data, settings.split)
        if split.tokenizer_identity != tok.identity:
            raise UserError(
                f"{split.data_dir}: tokenized with {split.tokenizer_identity}, but {ckpt} was "
                f"trained with {tok.identity}; evaluate on data prepared with the checkpoint's "
                "tokenizer"
            )
        sources = val_sources(split, cfg.model.block_size, settings.max_tokens, settings.source)
        score = score_val(model, sources, batch_size=settings.batch_size, device=dev,
                          dtype=dtype, progress=settings.progress)
        result.data_dir = str(sources[0].split.data_dir if len(sources) == 1 else
                              split.data_dir)
        listed = len(sources) > 1 or settings.source is not None
        for key, value in val_figures(score, listed).items():
            setattr(result, key, value)

    def logits(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            return model(x)[0].float()

    for task in settings.tasks:
        task_result, _ = run_task(task, logits, tok, block_size=cfg.model.block_size,
                                  batch_size=settings.batch_size, device=dev,
                                  progress=settings.progress)
        for note in task.notes():
            _say(f"warning: {note}")
        result.tasks.append(task_result.as_dict())
    return result


def checkpoints_to_evaluate(
    checkpoints: list[str], all_steps: bool, runs_dir: str = "runs"
) -> list[Path]:
    """The checkpoint folders: each --checkpoint (a run: its latest; none: the newest run),
    or with --all-steps every step folder of each run, oldest first."""
    if not all_steps:
        return [find_checkpoint(c, runs_dir) for c in (checkpoints or [None])]
    runs = [Path(c) for c in checkpoints] if checkpoints else [most_recent_run(runs_dir).parent]
    found: list[Path] = []
    for run in runs:
        steps = [p for p in ckpt_io.list_checkpoints(run) if (p / ckpt_io.MODEL_FILE).is_file()]
        if not steps:
            raise UserError(f"--all-steps {run}: no step-N checkpoint folders in this run; "
                            "give a run directory, e.g. runs/<name>")
        found += steps
    return found


def evaluate_checkpoints(
    checkpoints: list[str],
    settings: EvalSettings,
    *,
    all_steps: bool = False,
    tasks: Sequence[tuple[str, str]] = (),
    limit: int | None = None,
    runs_dir: str = "runs",
) -> list[EvalResult]:
    """What `andrea eval` does: the task files read (and checked) first, then every
    checkpoint scored on the same val set and tasks."""
    settings.check()
    if limit is not None and limit < 1:
        raise UserError(f"--limit: must be a positive integer, got {limit}")
    settings.tasks = [read_task(kind, path, limit) for kind, path in tasks]
    ckpts = checkpoints_to_evaluate(checkpoints, all_steps, runs_dir)
    if not checkpoints and not all_steps:
        _say(f"checkpoint: {ckpts[0]} (the most recent run under {runs_dir}/)")
    return [evaluate_one(ckpt, settings) for ckpt in ckpts]


def evaluate_checkpoint(
    checkpoint: str | None,
    data: str | None = None,
    max_tokens: int | None = None,
    precision: str = "auto",
    device: str = "auto",
    batch_size: int = 8,
    progress: bool = True,
    split: str = "val",
    runs_dir: str = "runs",
    source: str | None = None,
) -> EvalResult:
    """The val loss of one checkpoint (None: the most recent run under runs_dir)."""
    settings = EvalSettings(data, max_tokens, precision, device, batch_size, progress, split,
                            source)
    return evaluate_checkpoints([checkpoint] if checkpoint else [], settings,
                                runs_dir=runs_dir)[0]


def format_table(results: list[EvalResult]) -> str:
    """One row per checkpoint: step, val loss and bits per byte, each source's loss, each
    task's acc (and acc_norm)."""
    header = ["CHECKPOINT", "STEP", "VAL LOSS", "BITS/BYTE"]
    names = [s["name"] for s in results[0].sources] if results[0].sources else []
    header += [f"{n.rstrip('/').rsplit('/', 1)[-1]} LOSS" for n in names]
    header += [_task_header(t) for t in results[0].tasks]
    rows = [header]
    for r in results:
        row = [r.checkpoint, "-" if r.step is None else str(r.step), _fmt(r.loss),
               _fmt(r.bits_per_byte)]
        row += [_fmt(s["loss"]) for s in r.sources]
        row += [_task_cell(t) for t in r.tasks]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def _task_header(task: dict[str, Any]) -> str:
    name = f"{task['task']} ({Path(task['file']).name})"
    return f"{name} ACC" + (" / NORM" if task["acc_norm"] is not None else "")


def _task_cell(task: dict[str, Any]) -> str:
    cell = f"{task['acc']:.4f}"
    return cell + (f" / {task['acc_norm']:.4f}" if task["acc_norm"] is not None else "")
