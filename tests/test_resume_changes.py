"""What a user changes between stopping a run and resuming it: the keys a resume may change,
and those it refuses in one line, however the change is made."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import andrea_main, assert_user_error, config_file, tiny_config

from andrea.train.rundir import CHECKSUMS, TRAINER_STATE, file_sha256, write_checksums


def rewrite_state(ckpt: Path, **keys) -> None:
    """Checkpoint CKPT's trainer_state.json with KEYS changed, its checksum recorded again (so
    it still reads as intact), as another machine or run would have written it."""
    state = json.loads((ckpt / TRAINER_STATE).read_text())
    state.update(keys)
    (ckpt / TRAINER_STATE).write_text(json.dumps(state, indent=1))
    sums = json.loads((ckpt / CHECKSUMS).read_text())["files"]
    write_checksums(ckpt, {**sums, TRAINER_STATE: file_sha256(ckpt / TRAINER_STATE)})


def recorded_best_val(run: Path, step: int, loss: float) -> None:
    """Run RUN as if its evaluations had found val loss LOSS at checkpoint STEP, its best: the
    eval event in metrics.jsonl and the checkpoint's trainer_state.json."""
    rewrite_state(run / f"step-{step:06d}", best_val_loss=loss, best_val_step=step)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"event": "eval", "step": step, "val_loss": loss}) + "\n")


@pytest.mark.parametrize("edit", [("  lr: 0.003\n", "  lr: 0.001\n", "train.lr 0.001"),
                                  ("optimizer: adamw", "optimizer: muon", "train.optimizer muon")])
def test_a_fixed_key_edited_in_the_runs_config_yaml_is_refused_as_its_set_is(
    tmp_path, trained_tiny, edit
):
    """Before: train.lr edited in runs/t/config.yaml between stop and resume trained on at the
    new lr (the schedule jumping to it) without a word, where --set train.lr was refused; an
    edited train.optimizer called the checkpoint's optimizer state damaged and sent the user to
    another step folder, which failed the same way. Now both are the one line --set gets,
    naming config.yaml, the key, and what the checkpoint was trained with."""
    run = tmp_path / "t"
    shutil.copytree(trained_tiny.run_dir, run)
    config = run / "config.yaml"
    old, new, named = edit
    assert old in config.read_text()
    config.write_text(config.read_text().replace(old, new))
    line = assert_user_error(
        andrea_main("train", "--resume", str(run / "step-000020"), "--no-progress"),
        f"{config}: {named} where {run / 'step-000020'} was trained with",
        "put them back as the run trained them")
    assert "damaged" not in line
    assert (run / "latest").read_text().strip() == "step-000040"  # nothing written


def test_a_resume_pointed_at_another_runs_data_names_no_set_it_would_refuse(
    tmp_path, trained_tiny
):
    """Before: `--resume RUN --set data.dir=DIR`, DIR holding data prepared from another text,
    was refused with 'to use that data as it is, add to the command what it was prepared with
    (--set data.source=own.txt)', and that --set is one a resume refuses (data.source defines
    the run). Now the line gives only what a resume can do: another data.dir, or that folder
    prepared again."""
    from andrea.config import load_config
    from andrea.data.prepare import ensure_prepared

    text = tmp_path / "own.txt"
    text.write_text("another text to train on, repeated. " * 3000)
    other = tmp_path / "other-byte"
    ensure_prepared(load_config("andrea-tiny", [f"data.source={text}", f"data.dir={other}"]))
    run = tmp_path / "t"
    shutil.copytree(trained_tiny.run_dir, run)
    line = assert_user_error(
        andrea_main("train", "--resume", str(run), "--set", "train.max_steps=41",
                    "--set", f"data.dir={other}", "--no-progress"),
        f"{other}: holds data prepared with source {text}", "use another data folder")
    assert "data.source=" not in line, line


def test_a_resumed_runs_config_says_where_the_run_is(tmp_path, trained_tiny):
    """Before: `--resume RUN --set train.runs_dir=X` trained on in RUN (which names the run by
    its folder) and wrote X into RUN's config.yaml, where a later `--config RUN/config.yaml
    --resume auto` found no run under X and started a new one there. Now config.yaml keeps
    the run's own place, and that command continues the run."""
    run = tmp_path / "t"
    shutil.copytree(trained_tiny.run_dir, run)
    done = andrea_main("train", "--resume", str(run), "--set", "train.runs_dir=elsewhere",
                       "--set", "train.max_steps=42", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (run / "latest").read_text().strip() == "step-000042"
    again = andrea_main("train", "--config", str(run / "config.yaml"), "--resume", "auto",
                        "--set", "train.max_steps=44", "--no-progress", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "starting a new run" not in again.stdout, again.stdout
    assert (run / "latest").read_text().strip() == "step-000044"
    assert not (tmp_path / "elsewhere").exists()


def test_a_run_from_before_the_spike_guard_resumes_without_it(tmp_path, trained_tiny):
    """A run's config.yaml lists every key of the andrea that wrote it: one written before
    train.spike_guard (2026-12-01) has none, and its run trained unguarded. Before: a resume
    read the missing key as today's default, skip, and guarded the rest of the run (outlier
    steps not applied) without a word. Now a key a run's config.yaml lacks reads as what andrea
    did before it; a --set still changes it."""
    run = tmp_path / "t"
    shutil.copytree(trained_tiny.run_dir, run)
    config = run / "config.yaml"
    assert "  spike_guard: 'off'\n" in config.read_text()
    config.write_text(config.read_text().replace("  spike_guard: 'off'\n", ""))  # as written then
    done = andrea_main("train", "--resume", str(run), "--set", "train.max_steps=41",
                       "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "  spike_guard: 'off'\n" in config.read_text()
    config.write_text(config.read_text().replace("  spike_guard: 'off'\n", ""))
    done = andrea_main("train", "--resume", str(run), "--set", "train.max_steps=42",
                       "--set", "train.spike_guard=skip", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "  spike_guard: skip\n" in config.read_text()


def test_a_run_from_before_the_spread_val_set_is_told_its_val_losses_change(
    tmp_path, trained_tiny
):
    """An andrea from before 2026-12-01 scored the val loss on the val split's first
    train.eval_batches micro-batches, and wrote eval_batches (no eval_tokens) in config.yaml.
    Resumed now, the same budget is spread over the whole split: another val set, whose losses
    and best val were mixed with the old ones without a word. Now one line says so, once, and
    the best val starts again (resume.new_val_set)."""
    run = tmp_path / "t"
    shutil.copytree(trained_tiny.run_dir, run)
    config = run / "config.yaml"
    text = config.read_text()
    assert "  eval_tokens: 2048\n  eval_batches: null\n" in text
    config.write_text(text.replace("  eval_tokens: 2048\n  eval_batches: null\n",
                                   "  eval_batches: 4\n"))  # as written then
    done = andrea_main("train", "--resume", str(run), "--set", "train.max_steps=41",
                       "--no-progress")
    assert done.returncode == 0, done.stderr
    assert ("resume: the run scored its val loss on the val split's first 2,048 tokens "
            "(train.eval_batches, an andrea before 2026-12-01), now on 2,048 spread over the "
            "whole split (train.eval_tokens): a new val set, so the val losses after step 40 "
            "are not comparable with the earlier ones, and the best val starts again from "
            "them\n") in done.stdout, done.stdout
    again = andrea_main("train", "--resume", str(run), "--set", "train.max_steps=42",
                        "--no-progress")
    assert again.returncode == 0 and "scored its val loss" not in again.stdout, again.stdout


def test_a_resume_spells_changed_values_as_the_user_writes_them(tmp_path, trained_tiny):
    """Before: a resume's lines printed a changed value as Python does, `resume: train.compile
    auto -> False`, and a refused one `model.bias (False -> True)`: spellings no config file or
    --set takes. Now each is the value as YAML writes it (config.value_text), as docs/config.md
    gives the defaults."""
    run = tmp_path / "t"
    shutil.copytree(trained_tiny.run_dir, run)
    assert_user_error(
        andrea_main("train", "--resume", str(run), "--no-progress", "--set", "model.bias=true"),
        "resuming cannot change model.bias (false -> true)")
    done = andrea_main("train", "--resume", str(run), "--no-progress",
                       "--set", "train.compile=false", "--set", "train.max_steps=41")
    assert done.returncode == 0, done.stderr
    assert "resume: train.compile auto -> false\n" in done.stdout, done.stdout
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("  bias: false\n", "  bias: true\n"))
    assert_user_error(andrea_main("train", "--resume", str(run), "--no-progress",
                                  "--set", "train.max_steps=42"),
                      f"{config}: model.bias true where {run / 'step-000041'} was trained "
                      f"with false")


def test_a_mixtures_weights_may_change_on_resume_and_nothing_else_of_it(tmp_path):
    """A mix shifted late in a run (annealing on the best data): a resume refused any change
    of data.sources, even of its weights alone. Now the weights may change, in one line, and
    the windows from then on are drawn by them; another source, or the same ones in another
    order, is still refused."""
    for name, letters in (("a.txt", "abcd \n"), ("b.txt", "WXYZ \n")):
        (tmp_path / name).write_text("".join(letters[(i * 7 + i // 5) % 6] for i in range(30000)))
    mix = "data.sources=[{path: a.txt, weight: 1}, {path: b.txt, weight: %d}]"
    train = ("train", "--config", "andrea-tiny", "--no-progress", "--set", "train.max_steps=6",
             "--set", "train.checkpoint_every=3", "--set", "train.eval_every=0")
    assert andrea_main(*train, "--set", mix % 1, "--stop-after", "3", cwd=tmp_path).returncode == 0
    run = tmp_path / "runs" / "andrea-tiny"
    refused = andrea_main("train", "--resume", str(run), "--no-progress", "--set",
                          "data.sources=[{path: b.txt, weight: 1}, {path: a.txt, weight: 1}]",
                          cwd=tmp_path)
    assert_user_error(refused, "resuming cannot change data.sources")
    done = andrea_main("train", "--resume", str(run), "--no-progress", "--set", mix % 9,
                       cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "resume: data.sources [{path: a.txt, weight: 1.0}, {path: b.txt, weight: 1.0}] -> " \
           "[{path: a.txt, weight: 1.0}, {path: b.txt, weight: 9.0}]" in done.stdout, done.stdout
    assert "realised share of tokens over steps 4-6: a.txt" in done.stdout
    # The val loss of a mixture is its sources' weighted by the weights: another val set, whose
    # best starts again (`andrea runs` reads the start record's new_val_set).
    assert "weight: 9.0}]: a new val set, so the val losses after step 3 are not comparable " \
           "with the earlier ones" in done.stdout, done.stdout
    starts = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"event": "start"' in line]
    assert [bool(s.get("new_val_set")) for s in starts] == [False, True]
    share = float(done.stdout.split("b.txt ")[1].split("%")[0])
    assert share > 70, done.stdout  # 90% by weight, from 50% before
    assert "weight: 9" in (run / "config.yaml").read_text()


def test_a_resume_onto_another_val_set_starts_the_best_val_again(tmp_path, trained_tiny):
    """Before: `--resume RUN --set train.eval_tokens=256` (the run evaluated on 2,048) kept the
    best val of the old set, and the end line, trainer_state.json and `andrea runs` went on
    comparing the new set's losses with it: a loss of an easier set stayed the best for good.
    Now one line says the set is new and from which step the losses are not comparable, and
    the best val is the new set's alone, in the run's records as in `andrea runs`."""
    from andrea.runs import read_run

    run = tmp_path / "t"
    shutil.copytree(trained_tiny.run_dir, run)
    recorded_best_val(run, 40, 0.5)  # lower than any loss this model gives on any set
    done = andrea_main("train", "--resume", str(run), "--no-progress",
                       "--set", "train.eval_tokens=256", "--set", "train.eval_every=1",
                       "--set", "train.max_steps=41")
    assert done.returncode == 0, done.stderr
    assert "resume: train.eval_tokens 2048 -> 256: a new val set, so the val losses after step " \
           "40 are not comparable with the earlier ones, and the best val starts again from " \
           "them\n" in done.stdout, done.stdout
    assert "resume: train.eval_tokens 2048 -> 256\n" not in done.stdout  # said once
    assert " at step 41; checkpoint " in done.stdout, done.stdout  # the end line's best
    end = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert end["event"] == "end" and end["best_val_step"] == 41, end
    state = json.loads((run / "step-000041" / TRAINER_STATE).read_text())
    assert state["best_val_step"] == 41 and state["best_val_loss"] > 0.5, state
    summary = read_run(run)
    assert (summary.best_val_step, summary.best_val_loss) == (41, state["best_val_loss"])
    again = andrea_main("train", "--resume", str(run), "--no-progress",
                        "--set", "train.max_steps=42")  # the same set: the best is kept
    assert again.returncode == 0, again.stderr
    assert "a new val set" not in again.stdout, again.stdout
    assert read_run(run).best_val_loss <= state["best_val_loss"]


def test_weights_scaled_alike_are_the_same_val_set():
    """Before: data.sources' weights 1, 1 resumed as 2, 2 (one mixture: the same windows, the
    same val loss) were called a new val set, and the run's best val started again."""
    from andrea.config import load_config
    from andrea.train.resume import new_val_set

    def mix(a: float, b: float):
        return load_config("andrea-tiny", [
            f"data.sources=[{{path: a.txt, weight: {a}}}, {{path: b.txt, weight: {b}}}]"])

    assert new_val_set(mix(1, 1), mix(1, 1), mix(2, 2), None, []) == []
    assert new_val_set(mix(1, 3), mix(1, 3), mix(0.5, 1.5), None, []) == []
    causes = new_val_set(mix(1, 1), mix(1, 1), mix(1, 9), None, [])
    assert len(causes) == 1 and causes[0].startswith("data.sources "), causes


def test_a_resume_may_pin_precision_auto_to_what_it_resolved_to_and_to_nothing_else(
    tmp_path, data_dir
):
    """Before: a run of train.precision auto (fp32 on a CPU without bf16 units) resumed with
    --set train.precision=fp32, the precision it was training in, was refused as a change that
    defines the run. Now the checkpoint records what auto resolved to (trainer_state.json's
    `precision`), and a pin to it goes on, by --set as in the config.yaml it then writes; a
    pin to any other precision is refused as before."""
    from andrea.train.device import choose_precision, pick_device

    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                      "train.checkpoint_every=1", "train.precision=auto")
    first = andrea_main("train", "-c", str(config_file(cfg, tmp_path)), "--no-progress")
    assert first.returncode == 0, first.stderr
    run = tmp_path / "runs" / "t"
    resolved = choose_precision("auto", pick_device("auto")).name  # on this machine
    other = next(p for p in ("bf16", "fp32") if p != resolved)
    assert_user_error(
        andrea_main("train", "--resume", str(run), "--no-progress",
                    "--set", f"train.precision={other}", "--set", "train.max_steps=3"),
        f"resuming cannot change train.precision (auto -> {other})")
    pinned = andrea_main("train", "--resume", str(run), "--no-progress",
                         "--set", f"train.precision={resolved}", "--set", "train.max_steps=3")
    assert pinned.returncode == 0, pinned.stderr
    assert f"resume: train.precision auto -> {resolved}\n" in pinned.stdout, pinned.stdout
    assert json.loads((run / "step-000002" / TRAINER_STATE).read_text())["precision"] == resolved
    assert f"precision: {resolved}" in (run / "config.yaml").read_text()
    # config.yaml pins it now; step-000001 was trained with auto, and resolved it alike.
    again = andrea_main("train", "--resume", str(run / "step-000001"), "--no-progress")
    assert again.returncode == 0, again.stderr


def test_a_resume_whose_auto_precision_resolves_otherwise_here_says_so(tmp_path, data_dir):
    """Before: a run of train.precision auto trained in bf16 (a CPU with bf16 units, a GPU) and
    resumed on a machine where auto resolves to fp32 went on in fp32 without a word, its losses
    from there another precision's. Now one line names both and the pin that keeps the run's;
    where auto resolves as it recorded, nothing is said."""
    from andrea.train.device import choose_precision, pick_device

    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                      "train.checkpoint_every=2", "train.precision=auto")
    first = andrea_main("train", "-c", str(config_file(cfg, tmp_path)), "--no-progress")
    assert first.returncode == 0, first.stderr
    run = tmp_path / "runs" / "t"
    here = choose_precision("auto", pick_device("auto")).name
    same = andrea_main("train", "--resume", str(run), "--no-progress", "--set",
                       "train.max_steps=3")
    assert same.returncode == 0, same.stderr
    assert "resume: precision" not in same.stdout, same.stdout
    other = next(p for p in ("bf16", "fp32") if p != here)
    # as a machine where auto resolved otherwise recorded it
    rewrite_state(run / "step-000003", precision=other)
    moved = andrea_main("train", "--resume", str(run), "--no-progress", "--set",
                        "train.max_steps=4")
    assert moved.returncode == 0, moved.stderr
    assert (f"resume: precision {other} -> {here} (auto: " in moved.stdout
            and f"--set train.precision={other} keeps it" in moved.stdout), moved.stdout


def test_a_muon_runs_auto_newton_schulz_precision_is_recorded_and_resumed_as_precision_is(
    tmp_path, data_dir
):
    """train.muon_ns_precision auto resolves by the machine (bf16 on a GPU or CPU with bf16
    units, else fp32), as train.precision's does. Before: the checkpoint recorded nothing of
    it, so a resume on another machine changed the precision of Muon's iterations without a
    word, and a pin to the one it ran in was refused as a change that defines the run. Now
    trainer_state.json records it (muon_ns_precision), a pin to it goes on, and a resume where
    auto resolves otherwise says so in one line, as a resumed train.precision does."""
    import torch

    from andrea.model.transformer import Andrea
    from andrea.train.device import pick_device
    from andrea.train.optim import build_optimizer

    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                      "train.checkpoint_every=1", "train.optimizer=muon",
                      "train.precision=fp32")
    first = andrea_main("train", "-c", str(config_file(cfg, tmp_path)), "--no-progress")
    assert first.returncode == 0, first.stderr
    run = tmp_path / "runs" / "t"
    muon = build_optimizer(Andrea(cfg.model), cfg, pick_device("auto")).parts["muon"]
    # torch's own Muon (no ns_dtype) is what bf16 takes: auto's choice on this machine
    here = {torch.bfloat16: "bf16", torch.float32: "fp32"}[
        getattr(muon, "ns_dtype", torch.bfloat16)]
    other = next(p for p in ("bf16", "fp32") if p != here)
    ckpt = run / "step-000002"
    state = json.loads((ckpt / TRAINER_STATE).read_text())
    assert state["muon_ns_precision"] == here, state
    assert_user_error(
        andrea_main("train", "--resume", str(run), "--no-progress",
                    "--set", f"train.muon_ns_precision={other}", "--set", "train.max_steps=3"),
        f"resuming cannot change train.muon_ns_precision (auto -> {other})")
    rewrite_state(ckpt, muon_ns_precision=other)  # as a machine where auto resolved otherwise
    moved = andrea_main("train", "--resume", str(run), "--no-progress", "--set",
                        "train.max_steps=3")
    assert moved.returncode == 0, moved.stderr
    assert (f"resume: Muon's Newton-Schulz precision {other} -> {here} (auto: " in moved.stdout
            and f"the run iterated in {other} until now: --set train.muon_ns_precision={other} "
                "keeps it\n" in moved.stdout), moved.stdout
    assert "resume: precision" not in moved.stdout  # train.precision was pinned: no line
    pinned = andrea_main("train", "--resume", str(run), "--no-progress",
                         "--set", f"train.muon_ns_precision={here}", "--set", "train.max_steps=4")
    assert pinned.returncode == 0, pinned.stderr
    assert f"resume: train.muon_ns_precision auto -> {here}\n" in pinned.stdout, pinned.stdout
    assert "Newton-Schulz precision" not in pinned.stdout, pinned.stdout
    assert json.loads((run / "step-000004" / TRAINER_STATE).read_text())[
        "muon_ns_precision"] == here


def test_a_document_added_to_the_val_split_alone_is_a_new_val_set_and_one_in_train_is_not(
    tmp_path,
):
    """A JSONL source's records go to val or train by their own hash: one record more, and only
    its split's shards change. Resumed on its text so grown, a run whose val split changed
    evaluates on a new val set (said, and its best val starts again); one whose train split
    alone changed evaluates on the set it had, its best val kept."""
    from andrea.data.documents import is_val_record

    def record(i: int) -> str:
        return json.dumps({"text": f"record {i}: " + "the cat sat on the mat. " * (4 + i % 5)})

    def first(split_is_val: bool, start: int) -> str:
        return next(record(i) for i in range(start, start + 1000)
                    if is_val_record(json.loads(record(i))["text"].encode(), 0.1) == split_is_val)

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(record(i) + "\n" for i in range(400)))
    train = ("train", "--config", "andrea-tiny", "--no-progress", "--set",
             "data.source=docs.jsonl", "--set", "train.max_steps=6", "--set",
             "train.checkpoint_every=1", "--set", "train.eval_every=1", "--set",
             "train.eval_tokens=256")
    assert andrea_main(*train, "--stop-after", "2", cwd=tmp_path).returncode == 0
    run = tmp_path / "runs" / "andrea-tiny"
    resume = ("train", "--resume", str(run), "--no-progress", "--stop-after", "1")
    lines = []
    for to_val in (True, False):
        with docs.open("a") as f:
            f.write(first(to_val, 1000 if to_val else 2000) + "\n")
        done = andrea_main(*resume, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "holds other shards than" in done.stdout, done.stdout  # prepared again
        lines.append(done.stdout)
    assert "is not the one the run evaluated on: a new val set, so the val losses after " \
           "step 2 are not comparable" in lines[0], lines[0]
    assert "a new val set" not in lines[1], lines[1]
    starts = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"event": "start"' in line]
    assert [bool(s.get("new_val_set")) for s in starts] == [False, True, False]
