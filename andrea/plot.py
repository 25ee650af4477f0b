"""`andrea plot`: training curves of one or more runs in one figure of four panels.

Panels: loss against tokens seen (train as lines, validation as markers), learning rate,
throughput and gradient norm against step. Each run keeps one colour across the panels.
matplotlib is an optional extra, imported only here and only when a plot is asked for.
"""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from andrea.data.inputs import source_last_part
from andrea.errors import UserError
from andrea.fileio import atomic_write_bytes, file_in_the_way
from andrea.runs import (
    current_history,
    read_metrics,
    read_run,
    starts_new_val_set,
    val_sources,
)
from andrea.train.metrics import format_mfu, format_speed, recorded_speed
from andrea.train.rundir import CONFIG, METRICS, is_run, run_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
X_AXES = ("tokens", "step")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def resolve_run(name: str | Path, runs_dir: Path = Path("runs")) -> Path:
    """A run directory given as a path, or as a bare name under ./runs."""
    path = run_path(name, runs_dir)
    if (path / METRICS).is_file() or (path / CONFIG).is_file():
        return path
    if path.is_dir():
        held = sorted(child.name for child in path.iterdir() if child.is_dir() and is_run(child))
        if held:  # `andrea plot runs`: the folder `andrea runs` takes, not a run
            raise UserError(f"{path}: a folder of runs, not one run; name the runs to plot, "
                            f"e.g. {path / held[0]}")
        raise UserError(f"{path}: not a run (no {METRICS} or {CONFIG} in it); give a run's "
                        f"folder, e.g. {runs_dir}/<name>, or a name in {runs_dir}/")
    raise UserError(f"{name}: no such run (give a run folder, e.g. runs/<name>, or a name in "
                    f"{runs_dir}/)")


def _series(records: list[dict[str, Any]], event: str, x_key: str, y_key: str):
    """(xs, ys) of one quantity, finite points only (a NaN loss would break a log axis)."""
    xs, ys = [], []
    for r in records:
        if r["event"] != event:
            continue
        x, y = r.get(x_key), r.get(y_key)
        ok = all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                 for v in (x, y))
        if ok:
            xs.append(x)
            ys.append(y)
    return xs, ys


def _source_series(records: list[dict[str, Any]], x_key: str) -> dict[str, tuple[list, list]]:
    """{source: (xs, ys)} of a mixture run's per-source val losses, finite points only."""
    out: dict[str, tuple[list, list]] = {}
    for r in records:
        x = r.get(x_key)
        if r["event"] != "eval" or not isinstance(x, int | float) or isinstance(x, bool):
            continue
        for name, loss in val_sources(r).items():
            if math.isfinite(loss):
                xs, ys = out.setdefault(name, ([], []))
                xs.append(x)
                ys.append(loss)
    return out


def _val_set_parts(history: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The history cut at each resume onto a new val set (runs.starts_new_val_set): the val
    losses of one part are comparable with each other, not with another part's."""
    parts: list[list[dict[str, Any]]] = [[]]
    for rec in history:
        if starts_new_val_set(rec) and parts[-1]:
            parts.append([])
        parts[-1].append(rec)
    return parts


# Markers of a mixture's sources (the weighted total keeps the round one).
SOURCE_MARKERS = ("s", "^", "v", "D", "P", "X", "*", "<", ">")


def _log_helps(values: list[float], spread: float) -> bool:
    """Log scale when everything is positive and the values span more than `spread` times."""
    positive = [v for v in values if v > 0]
    return bool(positive) and len(positive) == len(values) and max(positive) > spread * min(
        positive)


def _import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError(
            "plotting needs matplotlib, which is not installed: pip install -e '.[plot]' "
            "(or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    return plt


def _output_format(out: Path) -> str:
    fmt = FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise UserError(f"{out}: unknown image type '{out.suffix or '(none)'}'; "
                        f"end the file name with one of {', '.join(FORMATS)}")
    return fmt


def plot_runs(
    run_dirs: Sequence[Path | str],
    out: Path | str,
    x: str = "tokens",
    warn: Callable[[str], None] = _warn,
) -> Path:
    """Draw the runs' curves into `out` (.png, .svg or .pdf); returns the path written.

    `x` is the loss panel's x axis: "tokens" seen (compares runs of different batch sizes) or
    "step". Unreadable metrics lines and runs with nothing to draw are reported through `warn`
    and left out; if no run has anything to draw, UserError. The output folder is created if
    missing and the file appears whole or not at all (temp name, then rename).
    """
    out = Path(out)
    if out.is_dir():
        raise UserError(f"{out}: is a folder; give a file name such as {out / 'loss.png'}")
    fmt = _output_format(out)
    fig = draw_figure(run_dirs, x, warn)
    plt = _import_pyplot()
    image = io.BytesIO()
    try:
        fig.savefig(image, format=fmt, dpi=100)
    finally:
        plt.close(fig)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out, image.getvalue())
    except OSError as exc:
        why = file_in_the_way(out.parent) or exc.strerror or exc
        raise UserError(f"{out}: cannot write there: {why}") from None
    return out


def draw_figure(
    run_dirs: Sequence[Path | str],
    x: str = "tokens",
    warn: Callable[[str], None] = _warn,
) -> Figure:
    """The runs' four-panel figure, not yet saved (plot_runs saves it; tests measure it).

    The caller closes it (pyplot keeps every open figure). Errors as in plot_runs.
    """
    if x not in X_AXES:
        raise UserError(f"--x {x}: must be one of {', '.join(X_AXES)}")
    if not run_dirs:
        raise UserError("no runs given: andrea plot RUN [RUN ...] --out FILE.png")
    runs = _runs_to_draw(run_dirs, warn)
    plt = _import_pyplot()
    # Constrained layout makes room for the suptitle and for every panel's (multi-line)
    # title, labels and offset text ("1e-3"), as long as no title is wider than its panel.
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    losses, grads = [], []
    for i, (label, history) in enumerate(runs):
        run_losses, run_grads = _draw_run(axes.flat, label, history, x, colors[i % len(colors)])
        losses += run_losses
        grads += run_grads
    _label_axes(axes, x, losses, grads)
    fig.suptitle(f"andrea training curves: {len(runs)} run(s)", fontsize="large")
    return fig


def _runs_to_draw(
    run_dirs: Sequence[Path | str], warn: Callable[[str], None]
) -> list[tuple[str, list[dict[str, Any]]]]:
    """(legend label, current history) of each run with something to draw; why the others
    are left out is warned when some run is drawn, else it is the one-line error."""
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    notes: list[str] = []
    for name in run_dirs:
        path = resolve_run(name)
        history = _history_to_draw(path, notes)
        if history is not None:
            # The state in the legend says why a curve stops early.
            runs.append((f"{_legend_name(path.resolve().name)} ({read_run(path).state})",
                         history))
    if not runs:
        raise UserError("nothing to plot: " + "; ".join(notes))
    for note in notes:
        warn(note)
    return runs


# Characters of a run's or a mixture source's name in a legend: a longer one is cut in its
# middle, keeping its start and end (where names differ: a prefix, a date or seed, a folder), so
# the legend stays inside its panel.
LEGEND_NAME = 30


def _legend_name(name: str) -> str:
    if len(name) <= LEGEND_NAME:
        return name
    keep = LEGEND_NAME - 1
    return f"{name[:keep - keep // 2]}\u2026{name[len(name) - keep // 2:]}"


def _source_names(sources: list[str]) -> dict[str, str]:
    """{source: its legend name}: a source is named by its path as configured; its last folder
    names it (as `andrea eval --source` accepts) where that tells the run's sources apart, and
    a number before each where the names cut to fit still do not."""
    last = {s: source_last_part(s) or s for s in sources}
    short = len(set(last.values())) == len(sources)
    names = {s: _legend_name(last[s] if short else s) for s in sources}
    if len(set(names.values())) < len(sources):  # still alike once cut: numbered, in order
        names = {s: f"{j + 1}. {name}" for j, (s, name) in enumerate(names.items())}
    return names


def _history_to_draw(path: Path, notes: list[str]) -> list[dict[str, Any]] | None:
    """A run's current history, or None (why noted) when it has nothing to draw."""
    if not (path / METRICS).is_file():
        imported = read_run(path).state == "imported"
        why = "an imported run, not trained yet" if imported else "not trained yet"
        notes.append(f"{path}: no {METRICS} ({why}); run left out")
        return None
    try:
        records, n_bad = read_metrics(path / METRICS)
    except OSError as exc:
        notes.append(f"{path / METRICS}: cannot read ({exc.strerror or exc}); run left out")
        return None
    if n_bad:
        notes.append(f"{path / METRICS}: skipped {n_bad} unreadable line(s); plotting the rest")
    history = current_history(records)
    if not any(r["event"] in ("train", "eval") for r in history):
        notes.append(f"{path / METRICS}: no train or eval records; run left out")
        return None
    return history


def _draw_run(
    axes: Any, label: str, history: list[dict[str, Any]], x: str, color: str
) -> tuple[list[float], list[float]]:
    """One run's curves in its colour on the four panels; the losses and gradient norms
    drawn (for the log-scale choice)."""
    ax_loss, ax_lr, ax_speed, ax_grad = axes
    tx, ty = _series(history, "train", x, "loss")
    ax_loss.plot(tx, ty, color=color, lw=1.4, label=label, **_lone(tx))
    # A line of its own for each val set: joined across a resume onto a new one, the val
    # losses read as one curve, though the set they are measured on changed under them.
    parts = _val_set_parts(history)
    losses = list(ty)
    for part in parts:
        vx, vy = _series(part, "eval", x, "val_loss")
        if vx:
            ax_loss.plot(vx, vy, color=color, lw=1.0, ls="--", marker="o", ms=4)
            losses += vy
    # The spike guard: each held-back step a cross at its loss, each rollback a dotted line.
    sx, sy = _series(history, "spike", x, "loss")
    ax_loss.plot(sx, sy, color=color, ls="none", marker="x", ms=8, mew=2)
    for rx in _series(history, "rollback", x, x)[0]:
        ax_loss.axvline(rx, color=color, ls=":", lw=1.2)
    sources = list(_source_series(history, x))  # each source's marker, over the whole run
    names = _source_names(sources)
    labelled: set[str] = set()
    for part in parts:
        for source, (sx, sy) in _source_series(part, x).items():
            j = sources.index(source)
            ax_loss.plot(sx, sy, color=color, lw=0.8, ls=":", ms=4,
                         marker=SOURCE_MARKERS[j % len(SOURCE_MARKERS)],
                         label=None if source in labelled else f"{label}: val {names[source]}")
            labelled.add(source)
            losses += sy
    lx, ly = _series(history, "train", "step", "lr")
    ax_lr.plot(lx, ly, color=color, lw=1.4, **_lone(lx))
    px, py = _series(history, "train", "step", "tokens_per_s")
    ax_speed.plot(px, py, color=color, lw=1.4, **_lone(px))
    speed, mfu = recorded_speed(history)  # the run's figure, as the bar and `andrea runs` say
    if speed is not None:
        ax_speed.axhline(speed, color=color, ls="--", lw=1.0,
                         label=f"{label}: {format_speed(speed)} tok/s, MFU {format_mfu(mfu)}")
    gx, gy = _series(history, "train", "step", "grad_norm")
    ax_grad.plot(gx, gy, color=color, lw=1.0, **_lone(gx))
    return losses, gy


def _lone(xs: list[float]) -> dict[str, Any]:
    """A dot for a line of one point (a run of one logged step), which a line alone never
    draws."""
    return {"marker": "o", "ms": 4} if len(xs) == 1 else {}


# What each line style means, under the panel's name. On one line the loss key was wider than
# its panel: constrained layout cannot make room for that, so it ran off the figure's left
# edge and over the learning-rate panel's title and its "1e-3" offset text.
LOSS_KEY = ("solid: train", "dashed + dots: validation (a gap: a new val set)",
            "dotted + markers: a mixture's sources", "x: spike not applied",
            "dotted line: rollback")
SPEED_KEY = ("solid: each logged step", "dashed: the run's tokens/s")
# Characters a title line may hold: a panel is about 5 inches wide at the least (long run
# names widen the legends and narrow the panels), room for some 70 characters of title.
TITLE_WIDTH = 55


def _keyed_title(name: str, key: Sequence[str]) -> str:
    """A panel's name over its key, lines broken between the key's items (never inside one,
    so each reads whole) to fit the panel's width."""
    lines = [name, key[0]]
    for item in key[1:]:
        if len(lines[-1]) + len("; ") + len(item) <= TITLE_WIDTH:
            lines[-1] += "; " + item
        else:
            lines.append(item)
    return "\n".join(lines)


def _label_axes(axes: Any, x: str, losses: list[float], grads: list[float]) -> None:
    """Scales, tick formats, titles, grids and the legend of the four panels."""
    from matplotlib.ticker import EngFormatter, FormatStrFormatter, LogLocator, NullLocator

    ax_loss, ax_lr, ax_speed, ax_grad = axes.flat
    if _log_helps(losses, 2.0):
        ax_loss.set_yscale("log")
        # Losses span less than a decade or two: label 1, 1.5, 2, 3, 4, 6 of each decade as
        # plain numbers ("1.5", not "1.5×10⁰"), without the unlabelled minor ticks in between.
        ax_loss.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 4.0, 6.0)))
        ax_loss.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax_loss.yaxis.set_minor_locator(NullLocator())
    if _log_helps(grads, 10.0):
        ax_grad.set_yscale("log")
        ax_grad.yaxis.set_major_formatter(FormatStrFormatter("%g"))  # "0.1", not 10⁻¹
    x_label = "tokens seen" if x == "tokens" else "optimizer step"
    ax_loss.set(title=_keyed_title("Loss", LOSS_KEY), xlabel=x_label,
                ylabel="cross-entropy (nats / token)")
    ax_lr.set(title="Learning rate", xlabel="optimizer step", ylabel="learning rate")
    ax_speed.set(title=_keyed_title("Throughput", SPEED_KEY),
                 xlabel="optimizer step", ylabel="tokens / s")
    if ax_speed.get_legend_handles_labels()[0]:
        ax_speed.legend(fontsize="small")
    ax_grad.set(title="Gradient norm", xlabel="optimizer step", ylabel="global L2 norm")
    if x == "tokens":
        ax_loss.xaxis.set_major_formatter(EngFormatter())
    ax_speed.yaxis.set_major_formatter(EngFormatter())
    ax_speed.set_ylim(bottom=0)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for ax in axes.flat:
        ax.grid(True, which="major", alpha=0.3)
    ax_loss.legend(title="run", fontsize="small")
