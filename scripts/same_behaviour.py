"""Does a change move behaviour? A fingerprint of fixed fp32 runs, to compare a commit with its
parent (a refactor must give the same one).

    python scripts/same_behaviour.py --out FP.json [--work DIR]   # the fingerprint of this tree
    python scripts/same_behaviour.py --compare A.json B.json      # exit 1 on any difference

The runs, each as `andrea train` in this process with train.precision=fp32, one thread, every
step logged: andrea-tiny for 16 steps (eval and checkpoint every 8), then resumed to 24, so a
resume is in it; and the 12M preset for 4 steps of 4,096 tokens on the embedded corpus (its BPE
prepared once in DIR, the runs anew each time). The fingerprint holds every step's loss, grad
norm and lr, every val loss, and the sha256 of every tensor of every checkpoint (model,
optimizer, RNG) and of its trainer_state.json. Timings, pids and paths are not in it. Prints
the CPU's name first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from andrea.config import load_config
from andrea.resources import cpu_name
from andrea.train.loop import train

STEP_KEYS = ("step", "loss", "grad_norm", "lr", "val_loss", "tokens")


def run(work: Path, name: str, preset: str, sets: list[str], resume: str | None = None) -> None:
    cfg = load_config(preset, [f"train.runs_dir={work / 'runs'}", f"train.name={name}",
                               "train.precision=fp32", "train.log_every=1", *sets])
    train(cfg, resume=resume, progress=False)


def fingerprint_run(run_dir: Path) -> dict:
    events = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") in ("train", "eval"):
            events.append({k: record[k] for k in (*STEP_KEYS, "event") if k in record})
    tensors = {}
    for ckpt in sorted(run_dir.glob("step-*")):
        for path in sorted(ckpt.rglob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                for key in sorted(f.keys()):
                    flat = f.get_tensor(key).reshape(-1).contiguous()
                    blob = flat.view(torch.uint8).numpy().tobytes()
                    where = f"{path.relative_to(run_dir)}:{key}"
                    tensors[where] = hashlib.sha256(blob).hexdigest()[:16]
        state = json.loads((ckpt / "trainer_state.json").read_text())
        tensors[f"{ckpt.name}/trainer_state.json"] = hashlib.sha256(
            json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
    return {"events": events, "tensors": tensors}


def fingerprint(work: Path) -> dict:
    torch.set_num_threads(1)
    shutil.rmtree(work / "runs", ignore_errors=True)
    tiny = ["train.max_steps=16", "train.eval_every=8", "train.checkpoint_every=8",
            f"data.dir={work / 'data-tiny'}"]
    run(work, "tiny", "andrea-tiny", tiny)
    run(work, "tiny", "andrea-tiny", [*tiny[1:], "train.max_steps=24"], resume="auto")
    m12 = ["train.max_steps=4", "train.global_batch_tokens=4096", "train.seq_warmup_steps=2",
           "train.eval_every=4", "train.eval_tokens=4096", "train.checkpoint_every=2",
           f"data.dir={work / 'data-12m'}"]
    run(work, "m12", "andrea-12m", m12)
    return {name: fingerprint_run(work / "runs" / name) for name in ("tiny", "m12")}


def compare(a: dict, b: dict) -> list[str]:
    diffs = []
    for name in sorted(set(a) | set(b)):
        ra, rb = a.get(name, {}), b.get(name, {})
        if ra.get("events") != rb.get("events"):
            pairs = zip(ra.get("events", []), rb.get("events", []), strict=False)
            first = next(((x, y) for x, y in pairs if x != y), None)
            diffs.append(f"{name}: step records differ; first: {first}")
        ta, tb = ra.get("tensors", {}), rb.get("tensors", {})
        for key in sorted(set(ta) | set(tb)):
            if ta.get(key) != tb.get(key):
                diffs.append(f"{name}: {key}: {ta.get(key)} != {tb.get(key)}")
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path)
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        diffs = compare(a, b)
        print("\n".join(diffs) if diffs else
              f"identical: {sum(len(r['events']) for r in a.values())} step and eval records, "
              f"{sum(len(r['tensors']) for r in a.values())} checkpoint tensors and states")
        sys.exit(1 if diffs else 0)
    print(f"CPU: {cpu_name()}", flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="same-behaviour-"))
    result = fingerprint(work)
    out = args.out or work / "fingerprint.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"fingerprint: {out}")


if __name__ == "__main__":
    main()
