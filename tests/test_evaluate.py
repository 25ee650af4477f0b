"""`andrea eval`: loss against a float64 hand computation, bits per byte, run discovery, errors."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import andrea_main, assert_user_error, make_checkpoint

from andrea.data.loader import TokenSplit
from andrea.data.prepare import prepare_inputs
from andrea.data.tokenizer import ByteTokenizer, Gpt2Tokenizer, train_bpe
from andrea.evaluate import EvalResult, evaluate_checkpoint, format_results
from andrea.trained import load_model


def hand_nats(ckpt, tokens: np.ndarray, block: int, windows=None) -> float:
    """Sum of -log p(next token) in float64 over windows (start, targets) of `tokens`; by
    default windows of `block` targets from the start."""
    model, _, _ = load_model(ckpt)
    model = model.double()
    if windows is None:
        windows = [(s, min(block, len(tokens) - 1 - s)) for s in range(0, len(tokens) - 1, block)]
    total = 0.0
    for start, n in windows:
        window = torch.from_numpy(tokens[start : start + n + 1].astype(np.int64))
        logits, _ = model(window[None, :-1])
        logp = torch.log_softmax(logits[0], dim=-1)
        total -= logp[torch.arange(len(window) - 1), window[1:]].sum().item()
    return total


def test_loss_equals_hand_computation(trained_tiny, data_dir):
    """--max-tokens 300: five windows of 64 targets spread evenly over the val split (the
    last cut to 44), scored as a float64 hand computation."""
    result = evaluate_checkpoint(str(trained_tiny.run_dir), None, max_tokens=300, precision="fp32",
                                 device="cpu", batch_size=2, progress=False)
    assert result.tokens == 300 and result.checkpoint == str(trained_tiny.checkpoint)
    (val,) = TokenSplit(data_dir, "val").shards  # one shard
    val = np.asarray(val)
    n_full = (len(val) - 1) // 64
    starts = [64 * (j * n_full // 5) for j in range(5)]
    assert starts[-1] > 0.7 * len(val)  # the windows reach the end of the split
    windows = [(s, 64) for s in starts[:4]] + [(starts[4], 44)]
    nats = hand_nats(trained_tiny.checkpoint, val, 64, windows)
    assert result.loss == pytest.approx(nats / 300, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nats / 300), rel=1e-5)
    targets = np.concatenate([val[s + 1 : s + n + 1] for s, n in windows])
    n_bytes = int((targets != ByteTokenizer.eot_id).sum())
    assert result.bytes == n_bytes
    assert result.bits_per_byte == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    # bf16 autocast: the same pass, close to fp32.
    bf16 = evaluate_checkpoint(str(trained_tiny.run_dir), None, 300, "bf16", "cpu", 8, False)
    assert bf16.tokens == 300 and bf16.loss == pytest.approx(result.loss, rel=2e-2)


def test_bits_per_byte_on_a_known_text(tmp_path, trained_tiny):
    val_text = "héllo wörld ✓ 🙂 日本\n" * 3
    val_bytes = val_text.encode("utf-8")
    assert len(val_bytes) <= 99  # so the val split starts right after the 901-byte first line
    (tmp_path / "known.txt").write_text("x" * 900 + "\n" + val_text, encoding="utf-8")
    data = prepare_inputs(str(tmp_path / "known.txt"), "byte", tmp_path / "known", verbose=False)
    split = TokenSplit(data, "val")
    tokens = np.asarray(split.shards[0])
    assert bytes(tokens[:-1].tolist()) == val_bytes and tokens[-1] == ByteTokenizer.eot_id

    result = evaluate_checkpoint(str(trained_tiny.checkpoint), str(data), None, "fp32", "cpu", 4,
                                 False)
    # Targets: every token but the first; end-of-text stands for no bytes.
    assert result.tokens == len(val_bytes) and result.bytes == len(val_bytes) - 1
    nats = hand_nats(trained_tiny.checkpoint, tokens, 64)
    assert result.bits_per_byte == pytest.approx(nats / math.log(2) / (len(val_bytes) - 1),
                                                 rel=1e-5)


TEXT = "héllo wörld ✓ 🙂 日本語 — naïve café\n<|endoftext|> 123"


def test_byte_lengths_sum_to_the_utf8_length():
    gpt2 = Gpt2Tokenizer()
    ids = gpt2.encode(TEXT)
    lengths = gpt2.token_byte_lengths()
    assert len(ids) > 10 and lengths[gpt2.eot_id] == 0
    assert int(lengths[ids].sum()) == len(TEXT.encode("utf-8"))
    # Every token on its own, even the ones that hold part of a character.
    pieces = [i for i in ids if lengths[i] != len(gpt2.decode([i]).encode("utf-8"))]
    assert pieces, "the emoji and CJK text should split inside characters"


def test_byte_lengths_of_a_trained_bpe(tmp_path):
    texts = ["the cat sat on the mat, naïve café ✓ 🙂\n"] * 50
    bpe = train_bpe(iter(texts), 300, tmp_path / "tokenizer.json")
    lengths = bpe.token_byte_lengths()
    ids = bpe.encode(TEXT)
    assert lengths[bpe.eot_id] == 0
    assert int(lengths[ids].sum()) == len(TEXT.encode("utf-8"))


def test_most_recent_run_and_json_on_the_command_line(tmp_path, trained_tiny):
    older = make_checkpoint(tmp_path, "train.name=old")  # no data: eval of it would fail
    os.utime(older / "model.safetensors", (1, 1))
    newer = tmp_path / "runs" / "new"
    os.symlink(trained_tiny.run_dir, newer)
    proc = andrea_main("eval", "--json", "--no-progress", "--max-tokens", "128",
                       "--precision", "fp32", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (out,) = json.loads(proc.stdout)
    assert out["checkpoint"] == "runs/new/step-000040" and out["tokens"] == 128
    assert "runs/new/step-000040 (the most recent run under runs/)" in proc.stderr
    direct = evaluate_checkpoint(str(trained_tiny.checkpoint), None, 128, "fp32", "cpu", 8, False)
    assert out["loss"] == pytest.approx(direct.loss, rel=1e-6)


def test_a_run_is_named_as_andrea_runs_lists_it(tmp_path, trained_tiny):
    """`--checkpoint NAME`: the run of that name under ./runs, as `andrea runs` shows it and
    `train --resume NAME` takes it. eval, generate and export said "no such checkpoint"."""
    (tmp_path / "runs").mkdir()
    os.symlink(trained_tiny.run_dir, tmp_path / "runs" / "mine")
    proc = andrea_main("eval", "--checkpoint", "mine", "--json", "--no-progress",
                       "--max-tokens", "128", "--precision", "fp32", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["checkpoint"] == "runs/mine/step-000040"
    steps = andrea_main("eval", "--checkpoint", "mine", "--all-steps", "--json",
                        "--no-progress", "--max-tokens", "64", "--precision", "fp32",
                        cwd=tmp_path)
    assert [r["checkpoint"] for r in json.loads(steps.stdout)] == [
        "runs/mine/step-000020", "runs/mine/step-000040"], steps.stderr
    generated = andrea_main("generate", "--checkpoint", "mine", "-n", "4", "--seed", "1",
                            cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr
    exported = andrea_main("export", "--checkpoint", "mine", "--out", "hf", cwd=tmp_path)
    assert exported.returncode == 0 and (tmp_path / "hf" / "config.json").is_file(), \
        exported.stderr
    # A folder of that name here is what the name means: a copied step folder holds no run's
    # files, and was passed over for runs/mine's latest (another model, without a word).
    shutil.copytree(trained_tiny.run_dir / "step-000020", tmp_path / "mine")
    here = andrea_main("eval", "--checkpoint", "mine", "--json", "--no-progress",
                       "--max-tokens", "128", "--precision", "fp32", cwd=tmp_path)
    assert json.loads(here.stdout)[0]["checkpoint"] == "mine", here.stderr


def test_all_steps_scores_the_runs_history_as_it_stands(tmp_path, trained_tiny):
    """Before: a run resumed from its step-000020 (its step-000040 left behind until the resume
    trains past it) was scored by --all-steps as 20, 30, 40, the old line's step 40 in the same
    column as the new line's, one curve of two models' histories. Now the steps of the line the
    run threw away are left out, as `andrea runs` and `andrea plot` leave out their records,
    and one line on stderr names them and how to score one."""
    run = tmp_path / "t"
    shutil.copytree(trained_tiny.run_dir, run)
    resumed = andrea_main("train", "--resume", str(run / "step-000020"), "--no-progress",
                          "--set", "train.max_steps=30", "--set", "train.checkpoint_every=10")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(p.name for p in run.glob("step-*")) == [
        "step-000020", "step-000030", "step-000040"]
    steps = andrea_main("eval", "--checkpoint", str(run), "--all-steps", "--json",
                        "--no-progress", "--max-tokens", "64", "--precision", "fp32")
    assert steps.returncode == 0, steps.stderr
    assert [r["step"] for r in json.loads(steps.stdout)] == [20, 30]
    assert steps.stderr == (
        f"--all-steps {run}: leaves out step-000040, left behind by a resume from an older "
        f"step, of a line the run threw away (andrea runs and andrea plot leave out its "
        f"records too); score it alone with --checkpoint {run / 'step-000040'}\n")
    for current in ("step-000020", "step-000030"):
        shutil.rmtree(run / current)
    assert_user_error(andrea_main("eval", "--checkpoint", str(run), "--all-steps"),
                      f"--all-steps {run}: its step folders (step-000040) are all left behind")


def test_bad_checkpoints_and_data_are_clear_errors(tmp_path):
    assert_user_error(andrea_main("eval", "--checkpoint", str(tmp_path / "nope")),
                      "no such checkpoint")
    assert_user_error(andrea_main("eval", "--checkpoint", str(tmp_path)), "not a checkpoint")
    assert_user_error(andrea_main("eval", cwd=tmp_path), "no run with a checkpoint under runs/")
    # A data folder that cannot be prepared from the run's config: the source is missing.
    missing = tmp_path / "missing.txt"
    ckpt = make_checkpoint(tmp_path, f"data.dir={tmp_path / 'never'}",
                           f"data.source={missing}", "train.name=nosource")
    assert_user_error(andrea_main("eval", "--checkpoint", str(ckpt), cwd=tmp_path),
                      f"the run's data, {tmp_path / 'never'}, which is not here, nor is "
                      f"{missing}", "--out data/missing-byte`", "--data")
    assert not (tmp_path / "never").exists()


def test_a_missing_data_folder_is_prepared_from_the_run_config(tmp_path, data_dir):
    """Like train, eval prepares the run's data when its folder has none (one line on stderr,
    never claiming the folder existed) and then gives what --data on the same shards gives.
    It prepares under ./data, never in the folder the checkpoint's data.dir names (a
    checkpoint is untrusted), and says so."""
    ckpt = make_checkpoint(tmp_path, f"data.dir={tmp_path / 'fresh'}")
    args = ("eval", "--checkpoint", str(ckpt), "--max-tokens", "200", "--precision", "fp32",
            "--json", "--no-progress")
    proc = andrea_main(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    notices = [line for line in proc.stderr.splitlines() if line.strip()]
    assert notices == [
        "preparing data/shakespeare-byte from the embedded Shakespeare corpus with the byte "
        f"tokenizer: the run's data, {tmp_path / 'fresh'}, is not here (andrea writes a "
        "checkpoint's data only under ./data)"
    ]
    assert (tmp_path / "data/shakespeare-byte/manifest.json").is_file()
    assert not (tmp_path / "fresh").exists()
    (prepared,) = json.loads(proc.stdout)
    assert prepared["data_dir"] == "data/shakespeare-byte"
    given = evaluate_checkpoint(str(ckpt), str(data_dir), 200, "fp32", "cpu", 8, False)
    assert prepared["tokens"] == given.tokens == 200
    assert prepared["loss"] == given.loss and math.isfinite(given.loss)
    again = andrea_main(*args, cwd=tmp_path)  # prepared now: nothing more to say
    assert again.returncode == 0 and again.stderr == "" and json.loads(again.stdout) == [prepared]
    # A run whose data.dir holds prepared data reads it there (read only), as before.
    ckpt = make_checkpoint(tmp_path / "own", f"data.dir={data_dir}")
    proc = andrea_main(*args[:2], str(ckpt), *args[3:], cwd=tmp_path)
    assert proc.returncode == 0 and json.loads(proc.stdout)[0]["data_dir"] == str(data_dir)


def test_json_is_a_list_for_one_checkpoint_and_several_and_strict_json():
    def row(step: int, loss: float) -> EvalResult:
        return EvalResult(f"runs/r/step-{step}", step, "float32", "cpu", loss=loss,
                          perplexity=math.exp(loss), tasks=[{"task": "choice", "acc": loss}])

    def strict(text: str):  # as jq reads it: NaN and Infinity are not JSON
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in --json"))

    assert strict(format_results([row(1, 2.5)], as_json=True))[0]["step"] == 1
    both = strict(format_results([row(1, 2.5), row(2, float("nan"))], as_json=True))
    assert [r["step"] for r in both] == [1, 2]
    assert both[1]["loss"] is None and both[1]["tasks"][0]["acc"] is None


def test_a_table_of_checkpoints_on_other_data_gives_each_its_sources_and_val_set():
    """Before: a mixture's row beside a one-folder run's was a traceback (zip() shorter, or an
    index out of range, by order), after every checkpoint was scored; and the footer named the
    first row's folder for every row."""

    def source(name: str, loss: float) -> dict:
        return {"name": name, "weight": 0.5, "loss": loss, "bits_per_byte": 1.0, "tokens": 8,
                "bytes": 8, "data_dir": f"data/{name}-byte"}

    one = EvalResult("runs/one/step-2", 2, "float32", "cpu", data_dir="data/shakespeare-byte",
                     max_tokens=8, loss=2.0, perplexity=math.exp(2.0), bits_per_byte=1.0)
    mix = EvalResult("runs/mix/step-3", 3, "float32", "cpu", max_tokens=8, loss=2.5,
                     perplexity=math.exp(2.5), bits_per_byte=1.0,
                     sources=[source("a.txt", 2.25), source("b.txt", 2.75)])
    for results in ([one, mix], [mix, one]):
        lines = format_results(results).splitlines()
        assert lines[0].split()[-4:] == ["a.txt", "LOSS", "b.txt", "LOSS"]
        rows = {line.split()[0]: line.split()[-2:] for line in lines[1:3]}
        assert rows == {"runs/one/step-2": ["-", "-"], "runs/mix/step-3": ["2.2500", "2.7500"]}
        footers = sorted(lines[3:])
        assert footers == [
            "VAL LOSS of runs/mix/step-3: on 2 sources (data/a.txt-byte, data/b.txt-byte), val "
            "split, 8 tokens spread over each source as train.eval_tokens=8 scores",
            "VAL LOSS of runs/one/step-2: on data/shakespeare-byte, val split, 8 tokens spread "
            "over it as train.eval_tokens=8 scores"]
    same = EvalResult("runs/one/step-1", 1, "float32", "cpu", data_dir="data/shakespeare-byte",
                      max_tokens=8, loss=2.1, perplexity=math.exp(2.1), bits_per_byte=1.0)
    assert format_results([same, one]).splitlines()[-1] == (
        "VAL LOSS: on data/shakespeare-byte, val split, 8 tokens spread over it as "
        "train.eval_tokens=8 scores")


def test_eval_names_its_checkpoint_once_and_its_val_set(tmp_path, data_dir):
    """Before: `checkpoint: ...` twice on stderr, and nothing saying which val set the figure is
    on (the trainer's train.eval_tokens windows, or the whole split)."""
    ckpt = make_checkpoint(tmp_path)
    shutil.copytree(data_dir, tmp_path / "data" / "shakespeare-byte")
    r = andrea_main("eval", "--max-tokens", "256", "--no-progress", "--precision", "fp32",
                    cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "checkpoint: runs/r/step-000005 (the most recent run under runs/)\n"
    assert (f"{ckpt.relative_to(tmp_path)} on data/shakespeare-byte (val split, 256 tokens "
            "spread over it as train.eval_tokens=256 scores): loss ") in r.stdout
    whole = EvalResult(checkpoint="c", step=1, precision="float32", device="cpu",
                       data_dir="d", loss=1.0, perplexity=2.7, bits_per_byte=1.0, tokens=10)
    assert whole.summary().startswith("c on d (the whole val split): loss 1.0000")
    # A budget that covers the split is the whole split. (On a small folder: Shakespeare's val
    # split is half a million tokens.)
    text = tmp_path / "small.txt"
    text.write_text("".join(f"line {i}: to be, or not to be\n" for i in range(400)))
    small = prepare_inputs(str(text), "byte", tmp_path / "small-byte")
    budget = andrea_main("eval", "--checkpoint", str(ckpt), "--data", str(small),
                         "--max-tokens", "10000000", "--no-progress", "--json", cwd=tmp_path)
    assert budget.returncode == 0, budget.stderr
    assert json.loads(budget.stdout)[0]["max_tokens"] is None


def test_a_diverged_checkpoints_perplexity_reads_the_same_in_its_line_and_the_table():
    """Before: its line said `perplexity inf` (a NaN loss's too), the table `n/a`."""
    from andrea.evaluate import format_table, val_figures
    from andrea.train.validation import SourceScore, ValScore

    for nats in (8 * 800.0, math.nan):
        score = ValScore([SourceScore("data/x", 1.0, nats=nats, tokens=8, bytes=8)])
        row = EvalResult("runs/r/step-1", 1, "float32", "cpu",
                         **val_figures(score, list_sources=False))
        assert "perplexity n/a," in row.summary()
        assert format_table([row]).splitlines()[1].split()[3] == "n/a"


@pytest.mark.parametrize("settings, limit, line", [
    (dict(max_tokens=0), None, "--max-tokens: must be a positive integer, got 0"),
    (dict(batch_size=0), None, "--batch-size: must be a positive integer, got 0"),
    (dict(), 0, "--limit: must be a positive integer, got 0"),
])
def test_a_zero_count_is_refused_before_anything_is_read(settings, limit, line):
    """--max-tokens 0 went on to an empty val set, refused as a split with "nothing to
    evaluate; prepare more text" (mutation round 3: the check as `< 0` passed every test)."""
    from andrea.errors import UserError
    from andrea.evaluate import EvalSettings, evaluate_checkpoints

    with pytest.raises(UserError) as raised:
        evaluate_checkpoints(["no/such/run"], EvalSettings(**settings),
                             tasks=[("hellaswag", "no/such/file.jsonl")], limit=limit)
    assert str(raised.value) == line
