"""metrics.jsonl: one JSON event per line, appended (and passed on to any other sinks: TensorBoard,
Weights & Biases); and the run's one tokens/s figure."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Protocol


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
           if (v := _number(record.get(k))) is not None and math.isfinite(v)}
    sources = record.get("val_sources") if event == "eval" else None
    for source, fields in (sources.items() if isinstance(sources, dict) else ()):
        loss = _number(fields.get("loss")) if isinstance(fields, dict) else None
        if loss is not None and math.isfinite(loss):
            out[f"val/source/{source}/loss"] = loss
    return (step, out) if out else None


class MetricsLog:
    """metrics.jsonl: one JSON object a line, appended and flushed as it happens (rank 0); each
    record also goes to every sink, so the loop writes a record once whatever is logging it."""

    def __init__(self, path: Path | None, sinks: list[Sink] | None = None) -> None:
        self.file = open(path, "a", encoding="utf-8") if path is not None else None
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


def tokens_per_s(tokens: float, seconds: float) -> float | None:
    """The one speed figure (see Throughput), rounded as every record and display gives it."""
    return round(tokens / seconds, 1) if seconds > 0 else None


class Throughput:
    """The run's tokens/s: the tokens this process's steps trained over the wall time of those
    steps, from the start of a step's first micro-batch to its logging. Evaluation, checkpoints,
    set-up and a rolled-back step's work are left out, so the figure says how fast the model
    trains, whatever the eval and checkpoint intervals. Counted per `andrea train` process (a
    resumed segment starts again at zero: it may run on other hardware)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    @property
    def tokens_per_s(self) -> float | None:
        # From the seconds as recorded, so the figure recomputes exactly from a record.
        return tokens_per_s(self.tokens, round(self.seconds, 4))

    def fields(self) -> dict[str, Any]:
        """What a train or end record carries to recompute the figure: tokens over seconds."""
        return {"train_tokens": self.tokens, "train_seconds": round(self.seconds, 4)}


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else None


def recorded_speed(records: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(tokens/s, MFU) of the run as its metrics.jsonl records give them, for `andrea runs` and
    `andrea plot`: those of the latest segment's end record; a segment still running (or one
    that failed) from its last train record's train_tokens / train_seconds (its MFU then None).
    (None, None) for runs written before these fields (their readers fall back to a median)."""
    last_start = max((i for i, r in enumerate(records) if r.get("event") == "start"), default=-1)
    for rec in reversed(records[last_start + 1:]):
        if rec.get("event") == "end" and _number(rec.get("tokens_per_s")) is not None:
            return _number(rec["tokens_per_s"]), _number(rec.get("mfu"))
        tokens, seconds = _number(rec.get("train_tokens")), _number(rec.get("train_seconds"))
        if rec.get("event") == "train" and tokens is not None and seconds is not None:
            return tokens_per_s(tokens, seconds), None
    return None, None


def median_tokens_per_s(rates: list[float]) -> float | None:
    """The median of steps' tokens/s (the end record's `median_tokens_per_s`, as before the run
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
        if rec.get("event") == "end" and _number(rec.get("median_tokens_per_s")) is not None:
            return _number(rec["median_tokens_per_s"])
    rates = (_number(r.get("tokens_per_s")) for r in history if r.get("event") == "train")
    return median_tokens_per_s([x for x in rates if x is not None])
