"""andrea's `--task hellaswag` scorer against lm-evaluation-harness's, example for example.

Reads the samples file `lm_eval --log_samples` wrote for a task YAML over a HellaSwag-format
jsonl (docs/evaluation.md, "Scoring with lm-evaluation-harness"), scores the same file with
the andrea checkpoint that was exported, and prints both scorers' acc and acc_norm, the largest
difference between their log-likelihoods of one ending, and the harness's log-likelihoods
normalised as andrea normalises (by tokens), which gives andrea's acc_norm back.

    python scripts/compare_lm_eval.py --checkpoint RUN --task-file FILE.jsonl --samples S.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from andrea.tasks import read_task, run_task
from andrea.trained import find_checkpoint, open_trained


def harness_lls(samples: Path) -> dict[int, list[float]]:
    """doc_id -> each ending's log-likelihood, as the harness logged them."""
    out = {}
    for line in samples.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        out[int(rec["doc_id"])] = [float(r[0]) for r in rec["filtered_resps"]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--task-file", type=Path, required=True)
    parser.add_argument("--samples", type=Path, required=True)
    args = parser.parse_args()
    opened = open_trained(find_checkpoint(args.checkpoint))
    task = read_task("hellaswag", args.task_file)
    result, scored = run_task(task, lambda x: opened.model(x)[0].float(), opened.tokenizer,
                              block_size=opened.cfg.model.block_size, batch_size=16,
                              device=torch.device("cpu"))
    theirs = harness_lls(args.samples)
    rows = []
    for i, (ex, choices) in enumerate(zip(task.examples, scored, strict=True)):
        ours = np.array([-c.total for c in choices])
        tokens = np.array([len(c.nats) for c in choices])
        chars = np.array([len(e) for e in ex.continuations])
        lls = np.array(theirs[i])
        rows.append((ex.label, ours, lls, tokens, chars))
    diff = max(float(np.abs(o - h).max()) for _, o, h, _, _ in rows)

    def acc(pick: callable) -> float:
        return float(np.mean([int(np.argmax(pick(*r[1:]))) == r[0] for r in rows]))

    print(f"{len(rows)} examples; largest |log-likelihood difference| of one ending: {diff:.2e}")
    print(f"acc       andrea {result.acc:.4f}  harness {acc(lambda o, h, t, c: h):.4f}")
    print(f"acc_norm  andrea {result.acc_norm:.4f} (per token)  harness "
          f"{acc(lambda o, h, t, c: h / c):.4f} (per character)")
    print(f"the harness's log-likelihoods per token: {acc(lambda o, h, t, c: h / t):.4f}")


if __name__ == "__main__":
    main()
