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

Finding, loading and the data of a checkpoint are andrea.trained's, shared with `generate`,
`export` and `runs`.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from andrea.config import PRECISIONS
from andrea.data.inputs import source_last_part
from andrea.data.prepare import SPLITS
from andrea.errors import UserError
from andrea.fileio import json_safe
from andrea.runs import left_behind_steps
from andrea.tasks import TaskFile, TaskResult, read_task, run_task
from andrea.train.rundir import MODEL_FILE, is_step_dir, step_dirs, step_of_dir
from andrea.train.validation import ValScore, score_val, val_sources
from andrea.trained import (
    TrainedModel,
    find_checkpoint,
    most_recent_run,
    named_run,
    notice,
    open_data_split,
    open_trained,
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
    data_dir: str | None = None  # the one prepared folder; a mixture's are in `sources`
    # The val set: that many target tokens spread over the split (each source's, for a
    # mixture), the set a run with train.eval_tokens = max_tokens scores; None: the whole split.
    max_tokens: int | None = None
    loss: float | None = None  # mean nats per target token (weighted over the sources)
    perplexity: float | None = None
    bits_per_byte: float | None = None  # None when the targets decode to no bytes
    tokens: int = 0  # target tokens evaluated
    bytes: int = 0
    # A mixture's sources (or the one --source names): name, data_dir, weight, loss,
    # bits_per_byte, tokens, bytes.
    sources: list[dict[str, Any]] = field(default_factory=list)
    tasks: list[dict[str, Any]] = field(default_factory=list)  # tasks.TaskResult.as_dict()

    def to_json(self) -> str:
        """Strict JSON: a non-finite figure (a diverged checkpoint's loss) is null, as in
        `andrea runs --json`; json.dumps would write NaN, which strict parsers (jq) refuse."""
        return json.dumps(json_safe(asdict(self)), indent=2)

    def val_set(self) -> str:
        """The val set in words: the whole split, or the set a train.eval_tokens scores (that
        many tokens of each source of a mixture)."""
        each = len(self.sources) > 1
        if self.max_tokens is None:
            return f"the whole {self.split} split" + (" of each source" if each else "")
        return (f"{self.split} split, {self.max_tokens:,} tokens spread over "
                f"{'each source' if each else 'it'} as train.eval_tokens={self.max_tokens} "
                "scores")

    def data_words(self) -> str:
        """Where the val set is: the prepared folder, or a mixture's folders."""
        if self.data_dir is not None or not self.sources:
            return str(self.data_dir)
        return f"{len(self.sources)} sources ({', '.join(s['data_dir'] for s in self.sources)})"

    def summary(self) -> str:
        """The val line (and one per source of a mixture), then one line per task."""
        if self.loss is None:
            lines = [f"{self.checkpoint}: {self.precision}, {self.device}"]
        else:
            what = "weighted over the sources: " if len(self.sources) > 1 else ""
            lines = [
                f"{self.checkpoint} on {self.data_words()} ({self.val_set()}): {what}loss "
                f"{self.loss:.4f}, perplexity {_fmt(self.perplexity, 3)}, "
                f"bits/byte {_fmt(self.bits_per_byte)}, "
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


def _fmt(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def val_figures(score: ValScore, list_sources: bool) -> dict[str, Any]:
    """EvalResult's val fields from a ValScore; its sources listed with `list_sources`."""
    loss = score.loss
    return dict(
        loss=loss, perplexity=math.inf if loss > 700 else math.exp(loss),  # a NaN loss stays NaN
        bits_per_byte=score.bits_per_byte, tokens=score.tokens, bytes=score.bytes,
        sources=[
            {"name": s.name, "weight": s.weight, "loss": s.loss,
             "bits_per_byte": s.bits_per_byte, "tokens": s.tokens, "bytes": s.bytes}
            for s in score.sources
        ] if list_sources else [],
    )


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
            raise UserError(f"--precision: '{self.precision}' is not one of "
                            f"{', '.join(PRECISIONS)}")
        if self.split not in SPLITS:
            raise UserError(f"--split: '{self.split}' is not one of {', '.join(SPLITS)}")
        given = [f"--max-tokens {self.max_tokens}" if self.max_tokens is not None else "",
                 f"--source {self.source}" if self.source is not None else "",
                 f"--data {self.data}" if self.data is not None else "",
                 f"--split {self.split}" if self.split != "val" else ""]
        if not self.val and any(given):  # else they would be ignored without a word
            raise UserError(f"{next(g for g in given if g)}: chooses the val set, which this "
                            "eval skips (--task without --val, or --no-val); add --val to "
                            "score it too, or drop it")


def evaluate_one(ckpt: Path, settings: EvalSettings) -> EvalResult:
    """One checkpoint's val loss (per source) and tasks."""
    from andrea.train.device import pick_device, pick_dtype

    dev = pick_device(settings.device)
    dtype = pick_dtype(settings.precision, dev)
    opened = open_trained(ckpt, dev, dtype=dtype)
    result = EvalResult(checkpoint=str(ckpt), step=step_of_dir(ckpt), split=settings.split,
                        precision=str(dtype).removeprefix("torch."), device=str(dev))
    if settings.val:
        _score_split(opened, settings, dev, dtype, result)
    _score_tasks(opened, settings, dev, dtype, result)
    return result


def _score_split(
    opened: TrainedModel, settings: EvalSettings, dev: torch.device, dtype: torch.dtype,
    result: EvalResult,
) -> None:
    """The val figures of `result`: the model's loss over the split's val windows."""
    ckpt, cfg, tok = opened.checkpoint, opened.cfg, opened.tokenizer
    split = open_data_split(ckpt, cfg, settings.data, settings.split)
    if split.tokenizer_identity != tok.identity:
        raise UserError(
            f"{split.data_dir}: tokenized with {split.tokenizer_identity}, but {ckpt} was "
            f"trained with {tok.identity}; evaluate on data prepared with the checkpoint's "
            "tokenizer"
        )
    sources = val_sources(split, cfg.model.block_size, settings.max_tokens, settings.source)
    score = score_val(opened.model, sources, batch_size=settings.batch_size, device=dev,
                      dtype=dtype, progress=settings.progress)
    result.data_dir = str(sources[0].split.data_dir) if len(sources) == 1 else None
    whole = all(sum(n for _, _, n in s.windows) == int(np.maximum(s.split.shard_sizes - 1, 0).sum())
                for s in sources)
    result.max_tokens = None if whole else settings.max_tokens
    listed = len(sources) > 1 or settings.source is not None
    for key, value in val_figures(score, listed).items():
        setattr(result, key, value)
    for entry, source in zip(result.sources, sources, strict=False):
        entry["data_dir"] = str(source.split.data_dir)


def _score_tasks(
    opened: TrainedModel, settings: EvalSettings, dev: torch.device, dtype: torch.dtype,
    result: EvalResult,
) -> None:
    """Each task's result appended to `result.tasks`, its skipped records noted on stderr."""

    def logits(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            return opened.model(x)[0].float()

    for task in settings.tasks:
        task_result, _ = run_task(task, logits, opened.tokenizer,
                                  block_size=opened.cfg.model.block_size,
                                  batch_size=settings.batch_size, device=dev,
                                  progress=settings.progress)
        for note in task.notes():
            notice(f"warning: {note}")
        result.tasks.append(task_result.as_dict())


def checkpoints_to_evaluate(
    checkpoints: list[str], all_steps: bool, runs_dir: str = "runs"
) -> list[Path]:
    """The checkpoint folders: each --checkpoint (a run: its latest; none: the newest run),
    or with --all-steps every step folder of each run's history as it stands, oldest first
    (current_steps)."""
    if not all_steps:
        return [find_checkpoint(c, runs_dir) for c in (checkpoints or [None])]
    if checkpoints:
        runs = [named_run(c, runs_dir) for c in checkpoints]
    else:
        runs = [most_recent_run(runs_dir).parent]
        notice(f"run: {runs[0]} (the most recent run under {runs_dir}/)")
    found: list[Path] = []
    for run in runs:
        steps = [p for p in step_dirs(run) if (p / MODEL_FILE).is_file()]
        if not steps and is_step_dir(run):
            raise UserError(f"--all-steps {run}: a checkpoint's step folder; --all-steps takes "
                            f"its run's folder: {run.parent}")
        if not steps:
            raise UserError(f"--all-steps {run}: no step-N checkpoint folders in this run; "
                            "give a run directory, e.g. runs/<name>")
        found += current_steps(run, steps)
    return found


def current_steps(run: Path, steps: list[Path]) -> list[Path]:
    """The step folders of `run` on its history as it stands, the line that led to its latest
    checkpoint: a curve of val loss over steps is one model's. Those a resume from an older
    step left behind (left_behind_steps), of a line it threw away, are left out in one line
    that names them and how to score one, as `andrea runs` and `andrea plot` leave out their
    records."""
    left = left_behind_steps(run)
    kept = [p for p in steps if step_of_dir(p) not in left]
    if len(kept) == len(steps):
        return kept
    behind = [p for p in steps if step_of_dir(p) in left]
    names, them = ", ".join(p.name for p in behind), "it" if len(behind) == 1 else "one"
    why = (f"left behind by a resume from an older step, of a line the run threw away (andrea "
           f"runs and andrea plot leave out its records too); score {them} alone with "
           f"--checkpoint {shlex.quote(str(behind[0]))}")
    if not kept:
        raise UserError(f"--all-steps {run}: its step folders ({names}) are all {why}")
    notice(f"--all-steps {run}: leaves out {names}, {why}")
    return kept


def task_pairs(kinds: list[str] | None, files: list[str] | None) -> list[tuple[str, str]]:
    """`--task KIND` (repeatable) paired in order with the FILE arguments; the counts must agree."""
    kinds, files = kinds or [], files or []
    folder = next((f for f in files if Path(f).is_dir()), None)
    if not kinds and folder is not None:  # `andrea eval runs/x`: a run, not a task file
        raise UserError(f"{folder}: eval's arguments are task files (one per --task); to score "
                        f"a checkpoint, name it with --checkpoint: andrea eval --checkpoint "
                        f"{shlex.quote(folder)}")
    if len(kinds) != len(files):
        raise UserError(f"--task: {len(kinds)} task(s) but {len(files)} file(s); give one file "
                        "per --task, e.g. andrea eval --task hellaswag hellaswag_val.jsonl")
    return list(zip(kinds, files, strict=True))


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
    if limit is not None and not tasks:  # else it would be ignored without a word
        raise UserError(f"--limit {limit}: counts the examples of a task; give --task KIND FILE "
                        "with it, or drop it")
    settings.tasks = [read_task(kind, path, limit) for kind, path in tasks]
    ckpts = checkpoints_to_evaluate(checkpoints, all_steps, runs_dir)  # names the one it picks
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


def format_results(results: list[EvalResult], as_json: bool = False) -> str:
    """What `andrea eval` prints: one result's summary, a table of several, or JSON: always a
    list, one object per checkpoint (a script reads one checkpoint as it reads several)."""
    if as_json:
        return json.dumps([json.loads(r.to_json()) for r in results], indent=2)
    return results[0].summary() if len(results) == 1 else format_table(results)


def format_table(results: list[EvalResult]) -> str:
    """One row per checkpoint: step, val loss, perplexity and bits per byte, each source's
    loss, each task's acc (and acc_norm)."""
    header = ["CHECKPOINT", "STEP", "VAL LOSS", "PERPLEXITY", "BITS/BYTE"]
    # Every source any checkpoint was scored on, in order: checkpoints of runs on other data
    # (a mixture beside a single folder) each fill the columns of their own sources.
    names = list(dict.fromkeys(s["name"] for r in results for s in r.sources))
    header += [f"{source_last_part(n)} LOSS" for n in names]
    header += [_task_header(t) for t in results[0].tasks]
    rows = [header]
    for r in results:
        row = [r.checkpoint, "-" if r.step is None else str(r.step), _fmt(r.loss),
               _fmt(r.perplexity, 3), _fmt(r.bits_per_byte)]  # 3 digits: as one line gives it
        losses = {s["name"]: s["loss"] for s in r.sources}
        row += [_fmt(losses[n]) if n in losses else "-" for n in names]
        row += [_task_cell(t) for t in r.tasks]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    scored = [r for r in results if r.loss is not None]
    sets = list(dict.fromkeys(f"on {r.data_words()}, {r.val_set()}" for r in scored))
    if len(sets) == 1:
        lines.append(f"VAL LOSS: {sets[0]}")
    else:  # runs on other data: each row's val set
        lines += [f"VAL LOSS of {r.checkpoint}: on {r.data_words()}, {r.val_set()}"
                  for r in scored]
    return "\n".join(lines)


def _task_header(task: dict[str, Any]) -> str:
    name = f"{task['task']} ({Path(task['file']).name})"
    return f"{name} ACC" + (" / NORM" if task["acc_norm"] is not None else "")


def _task_cell(task: dict[str, Any]) -> str:
    cell = f"{task['acc']:.4f}"
    return cell + (f" / {task['acc_norm']:.4f}" if task["acc_norm"] is not None else "")
