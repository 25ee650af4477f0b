"""What a run records: metrics.jsonl, its sinks (TensorBoard, W&B), the run's tokens/s.

metrics.jsonl: one JSON event a line, appended and passed on to its optional sinks (TensorBoard,
Weights & Biases); the run's one tokens/s figure, and that figure read back from a run's records
(`andrea runs`, `andrea plot`).

The sinks: the trainer opens them once (rank 0), MetricsLog passes each every record (`.log`:
the scalars that `scalars` finds in it, the same for both) and closes them at the end.
TensorBoard (`train.tensorboard: true`) is not a dependency: without the package,
`open_tensorboard` says so in one line and returns None, and training goes on with
metrics.jsonl alone. W&B (`train.wandb: online | offline`) logs the scalars against the
optimizer step, with the resolved config as the W&B run's config. The W&B run's id is kept in
the run folder (`wandb_run_id`), so a resumed run continues the same W&B run. `offline` writes
W&B's files under `<run>/wandb/` without any network; `wandb sync <run>/wandb/offline-run-*`
uploads them later.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from andrea.config import Config
from andrea.errors import UserError
from andrea.fileio import atomic_write_text
from andrea.train.rundir import WANDB_RUN_ID


class Sink(Protocol):
    """A second home for the records (TensorBoard, W&B): every record as written, then close."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


# Record field -> scalar name, per event type: what TensorBoard and W&B draw of each record.
SCALARS: dict[str, dict[str, str]] = {
    "train": {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "tokens_per_s": "train/tokens_per_s",
        "mfu": "train/mfu",
        "tokens": "train/tokens_seen",
    },
    "eval": {"val_loss": "val/loss", "val_bpb": "val/bits_per_byte"},
    "end": {"tokens_per_s": "run/tokens_per_s", "mfu": "run/mfu"},
}


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(step, {name: value}) of a record for a sink that draws curves, or None when it has none.

    A mixture's val losses become one curve per source; the counters of the other events
    (spike, rollback, skip, overflow: their `*_total` fields) become `events/<field>`, so an
    event kind added later is drawn without a change here. Missing values (MFU on a CPU is null)
    and NaN losses are left out, not drawn as 0."""
    event, step = record.get("event", ""), record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    names = dict(SCALARS.get(event, {}))
    if event not in SCALARS:
        names = {k: f"events/{k}" for k in record if k.endswith("_total")}
    out = {name: float(v) for k, name in names.items()
           if (v := json_number(record.get(k))) is not None and math.isfinite(v)}
    sources = record.get("val_sources") if event == "eval" else None
    for source, fields in (sources.items() if isinstance(sources, dict) else ()):
        loss = json_number(fields.get("loss")) if isinstance(fields, dict) else None
        if loss is not None and math.isfinite(loss):
            out[f"val/source/{source}/loss"] = loss
    return (step, out) if out else None


class MetricsLog:
    """metrics.jsonl: one JSON object a line, appended and flushed as it happens (rank 0); each
    record also goes to every sink, so the loop writes a record once whatever is logging it."""

    def __init__(self, path: Path | None, sinks: list[Sink] | None = None) -> None:
        self.file = None
        if path is not None:  # never appended through a link (the run's set-up refuses one)
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            size = os.fstat(fd).st_size
            self.file = os.fdopen(fd, "a", encoding="utf-8")
            if size and os.pread(fd, 1, size - 1) != b"\n":
                # A process killed mid-write left its last line cut short: end it, so that it
                # stays one unreadable line and this segment's first record (its start, which
                # tells `andrea runs` the segment and its process) is not glued onto it.
                self.file.write("\n")
        self.sinks = list(sinks or [])

    def write(self, event: str, **fields: Any) -> None:
        if self.file is None:
            return
        record = {"event": event, **fields, "time": round(time.time(), 3)}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        for sink in self.sinks:
            sink.close()


SEGMENT_EDGES = (b'{"event": "start"', b'{"event": "end"')  # how MetricsLog begins them
TAIL_BYTES = 1 << 16  # read back from the end of metrics.jsonl at a time


def open_segment(path: Path) -> dict[str, Any] | None:
    """The start record of metrics.jsonl's last segment while no end record follows it (a
    training writes the run now, or was killed); None when the file is missing or its last
    segment ended. Read backwards, a block at a time, only as far as the segment began: a
    segment that ended costs one block, however long the run."""
    try:
        f = open(path, "rb")
    except OSError:
        return None
    with f:
        end, head = f.seek(0, os.SEEK_END), b""
        while end > 0:
            begin = max(0, end - TAIL_BYTES)
            f.seek(begin)
            lines = (f.read(end - begin) + head).split(b"\n")
            # The block's first line may have begun in the block before: read on with it.
            head = lines.pop(0) if begin else b""
            for line in reversed(lines):
                if line.startswith(SEGMENT_EDGES[1]):
                    return None
                if line.startswith(SEGMENT_EDGES[0]):
                    return _start_record(line)
            end = begin
    return None


def _start_record(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:  # cut short by a kill mid-write
        return None
    return record if isinstance(record, dict) else None


def tokens_per_s(tokens: float, seconds: float) -> float | None:
    """The one speed figure (see Throughput), rounded as every record and display gives it."""
    return round(tokens / seconds, 1) if seconds > 0 else None


class Throughput:
    """The run's tokens/s: the tokens this process's steps trained over the wall time of those
    steps, from the start of a step's first micro-batch to its logging. Evaluation, checkpoints,
    set-up and a rolled-back step's work are left out, so the figure says how fast the model
    trains, whatever the eval and checkpoint intervals. So are warm-up steps, the first step of
    each window length in a process (a compiled model compiles then; CUDA allocates and tunes
    then): their count and seconds are kept apart. Counted per `andrea train` process (a
    resumed segment starts again at zero: it may run on other hardware). The model FLOPs of the
    same steps are summed beside the tokens for the run's MFU: a token of a sequence-length
    warm-up's shorter window costs fewer."""

    def __init__(self) -> None:
        self.tokens = 0
        self.flops = 0.0
        self.seconds = 0.0
        self.warmup_steps = 0
        self.warmup_seconds = 0.0

    def add(self, tokens: int, seconds: float, *, flops: float = 0.0,
            warmup: bool = False) -> None:
        if warmup:
            self.warmup_steps += 1
            self.warmup_seconds += seconds
            return
        self.tokens += tokens
        self.flops += flops
        self.seconds += seconds

    @property
    def tokens_per_s(self) -> float | None:
        # From the seconds as recorded, so the figure recomputes exactly from a record.
        return tokens_per_s(self.tokens, round(self.seconds, 4))

    @property
    def flops_per_s(self) -> float | None:
        seconds = round(self.seconds, 4)
        return self.flops / seconds if seconds > 0 else None

    def fields(self) -> dict[str, Any]:
        """What a train or end record carries to recompute the figure (tokens over seconds),
        and the warm-up steps left out of it."""
        return {"train_tokens": self.tokens, "train_seconds": round(self.seconds, 4),
                "warmup_steps": self.warmup_steps,
                "warmup_seconds": round(self.warmup_seconds, 4)}


def json_number(value: Any) -> float | None:
    """A float from a JSON value, or None if it is not a number (bools are not numbers)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else None


def recorded_speed(records: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(tokens/s, MFU) of the run as its metrics.jsonl records give them, for `andrea runs` and
    `andrea plot`: those of the latest segment's end record; a segment still running (or one
    killed) from its last train record's train_tokens / train_seconds and train_mfu. (None,
    None) for runs written before these fields (their readers fall back to a median), and for
    a segment of warm-up steps only."""
    last_start = max((i for i, r in enumerate(records) if r.get("event") == "start"), default=-1)
    for rec in reversed(records[last_start + 1:]):
        if rec.get("event") == "end" and "tokens_per_s" in rec:
            return json_number(rec["tokens_per_s"]), json_number(rec.get("mfu"))
        tokens = json_number(rec.get("train_tokens"))
        seconds = json_number(rec.get("train_seconds"))
        if rec.get("event") == "train" and tokens is not None and seconds is not None:
            return tokens_per_s(tokens, seconds), json_number(rec.get("train_mfu"))
    return None, None


def median_tokens_per_s(rates: list[float]) -> float | None:
    """The median of steps' tokens/s (the end record's `median_tokens_per_s`, beside the run's
    figure); None without a step."""
    finite = [r for r in rates if math.isfinite(r)]
    return statistics.median(finite) if finite else None


def recorded_median(records: list[dict[str, Any]], history: list[dict[str, Any]]) -> float | None:
    """The median steps' tokens/s as `andrea runs` gives it: the latest segment's end record's
    (over every step of that segment, as the trainer timed them), so that the two never differ;
    a segment without one (running, crashed, or written before the field) from the logged
    steps' rates in `history`."""
    last_start = max((i for i, r in enumerate(records) if r.get("event") == "start"), default=-1)
    for rec in reversed(records[last_start + 1:]):
        if rec.get("event") == "end" and "median_tokens_per_s" in rec:  # None: no timed step
            return json_number(rec["median_tokens_per_s"])
    rates = (json_number(r.get("tokens_per_s")) for r in history if r.get("event") == "train")
    return median_tokens_per_s([x for x in rates if x is not None])


def format_speed(tokens_per_s: float | None) -> str:
    """A tokens/s figure as the progress bar prints it ('1.11k'), wherever else it is shown."""
    return "-" if tokens_per_s is None else tqdm.format_sizeof(tokens_per_s)


def format_mfu(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


# ----------------------------------------------------------------------------- TensorBoard


class TensorBoardWriter:
    """Writes the scalars of each record (train.metrics.scalars) into `<run_dir>/tensorboard/`."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def log(self, record: dict[str, Any]) -> None:
        found = scalars(record)
        for tag, value in (found[1].items() if found else ()):
            self._writer.add_scalar(tag, value, global_step=found[0])

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_tensorboard(run_dir: Path, enabled: bool) -> TensorBoardWriter | None:
    """A writer for `run_dir/tensorboard`, or None when disabled or TensorBoard is missing."""
    if not enabled:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as exc:  # ImportError, or a broken install (protobuf mismatches raise others)
        print(
            f"tensorboard: skipped, the package is not usable ({type(exc).__name__}: {exc}); "
            "pip install -e '.[tensorboard]' (or pip install tensorboard) to enable it",
            file=sys.stderr,
        )
        return None
    return TensorBoardWriter(SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard")))


# ----------------------------------------------------------------------------- W&B

# W&B draws every scalar against this one, not its own call counter: a resume from an earlier
# checkpoint repeats steps, which W&B's counter would refuse as going backwards.
STEP = "step"


def import_wandb(mode: str) -> Any:
    """The wandb module, or a one-line error saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise UserError(
            f"train.wandb: {mode} needs the wandb package, which is not installed: "
            "pip install -e '.[wandb]' (or pip install wandb), or set train.wandb=off"
        ) from None
    return wandb


class WandbWriter:
    """Logs each record's scalars to one W&B run; the end record's also as its summary.
    `line`: what andrea says of it, W&B itself saying nothing."""

    def __init__(self, run: Any, mode: str) -> None:
        self.run = run
        run.define_metric("*", step_metric=STEP)
        if mode == "offline":
            folder = run.settings.sync_dir
            self.line = (f"W&B: offline run {run.id} in {folder}; upload it with: wandb sync "
                         f"{folder}")
        else:
            self.line = f"W&B: run {run.id}: {run.url}"

    def log(self, record: dict[str, Any]) -> None:
        found = scalars(record)
        if found is None:
            return
        step, values = found
        self.run.log({STEP: step, **values})
        if record.get("event") == "end":
            self.run.summary.update(values)

    def close(self) -> None:
        self.run.finish()


def open_wandb(cfg: Config, run_dir: Path) -> WandbWriter | None:
    """The W&B run of `run_dir` (a new one, or the one its `wandb_run_id` names), or None when
    train.wandb is off. Call before anything else is written: a missing package is an error."""
    t = cfg.train
    if t.wandb == "off":
        return None
    wandb = import_wandb(t.wandb)
    id_file = run_dir / WANDB_RUN_ID
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(id_file, run_id + "\n")
    # console off: the bar and andrea's lines stay on the terminal, not copied into W&B; silent:
    # W&B's own banner, run summary and sync hints stay off it (andrea says one line instead).
    settings = wandb.Settings(console="off", silent=True)
    try:
        run = wandb.init(
            mode=t.wandb, dir=str(run_dir), project=t.wandb_project,
            entity=t.wandb_entity or None, name=t.wandb_name or run_dir.name, id=run_id,
            resume="allow", config=cfg.to_dict(), settings=settings,
        )
    except Exception as exc:  # no login, no network, a refused entity: wandb's own types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(
            f"train.wandb: {t.wandb}: W&B could not start the run ({first}); run `wandb login`, "
            "or set train.wandb=offline and `wandb sync` the run's wandb folder later"
        ) from None
    return WandbWriter(run, t.wandb)
