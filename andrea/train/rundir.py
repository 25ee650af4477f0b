"""A run directory's layout, and how a run is named on the command line.

    runs/NAME/config.yaml          the resolved config the run trains with
    runs/NAME/metrics.jsonl        one JSON event per line (start, step, eval, end, ...)
    runs/NAME/step-NNNNNN/         checkpoints (andrea/train/checkpoint.py writes them)
    runs/NAME/latest               the name of the newest complete checkpoint

No torch here: `andrea runs` and `andrea plot` read runs without loading it.
"""

from __future__ import annotations

from pathlib import Path

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"


def is_run(path: Path) -> bool:
    return (path / METRICS).exists() or (path / CONFIG).exists()


def run_path(name: str | Path, runs_dir: str | Path = "runs") -> Path:
    """A run given as a path, or as a bare name under runs_dir (when no run has that path:
    `andrea export --out NAME` then `andrea import NAME` leaves ./NAME, an export, beside
    runs/NAME, the run)."""
    path = Path(name)
    under = Path(runs_dir) / path
    if len(path.parts) == 1 and not is_run(path) and under.is_dir():
        if not path.exists() or is_run(under):
            return under
    return path
