"""The training loop: learning, exact resume, checkpoints, signals, faults (several processes:
tests/test_parallel.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from conftest import (
    andrea_main,
    assert_user_error,
    config_file,
    fake_cgroup,
    make_checkpoint,
    python_command,
    tiny_config,
    wait_until,
)
from test_runs import dead_pid

from andrea.config import load_config
from andrea.data.loader import TokenSplit
from andrea.errors import UserError
from andrea.fileio import size_text
from andrea.model.transformer import Andrea
from andrea.runs import read_run
from andrea.train import checkpoint as ckpt_io
from andrea.train.device import pick_device, pick_dtype
from andrea.train.loop import train
from andrea.train.memory import HEADROOM, choose_micro_batch, estimate_peak_bytes
from andrea.train.optim import build_optimizer
from andrea.train.rundir import (
    CHECKSUMS,
    MODEL_FILE,
    OPTIMIZER_FILE,
    TRAINER_STATE,
    file_sha256,
    resolve_checkpoint,
    step_dirs,
    step_of_dir,
    write_checksums,
)
from andrea.train.signals import SignalWatch

# data_dir: the session fixture in conftest.py (the tiny preset's prepared data).


def read_events(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def test_loss_falls_within_50_steps(tmp_path, data_dir):
    result = train(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=50",
                               "train.eval_every=50"), progress=False)
    first, last = result.losses[1], sum(result.losses[s] for s in range(46, 51)) / 5
    assert last < 0.7 * first, (first, last)
    assert result.best_val_loss is not None and result.best_val_loss < 0.7 * first
    assert (result.run_dir / "latest").read_text().strip() == "step-000050"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_exact_resume_bit_for_bit(tmp_path, data_dir, precision):
    sets = ("train.max_steps=12", f"train.precision={precision}", "model.dropout=0.1",
            "train.global_batch_tokens=1024")  # 2 accumulation steps; dropout uses the RNG
    whole = train(tiny_config(tmp_path / "a" / "runs", data_dir, *sets), progress=False)
    first = train(tiny_config(tmp_path / "b" / "runs", data_dir, *sets), progress=False,
                  stop_after=5)
    assert first.state == "stopped" and first.steps == 5
    rest = train(tiny_config(tmp_path / "b" / "runs", data_dir, *sets), resume=str(first.run_dir),
                 progress=False)
    assert rest.steps == 12
    resumed = {**first.losses, **rest.losses}
    assert resumed == whole.losses  # exact float equality, every step
    a = ckpt_io.read_model_checkpoint(whole.checkpoint)[0]
    b = ckpt_io.read_model_checkpoint(rest.checkpoint)[0]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_by_bare_run_name(tmp_path, data_dir):
    first = train(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=4"), progress=False,
                  stop_after=2)
    proc = andrea_main("train", "--resume", "t", "--no-progress", cwd=tmp_path)  # runs/t
    assert proc.returncode == 0, proc.stderr
    assert "finished: 4 steps" in proc.stdout
    assert resolve_checkpoint(first.run_dir).name == "step-000004"


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_weight_decay_only_on_matrices(tmp_path, data_dir, decay_embeddings):
    """Matrices decay, vectors (norms, biases) never; the embeddings only with
    train.decay_embeddings. AdamW's groups, and Muon's AdamW part alike."""
    for optimizer in ("adamw", "muon"):
        cfg = tiny_config(tmp_path / "runs", data_dir, "model.bias=true",
                          f"train.optimizer={optimizer}",
                          f"train.decay_embeddings={str(decay_embeddings).lower()}")
        model = Andrea(cfg.model)
        opt = build_optimizer(model, cfg, torch.device("cpu"))
        groups = [g for g in opt.param_groups if "momentum" not in g]  # AdamW's, not Muon's
        decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
        adamw = {id(p) for g in groups for p in g["params"]}
        for name, p in model.named_parameters():
            if id(p) not in adamw:
                continue  # a block matrix Muon takes (test_muon.py)
            expect = p.dim() == 2 and (decay_embeddings or "emb" not in name)
            assert (id(p) in decayed) == expect, (optimizer, name)
        assert any("emb" in name for name, p in model.named_parameters() if id(p) in adamw)


@pytest.mark.parametrize("accum", [1, 4])
def test_steps_match_a_float64_loop_written_from_the_recipe(tmp_path, data_dir, monkeypatch,
                                                            accum):
    """Three AdamW steps with the clip cutting every step's gradient, against a float64 loop
    written here: the mean loss of the step's micro-batches (each backward over `accum`), the
    norm clipped to train.grad_clip, torch's AdamW with the config's betas, eps and decay
    groups (matrices but not the embeddings), at each step's logged lr, on the batches the
    trainer drew. AdamW is blind to a gradient's scale, so loss curves alone cannot see a
    missing clip or a missing 1/accum; the logged norm (before the clip) and the weights can."""
    from andrea.train import loop, setup

    start, batches = {}, []
    real_build, real_batch = setup.build_optimizer, loop.train_batch

    def build_recording(model, *args, **kwargs):
        start.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return real_build(model, *args, **kwargs)

    def batch_recording(split, **kw):
        x, y = real_batch(split, **kw)
        batches.append((kw["step"], x.clone(), y.clone()))
        return x, y

    monkeypatch.setattr(setup, "build_optimizer", build_recording)
    monkeypatch.setattr(loop, "train_batch", batch_recording)
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=3", "train.precision=fp32",
                      "train.optimizer=adamw", "train.grad_clip=0.05", "train.micro_batch_size=8",
                      f"train.global_batch_tokens={accum * 8 * 64}", "train.compile=false")
    result = train(cfg, progress=False)
    assert result.state == "finished"
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").open()]
    logged = [r for r in records if r["event"] == "train"]
    assert len(logged) == 3 and len(batches) == 3 * accum

    ref = Andrea(cfg.model).double()
    ref.load_state_dict({k: v.double() for k, v in start.items()})
    t = cfg.train
    named = list(ref.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2 and n not in ("tok_emb.weight", "pos_emb.weight")]
    rest = [p for n, p in named if not any(p is q for q in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    for step, record in enumerate(logged):
        opt.zero_grad(set_to_none=True)
        for s, x, y in batches[step * accum:(step + 1) * accum]:
            assert s == step
            (ref(x, y)[1] / accum).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), t.grad_clip)
        assert norm > 2 * t.grad_clip  # the clip cuts this step
        assert record["grad_norm"] == pytest.approx(norm.item(), rel=1e-4), step
        for group in opt.param_groups:
            group["lr"] = record["lr"]
        opt.step()

    trained, _, _ = ckpt_io.read_model_checkpoint(result.checkpoint)
    assert set(trained) == set(start) - {"lm_head.weight"}  # tied to tok_emb.weight
    now = ref.state_dict()
    moved = torch.cat([(trained[k].double() - start[k].double()).flatten() for k in trained])
    expected = torch.cat([(now[k] - start[k].double()).flatten() for k in trained])
    assert (moved - expected).norm() <= 1e-3 * expected.norm(), (
        (moved - expected).norm() / expected.norm())


def test_checkpoint_round_trip(tmp_path, data_dir):
    result = train(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=3"), progress=False)
    tensors, cfg, meta = ckpt_io.read_model_checkpoint(result.checkpoint)
    assert meta["step"] == "3" and meta["tokenizer"] == "byte:v1"
    assert not any("_orig_mod" in k or k.startswith("module.") for k in tensors)
    model = Andrea(cfg.model)
    ckpt_io.load_weights(model, tensors, result.checkpoint)
    assert model.lm_head.weight is model.tok_emb.weight
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    ckpt_io.load_optimizer(opt, names, result.checkpoint)
    again = ckpt_io.optimizer_state(opt, names)
    stored, _ = ckpt_io.read_safetensors(result.checkpoint / OPTIMIZER_FILE)
    assert stored.keys() == again.keys()
    assert all(torch.equal(stored[k], again[k]) for k in stored)
    state, rng = ckpt_io.read_trainer_state(result.checkpoint)
    assert state.step == 3 and state.tokens == 3 * 8 * 64
    assert "cpu.rank0" in rng


def test_keep_last_prunes_old_checkpoints(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=4", "train.checkpoint_every=1",
               "train.keep_last=2")
    result = train(cfg, progress=False)
    assert [p.name for p in step_dirs(result.run_dir)] == [
        "step-000003", "step-000004"]
    assert len(read_events(result.run_dir, "checkpoint")) == 4


def test_keep_last_after_a_resume_from_an_older_step_keeps_the_checkpoint_resumed_from(
        tmp_path, data_dir):
    """Before: a resume from step 4 of a run keeping 4, 6 and 8 deleted step 4 at its first
    checkpoint (5) and kept the steps it had gone back from, and then each checkpoint of the
    new line deleted the one before. Now keep_last counts the line up to `latest`; the steps
    past it stay until the resume writes its way back to them."""
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=8",
                      "train.checkpoint_every=2", "train.keep_last=3", "train.eval_every=0")
    run = train(cfg, progress=False).run_dir
    assert [p.name for p in step_dirs(run)] == ["step-000004", "step-000006", "step-000008"]
    for resume, kept in [(run / "step-000004", [4, 5, 6, 8]), (run, [4, 5, 6, 8]),
                         (run, [5, 6, 7, 8])]:
        proc = andrea_main("train", "--resume", str(resume), "--stop-after", "1", "--no-progress")
        assert proc.returncode == 0, proc.stderr
        assert [step_of_dir(p) for p in step_dirs(run)] == kept, proc.stdout
    proc = andrea_main("train", "--resume", str(run), "--no-progress")  # writes 8 again
    assert proc.returncode == 0, proc.stderr
    assert [step_of_dir(p) for p in step_dirs(run)] == [6, 7, 8]
    assert (run / "latest").read_text().strip() == "step-000008"


def test_compiled_model_state_has_plain_keys():
    model = Andrea(load_config("andrea-tiny").model)
    compiled = torch.compile(model)  # wrapping is lazy: nothing compiles until it is called
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    keys = ckpt_io.model_state(compiled).keys()
    assert keys == ckpt_io.model_state(model).keys()
    assert not any("_orig_mod" in k for k in keys) and "lm_head.weight" not in keys


def test_device_and_precision_names_are_checked(monkeypatch):
    assert pick_device("cpu") == torch.device("cpu")
    for bad in ("gpu", "cpu:0", "cuda:x"):
        with pytest.raises(UserError, match=f"--device {bad}: expected auto"):
            pick_device(bad)
    # The way out fits the GPUs there are ("another index" with none was no way out).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for count, asked, said in [(0, "cuda", "sees 0 GPUs; use --device cpu"),
                               (1, "cuda:1", "sees 1 GPU; use --device cpu or cuda"),
                               (2, "cuda:2", "sees 2 GPUs; use --device cpu or an index below 2")]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        with pytest.raises(UserError) as raised:
            pick_device(asked)
        assert str(raised.value) == f"--device {asked}: PyTorch {said}"
    # A training names its config key, in the form --set takes (before: "device 'cuda'").
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(UserError, match="^train.device cuda: PyTorch sees 0 GPUs; use "
                                        "--set train.device=cpu$"):
        pick_device("cuda", "train.device")
    with pytest.raises(UserError, match="precision 'fp8'"):
        pick_dtype("fp8", torch.device("cpu"))


def _start(tmp_path: Path, cfg, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        python_command("-m", "andrea", "train", "-c", str(config_file(cfg, tmp_path)),
                       "--no-progress", *args),
        env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_checkpoints_and_exits(tmp_path, data_dir, sig, code):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=100000")
    run_dir = Path(cfg.train.runs_dir) / "t"
    proc = _start(tmp_path, cfg)
    wait_until(lambda: (run_dir / "metrics.jsonl").exists()
               and '"train"' in (run_dir / "metrics.jsonl").read_text(),
               what="a step's record", timeout=120, proc=proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    (end,) = read_events(run_dir, "end")
    assert end["state"] == "interrupted" and end["signal"] == sig.name
    latest = resolve_checkpoint(run_dir)
    assert latest.name == end["checkpoint"] and latest.name in out
    assert ckpt_io.read_trainer_state(latest)[0].step == end["step"]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_second_signal_exits_at_once_leaving_the_last_checkpoint(tmp_path, data_dir, sig, code):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=100000")
    first = train(cfg, progress=False, stop_after=2)  # the last good checkpoint: step 2
    # Resumed with no periodic checkpoints and every write taking 3 s, the only checkpoint
    # started is the one the first Ctrl-C asks for; the second Ctrl-C lands inside it.
    proc = subprocess.Popen(
        python_command("-m", "andrea", "train", "--resume", str(first.run_dir),
                       "--no-progress"),
        env={**os.environ, "ANDREA_FAULTS": "checkpoint-delay@3"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    wait_until(lambda: any(r["step"] > 2 for r in read_events(first.run_dir, "train")),
               what="step 3's record", timeout=120, proc=proc)
    proc.send_signal(sig)
    # Two signals that arrive before Python runs the handler count as one: wait until the
    # first is seen before sending the second.
    wait_until(lambda: any("stopping after this micro-batch" in line for line in stderr),
               what="the first signal's line", timeout=120, proc=proc)
    wait_until(lambda: any(first.run_dir.glob("*.partial-*/model.safetensors")),
               what="the checkpoint's write under way", timeout=120, proc=proc)
    proc.send_signal(sig)  # old code: a second SIGTERM was ignored, the checkpoint completed
    proc.wait(timeout=60)
    assert proc.returncode == code
    assert "step-000002 stays the latest checkpoint" in "".join(stderr)
    end = read_events(first.run_dir, "end")[-1]
    assert end["state"] == "interrupted"
    # Its tokens with its step: `andrea runs` showed the step reached beside the tokens of the
    # checkpoint's step (5/550 steps, 4 steps' tokens), the end record having none.
    summary = read_run(first.run_dir)
    assert summary.step == end["step"] > 2
    assert summary.tokens == end["tokens"] == end["step"] * first.tokens // first.steps
    assert resolve_checkpoint(first.run_dir).name == "step-000002"
    ckpt_io.read_model_checkpoint(first.run_dir / "step-000002")  # complete and loadable
    (cut,) = first.run_dir.glob("*.partial-*")  # the interrupted write, never the latest
    assert not (cut / TRAINER_STATE).exists() and step_of_dir(cut.with_suffix("")) > 2


def test_a_second_signal_while_the_oldest_checkpoint_is_pruned_names_the_new_latest(
        tmp_path, monkeypatch, capfd):
    # The checkpoint of step 20 is published (`latest` names it) and the oldest is being
    # pruned, so the trainer has not heard back: its SignalWatch still holds step 10. A second
    # Ctrl-C then said "step-000010 stays the latest checkpoint", its end record naming it too.
    run = tmp_path / "r"
    for step in (10, 20):
        (run / f"step-{step:06d}").mkdir(parents=True)
    (run / "latest").write_text("step-000020\n")
    (run / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n')
    watch = SignalWatch()
    watch.setting_up, watch.received = False, signal.SIGINT  # the first signal, seen
    watch.metrics_path, watch.checkpoint = run / "metrics.jsonl", run / "step-000010"
    watch.completed_step = 20

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    with pytest.raises(SystemExit) as stop:
        watch._handle(signal.SIGINT, None)
    assert stop.value.code == 130
    assert f"{run / 'step-000020'} stays the latest checkpoint" in capfd.readouterr().err
    (end,) = read_events(run, "end")
    assert end["checkpoint"] == "step-000020" and "step-000020 stays" in end["message"]
    # A process that does not write the run (another rank) names what its trainer saved.
    watch.metrics_path = None
    assert watch.latest_checkpoint() == run / "step-000010"


def test_kill_9_while_writing_a_checkpoint_leaves_latest_loadable(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=100000",
                      "train.checkpoint_every=5")
    run_dir = Path(cfg.train.runs_dir) / "t"
    # step-000005 is written slowly too; wait for it, then catch step-000010 half written.
    proc = _start(tmp_path, cfg, env={"ANDREA_FAULTS": "checkpoint-delay@2"})
    wait_until(lambda: (run_dir / "latest").exists(), what="step 5's checkpoint", timeout=120,
               proc=proc)
    wait_until(lambda: any(run_dir.glob("step-000010.partial-*/model.safetensors")),
               what="step 10's checkpoint under way", timeout=120, proc=proc)
    proc.kill()
    proc.communicate()
    assert (run_dir / "latest").read_text().strip() == "step-000005"
    tensors, _, meta = ckpt_io.read_model_checkpoint(resolve_checkpoint(run_dir))
    assert meta["step"] == "5" and tensors
    # Resuming continues from step 5 and sweeps away the half-written folder.
    result = train(cfg, resume=str(run_dir), progress=False, stop_after=1)
    assert result.steps == 6
    assert not list(run_dir.glob("*.partial-*"))


def test_what_a_kill_while_pruning_leaves_is_removed_by_the_next_training(tmp_path, data_dir):
    """A checkpoint pruned is renamed step-N.stale-PID, then deleted: a kill in between leaves a
    whole checkpoint's worth of files under that name, which no command reads. The next
    training of the run removes it, with what a kill while writing leaves (.partial-)."""
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                      "train.checkpoint_every=1", "train.keep_last=1")
    run = train(cfg, progress=False).run_dir
    assert [p.name for p in run.iterdir() if p.name.startswith("step-")] == ["step-000002"]
    shutil.copytree(run / "step-000002", run / "step-000001.stale-4242")  # killed pruning 1
    shutil.copytree(run / "step-000002", run / "step-000003.partial-4242")  # killed writing 3
    result = train(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=3",
                               "train.checkpoint_every=1", "train.keep_last=1"),
                   resume=str(run), progress=False)
    assert result.steps == 3
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == [
        "step-000003"]


def test_nonfinite_loss_stops_and_names_the_last_good_checkpoint(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=20", "train.checkpoint_every=5")
    path = config_file(cfg, tmp_path)
    proc = andrea_main("train", "-c", str(path), "--no-progress",
                       env={"ANDREA_FAULTS": "nan@7"})
    assert proc.returncode == 1
    assert "step 7" in proc.stderr and "step-000005" in proc.stderr
    assert "Traceback" not in proc.stderr
    run_dir = Path(cfg.train.runs_dir) / "t"
    assert (run_dir / "latest").read_text().strip() == "step-000005"
    assert read_events(run_dir, "end")[-1]["state"] == "nonfinite"

    skip = andrea_main("train", "-c", str(path), "--no-progress", "--overwrite",
                       "--set", "train.skip_nonfinite=true",
                       env={"ANDREA_FAULTS": "nan@7"})
    assert skip.returncode == 0, skip.stderr
    assert [r["step"] for r in read_events(run_dir, "skip")] == [7]
    assert read_events(run_dir, "end")[-1]["state"] == "finished"
    # Said at the end and in `andrea runs`: the run is not a clean one.
    said = "1 of its 20 steps not applied: a non-finite loss or gradient (train.skip_nonfinite)"
    assert said in skip.stdout.splitlines()[-1]
    assert "t: 1 step not applied: a non-finite loss" in andrea_main(
        "runs", str(tmp_path / "runs")).stdout


def test_a_run_whose_every_step_is_non_finite_has_no_best_val_loss(tmp_path, data_dir):
    """Before: `finished: ...; best val loss nan at step 6`, and a NaN first val loss stayed the
    best whatever came after (nothing compares below NaN)."""
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=6", "train.eval_every=3",
                      "model.init_std=1e308", "train.skip_nonfinite=true")
    proc = andrea_main("train", "-c", str(config_file(cfg, tmp_path)), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.splitlines()[-1]
    assert "no finite val loss" in last and "best val loss" not in last
    assert "6 of its 6 steps not applied" in last
    assert read_events(tmp_path / "runs" / "t", "end")[-1]["best_val_loss"] is None


def test_overwrite_replaces_a_run_only_once_the_new_one_can_start(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2")
    run_dir = train(cfg, progress=False).run_dir
    old_metrics = (run_dir / "metrics.jsonl").read_bytes()
    path = str(config_file(cfg, tmp_path))
    # The model's vocabulary is too small for the data: found after the run folder is chosen.
    assert_user_error(andrea_main("train", "-c", path, "--overwrite", "--set",
                                  "model.vocab_size=100"), "model.vocab_size")
    assert (run_dir / "metrics.jsonl").read_bytes() == old_metrics
    assert (run_dir / "latest").read_text().strip() == "step-000002"
    assert (run_dir / "step-000002" / "model.safetensors").is_file()

    old = [f for f in (run_dir / "step-000002").iterdir()] + [run_dir / "metrics.jsonl"]
    size = size_text(sum(f.stat().st_size for f in old))
    replaced = andrea_main("train", "-c", path, "--overwrite", "--no-progress",
                           "--set", "train.max_steps=1")
    assert replaced.returncode == 0, replaced.stderr
    # It names what it deletes before it does.
    assert replaced.stdout.splitlines()[0] == (f"--overwrite: deleting the run in {run_dir} "
                                               f"(1 checkpoint, the newest at step 2, "
                                               f"{size} on disk)")
    assert [c.name for c in step_dirs(run_dir)] == ["step-000001"]
    assert len(read_events(run_dir, "start")) == 1


def test_a_new_run_never_writes_over_checkpoints_without_latest_nor_a_users_folder(tmp_path,
                                                                                   data_dir):
    """A run whose `latest` was lost (deleted, or a copy without it) was taken for no run:
    the same command trained over its checkpoints without --overwrite. A folder of a user's
    files that holds a config.yaml, a metrics.jsonl or a step-* folder was written into: its
    config replaced, the metrics appended to, a step-* folder with the user's files pruned.
    Now the first is "already holds a run" (--resume continues it), the second is refused even
    with --overwrite; nothing in either changes."""
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                      "train.checkpoint_every=1")
    run_dir = train(cfg, progress=False).run_dir
    (run_dir / "latest").unlink()
    before = run_files(run_dir)
    path = str(config_file(cfg, tmp_path))
    assert_user_error(andrea_main("train", "-c", path, "--no-progress"),
                      f"{run_dir}: already holds a run", f"--resume {run_dir}", "--overwrite")
    assert run_files(run_dir) == before

    project = tmp_path / "runs" / "project"
    (project / "step-000001").mkdir(parents=True)
    (project / "config.yaml").write_text("user: config\n")
    (project / "metrics.jsonl").write_text('{"mine": 1}\n')
    (project / "step-000001" / "results.csv").write_text("keep\n")
    theirs = run_files(project)
    mine = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                                   "train.checkpoint_every=1", "train.keep_last=1",
                                   name="project"), tmp_path)
    for overwrite in ((), ("--overwrite",)):
        proc = andrea_main("train", "-c", str(mine), "--no-progress", *overwrite)
        assert_user_error(proc, f"{project}: its metrics.jsonl is not an andrea run's",
                          "--set train.name=")
        assert run_files(project) == theirs
    (project / "notes.md").write_text("mine")
    assert_user_error(andrea_main("train", "-c", str(mine), "--no-progress"),
                      "holds notes.md, which no andrea run holds")


def test_a_second_training_into_a_run_folder_with_a_space_quotes_its_resume(tmp_path, data_dir):
    """Before: `error: my runs/r: already holds a run; continue it with --resume my runs/r`,
    which a shell splits at the space. Now the folder is quoted in the option, not in the
    line's subject."""
    run_dir = make_checkpoint(tmp_path / "my runs", f"data.dir={data_dir}").parent
    line = assert_user_error(
        andrea_main("train", "-c", "andrea-tiny", "--no-progress", "--set", f"data.dir={data_dir}",
                    "--set", f"train.runs_dir={run_dir.parent}", "--set", "train.name=r"),
        f"error: {run_dir}: already holds a run")
    assert f"continue it with --resume '{run_dir}' (or --resume auto)" in line, line


def test_a_run_folder_with_links_in_place_of_its_files_is_refused(tmp_path, data_dir):
    """A run folder from elsewhere whose lock file or metrics.jsonl is a symbolic link: a
    resume wrote the lock's record over the file it pointed to, or appended the run's records
    to it. Refused in one line naming the links; the files they point to are untouched."""
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2")
    run_dir = train(cfg, progress=False).run_dir
    victim = tmp_path / "victim.txt"
    victim.write_text("important\n")
    (run_dir / ".andrea-train.lock").symlink_to(victim)
    assert_user_error(andrea_main("train", "--resume", str(run_dir), "--set",
                                  "train.max_steps=4"),
                      f".andrea-train.lock -> {victim}", "outside the run")
    (run_dir / ".andrea-train.lock").unlink()
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").symlink_to(victim)
    assert_user_error(andrea_main("train", "--resume", str(run_dir), "--set",
                                  "train.max_steps=4"), f"metrics.jsonl -> {victim}")
    assert victim.read_text() == "important\n"


def run_files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run folder by its path inside it, with its bytes."""
    return {str(f.relative_to(run_dir)): f.read_bytes() for f in sorted(run_dir.rglob("*"))
            if f.is_file()}


def test_an_overwrite_refused_by_the_data_size_keeps_the_old_run(tmp_path):
    """The issue's case: a data folder of 74,603 tokens, --overwrite with block_size 9000.
    The check of the data's size against one step's windows ran at the first batch, after the
    old run was deleted; now at set-up, before the run folder is touched."""
    text = tmp_path / "short.txt"
    text.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n"
                            for i in range(1500)))
    data = tmp_path / "short-byte"
    sets = [f"data.source={text}", f"data.dir={data}", f"train.runs_dir={tmp_path / 'runs'}",
            "train.name=edge4", "train.max_steps=2", "train.eval_every=0"]
    run_dir = train(load_config("andrea-tiny", sets), progress=False).run_dir
    before = run_files(run_dir)
    refused = andrea_main("train", "-c", "andrea-tiny", *[a for x in sets for a in ("--set", x)],
                          "--overwrite", "--set", "model.block_size=9000", "--no-progress")
    assert_user_error(refused, f"{data}: the train split has 74,603 tokens, too few for one "
                               f"global batch of 8 windows of 9,000 tokens")
    assert "deleting" not in refused.stdout, refused.stdout
    assert run_files(run_dir) == before  # checkpoint, latest, metrics, config: untouched


def test_an_overwrite_whose_start_fails_puts_the_old_run_back(tmp_path, data_dir, monkeypatch,
                                                              capsys):
    """The old run is set aside, not deleted, until the new run's start files are written and
    its plan said; anything that stops the start (here the plan's lines) puts it back."""
    from andrea.train import setup

    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2")
    run_dir = train(cfg, progress=False).run_dir
    before = run_files(run_dir)

    def fail(*args, **kwargs):
        raise UserError("the start failed")

    monkeypatch.setattr(setup, "announce", fail)
    with pytest.raises(UserError, match="the start failed"):
        train(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=1"), overwrite=True,
              progress=False)
    said = capsys.readouterr().out
    assert f"--overwrite: this run did not start; the run in {run_dir} is back as it was" in said
    assert run_files(run_dir) == before  # its own config and metrics, not the new run's


def test_a_signal_while_an_overwrite_sets_the_old_run_aside_puts_it_back(tmp_path, data_dir,
                                                                         monkeypatch, capsys):
    """Before: set_aside ran outside the try that puts the run back, so a Ctrl-C during its
    renames left the old run hidden in runs/NAME/.andrea-overwritten (5 of 6 tries of a user's)."""
    from andrea.train import rundir
    from andrea.train.signals import SetUpInterrupted

    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2", "train.checkpoint_every=1")
    run_dir = train(cfg, progress=False).run_dir
    before = run_files(run_dir)
    renames = []
    rename = Path.rename

    def interrupted_rename(self, target):
        renames.append(self.name)
        if len(renames) == 2:  # the signal lands between the second and third rename
            raise SetUpInterrupted(signal.SIGINT)
        return rename(self, target)

    monkeypatch.setattr(rundir.Path, "rename", interrupted_rename)
    stopped = train(cfg, overwrite=True, progress=False)
    monkeypatch.setattr(rundir.Path, "rename", rename)
    assert stopped.exit_code == 130 and renames[:2] == ["latest", "metrics.jsonl"]
    assert (f"--overwrite: this run did not start; the run in {run_dir} is back as it was"
            in capsys.readouterr().out)
    assert run_files(run_dir) == before and not (run_dir / rundir.OVERWRITTEN).exists()


def test_an_overwrite_killed_during_its_start_is_put_back_by_the_next_training(tmp_path,
                                                                               data_dir):
    """A process killed between setting the old run aside and deleting it (a kill -9, its node
    lost) leaves it in runs/NAME/.andrea-overwritten: the next training of the run, holding its
    lock, puts it back, and --resume continues it."""
    from andrea.train.rundir import OVERWRITTEN, set_aside

    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2", "train.checkpoint_every=1")
    run_dir = train(cfg, progress=False).run_dir
    before = run_files(run_dir)
    set_aside(run_dir)  # what the killed --overwrite had done, then its new start files:
    (run_dir / "config.yaml").write_text("the killed run's config\n")
    (run_dir / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n')
    assert not (run_dir / "latest").exists()
    resumed = andrea_main("train", "--resume", "auto", "-c", str(config_file(cfg, tmp_path)),
                          "--set", "train.max_steps=3", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith(f"{run_dir}: an --overwrite stopped during its set-up"), \
        resumed.stdout
    assert "resuming from" in resumed.stdout and not (run_dir / OVERWRITTEN).exists()
    after = run_files(run_dir)
    assert all(after[name] == blob for name, blob in before.items()
               if name.startswith("step-"))
    assert after["metrics.jsonl"].startswith(before["metrics.jsonl"])
    assert [c.name for c in step_dirs(run_dir)][-1] == "step-000003"

    # Killed before it wrote anything of its own: `--resume RUN` (the docs' first form) and
    # eval, which said the folder was not a run, find the run set aside.
    set_aside(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == [OVERWRITTEN]
    listed = andrea_main("runs", str(run_dir.parent))
    assert listed.returncode == 0 and listed.stdout.splitlines()[1].startswith("t "), listed
    assert f"left the old run in {run_dir / OVERWRITTEN}" in listed.stdout
    for named in (run_dir, run_dir / "step-000003"):  # the run, or a step folder of it
        assert_user_error(andrea_main("eval", "--checkpoint", str(named)),
                          f"left the run in {run_dir / OVERWRITTEN}",
                          f"andrea train --resume {run_dir}")
    # Once the killed --overwrite had written its start files, `andrea runs` lists the run: its
    # note says the same, never "start it over", which would replace the run set aside.
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    (run_dir / "metrics.jsonl").write_text(json.dumps(
        {"event": "start", "step": 0, "pid": dead_pid(), "host": socket.gethostname()}) + "\n")
    notes = andrea_main("runs", str(run_dir.parent)).stdout
    assert (f"an --overwrite that stopped during its set-up left the old run in "
            f"{run_dir / OVERWRITTEN}; any training of the run puts it back: andrea train "
            f"--resume {run_dir}") in notes, notes
    assert "start it over" not in notes
    resumed = andrea_main("train", "--resume", str(run_dir), "--set", "train.max_steps=4",
                          "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith(f"{run_dir}: an --overwrite stopped during its set-up")
    assert [c.name for c in step_dirs(run_dir)][-1] == "step-000004"


def test_a_file_where_the_run_folder_goes_is_named_with_what_to_do(tmp_path, data_dir):
    """Before: `cannot write the run folder: File exists` and `--resume: no such run
    directory`, neither naming the file nor what to do."""
    (tmp_path / "rd").mkdir()
    (tmp_path / "rd" / "x").write_text("notes\n")
    path = config_file(tiny_config(tmp_path / "rd", data_dir, name="x"), tmp_path)
    assert_user_error(andrea_main("train", "-c", str(path), "--no-progress"),
                      f"{tmp_path / 'rd' / 'x'} is a file, not a folder; move it away")
    assert_user_error(andrea_main("train", "--resume", str(tmp_path / "rd" / "x")),
                      "is a file; give a run folder")
    assert (tmp_path / "rd" / "x").read_text() == "notes\n"


def test_bad_resumes_are_clear_errors(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2")
    result = train(cfg, progress=False)
    run = str(result.run_dir)
    assert_user_error(andrea_main("train", "--resume", str(tmp_path)), "not a run")
    assert_user_error(andrea_main("train", "--resume", str(tmp_path / "nope")), "no such run")
    assert_user_error(
        andrea_main("train", "--resume", run, "--set", "model.n_layer=3"),
        "cannot change", "model.n_layer (2 -> 3)",
    )
    assert_user_error(andrea_main("train", "-c", str(config_file(cfg, tmp_path))),
                      "already holds a run", "--resume")

    stored = load_config(result.run_dir / "config.yaml")
    shape_dir = tmp_path / "shape"
    shape_dir.mkdir()
    (shape_dir / "config.yaml").write_text(
        (result.run_dir / "config.yaml").read_text()
        .replace(f"head_dim: {stored.model.head_dim}", "head_dim: 8")
        .replace(f"d_model: {stored.model.d_model}", "d_model: 32"))
    (shape_dir / "latest").write_text(result.checkpoint.name)
    shutil.copytree(result.checkpoint, shape_dir / result.checkpoint.name)
    # Found in the weights file's header, before a model is built (check_checkpoint_shape).
    assert_user_error(
        andrea_main("train", "--resume", str(shape_dir), "--set", "train.max_steps=3"),
        f"{shape_dir / 'config.yaml'}: the config does not describe the stored weights",
        f"vocab_size x d_model {stored.model.vocab_size} x 32 (tok_emb.weight is "
        f"[{stored.model.vocab_size}, {stored.model.d_model}])",
    )

    model_file = result.checkpoint / MODEL_FILE
    model_file.write_bytes(model_file.read_bytes()[:1000])
    assert_user_error(andrea_main("train", "--resume", run, "--set", "train.max_steps=3"),
                      "model.safetensors", "truncated")


def test_train_from_python_refuses_resume_with_overwrite_as_the_command_does(tmp_path, data_dir):
    """resume= with overwrite=True resumed, the overwrite dropped without a word: the command
    refuses the pair, and from Python it is the same UserError, the run left as it was."""
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2")
    result = train(cfg, progress=False)
    before = sorted(p.name for p in result.run_dir.iterdir())
    with pytest.raises(UserError, match="^--resume auto --overwrite: give one"):
        train(cfg, resume="auto", overwrite=True, progress=False)
    assert sorted(p.name for p in result.run_dir.iterdir()) == before


def test_a_run_paused_after_one_step_says_step(tmp_path, data_dir):
    """The last line said 'paused after 1 steps (--stop-after)'."""
    result = train(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2"),
                   progress=False, stop_after=1)
    assert result.message.startswith("paused after 1 step (--stop-after); "), result.message


@pytest.mark.parametrize("stop_after", [0, -1])
def test_train_from_python_refuses_a_stop_after_below_one(tmp_path, data_dir, stop_after):
    """stop_after=0 trained a step and said 'paused after 0 steps'; the command's --stop-after
    takes at least 1, and from Python it is a UserError before anything is written."""
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2")
    with pytest.raises(UserError, match=f"^--stop-after {stop_after}: expected a number of steps"):
        train(cfg, progress=False, stop_after=stop_after)
    assert not (tmp_path / "runs").exists()


def test_interrupt_mid_accumulation_resumes_bit_for_bit(tmp_path, data_dir, inject_faults):
    sets = ("train.max_steps=6", "train.precision=fp32", "model.dropout=0.1",
            "train.global_batch_tokens=2048")  # 4 micro-batches a step; dropout uses the RNG
    whole = train(tiny_config(tmp_path / "a" / "runs", data_dir, *sets), progress=False)
    cfg = tiny_config(tmp_path / "b" / "runs", data_dir, *sets)
    inject_faults("sigint@3.1")  # Ctrl-C in step 4's 2nd micro-batch
    cut = train(cfg, progress=False)
    inject_faults(None)
    assert (cut.state, cut.exit_code, cut.steps) == ("interrupted", 130, 3)
    assert cut.checkpoint.name == "step-000003" and "after step 3" in cut.message
    rest = train(cfg, resume=str(cut.run_dir), progress=False)
    assert {**cut.losses, **rest.losses} == whole.losses  # exact float equality, every step
    a = ckpt_io.read_model_checkpoint(whole.checkpoint)[0]
    b = ckpt_io.read_model_checkpoint(rest.checkpoint)[0]
    assert all(torch.equal(a[k], b[k]) for k in a)
    opt_a, _ = ckpt_io.read_safetensors(whole.checkpoint / OPTIMIZER_FILE)
    opt_b, _ = ckpt_io.read_safetensors(rest.checkpoint / OPTIMIZER_FILE)
    assert all(torch.equal(opt_a[k], opt_b[k]) for k in opt_a)


def test_a_signal_during_the_last_step_lets_the_run_finish(tmp_path, data_dir, inject_faults):
    inject_faults("sigint@1.0")
    result = train(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2"), progress=False)
    assert (result.state, result.exit_code, result.steps) == ("finished", 0, 2)
    assert result.checkpoint.name == "step-000002"


def test_interrupt_before_the_first_step_writes_and_mentions_no_checkpoint(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=5",
                      "train.global_batch_tokens=2048")
    proc = andrea_main("train", "-c", str(config_file(cfg, tmp_path)), "--no-progress",
                       env={"ANDREA_FAULTS": "sigint@0.0"})
    assert proc.returncode == 130, proc.stderr
    assert "checkpointing the last completed step" in proc.stderr
    assert "before its first step; no checkpoint was written" in proc.stderr
    assert "step-0" not in proc.stdout + proc.stderr
    run_dir = Path(cfg.train.runs_dir) / "t"
    assert not step_dirs(run_dir) and not (run_dir / "latest").exists()
    (end,) = read_events(run_dir, "end")
    assert end["state"] == "interrupted" and end["checkpoint"] is None and end["step"] == 0
    table = andrea_main("runs", str(run_dir.parent))
    assert table.returncode == 0, table.stderr
    assert "interrupted (SIGINT)" in table.stdout and "crashed" not in table.stdout
    again = andrea_main("train", "-c", str(config_file(cfg, tmp_path)), "--no-progress")
    assert again.returncode == 0, again.stderr  # nothing to resume: a new run starts


def test_plan_line_and_progress_in_tokens(tmp_path, data_dir, capsys):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=1000000",
                      "train.global_batch_tokens=1024")
    result = train(cfg, progress=True, stop_after=2)
    assert result.state == "stopped"
    out, err = capsys.readouterr()
    passes = 1_000_000 * 1024 / TokenSplit(Path(cfg.data.dir), "train").n_tokens
    assert (f"plan: 1,000,000 steps x 1,024 tokens/step = 1,024,000,000 tokens = "
            f"{passes:,.1f} passes over the") in out
    assert f"warning: {passes:,.0f} passes over the same training tokens" in out
    # The bar counts tokens and moves per micro-batch: 2 steps x 2 micro-batches of 512.
    assert "tok/s" in err and "2.05k/1.02G" in err and "step 2/1000000" in err


def test_micro_batch_auto_fits_memory_and_keeps_the_global_batch():
    model = load_config("andrea-120m").model
    n = 124_373_760

    def pick(gib: float, checkpointing: bool = False):
        return choose_micro_batch(model, n, 12, torch.bfloat16, checkpointing=checkpointing,
                                  available=int(gib * 2**30))

    big, small = pick(1000), pick(5)
    assert big.micro_batch == 12 and big.fits  # the whole per-rank batch at once
    assert 12 % small.micro_batch == 0 and small.micro_batch < 12 and small.fits
    larger = [m for m in (12, 6, 4, 3, 2) if m > small.micro_batch]
    assert all(estimate_peak_bytes(model, n, m, torch.bfloat16, False) > 5 * 2**30 * HEADROOM
               for m in larger)
    assert pick(5, checkpointing=True).micro_batch > small.micro_batch
    none = pick(1)
    assert none.micro_batch == 1 and not none.fits
    # A cap (a CPU's) takes the largest divisor at or under it, whatever memory allows.
    assert choose_micro_batch(model, n, 12, torch.bfloat16, checkpointing=False,
                              available=1000 * 2**30, max_sequences=4).micro_batch == 4
    assert choose_micro_batch(model, n, 12, torch.bfloat16, checkpointing=False,
                              available=1000 * 2**30, max_sequences=5).micro_batch == 4
    assert choose_micro_batch(model, n, 12, torch.bfloat16, checkpointing=False,
                              available=5 * 2**30, max_sequences=12).micro_batch \
        == small.micro_batch


def test_the_estimate_weighs_each_parameter_and_token_as_its_precision_keeps_them():
    """A parameter: 16 bytes in float32 (weights, gradients, AdamW's two moments), 2 more under
    half-precision autocast (its cached copy of the weights). A token with activation
    checkpointing keeps each layer's input (6 units of d_model) and one block recomputed (26 in
    float32) instead of every layer's 26."""
    model = load_config("andrea-tiny").model
    for dtype, per_param in ((torch.float32, 16), (torch.bfloat16, 18), (torch.float16, 18)):
        one, more = (estimate_peak_bytes(model, n, 1, dtype, False) for n in (1000, 1001))
        assert more - one == per_param, dtype
    plain, checkpointed = (estimate_peak_bytes(model, 1000, 2, torch.float32, ckpt)
                           for ckpt in (False, True))
    kept = model.n_layer * 26 - (model.n_layer * 6 + 26)  # units of d_model a token saves
    assert plain - checkpointed == 2 * model.block_size * kept * model.d_model * 4


def test_a_step_that_the_processes_cannot_share_says_what_would_split_it():
    """Resumed on another process count, or started with micro_batch_size auto: the error named
    a fixed key (a resume may not change global_batch_tokens) or a micro-batch auto had picked,
    and no way out. It now gives a micro-batch that divides a process's windows where one does,
    and says where none can."""
    from andrea.train.batch import accumulation_steps, windows_per_process

    def cfg(tokens: int):
        return load_config("andrea-tiny", [f"train.global_batch_tokens={tokens}"])  # block 64

    # A 3-process run of 768 tokens a step (micro-batch 4) resumed on 2: 6 windows each.
    with pytest.raises(UserError) as caught:
        accumulation_steps(cfg(768), 4, 2)
    assert str(caught.value).endswith(
        "is not a multiple of micro_batch_size * block_size * processes = 4 * 64 * 2 = 512; "
        "each process takes 6 windows a step: give a micro-batch that divides them, e.g. "
        "--set train.micro_batch_size=3")
    assert accumulation_steps(cfg(768), 3, 2) == (2, "")  # as the line says
    # Under a batch warm-up the micro-batch must divide its windows too (384 tokens: 6).
    warm = load_config("andrea-tiny", ["train.global_batch_tokens=768",
                                       "train.batch_warmup_tokens=384",
                                       "train.batch_warmup_steps=2"])
    with pytest.raises(UserError, match="e.g. --set train.micro_batch_size=3$"):
        accumulation_steps(warm, 5, 1)
    for tokens, world, why, other_count in (
            (1024, 3, "1,024 is 16 windows of 64 tokens, which 3 processes cannot share evenly",
             ", or train on a number of processes that divides the step's windows"),
            (128, 4, "128 is less than one 64-token window for each of 4 processes",
             ", or train on fewer processes"),
            (1000, 1, "1,000 is not whole 64-token windows", "")):
        with pytest.raises(UserError) as caught:
            windows_per_process(cfg(tokens), world)
        assert str(caught.value).endswith(
            f"train.global_batch_tokens: {why}; a step's tokens must be a multiple of "
            f"block_size x processes = {64 * world:,} (a new run){other_count}")
    assert windows_per_process(cfg(1024), 4) == 4


def test_micro_batch_auto_is_resolved_recorded_and_reused(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.micro_batch_size=auto",
               "train.global_batch_tokens=2048", "train.max_steps=3")
    path = config_file(cfg, tmp_path)
    proc = andrea_main("train", "-c", str(path), "--no-progress", "--stop-after", "1")
    assert proc.returncode == 0, proc.stderr
    # The tiny model fits at once: all 32 sequences of the step in one micro-batch.
    assert "micro-batch: auto -> 32 x 64 (1 accumulation step), estimated" in proc.stdout
    # Said before the line that uses it (it came after that line and the warm-up's own sizes).
    said = proc.stdout.splitlines()
    choice = next(i for i, line in enumerate(said) if line.startswith("micro-batch: auto"))
    assert "tokens/step (32 x 64 x 1 accumulation" in said[choice + 1]
    run_dir = Path(cfg.train.runs_dir) / "t"
    assert read_events(run_dir, "start")[0]["micro_batch_size"] == 32
    assert load_config(run_dir / "config.yaml").train.micro_batch_size == "auto"
    assert ckpt_io.read_trainer_state(run_dir / "step-000001")[0].micro_batch_size == 32
    rest = andrea_main("train", "--resume", str(run_dir), "--no-progress")
    assert rest.returncode == 0, rest.stderr
    assert "micro-batch: auto -> 32 x 64 (the run's recorded choice)" in rest.stdout
    explicit = andrea_main("train", "-c", str(path), "--no-progress", "--overwrite",
                           "--set", "train.micro_batch_size=8", "--stop-after", "1")
    assert explicit.returncode == 0, explicit.stderr
    assert "micro-batch: auto" not in explicit.stdout and "8 x 64 x 4 accumulation" in (
        explicit.stdout)
    assert_user_error(
        andrea_main("train", "-c", str(path), "--set", "train.name=t2",
                    "--set", "train.global_batch_tokens=0"),
        "train.micro_batch_size: auto needs train.global_batch_tokens of at least",
    )


def recorded_attention(ckpt: Path, backend: str | None) -> None:
    """Rewrite the checkpoint's trainer_state.json as if the run had run `backend` (None: as a
    checkpoint from before the record), with its checksum, so that it still reads as intact."""
    raw = json.loads((ckpt / TRAINER_STATE).read_text())
    raw.pop("attention")
    if backend is not None:
        raw["attention"] = backend
    (ckpt / TRAINER_STATE).write_text(json.dumps(raw, indent=1))
    sums = json.loads((ckpt / CHECKSUMS).read_text())["files"]
    write_checksums(ckpt, {**sums, TRAINER_STATE: file_sha256(ckpt / TRAINER_STATE)})


def test_the_attention_backend_is_recorded_and_a_resume_never_changes_it_silently(
    tmp_path, data_dir
):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                      "train.checkpoint_every=1")
    first = andrea_main("train", "-c", str(config_file(cfg, tmp_path)), "--no-progress",
                        "--stop-after", "1")
    assert first.returncode == 0, first.stderr
    assert "attention: sdpa (auto: no GPU)" in first.stdout
    run_dir = Path(cfg.train.runs_dir) / "t"
    assert json.loads((run_dir / "step-000001" / TRAINER_STATE).read_text())["attention"] == "sdpa"

    def resume(recorded: str | None, *sets: str) -> tuple[str, Path]:
        copy = tmp_path / "runs" / f"copy-{recorded}-{len(sets)}"
        shutil.copytree(run_dir, copy)
        recorded_attention(copy / "step-000001", recorded)
        proc = andrea_main("train", "--resume", str(copy), "--no-progress",
                           *(a for s in sets for a in ("--set", s)))
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, copy

    # A run that ran the kernels, resumed where they cannot run: said, and recorded anew.
    out, copy = resume("cuda")
    assert ("resume: attention cuda -> sdpa (cuda cannot run here: no GPU: the CUDA kernels "
            "need one)") in out
    assert "attention: sdpa (auto: no GPU)" in out
    assert json.loads((copy / "step-000002" / TRAINER_STATE).read_text())["attention"] == "sdpa"
    # auto keeps a recorded backend that runs here, even where a new run would take another.
    out, copy = resume("math")
    assert "attention: math (auto: the run's recorded choice; a new run would take sdpa)" in out
    assert "resume: attention" not in out
    assert read_events(copy, "start")[-1]["attention"] == "math"
    assert json.loads((copy / "step-000002" / TRAINER_STATE).read_text())["attention"] == "math"
    # The user's own model.attention decides, in one line for both the key and the backend.
    out, _ = resume("math", "model.attention=sdpa")
    assert "resume: attention math -> sdpa (model.attention auto -> sdpa)" in out
    assert "resume: model.attention" not in out
    # A checkpoint from before the record resolves model.attention afresh, as it always did.
    out, copy = resume(None)
    assert "attention: sdpa (auto: no GPU)" in out and "resume: attention" not in out
    assert json.loads((copy / "step-000002" / TRAINER_STATE).read_text())["attention"] == "sdpa"


def test_resume_may_change_only_keys_that_keep_the_runs_meaning(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2")
    result = train(cfg, progress=False)
    run = str(result.run_dir)
    assert_user_error(andrea_main("train", "--resume", run, "--set", "train.lr=0.01"),
                      "train.lr (0.003 -> 0.01)", "cannot change")
    # --config with --resume must agree with the run on every meaning-carrying key.
    other = load_config(config_file(cfg, tmp_path), ["train.warmup_steps=3", "model.n_layer=3"])
    other_path = tmp_path / "other.yaml"
    other_path.write_text(other.to_yaml())
    assert_user_error(andrea_main("train", "-c", str(other_path), "--resume", run),
                      "train.warmup_steps (10 -> 3)", "model.n_layer (2 -> 3)")
    metrics_before = (result.run_dir / "metrics.jsonl").read_bytes()
    config_before = (result.run_dir / "config.yaml").read_bytes()

    # Already at max_steps: one line, exit 0, the run untouched.
    for steps in ("2", "1"):
        proc = andrea_main("train", "--resume", run, "--set", f"train.max_steps={steps}")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == (
            f"run {run} is already at step 2 (max_steps {steps}): nothing to do")
        assert proc.stderr == ""
    assert (result.run_dir / "metrics.jsonl").read_bytes() == metrics_before
    assert (result.run_dir / "config.yaml").read_bytes() == config_before

    # A larger max_steps continues the finished run; the change is printed and recorded.
    proc = andrea_main("train", "--resume", run, "--no-progress", "--set", "train.max_steps=4",
                       "--set", "train.log_every=2")
    assert proc.returncode == 0, proc.stderr
    assert "resume: train.max_steps 2 -> 4" in proc.stdout
    assert "resume: train.log_every 1 -> 2" in proc.stdout and "finished: 4 steps" in proc.stdout
    start = read_events(result.run_dir, "start")[-1]
    assert start["changed"] == {"train.max_steps": [2, 4], "train.log_every": [1, 2]}
    stored = load_config(result.run_dir / "config.yaml")
    assert (stored.train.max_steps, stored.train.log_every, stored.train.lr) == (4, 2, 0.003)


def test_extending_a_run_that_decayed_to_lr_zero_is_refused(tmp_path, data_dir):
    """wsd to min_lr 0 (the 12M preset's schedule) ends at lr 0: a longer max_steps on resume
    would train at lr 0 without a word. It is one line naming the way that works, and that way
    (a checkpoint from before the decay) trains on, holding lr and decaying over the new end."""
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=4", "train.warmup_steps=1",
               "train.schedule=wsd", "train.min_lr=0", "train.decay_fraction=0.5",
               "train.checkpoint_every=1", "train.keep_last=5")
    result = train(cfg, progress=False)
    before = (result.run_dir / "metrics.jsonl").read_bytes()
    assert_user_error(
        andrea_main("train", "--resume", str(result.run_dir), "--set", "train.max_steps=8"),
        f"{result.run_dir}: resume: train.max_steps 4 -> 8: the run had decayed to lr 0 by step 4",
        "resume from an earlier checkpoint (kept here: step-000002, step-000001; one of step 1 "
        "or earlier holds the peak lr longer")
    assert (result.run_dir / "metrics.jsonl").read_bytes() == before
    proc = andrea_main("train", "--resume", str(result.run_dir / "step-000001"), "--no-progress",
                       "--set", "train.max_steps=8")
    assert proc.returncode == 0, proc.stderr
    assert ("resume: step-000001 is older than this run's step-000002 to step-000004, which "
            "stay until this resume trains past them, each then replaced or pruned "
            "(train.keep_last); copy the run folder first to keep them") in proc.stdout
    lrs = {r["step"]: r["lr"] for r in read_events(result.run_dir, "train")}
    assert lrs[2] == lrs[3] == lrs[4] == cfg.train.lr and 0 < lrs[7] < lrs[5] < cfg.train.lr


def test_resume_auto_keeps_the_runs_own_config(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2", "train.warmup_steps=3")
    path = config_file(cfg, tmp_path)
    train(cfg, progress=False)
    changed = load_config(path, ["train.warmup_steps=5"])
    path.write_text(changed.to_yaml())  # as if the preset changed since the run began
    assert_user_error(andrea_main("train", "-c", str(path), "--resume", "auto"),
                      "train.warmup_steps (3 -> 5)")
    same = andrea_main("train", "-c", str(path), "--resume", "auto", "--no-progress",
                       "--set", "train.warmup_steps=3", "--set", "train.max_steps=3")
    assert same.returncode == 0, same.stderr
    assert "finished: 3 steps" in same.stdout


def test_one_command_with_resume_auto_starts_the_run_then_continues_it(tmp_path, data_dir):
    """docs/faults.md's requeued job: the same `andrea train -c CFG --resume auto` every time.
    The first launch finds no checkpoint and starts the run, each later one continues it from
    its newest, the last finds it finished; the steps are those of one uninterrupted run."""
    sets = ("train.max_steps=4", "train.checkpoint_every=1")
    whole = train(tiny_config(tmp_path / "whole", data_dir, *sets), progress=False)
    path = config_file(tiny_config(tmp_path / "runs", data_dir, *sets), tmp_path)
    said = []
    for _ in range(3):
        proc = andrea_main("train", "-c", str(path), "--resume", "auto", "--stop-after", "2",
                           "--no-progress")
        assert proc.returncode == 0, proc.stderr
        said.append(proc.stdout)
    run = tmp_path / "runs" / "t"
    assert f"--resume auto: no checkpoint under {run}, starting a new run" in said[0], said[0]
    assert "starting a new run" not in said[1] + said[2]
    losses = {r["step"]: r["loss"] for r in read_events(run, "train")}
    assert losses == whole.losses  # exact: steps 1-2, then 3-4 from step 2's checkpoint
    assert (run / "latest").read_text().strip() == "step-000004"


def test_an_untrained_run_may_still_change_its_schedule(tmp_path, data_dir):
    """An import is a run at step 0: fine-tuning picks its own schedule and data."""
    ckpt = make_checkpoint(tmp_path, f"data.dir={data_dir}", step=0)
    run = ckpt.parent
    cfg = load_config(run / "config.yaml", ["train.lr=0.01", "train.max_steps=2"])
    result = train(cfg, resume=str(run), progress=False)
    assert result.steps == 2
    assert read_events(run, "start")[0]["changed"]["train.lr"] == [0.003, 0.01]
    with pytest.raises(UserError, match=r"model.n_layer \(2 -> 3\)"):
        train(load_config(run / "config.yaml", ["model.n_layer=3"]), resume=str(run))


@pytest.mark.parametrize("capability", [(7, 5), (8, 0)])
def test_muon_iterates_in_bf16_only_where_the_gpu_has_bf16_units(monkeypatch, capability):
    """A T4 or V100 reports bf16 'supported' only through emulation (slower than fp32): Muon's
    Newton-Schulz iterations take fp32 there (never fp16, whose range they would not keep),
    while the model itself trains in fp16 (tests/test_fp16.py has the whole table)."""
    native = capability >= (8, 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native or including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda")
    want = torch.bfloat16 if native else torch.float32
    assert pick_dtype("auto", cuda) == (torch.bfloat16 if native else torch.float16)
    assert pick_dtype("bf16", cuda) == torch.bfloat16  # asked for by name: obeyed
    cfg = load_config("andrea-tiny", ["train.optimizer=muon"])
    optimizer = build_optimizer(Andrea(cfg.model), cfg, cuda)
    assert getattr(optimizer.parts["muon"], "ns_dtype", torch.bfloat16) == want


@pytest.mark.parametrize("version", [2, 1])
def test_auto_micro_batch_on_a_cpu_reads_the_containers_memory_limit(
    tmp_path, monkeypatch, version
):
    """In a container the machine's MemAvailable is not what the process may use: the cgroup
    limit (less its usage, plus the page cache the kernel reclaims first) is, when lower."""
    from andrea.train import memory

    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "self-cgroup")
    cpu = torch.device("cpu")
    fake_cgroup(tmp_path, version, str(3 * 2**30), usage=2**30, cache=2**28)
    assert memory.available_memory(cpu, processes_here=2) == (2 * 2**30 + 2**28) // 2
    # With no limit ("max"; v1's huge number) the machine's memory counts, as before.
    unlimited = "max" if version == 2 else str(2**63 - 4096)
    limit_file = ("job/memory.max" if version == 2 else "memory/memory.limit_in_bytes")
    (tmp_path / limit_file).write_text(unlimited + "\n")
    assert memory.cgroup_memory_left() is None
    assert memory.available_memory(cpu, processes_here=2) > (2 * 2**30 + 2**28) // 2


def test_ranks_a_checkpoint_has_no_generator_state_for_get_their_own_seed(monkeypatch):
    """A run resumed on more processes: the checkpoint holds rank 0's generator states only.
    Ranks 1 and 2 each get a fresh seed of their own (seed + rank), not one shared state; and
    on a GPU after a CPU run the CUDA generator is seeded too, per rank."""
    from andrea.train.torchrun import DistInfo
    from andrea.train.training_state import restore_rng_states, seed_for_rank

    torch.manual_seed(123)
    saved = {"cpu.rank0": torch.get_rng_state()}
    states = {}
    for rank in (0, 1, 2):
        torch.manual_seed(7)  # what every rank's generator holds before the restore
        restore_rng_states(saved, torch.device("cpu"), DistInfo(rank, rank, 3),
                           seed_for_rank(5, rank))
        states[rank] = torch.get_rng_state()
    assert torch.equal(states[0], saved["cpu.rank0"])
    torch.manual_seed(5 + 1)
    assert torch.equal(states[1], torch.get_rng_state())
    assert not torch.equal(states[1], states[2]) and not torch.equal(states[0], states[2])

    seeded, restored = [], []
    monkeypatch.setattr(torch.cuda, "manual_seed", seeded.append)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append(state))
    for rank in (0, 1):
        restore_rng_states(saved, torch.device("cuda"), DistInfo(rank, rank, 2),
                           seed_for_rank(5, rank))
    assert seeded == [5, 6] and restored == []  # the CPU run's checkpoint has no CUDA state


def test_a_vocab_larger_than_the_tokenizers_ids_is_noted_with_the_size_that_fits(
    tmp_path, data_dir, capsys
):
    """A BPE trained on a small text reaches fewer ids than model.vocab_size: the rows past
    them (embedding and LM head) trained nothing, without a word. A new run now says how
    many and the model.vocab_size that fits; the presets' own padding (a byte tokenizer's 257
    ids in 320 rows) is within one multiple of 64 and says nothing."""
    cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=1", "model.vocab_size=1000")
    train(cfg, progress=False)
    assert ("note: the tokenizer has 257 ids and model.vocab_size is 1,000: 743 embedding rows "
            "(47,552 parameters) no token uses; a new run with --set model.vocab_size=320 trains "
            "without them\n") in capsys.readouterr().out
    train(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=1", "train.name=padded"),
          progress=False)
    assert "no token uses" not in capsys.readouterr().out
