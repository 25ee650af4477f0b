"""Optional Weights & Biases logging (`train.wandb: online | offline`), a sink beside
metrics.jsonl.

Rank 0 opens it once as the run starts; MetricsLog passes it every record, and it logs the
scalars TensorBoard gets (train.metrics.scalars) against the optimizer step, with the resolved
config as the W&B run's config. The W&B run's id is kept in the run folder (`wandb_run_id`), so
a resumed run continues the same W&B run. `offline` writes W&B's files under `<run>/wandb/`
without any network; `wandb sync <run>/wandb/offline-run-*` uploads them later.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from andrea.config import Config
from andrea.errors import UserError
from andrea.fileio import atomic_write_text
from andrea.train.metrics import scalars
from andrea.train.rundir import WANDB_RUN_ID

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
            "pip install 'andrea[wandb]' (or pip install wandb), or set train.wandb=off"
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
