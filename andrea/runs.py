"""Read run directories (`runs/<name>/`) and summarise them: the `andrea runs` command.

A run directory holds `config.yaml` (the resolved config), `metrics.jsonl` (one JSON event per
line, see docs/model.md and the trainer), `latest` (the name of the newest complete checkpoint) and
`step-NNNNNN/` checkpoint dirs. Everything here reads; nothing writes. A damaged run is summarised
as far as its files allow and the damage is listed in `problems`, never raised: one bad run must
not hide the others.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from andrea.config import PRECISION_DTYPES
from andrea.errors import UserError
from andrea.fileio import json_safe
from andrea.folder_lock import pid_alive
from andrea.train.metrics import (
    format_mfu,
    format_speed,
    json_number,
    recorded_median,
    recorded_speed,
)
from andrea.train.rundir import (
    CONFIG,
    LATEST,
    METRICS,
    OVERWRITTEN,
    TRAINER_STATE,
    TrainerState,
    checkpoint_problem,
    is_run,
    latest_problem,
    newest_intact,
    start_over_command,
    step_dirs,
)

# Every state a run can be in; the first five come from the trainer's "end" event. "imported":
# made by `andrea import` (a checkpoint at step 0, no metrics), not trained yet. "damaged": its
# `latest` or the model file of the checkpoint it names is missing or unreadable, whatever
# the metrics say (eval, generate and resume of the run would fail; notes name the newest
# intact checkpoint, which --checkpoint / --resume take as a step folder).
STATES = ("finished", "stopped", "interrupted", "nonfinite", "failed", "running", "crashed",
          "imported", "damaged")
# The loss-spike guard's events (andrea/train/spike.py).
GUARD_EVENTS = ("spike", "rollback")


@dataclass
class RunSummary:
    name: str
    path: str
    preset: str | None = None
    # e.g. "6L/12H/d384/ctx256": layers, heads, d_model, block_size (context in tokens).
    shape: str | None = None
    n_params: int | None = None
    # What it computes in (bf16, fp16, fp32): its last segment's start record (auto resolved),
    # else config.yaml's train.precision.
    precision: str | None = None
    step: int | None = None
    max_steps: int | None = None
    tokens: int | None = None
    best_val_loss: float | None = None
    best_val_step: int | None = None
    # train.eval_tokens: the val set the run's val losses are on, that many target tokens
    # spread over the val split (per source); 0: the whole split.
    eval_tokens: int | None = None
    # The latest evaluation: val loss (a mixture's: weighted over its sources), bits per byte,
    # and for a mixture each source's val loss.
    last_val_loss: float | None = None
    last_val_bpb: float | None = None
    last_val_step: int | None = None
    last_val_sources: dict[str, float] | None = None
    last_train_loss: float | None = None
    # The run's (train.metrics.recorded_speed); the median of logged steps for runs whose
    # records lack it.
    tokens_per_s: float | None = None
    mfu: float | None = None
    median_tokens_per_s: float | None = None
    # One of STATES, or "unknown" when the files do not say (see problems).
    state: str = "unknown"
    signal: str | None = None
    message: str | None = None
    latest_checkpoint: str | None = None
    # The newest checkpoint that is whole, when the latest is damaged (else None).
    intact_checkpoint: str | None = None
    started: float | None = None
    host: str | None = None
    pid: int | None = None
    n_segments: int = 0
    # The loss-spike guard: steps it held back (or took as a new level), and its rollbacks.
    spikes: int = 0
    rollbacks: int = 0
    overflows: int = 0  # fp16: steps skipped, their gradients overflowing the loss scale
    nonfinite: int = 0  # steps skipped for a non-finite loss or gradient (skip_nonfinite)
    problems: list[str] = field(default_factory=list)

    @property
    def model(self) -> str:
        """The "preset/shape" column, e.g. 'andrea-12m 6L/12H/d384/ctx256'."""
        parts = [p for p in (self.preset, self.shape) if p]
        return " ".join(parts) if parts else "?"

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; non-finite floats (a NaN loss) become null."""
        out = dataclasses.asdict(self)
        out["model"] = self.model
        return json_safe(out)


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """All readable events of a metrics.jsonl, in file order, and how many lines were not.

    A line is unreadable if it is not JSON (e.g. cut short by a crash mid-write) or not an object
    with an "event" key. Blank lines are ignored, not counted. Raises OSError if the file cannot
    be opened; the callers decide what that means.
    """
    records: list[dict[str, Any]] = []
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                skipped += 1
                continue
            if isinstance(rec, dict) and isinstance(rec.get("event"), str):
                records.append(rec)
            else:
                skipped += 1
    return records, skipped


def current_history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the run as it stands, with steps a resume threw away removed.

    A run resumed from an earlier checkpoint (say step 100 after dying at step 150) repeats steps
    101..150; the old records of those steps describe a history that no longer leads to the
    current weights, so every "start" at step s drops the earlier step-bearing events past s.
    A spike guard's "rollback" to step s does the same, but keeps the guard's own events (the
    spikes that caused it), which are what the user needs to see.

    Read backwards in one pass: a record stays when no later start (nor, unless it is the
    guard's own, a later rollback) went back before its step. Filtering the records kept so
    far at each start took segments x records: seconds for a run of days requeued hourly.
    """
    kept: list[dict[str, Any]] = []
    back_to = rolled_back_to = math.inf  # the lowest step a later start (rollback) went to
    for rec in reversed(records):
        step, event = _int(rec.get("step")) or 0, rec["event"]
        if event == "start" or (step <= back_to
                                and (event in GUARD_EVENTS or step <= rolled_back_to)):
            kept.append(rec)
        first = _int(rec.get("step"))
        if first is not None and event == "start":
            back_to = min(back_to, first)
        elif first is not None and event == "rollback":
            rolled_back_to = min(rolled_back_to, first)
    return kept[::-1]


def left_behind_steps(run: Path) -> set[int]:
    """The steps of the run's checkpoints that a resume from an older step left behind: their
    `checkpoint` records are of a line the run went back before (current_history drops them)
    and none since wrote that step again. A step with no record (metrics.jsonl missing or cut
    short) is not known to be left behind."""
    try:
        records, _ = read_metrics(run / METRICS)
    except OSError:
        return set()
    return _checkpoint_steps(records) - _checkpoint_steps(current_history(records))


def _checkpoint_steps(records: list[dict[str, Any]]) -> set[int]:
    return {step for rec in records
            if rec["event"] == "checkpoint" and (step := _int(rec.get("step"))) is not None}


def _int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _read_config(run: Path, summary: RunSummary) -> dict[str, Any] | None:
    path = run / CONFIG
    if not path.is_file():
        summary.problems.append(f"no {CONFIG}")
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        summary.problems.append(f"{CONFIG} unreadable: {first}")
        return None
    if not isinstance(data, dict):
        summary.problems.append(f"{CONFIG} is not a mapping of sections (model, data, train)")
        return None
    return data


def _shape(model: Any) -> str | None:
    if not isinstance(model, dict):
        return None
    keys = ("n_layer", "n_head", "head_dim", "block_size")
    values = [_int(model.get(k)) for k in keys]
    if any(v is None for v in values):
        return None
    n_layer, n_head, head_dim, block = values
    # d_model, not head_dim, is the width people compare ("d384"); head_dim = d_model / heads.
    return f"{n_layer}L/{n_head}H/d{n_head * head_dim}/ctx{block}"


def _latest_checkpoint(run: Path, summary: RunSummary) -> None:
    pointer = run / LATEST
    if not pointer.is_file():
        return
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        summary.problems.append(f"{LATEST} unreadable: {exc}")
        return
    if not name or "/" in name or name in (".", ".."):
        summary.problems.append(f"{LATEST} does not name a checkpoint dir: {name!r}")
        return
    summary.latest_checkpoint = name


def _read_import(run: Path, summary: RunSummary) -> bool:
    """Fill in an imported run (its latest checkpoint's trainer state names its source);
    False if the run is not one."""
    if summary.latest_checkpoint is None:
        return False
    try:
        raw = json.loads((run / summary.latest_checkpoint / TRAINER_STATE).read_text("utf-8"))
        state = TrainerState.from_dict(raw)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return False  # unreadable, or not a trainer state: the run's other records say more
    if not isinstance(state.imported_from, str):
        return False
    summary.state = "imported"
    summary.step, summary.tokens = _int(state.step), _int(state.tokens)
    summary.preset = state.preset if isinstance(state.preset, str) else None
    summary.message = f"imported from {state.imported_from}; not trained here yet"
    return True


def val_sources(record: dict[str, Any]) -> dict[str, float]:
    """{source: val loss} of an eval event of a mixture run (empty for one source)."""
    sources = record.get("val_sources")
    if not isinstance(sources, dict):
        return {}
    out = {}
    for name, value in sources.items():
        loss = json_number(value.get("loss")) if isinstance(value, dict) else None
        if loss is not None:
            out[str(name)] = loss
    return out


def _last_eval(summary: RunSummary, rec: dict[str, Any]) -> None:
    summary.last_val_loss = json_number(rec.get("val_loss"))
    summary.last_val_step = _int(rec.get("step"))
    summary.last_val_bpb = json_number(rec.get("val_bpb"))
    summary.last_val_sources = val_sources(rec) or None


def read_run(path: Path | str, verify: bool = False) -> RunSummary:
    """Summarise one run directory. Damage goes into `problems`; this never raises for it.
    `verify`: the checkpoint files' checksums too (checkpoint_problem's), seconds a big
    checkpoint."""
    summary = _read_history(Path(path))
    _check_checkpoint(Path(path), summary, verify)
    return summary


def _check_checkpoint(run: Path, summary: RunSummary, verify: bool = False) -> None:
    """Mark the run damaged when its `latest` or the model of the checkpoint it names is gone
    or unreadable (`verify`: or not the bytes its checksums.json recorded) while the run has
    (or had) checkpoints; name the newest intact one. A running run keeps its state (it
    writes the next checkpoint)."""
    had_one = (run / LATEST).is_file() or step_dirs(run) or summary.latest_checkpoint
    if not had_one:
        return  # never checkpointed (a crash before the first save): nothing is damaged
    bad_pointer = any(p.startswith(f"{LATEST} ") for p in summary.problems)  # already said
    name = summary.latest_checkpoint if (run / LATEST).is_file() else None
    problem = "" if bad_pointer else latest_problem(run, name, verify)
    if problem is None:
        resume = checkpoint_problem(run / str(name), for_resume=True, verify=verify)
        if resume is not None:  # its model opens; `train --resume` refuses it
            again = newest_intact(run, for_resume=True, verify=verify)
            summary.problems.append(
                f"{LATEST} points to {name}, which eval and generate open but a resume cannot "
                f"({resume}); " + (f"the newest that resumes: {again.name}" if again is not None
                                   else "no checkpoint of the run resumes"))
        return
    intact = newest_intact(run, verify=verify)
    summary.intact_checkpoint = intact.name if intact is not None else None
    found = (f"newest intact checkpoint: {intact.name}" if intact is not None
             else "no intact checkpoint")
    summary.problems.append(f"{problem}; {found}" if problem else found)
    if summary.state != "running":
        summary.state = "damaged"


def run_name(run: Path) -> str:
    """The run's name, its folder's, also where the path names it as `.` or `..` (`andrea runs
    .` inside the run), whose own name is empty or `..`. Not resolved: a run reached through a
    link keeps the name the user sees."""
    return Path(os.path.abspath(run)).name


def _read_history(run: Path) -> RunSummary:
    """The summary from config.yaml, `latest` and metrics.jsonl (see read_run)."""
    summary = RunSummary(name=run_name(run), path=str(run))
    _read_shape(run, summary)
    _latest_checkpoint(run, summary)
    records = _load_metrics(run, summary)
    if not records:
        return summary
    starts = [i for i, r in enumerate(records) if r["event"] == "start"]
    _read_starts(records, starts, summary)
    history = current_history(records)
    _read_progress(history, summary)
    _read_losses(history, summary)
    summary.tokens_per_s, summary.mfu = recorded_speed(records)
    summary.median_tokens_per_s = recorded_median(records, history)
    # The state comes from the current segment: the events after the last start.
    _read_state(records[starts[-1]:] if starts else records, bool(starts), summary)
    trained_in = records[starts[-1]].get("run_dir") if starts else None
    if summary.message and isinstance(trained_in, str):
        summary.message = _relocated(summary.message, trained_in, summary.path)
    return summary


def _read_shape(run: Path, summary: RunSummary) -> None:
    """The model's shape and max_steps from config.yaml."""
    config = _read_config(run, summary)
    if config is None:
        return
    summary.shape = _shape(config.get("model"))
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    summary.max_steps = _int(train.get("max_steps"))
    summary.eval_tokens = _int(train.get("eval_tokens"))
    precision = train.get("precision")
    summary.precision = precision if isinstance(precision, str) else None
    if summary.shape is None:
        summary.problems.append(f"{CONFIG}: model section lacks the shape keys")


def _load_metrics(run: Path, summary: RunSummary) -> list[dict[str, Any]]:
    """The readable events of metrics.jsonl; none (and the problem said, or the run read as
    an import) when there are none."""
    metrics = run / METRICS
    if not metrics.is_file():
        if not _read_import(run, summary):
            summary.problems.append(f"no {METRICS}")
        return []
    try:
        records, n_bad = read_metrics(metrics)
    except OSError as exc:
        summary.problems.append(f"{METRICS} unreadable: {exc.strerror or exc}")
        return []
    if n_bad:
        summary.problems.append(f"{METRICS}: {n_bad} unreadable line(s) skipped")
    if not records and not n_bad:
        summary.problems.append(f"{METRICS} is empty")
    return records


def _read_starts(records: list[dict[str, Any]], starts: list[int], summary: RunSummary) -> None:
    """Segments, start time, preset, and the last segment's max_steps, size, pid and host."""
    summary.n_segments = len(starts)
    if not starts:
        summary.problems.append(f"{METRICS} has no start event")
        return
    first, last = records[starts[0]], records[starts[-1]]
    summary.started = json_number(first.get("time"))
    # The preset the run was created from: a resumed segment is started from the run's own
    # config.yaml, so its start event may name that file ("config") instead.
    presets = [r.get("preset") for r in (records[i] for i in starts)]
    summary.preset = next((p for p in presets if isinstance(p, str) and p), None)
    summary.max_steps = _int(last.get("max_steps")) or summary.max_steps
    summary.n_params = _int(last.get("n_params"))
    recorded = last.get("precision")
    summary.precision = next((name for name, dtype in PRECISION_DTYPES.items()
                              if dtype == recorded), summary.precision)
    summary.pid = _int(last.get("pid"))
    summary.host = last.get("host") if isinstance(last.get("host"), str) else None


def _read_progress(history: list[dict[str, Any]], summary: RunSummary) -> None:
    """The step and tokens reached, the guard's and fp16's counts, the last loss."""
    for rec in history:
        step, tokens = _int(rec.get("step")), _int(rec.get("tokens"))
        if rec["event"] in ("train", "eval", "checkpoint", "end") and step is not None:
            summary.step = step if summary.step is None else max(summary.step, step)
        if rec["event"] in ("train", "eval", "end") and tokens is not None:
            summary.tokens = tokens if summary.tokens is None else max(summary.tokens, tokens)
    summary.spikes, summary.rollbacks, summary.overflows, summary.nonfinite = (
        sum(r["event"] == kind for r in history)
        for kind in ("spike", "rollback", "overflow", "skip"))
    trains = [r for r in history if r["event"] == "train"]
    losses = [x for x in (json_number(r.get("loss")) for r in trains) if x is not None]
    if losses:
        summary.last_train_loss = losses[-1]


def starts_new_val_set(rec: dict[str, Any]) -> bool:
    """Whether `rec` is the start of a resume onto a new val set (its `new_val_set`, the causes
    resume.new_val_set found): the val losses after it are not comparable with those before."""
    return rec["event"] == "start" and bool(rec.get("new_val_set"))


def _read_losses(history: list[dict[str, Any]], summary: RunSummary) -> None:
    """The best finite val loss (and its step) and the latest evaluation. The best starts again
    at a resume onto a new val set (starts_new_val_set), as the trainer's does: the losses
    before it are of another set."""
    for rec in history:
        if starts_new_val_set(rec):
            summary.best_val_loss = summary.best_val_step = None
        val, step = json_number(rec.get("val_loss")), _int(rec.get("step"))
        if rec["event"] == "eval" and val is not None and math.isfinite(val):
            if summary.best_val_loss is None or val < summary.best_val_loss:
                summary.best_val_loss, summary.best_val_step = val, step
        if rec["event"] == "eval" and val is not None:
            _last_eval(summary, rec)


def _read_state(segment: list[dict[str, Any]], started: bool, summary: RunSummary) -> None:
    """The state of the current segment: its end event's, else running or crashed by its
    process (when the start event says which, on this host)."""
    ends = [r for r in segment if r["event"] == "end"]
    if ends:
        _read_end(ends[-1], summary)
    elif started:
        if summary.pid is None:
            summary.problems.append(f"{METRICS}: start event has no pid; cannot tell if running")
        elif summary.host not in (None, socket.gethostname()):
            summary.problems.append(
                f"started on host {summary.host}; cannot check its process from here"
            )
        else:
            since = json_number(segment[0].get("time")) if segment else None
            summary.state = "running" if pid_alive(summary.pid, since) else "crashed"


def _read_end(end: dict[str, Any], summary: RunSummary) -> None:
    state = end.get("state")
    if state in STATES:
        summary.state = state
    else:
        summary.problems.append(f"{METRICS}: end event has an unknown state {state!r}")
    summary.signal = end.get("signal") if isinstance(end.get("signal"), str) else None
    summary.message = end.get("message") if isinstance(end.get("message"), str) else None
    if summary.best_val_loss is None and json_number(end.get("best_val_loss")) is not None:
        summary.best_val_loss = json_number(end.get("best_val_loss"))
        summary.best_val_step = _int(end.get("best_val_step"))
    if summary.latest_checkpoint is None and isinstance(end.get("checkpoint"), str):
        summary.latest_checkpoint = end["checkpoint"]


def _relocated(message: str, recorded: str, run: str) -> str:
    """A recorded message with the run's folder as its start event recorded it (`recorded`)
    replaced by `run`, where it is now: a copied or moved run's notes name its own checkpoints
    and commands, not those of the run it was copied from. Only whole paths are replaced: the
    folder alone or before a `/`, bare or quoted as a shell would quote it."""
    if recorded == run or Path(recorded).resolve() == Path(run).resolve():
        return message
    pairs = [(recorded, run)]
    if shlex.quote(recorded) != recorded:
        pairs.insert(0, (shlex.quote(recorded), shlex.quote(run)))
    for old, new in pairs:
        whole = r"(?<![^\s(=])" + re.escape(old) + r"(?=[/\s);,]|$)"
        message = re.sub(whole, lambda _, new=new: new, message)
    return message


def list_runs(root: Path | str = "runs", verify: bool = False) -> list[RunSummary]:
    """Every run under `root` (or `root` itself if it is one run), oldest start first; none for
    a folder that holds no run yet (a runs folder before its first training: as `ls` of an
    empty folder, an answer, not an error). `verify`: read_run's.

    Raises UserError when `root` is missing or a file: a mistyped path, nothing to list.
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UserError(f"{root}: a file, not a folder; pass the folder that holds the runs "
                        "(runs/ unless train.runs_dir says otherwise) or one run's folder")
    if not root.is_dir():
        raise UserError(f"{root}: no such directory (runs live in runs/ unless train.runs_dir "
                        "says otherwise; pass the folder as the argument)")
    if is_run(root) or (root / OVERWRITTEN).is_dir():
        dirs = [root]
    else:
        dirs = sorted(p for p in root.iterdir()
                      if p.is_dir() and (is_run(p) or (p / OVERWRITTEN).is_dir()))
    runs = [read_run(d, verify) if is_run(d) else _set_aside(d) for d in dirs]
    runs.sort(key=lambda r: (r.started is None, r.started or 0.0, r.name))
    return runs


def no_runs_line(root: Path | str) -> str:
    """What `andrea runs` says of a folder that holds no run."""
    return (f"no runs under {root} (a run is a folder with {CONFIG} and {METRICS}, which "
            "`andrea train` writes)")


def _set_aside(run: Path) -> RunSummary:
    """A run folder that holds only the old run an --overwrite stopped early set aside (it
    wrote nothing of its own): that run as it stands, under the folder's name (the notes say
    how to put it back)."""
    summary = read_run(run / OVERWRITTEN)
    summary.name, summary.path = run_name(run), str(run)
    return summary


def _si(x: float | None, digits: int = 3) -> str:
    """1234567 -> '1.23M': compact counts for a table."""
    if x is None or not math.isfinite(x):
        return "-" if x is None else str(x)
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.{digits}g}{suffix}"
    return f"{x:.{digits}g}"


def _loss(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4f}" if math.isfinite(x) else str(x)


def _row(r: RunSummary) -> list[str]:
    steps = f"{r.step if r.step is not None else '-'}/{r.max_steps or '?'}"
    best = "-" if r.best_val_loss is None else f"{_loss(r.best_val_loss)} @{r.best_val_step}"
    state = r.state + (f" ({r.signal})" if r.signal and r.state == "interrupted" else "")
    if r.problems:
        state += " !"
    return [r.name, r.model, steps, _si(r.tokens), best, _loss(r.last_train_loss),
            r.precision or "-",
            format_speed(r.tokens_per_s if r.tokens_per_s is not None else r.median_tokens_per_s),
            format_mfu(r.mfu), state, r.latest_checkpoint or "-"]


HEADER = ["RUN", "MODEL", "STEPS", "TOKENS", "BEST VAL", "LAST LOSS", "PRECISION", "TOK/S", "MFU",
          "STATE", "CHECKPOINT"]


def format_table(runs: list[RunSummary]) -> str:
    """A fixed-width table, one row per run, then each run's problems and end message."""
    rows = [HEADER] + [_row(r) for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    notes = []
    for r in runs:
        if r.message and r.state not in ("finished", "running"):
            notes.append(f"  {r.name}: {r.message}")
        aside = Path(r.path) / OVERWRITTEN
        if aside.is_dir():  # an --overwrite's start files over the old run it set aside
            notes.append(f"  {r.name}: an --overwrite that stopped during its set-up left the "
                         f"old run in {aside}; any training of the run puts it back: "
                         f"{shlex.join(['andrea', 'train', '--resume', r.path])}")
        elif r.state == "crashed":  # no end record: killed, out of memory, its machine lost
            notes.append(
                f"  {r.name}: its process ended without a word (killed?); continue it: "
                f"{shlex.join(['andrea', 'train', '--resume', r.path])}" if r.latest_checkpoint
                else f"  {r.name}: its process ended without a word (killed?) before its first "
                f"checkpoint; nothing to continue; start it over: "
                f"{start_over_command(Path(r.path))}")
        if r.last_val_sources and r.last_val_loss is not None:
            by_source = ", ".join(f"{n} {_loss(v)}" for n, v in r.last_val_sources.items())
            notes.append(f"  {r.name}: val loss by source at step {r.last_val_step}: "
                         f"{by_source} (weighted {_loss(r.last_val_loss)})")
        if r.spikes or r.rollbacks:
            notes.append(f"  {r.name}: spike guard: {r.spikes} outlier step"
                         f"{'s' if r.spikes != 1 else ''} not applied, {r.rollbacks} rollback"
                         f"{'s' if r.rollbacks != 1 else ''} (metrics.jsonl: spike, rollback)")
        if r.overflows:
            notes.append(f"  {r.name}: fp16 overflow steps skipped: {r.overflows} (metrics.jsonl)")
        if r.nonfinite:
            notes.append(f"  {r.name}: {r.nonfinite} step{'s' if r.nonfinite != 1 else ''} not "
                         f"applied: a non-finite loss or gradient (train.skip_nonfinite; "
                         f"metrics.jsonl: skip)")
        notes.extend(f"  {r.name}: ! {p}" for p in r.problems)
    legend = val_set_legend(runs)
    if notes or legend:
        lines += ["", "notes:", *notes, *([f"  {legend}"] if legend else [])]
    return "\n".join(lines)


def val_set_legend(runs: list[RunSummary]) -> str | None:
    """What BEST VAL is measured on: each run's own val set (train.eval_tokens), which `andrea
    eval` scores only when told to; None when no run has a val loss."""
    sets: dict[str, list[str]] = {}
    for r in runs:
        if r.best_val_loss is not None:
            words = ("the whole val split" if r.eval_tokens == 0 else
                     f"{r.eval_tokens:,} tokens spread over the val split"
                     if r.eval_tokens is not None else "an unrecorded set")
            sets.setdefault(words, []).append(r.name)
    if not sets:
        return None
    each = "; ".join(f"{words} ({', '.join(names)})" for words, names in sets.items())
    return (f"BEST VAL is each run's own val set, train.eval_tokens: {each}; `andrea eval "
            "--max-tokens N` scores that set (N: its tokens), `andrea eval` without it the whole "
            "val split")


def format_json(runs: list[RunSummary]) -> str:
    return json.dumps([r.as_dict() for r in runs], indent=2)
