"""Time to quality: ANDREA-12M on the embedded corpus, AdamW and Muon (or any recipes) at one
token budget.

    python scripts/bench_quality.py [--tokens 7864320] [--preset andrea-12m] [--runs-dir runs]
                                    [--eval-tokens 32768] [--set train.muon_lr=0.02 ...]
                                    [--optimizers adamw muon]
                                    [--variant LABEL:KEY=VALUE,KEY=VALUE ...] [--reuse]

Both runs are `andrea.train.loop.train` with the preset's settings, the same seed and therefore the
same initial weights and the same data order (batches are a function of seed and step; with
data.order epochs, of seed and the tokens before the step); they differ only in
train.optimizer. The budget is rounded up to a whole number of optimizer steps
divisible by 10; warm-up is the preset's, capped at a tenth of the steps so a short budget still
reaches the peak learning rate. Each run checkpoints at every tenth of the budget, and every
checkpoint is evaluated (andrea.evaluate.evaluate_checkpoint) on the same --eval-tokens tokens
of the validation split (windows spread over the whole split, the trainer's val set for
train.eval_tokens of that size), which gives validation loss and bits per byte on identical text.

Printed: the CPU, the settings, a table of val loss and bits/byte at each tenth, and the tokens
each optimizer needs to reach AdamW's final val loss (linear between tenths; "not reached" when it
does not within the budget), with Muon's share of AdamW's. The runs stay under --runs-dir as
quality-adamw-<tokens> and quality-muon-<tokens> (with the --set overrides appended, so a
learning-rate sweep keeps one run per setting): `andrea plot` them for the curves.
--optimizers runs one of them only (a sweep of one optimizer's learning rate); the comparison is
printed when both ran.

--variant compares recipes instead (the preset's own optimizer unless a variant sets one): each
is a label and its overrides, e.g. `--variant preset: --variant wsd:train.schedule=wsd,
train.min_lr=0`; the pseudo-key `tokens=N` gives one variant its own budget. Runs are named
quality-<label>-<tokens>. For every run (both modes) the wall time of training to each tenth is
read from its metrics.jsonl (checkpoint events against the start event; set-up, compilation and
checkpoint writing count, the evaluation here does not), the final checkpoint is also evaluated
on the whole val split, and the summary gives the wall time each run needs to reach the first
run's final val loss (linear between tenths) as a share of the first run's wall time.

--reuse: a run whose folder already holds a finished run of the same settings (compared with
its config.yaml) is evaluated again instead of retrained, e.g. to add a variant to a comparison
already run; its wall times are those it was trained in, so compare only runs of one quiet
machine.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from andrea.config import Config, load_config
from andrea.errors import UserError
from andrea.evaluate import evaluate_checkpoint
from andrea.resources import cpu_name
from andrea.runs import read_metrics
from andrea.train import checkpoint as ckpt_io
from andrea.train.batch import batch_warmup_active
from andrea.train.device import cpu_has_bf16
from andrea.train.loop import train
from andrea.train.resume import config_changes
from andrea.train.rundir import step_dirs, step_of_dir

OPTIMIZERS = ("adamw", "muon")


def plan(preset: str, tokens: int, extra: list[str]) -> tuple[int, int, int]:
    """(steps, tokens per step, warm-up steps) for a budget of about `tokens`; the steps of a
    batch-size warm-up (train.batch_warmup_steps) count at their own, smaller, size."""
    cfg = load_config(preset, extra)
    t = cfg.train
    per_step = t.global_batch_tokens or 8 * cfg.model.block_size
    warm = 0
    if batch_warmup_active(cfg):
        warm = min(t.batch_warmup_steps, -(-tokens // t.batch_warmup_tokens))
    steps = warm + -(-max(0, tokens - warm * t.batch_warmup_tokens) // per_step)
    steps = -(-steps // 10) * 10
    return steps, per_step, min(t.warmup_steps, max(1, steps // 10))


class Run:
    """One training run of the comparison: a label, its overrides and its token budget."""

    def __init__(self, label: str, overrides: list[str], tokens: int, name: str) -> None:
        self.label, self.overrides, self.tokens, self.name = label, overrides, tokens, name
        # [(tokens, val loss, bits/byte, training seconds)] at each tenth; the whole split's
        # (val loss, bits/byte) of the final checkpoint.
        self.points: list[tuple[int, float, float | None, float]] = []
        self.whole: tuple[float, float | None] = (float("nan"), None)


def run_one(run: Run, args: argparse.Namespace) -> float:
    """Train, then evaluate each tenth's checkpoint into run.points; seconds in all."""
    steps, _, warmup = plan(args.preset, run.tokens, run.overrides)
    tenth = steps // 10
    cfg = load_config(args.preset, [
        f"train.max_steps={steps}", f"train.warmup_steps={warmup}",
        f"train.checkpoint_every={tenth}", "train.keep_last=10",
        # The trainer's own evaluation is off: every tenth's checkpoint is evaluated below.
        "train.eval_every=0", f"train.runs_dir={args.runs_dir}", f"train.name={run.name}",
        *run.overrides,
    ])
    t0 = time.perf_counter()
    run_dir = Path(args.runs_dir) / run.name
    if args.reuse and (run_dir / "config.yaml").exists():
        reused_run(run_dir, cfg, steps)
    else:
        result = train(cfg, progress=False)
        if result.state != "finished":
            raise UserError(f"{result.run_dir}: the {run.label} run ended {result.state}")
    seconds = checkpoint_seconds(run_dir / "metrics.jsonl")
    checkpoints = step_dirs(run_dir)
    for ckpt in checkpoints:
        step = step_of_dir(ckpt)
        tokens = ckpt_io.read_trainer_state(ckpt)[0].tokens  # a batch warm-up's are fewer
        ev = evaluate_checkpoint(str(ckpt), max_tokens=args.eval_tokens, progress=False)
        run.points.append((tokens, ev.loss, ev.bits_per_byte, seconds[step]))
    if len(run.points) != 10:
        raise UserError(f"{result.run_dir}: expected 10 checkpoints, found {len(run.points)}")
    whole = evaluate_checkpoint(str(checkpoints[-1]), max_tokens=None, progress=False)
    run.whole = (whole.loss, whole.bits_per_byte)
    return time.perf_counter() - t0


def reused_run(run_dir: Path, cfg: Config, steps: int) -> None:
    """--reuse: check that run_dir is a finished run of exactly these settings."""
    changed = config_changes(load_config(run_dir / "config.yaml"), cfg)
    if changed:
        raise UserError(f"{run_dir}: --reuse: the run there was trained with other settings "
                        f"({', '.join(changed)}); give this variant another label or drop --reuse")
    checkpoints = step_dirs(run_dir)
    if not checkpoints or step_of_dir(checkpoints[-1]) != steps:
        raise UserError(f"{run_dir}: --reuse: not a finished run of {steps} steps; remove the "
                        "folder or drop --reuse")


def checkpoint_seconds(metrics: Path) -> dict[int, float]:
    """{step: seconds from the run's start event to that step's checkpoint event}."""
    start, at = None, {}
    for event in read_metrics(metrics)[0]:
        if event["event"] == "start" and start is None:
            start = event["time"]
        elif event["event"] == "checkpoint" and start is not None:
            at[event["step"]] = event["time"] - start
    return at


def run_name(label: str, tokens: int, overrides: list[str]) -> str:
    """quality-<label>-<tokens>[-<key>-<value>...]: one run folder per setting."""
    tags = [re.sub(r"[^A-Za-z0-9._-]+", "_", o.split(".", 1)[-1].replace("=", "-"))
            for o in overrides]
    return "-".join([f"quality-{label}-{tokens}", *tags])


def parse_variant(text: str, tokens: int, common: list[str]) -> Run:
    """LABEL:KEY=VALUE,KEY=VALUE (tokens=N: this run's budget) as a Run after the --set ones."""
    label, _, spec = text.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", label):
        raise UserError(f"--variant {text!r}: the label before ':' must be letters, digits, "
                        "'.', '_' or '-', e.g. --variant wsd:train.schedule=wsd")
    overrides = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--variant {text!r}: {item!r} is not KEY=VALUE")
        if key == "tokens":
            if not value.isdigit() or int(value) <= 0:
                raise UserError(f"--variant {text!r}: tokens={value!r} is not a positive integer")
            tokens = int(value)
        else:
            overrides.append(item)
    return Run(label, [*common, *overrides], tokens, run_name(label, tokens, common))


def tokens_to_reach(points: list[tuple[float, float, float | None]], target: float
                    ) -> float | None:
    """The first token count (or any other first coordinate, e.g. seconds) at which the val loss
    reaches target, linear between tenths."""
    prev_tokens, prev_loss = 0, None
    for tokens, loss, _ in points:
        if loss <= target:
            if prev_loss is None or prev_loss == loss:
                return float(tokens)
            return prev_tokens + (tokens - prev_tokens) * (prev_loss - target) / (prev_loss - loss)
        prev_tokens, prev_loss = tokens, loss
    return None


def seconds_to_reach(points: list[tuple[int, float, float | None, float]], target: float
                     ) -> float | None:
    """The training seconds at which the val loss first reaches target, linear between tenths."""
    return tokens_to_reach([(sec, loss, bpb) for _, loss, bpb, sec in points], target)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="andrea-12m")
    ap.add_argument("--tokens", type=int, default=7_864_320,
                    help="token budget per run (default: the former andrea-12m preset's, "
                         "7.9M tokens: about 27 minutes a run on 2 CPU cores)")
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--eval-tokens", type=int, default=32_768)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override for every run (e.g. train.muon_lr=0.03)")
    ap.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=None,
                    help="which optimizers to run (default: both, or none with --variant)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE,...",
                    help="a recipe to compare, in order (the first is the reference)")
    ap.add_argument("--reuse", action="store_true",
                    help="a finished run of the same name and settings is evaluated again, "
                         "not retrained (its wall times are its own)")
    args = ap.parse_args()
    optimizers = args.optimizers or ([] if args.variant else list(OPTIMIZERS))
    try:
        runs = [Run(opt, [f"train.optimizer={opt}", *args.set], args.tokens,
                    run_name(opt, args.tokens, args.set)) for opt in optimizers]
        runs += [parse_variant(v, args.tokens, args.set) for v in args.variant]
        if not runs:
            raise UserError("nothing to run: give --optimizers or --variant")
        steps, per_step, warmup = plan(args.preset, args.tokens, args.set)
        print(f"cpu: {cpu_name()}; bf16 units: {cpu_has_bf16()}")
        print(f"{args.preset}: {steps} steps x {per_step:,} tokens = {steps * per_step:,} tokens "
              f"per optimizer, warm-up {warmup} steps; val on {args.eval_tokens:,} tokens "
              f"spread over the val split; overrides: {' '.join(args.set) or '-'}", flush=True)
        for run in runs:
            if run.label not in OPTIMIZERS:
                steps, per_step, _ = plan(args.preset, run.tokens, run.overrides)
                cfg = load_config(args.preset, run.overrides)
                t = cfg.train
                warm = (f" (the first {t.batch_warmup_steps} x {t.batch_warmup_tokens:,})"
                        if batch_warmup_active(cfg) else "")
                print(f"{run.label}: {' '.join(run.overrides) or 'the preset'}; {steps} steps x "
                      f"{per_step:,} tokens{warm}", flush=True)
            seconds = run_one(run, args)
            print(f"{run.label}: trained and evaluated in {seconds:.0f} s "
                  f"(run: {Path(args.runs_dir) / run.name})", flush=True)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_tables(runs)
    print_summary(runs)
    return 0


def print_tables(runs: list[Run]) -> None:
    """One table with a column pair per run where the runs share their tenths, else one each."""
    same = all([p[0] for p in r.points] == [p[0] for p in runs[0].points] for r in runs)
    groups = [runs] if same else [[r] for r in runs]
    for group in groups:
        print(f"\n{'tokens':>11}" + "".join(
            f"  {r.label + ' loss':>10}  {r.label + ' bpb':>9}  {r.label + ' s':>8}"
            if r.label not in OPTIMIZERS else f"  {r.label + ' loss':>10}  {r.label + ' bpb':>9}"
            for r in group))
        for row in zip(*(r.points for r in group), strict=True):
            print(f"{row[0][0]:>11,}" + "".join(
                f"  {loss:>10.4f}  {bpb or float('nan'):>9.4f}"
                + (f"  {sec:>8.1f}" if r.label not in OPTIMIZERS else "")
                for r, (_, loss, bpb, sec) in zip(group, row, strict=True)))


def print_summary(runs: list[Run]) -> None:
    for r in runs:
        best = min(r.points, key=lambda point: point[1])
        print(f"{r.label}: best val loss {best[1]:.4f} ({best[2] or float('nan'):.4f} bits/byte) "
              f"at {best[0]:,} tokens; final on the whole val split {r.whole[0]:.4f} "
              f"({r.whole[1] or float('nan'):.4f} bits/byte) after {r.points[-1][3]:.0f} s")
    if [r.label for r in runs] == list(OPTIMIZERS):
        target = runs[0].points[-1][1]
        print(f"\ntokens to reach AdamW's final val loss {target:.4f}:")
        needed = {r.label: tokens_to_reach([p[:3] for p in r.points], target) for r in runs}
        for opt, tokens in needed.items():
            print(f"  {opt:6s} {f'{tokens:,.0f}' if tokens is not None else 'not reached'}")
        if needed["muon"] is not None and needed["adamw"]:
            print(f"  muon / adamw: {needed['muon'] / needed['adamw']:.2f} (goal: <= 0.75)")
    if len(runs) < 2:
        return
    first = runs[0]
    target, total = first.points[-1][1], first.points[-1][3]
    print(f"\nwall time of training to reach {first.label}'s final val loss {target:.4f}, "
          f"as a share of {first.label}'s {total:.0f} s:")
    for r in runs:
        sec = seconds_to_reach(r.points, target)
        print(f"  {r.label:12s} " + (f"{sec:,.0f} s ({sec / total:.2f})" if sec is not None
                                      else "not reached"))


if __name__ == "__main__":
    sys.exit(main())
