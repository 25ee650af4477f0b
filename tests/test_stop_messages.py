"""What `andrea train` says and does when it is stopped or cannot go on: a signal during set-up,
a stop during the last micro-batch of a step, a resume of a run without a checkpoint, a run of
days (its note also with an injected pace), a mixture source repeated many times. Real
processes, as a user runs them."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import torch
from conftest import (
    andrea_main,
    assert_user_error,
    config_file,
    python_command,
    tiny_config,
    wait_until,
)

from andrea.data.folder import PROGRESS
from andrea.resources import cpu_name
from andrea.train.progress import CPU_PRESET_PARAMS, RunBar, format_eta, plan_note_for


def words_file(path: Path, n_bytes: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    text, size = [], 0
    while size < n_bytes:
        line = " ".join(rng.choices(vocab, k=12)) + "\n"
        text.append(line)
        size += len(line)
    path.write_text("".join(text))
    return path


def test_sigterm_during_data_preparation_stops_it_within_seconds(tmp_path):
    # Training a BPE on 6 MB and encoding it takes ~10 s here: long enough to land inside.
    source = words_file(tmp_path / "big.txt", 6_000_000)
    data = tmp_path / "prepared"
    cfg = config_file(tiny_config(tmp_path / "runs", data, f"data.source={source}",
                                  "data.tokenizer=bpe", "train.max_steps=3", name="r"), tmp_path)
    proc = subprocess.Popen(
        python_command("-m", "andrea", "train", "-c", str(cfg), "--no-progress"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout.readline().startswith(f"preparing {data}")  # set-up is under way
    # Its progress record: the work on the folder has begun (the BPE's training comes next).
    wait_until(lambda: (data / PROGRESS).exists(), what=f"{data / PROGRESS}", proc=proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    stopped_in = time.monotonic() - sent
    assert proc.returncode == 143, err
    # The old code prepared all the data first (no manifest now: the preparation was cut),
    # then said "error: stopped by SIGTERM before its first step".
    assert not (data / "manifest.json").exists()
    assert "stopped by SIGTERM during set-up, before the first step; no checkpoint was " \
           "written" in err
    assert "error:" not in err and "Traceback" not in err
    assert stopped_in < 30, stopped_in  # a bound for a loaded machine, not a speed measurement
    assert not (tmp_path / "runs" / "r" / "latest").exists()


def test_a_stop_in_the_last_micro_batch_names_one_step(tmp_path, data_dir):
    # Ctrl-C in the second (last) micro-batch of step 4: step 4 completes and is checkpointed.
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=50",
                                  "train.global_batch_tokens=1024", name="r"), tmp_path)
    proc = andrea_main("train", "-c", str(cfg), "--no-progress",
                       env={"ANDREA_FAULTS": "sigint@3.1"})
    assert proc.returncode == 130, proc.stderr
    said = proc.stdout + proc.stderr
    assert "stopped by SIGINT after step 4; checkpoint" in said and "step-000004" in said
    # Old code: "checkpointing step 3" first, then "stopped after step 4"; and "error: ...".
    assert set(re.findall(r"step[- ]0*(\d+)", said)) == {"4"}, said
    assert "error:" not in said


def test_resume_of_a_run_without_a_checkpoint_says_what_happened(tmp_path, data_dir):
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=5",
                                  "train.global_batch_tokens=2048", name="r"), tmp_path)
    stopped = andrea_main("train", "-c", str(cfg), "--no-progress",
                          env={"ANDREA_FAULTS": "sigint@0.0"})  # before the first step
    assert stopped.returncode == 130, stopped.stderr
    run_dir = tmp_path / "runs" / "r"
    line = assert_user_error(andrea_main("train", "--resume", str(run_dir)),
                             "stopped before its first checkpoint", "nothing to continue")
    # ... and the way out it names works.
    again = line.split("start it over with: ")[1]
    assert again == f"andrea train --config {run_dir / 'config.yaml'}"
    started = andrea_main(*again.split()[1:], "--no-progress")
    assert started.returncode == 0, started.stderr
    assert (run_dir / "latest").read_text().strip() == "step-000005"


def test_an_eta_of_days_is_said_in_days_and_a_plan_of_days_once_with_what_to_run(
        tmp_path, data_dir, monkeypatch):
    assert format_eta(3 * 3600 + 62) == "3:01:02"
    assert format_eta(13317 * 3600 + 40 * 60 + 36) == "555 days"
    bar = RunBar(total=10**12, unit="tok", unit_scale=True, disable=True)
    shown = bar.format_meter(n=5000, total=10**12, elapsed=1.0, unit="tok", unit_scale=True)
    assert "2,315 days" in shown and not re.search(r"\d{3,}:\d\d:\d\d", shown)
    # The pace of the micro-batches after the first: 4,096 tokens in 2 s each, 2,048 tokens/s.
    clock = iter([100.0, 102.0, 104.0, 106.0, 108.0])
    cpu, n_120m = torch.device("cpu"), 124_000_000
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    note = plan_note_for(2_048 * 86_400 * 1_246 + 3 * 4_096, cpu, 1, n_120m)
    note.clock = lambda: next(clock)
    said = [note.after_micro_batch(4_096) for _ in range(5)]
    assert said[:2] == [None, None] and said[3:] == [None, None], said  # said once, at the 3rd
    assert said[2] == (
        f"note: this plan needs about 1,246 days on this machine ({cpu_name()}, "
        f"2 threads, 2,048 tokens/s); on a CPU train andrea-12m, as the "
        f"README does: andrea train --config andrea-12m.yaml; or lower train.max_steps for a "
        f"trial of this plan")
    clock = iter([0.0, 1.0, 2.0])  # a day's plan at 4,096 tokens/s: nothing to say
    note = plan_note_for(4_096 * 86_400, cpu, 1, n_120m)
    note.clock = lambda: next(clock)
    assert [note.after_micro_batch(4_096) for _ in range(3)] == [None, None, None]
    # Without the bar (--no-progress) nothing else is printed until the first val loss: an
    # hour's plan is said, as its hour; ten seconds' is not, nor an hour's beside a bar.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # "1 thread", not "1 threads"
    for quiet, left, expected in [(True, 3_600, "1:00:00"), (True, 10, None),
                                  (False, 3_600, None)]:
        note = plan_note_for(2_048 * left + 3 * 4_096, cpu, 1, n_120m, quiet=quiet)
        note.clock = iter([0.0, 2.0, 4.0]).__next__
        said = [note.after_micro_batch(4_096) for _ in range(3)]
        assert said[:2] == [None, None]
        assert said[2] == (expected and (
            f"note: the rest of this plan needs about {expected} on this machine ({cpu_name()}, "
            "1 thread, 2,048 tokens/s); without the bar "
            "(--no-progress), the next line on progress is the first val loss or the end"))
    monkeypatch.undo()  # the runs below count their own threads
    # A real run of a billion steps of the tiny model on this CPU: months, said before step 1
    # ends (the tiny model: no other preset to suggest).
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=1000000000",
                                  name="r"), tmp_path)
    proc = andrea_main("train", "-c", str(cfg), "--stop-after", "2", "--set",
                       "train.global_batch_tokens=2048", "--set", "train.micro_batch_size=8")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "note: this plan" in line]
    assert len(lines) == 1 and re.search(
        r"note: this plan needs about [\d,]+ days on this machine \(.+, [\d,]+ tokens/s\); "
        r"lower train.max_steps or train.global_batch_tokens, or train on a GPU$",
        lines[0]), proc.stderr
    assert re.search(r"<[\d,]+ days,", proc.stderr), proc.stderr
    assert not re.search(r"\d{3,}:\d\d:\d\d", proc.stderr), proc.stderr
    # 70,000 steps of 2,048 tokens, without the bar: 2 hours at this CPU's 20,000 tokens/s, so
    # between ten minutes and a day on a CPU 12 times faster or slower. A machine loaded by
    # other work measured 818 tokens/s, over a day: then the plan of days is what is said.
    proc = andrea_main("train", "-c", str(cfg), "--stop-after", "2", "--no-progress", "--set",
                       "train.max_steps=70000", "--set", "train.global_batch_tokens=2048",
                       "--set", "train.micro_batch_size=8", "--set", "train.name=quiet")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "plan needs" in line]
    assert len(lines) == 1 and (re.search(
        r"^note: the rest of this plan needs about (\d+:)?\d+:\d\d on this machine \(.+\); "
        r"without the bar \(--no-progress\)", lines[0]) or re.search(
        r"^note: this plan needs about [\d,.]+ days on this machine", lines[0])), proc.stderr


def test_a_plan_past_one_day_is_said_and_the_cpu_preset_is_not_suggested_to_itself(
        monkeypatch):
    """A day and a half is said (in tenths below ten days); a model the size of andrea-12m,
    or up to twice it, is told to lower its plan, not to train andrea-12m."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cpu = torch.device("cpu")
    note = plan_note_for(4_096 * 86_400 * 3 // 2 + 2 * 4_096, cpu, 1, CPU_PRESET_PARAMS)
    note.clock = iter([0.0, 1.0, 2.0]).__next__
    said = [note.after_micro_batch(4_096) for _ in range(3)]
    assert said[2] and said[2].startswith("note: this plan needs about 1.5 days"), said
    assert said[2].endswith("; lower train.max_steps or train.global_batch_tokens, or train on "
                            "a GPU"), said
    assert plan_note_for(1, cpu, 1, 2 * CPU_PRESET_PARAMS + 1).instead.startswith(
        "on a CPU train andrea-12m")


def test_the_bar_shows_the_runs_own_rate():
    bar = RunBar(total=10**6, unit="tok", disable=True)
    bar.set_rate(1234.5)
    assert bar.format_dict["rate"] == 1234.5


def test_a_small_mixture_source_is_counted_and_warned_about_on_its_own(tmp_path):
    small = words_file(tmp_path / "small.txt", 40_000, seed=1)
    big = words_file(tmp_path / "big.txt", 800_000, seed=2)
    cfg = tmp_path / "run.yaml"  # sources named relative to the run's folder, no data.dir
    cfg.write_text(
        "model: {n_layer: 2, n_head: 4, head_dim: 16, block_size: 64, vocab_size: 320}\n"
        f"data: {{tokenizer: byte, sources: [{{path: {small.name}, weight: 1}}, "
        f"{{path: {big.name}, weight: 1}}]}}\n"
        f"train: {{runs_dir: {tmp_path / 'runs'}, name: r, micro_batch_size: 8, log_every: 1, "
        "eval_every: 0, checkpoint_every: 0, max_steps: 20000}\n")
    proc = andrea_main("train", "-c", str(cfg), "--no-progress", "--stop-after", "1",
                       cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (plan,) = [x for x in proc.stdout.splitlines() if x.startswith("plan:")]
    # 20,000 x 512 tokens, half from each: ~36k training tokens of small.txt, ~720k of big.txt.
    per_source = dict(re.findall(r"(\w+\.txt) ([\d,.]+) over", plan))
    assert float(per_source["small.txt"].replace(",", "")) > 100 > float(
        per_source["big.txt"].replace(",", "")), plan
    warnings = [x for x in proc.stdout.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: mixture source small.txt: ")
    records = [json.loads(x) for x in (tmp_path / "runs" / "r" / "metrics.jsonl").open()]
    assert any(r["event"] == "data_mixture" for r in records)


def test_the_summary_line_counts_one_step_in_the_singular(tmp_path):
    """Before: `finished: 1 steps`."""
    from andrea.train.session import TrainResult

    def line(steps: int) -> str:
        return TrainResult(run_dir=tmp_path, steps=steps, tokens=512 * steps, seconds=1.0,
                           state="finished", best_val_loss=None, best_val_step=None,
                           last_val_loss=None, checkpoint=None).summary_line()

    assert line(1).startswith("finished: 1 step, 512 tokens in 1.0 s;")
    assert line(2).startswith("finished: 2 steps, 1,024 tokens")
    assert line(1000).startswith("finished: 1,000 steps, 512,000 tokens")


def test_a_resumed_runs_summary_line_says_which_steps_its_seconds_are(tmp_path, data_dir):
    """Before: `stopped: 300 steps, 153,600 tokens in 1.4 s` after a resume from step 207: the
    run's totals beside the seconds of the 93 steps this process trained."""
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=5",
                                  "train.eval_every=0", name="r"), tmp_path)
    proc = andrea_main("train", "-c", str(cfg), "--stop-after", "3", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^stopped: 3 steps, 1,536 tokens in [\d.]+ s; ", proc.stdout, re.M)
    proc = andrea_main("train", "--resume", str(tmp_path / "runs" / "r"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^finished: 5 steps, 2,560 tokens, 2 steps of them in [\d.]+ s from "
                     r"step 3; no evaluation; checkpoint ", proc.stdout, re.M), proc.stdout


def test_a_reader_that_goes_away_ends_the_output_not_the_training(tmp_path, data_dir):
    """`andrea train ... 2>&1 | head -1`: the pipe's reader leaves after the first line. Every
    later line (the bar, the evals, the summary) had nowhere to go, and the first one raised
    BrokenPipeError in the step loop: the run ended "failed" at its first eval, its last steps
    unsaved. Now the output ends and the training finishes. A real pipe: the process is the
    point."""
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=12",
                                  "train.eval_every=4", "train.checkpoint_every=6", name="r"),
                      tmp_path)
    proc = subprocess.Popen(python_command("-m", "andrea", "train", "-c", str(cfg)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout.readline()  # the first line, then the reader is gone
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0
    records = [json.loads(line)
               for line in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    end = records[-1]
    assert (end["event"], end["state"], end["step"]) == ("end", "finished", 12), end
    assert [r["step"] for r in records if r["event"] == "eval"] == [4, 8, 12]
    assert (tmp_path / "runs" / "r" / "latest").read_text().strip() == "step-000012"
