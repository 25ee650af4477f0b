"""The val loss means one thing: the same weights score the same at any micro-batch and on one
or two processes (real torchrun), `andrea eval --max-tokens N` gives the trainer's figure, a
mixture is scored per source with a weighted total, and old configs' eval_batches still load.

The trainer evaluates only after an optimizer step, so the runs here take one step at a
learning rate of 1e-12: the weights move by about 1e-12 of their size, far below the 1e-6
compared, and every run scores (as good as) the same weights as its initial ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import andrea_main, run_torchrun, tiny_config

from andrea.config import load_config
from andrea.errors import UserError
from andrea.train.loop import train

EVAL_TOKENS = 1000
SETS = ("train.max_steps=1", "train.lr=1e-12", "train.min_lr=0", "train.warmup_steps=0",
        "train.precision=fp32", "train.global_batch_tokens=512", "train.eval_every=1",
        f"train.eval_tokens={EVAL_TOKENS}", "train.checkpoint_every=1", "train.log_every=1")


def evals(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "eval"]


def test_same_val_loss_at_any_micro_batch_and_process_count(tmp_path, data_dir):
    losses = {}
    for micro in (1, 4, 8):
        cfg = tiny_config(tmp_path, data_dir, f"train.micro_batch_size={micro}", *SETS,
                          name=f"m{micro}")
        result = train(cfg, progress=False)
        (record,) = evals(result.run_dir)
        assert record["val_tokens"] == EVAL_TOKENS and record["val_bpb"] > 0
        assert result.best_val_loss == record["val_loss"]
        losses[f"1 process, micro-batch {micro}"] = record["val_loss"]
    proc = run_torchrun(
        "train", "-c", "andrea-tiny", "--set", f"data.dir={data_dir}", "--set",
        f"train.runs_dir={tmp_path}", "--set", "train.name=two", "--set",
        "train.micro_batch_size=2", *[a for s in SETS for a in ("--set", s)], "--no-progress")
    assert proc.returncode == 0, proc.stderr
    (record,) = evals(tmp_path / "two")
    assert record["val_tokens"] == EVAL_TOKENS
    losses["2 processes, micro-batch 2"] = record["val_loss"]
    reference = losses["1 process, micro-batch 8"]
    for where, loss in losses.items():
        assert loss == pytest.approx(reference, rel=1e-6), (where, losses)

    # One model in memory, truly the same weights: batch size changes nothing but rounding.
    from andrea.data.loader import TokenSplit
    from andrea.train.validation import score_val, val_sources
    from andrea.trained import load_model

    model = load_model(tmp_path / "m4" / "step-000001")[0]
    sources = val_sources(TokenSplit(data_dir, "val"), 64, EVAL_TOKENS)
    scores = [score_val(model, sources, batch_size=b, device=model.lm_head.weight.device,
                        dtype=torch.float32).loss for b in (1, 4, 8, 64)]
    assert scores == pytest.approx([scores[0]] * 4, rel=1e-6)
    assert scores[0] == pytest.approx(reference, rel=1e-6)

    # andrea eval --max-tokens N on the run's checkpoint gives the trainer's figure.
    out = andrea_main("eval", "--checkpoint", str(tmp_path / "m4"), "--max-tokens",
                      str(EVAL_TOKENS), "--precision", "fp32", "--batch-size", "3", "--json",
                      "--no-progress")
    assert out.returncode == 0, out.stderr
    (got,) = json.loads(out.stdout)  # a list, also of one checkpoint
    (record,) = evals(tmp_path / "m4")
    assert got["tokens"] == EVAL_TOKENS and got["step"] == 1
    assert got["loss"] == pytest.approx(record["val_loss"], rel=1e-6)
    assert got["bits_per_byte"] == pytest.approx(record["val_bpb"], rel=1e-6)


def test_eval_batches_of_an_old_config_is_a_token_budget(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("model: {block_size: 64}\ntrain: {micro_batch_size: 4, eval_batches: 5}\n")
    cfg = load_config(old)
    assert cfg.train.eval_tokens == 5 * 4 * 64 and cfg.train.eval_batches is None
    # The resolved config (a run's config.yaml) says it once, as eval_tokens, and reloads.
    (tmp_path / "resolved.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path / "resolved.yaml").train.eval_tokens == 1280
    both = load_config(old, ["train.eval_tokens=777"])
    assert both.train.eval_tokens == 777
    assert load_config(old, ["train.micro_batch_size=auto"]).train.eval_tokens == 5 * 8 * 64
    assert load_config("andrea-tiny").train.eval_tokens > 0


def test_a_set_eval_batches_that_a_files_eval_tokens_outranks_is_refused(tmp_path):
    """Before: `--set train.eval_batches=4` on a preset (every preset gives eval_tokens) did
    nothing, without a word, and the run scored 65,536 tokens. Now it is one line naming the
    key to set; an old file's eval_batches, or both set, still load as the rule says."""
    with pytest.raises(UserError, match=r"^--set train.eval_batches=4: .*andrea-12m.yaml gives "
                       r"train.eval_tokens \(65,536\), which outranks the deprecated "
                       r"train.eval_batches; --set train.eval_tokens=N instead"):
        load_config("andrea-12m", ["train.eval_batches=4"])
    both = load_config("andrea-12m", ["train.eval_batches=4", "train.eval_tokens=512"])
    assert both.train.eval_tokens == 512
    old = tmp_path / "old.yaml"
    old.write_text("model: {block_size: 64}\ntrain: {micro_batch_size: 4, eval_batches: 5}\n")
    assert load_config(old, ["train.eval_batches=2"]).train.eval_tokens == 2 * 4 * 64
    assert load_config("andrea-12m", ["train.eval_batches=null"]).train.eval_tokens == 65536


def write_text(path: Path, seed: int, alphabet: str) -> Path:
    import random

    rng = random.Random(seed)
    words = [" ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 7)))
                      for _ in range(12)) for _ in range(600)]
    path.write_text("\n".join(words) + "\n")
    return path


def test_a_source_named_by_a_last_part_two_sources_share_is_refused(tmp_path):
    # corpus1/*.jsonl and corpus2/*.jsonl both end in *.jsonl: --source '*.jsonl' scored the
    # first alone, as if it were the one meant.
    from andrea.data.loader import Mixture
    from andrea.data.prepare import prepare_inputs
    from andrea.errors import UserError
    from andrea.train.validation import val_sources

    parts = []
    for i, name in enumerate(("c1", "c2")):
        (tmp_path / name).mkdir()
        write_text(tmp_path / name / "t.txt", i, "etaoinshrdlu")
        out = prepare_inputs(str(tmp_path / name / "*.txt"), "byte", tmp_path / f"d{i}",
                             verbose=False)
        parts.append((f"{name}/*.txt", out, 1.0))
    val = Mixture(parts, "val")
    with pytest.raises(UserError, match=r"^--source \*\.txt: names 2 sources, c1/\*\.txt, "
                                        r"c2/\*\.txt; give the whole path of one$"):
        val_sources(val, 16, 64, only="*.txt")
    (one,) = val_sources(val, 16, 64, only="c2/*.txt")
    assert one.name == "c2/*.txt" and one.split.data_dir == tmp_path / "d1"


def test_a_mixture_is_scored_per_source_with_a_weighted_total(tmp_path):
    a = write_text(tmp_path / "a.txt", 1, "etaoinshrdlu")
    b = write_text(tmp_path / "b.txt", 2, "0123456789{}[]")
    sources = f"data.sources=[{{path: {a}, weight: 3}}, {{path: {b}, weight: 1}}]"
    cfg = tiny_config(tmp_path, tmp_path / "data", sources, "train.micro_batch_size=4", *SETS,
                      name="mix")
    result = train(cfg, progress=False)
    (record,) = evals(result.run_dir)
    by_source = record["val_sources"]
    assert list(by_source) == [str(a), str(b)]
    la, lb = by_source[str(a)]["loss"], by_source[str(b)]["loss"]
    assert by_source[str(a)]["weight"] == 0.75 and by_source[str(b)]["tokens"] == EVAL_TOKENS
    assert abs(la - lb) > 0.01  # two different texts: source 0 alone would be another figure
    assert record["val_loss"] == pytest.approx(0.75 * la + 0.25 * lb, rel=1e-12)
    bpb = 0.75 * by_source[str(a)]["bpb"] + 0.25 * by_source[str(b)]["bpb"]
    assert record["val_bpb"] == pytest.approx(bpb, rel=1e-12)
    assert result.best_val_loss == record["val_loss"]  # best_val is the weighted total

    args = ("eval", "--checkpoint", str(result.run_dir), "--max-tokens", str(EVAL_TOKENS),
            "--precision", "fp32", "--no-progress")
    (got,) = json.loads(andrea_main(*args, "--json").stdout)
    assert [s["name"] for s in got["sources"]] == [str(a), str(b)]
    assert got["loss"] == pytest.approx(record["val_loss"], rel=1e-6)
    for s in got["sources"]:
        assert s["loss"] == pytest.approx(by_source[s["name"]]["loss"], rel=1e-6)
        assert s["bits_per_byte"] == pytest.approx(by_source[s["name"]]["bpb"], rel=1e-6)
    # Each source's folder is named, and --max-tokens is each source's budget, as
    # train.eval_tokens is: the line says so beside twice as many tokens.
    folders = [Path(s["data_dir"]) for s in got["sources"]]
    assert got["data_dir"] is None and [f.parent for f in folders] == [tmp_path / "data"] * 2
    assert folders[0] != folders[1] and got["tokens"] == 2 * EVAL_TOKENS
    table = andrea_main(*args).stdout.splitlines()
    assert "weighted over the sources" in table[0] and len(table) == 3
    assert f" on 2 sources ({folders[0]}, {folders[1]}) (val split, {EVAL_TOKENS:,} tokens " \
        "spread over each source as" in table[0]
    assert table[2].startswith(f"  {b} (weight 0.250): loss {lb:.4f}")
    (only,) = json.loads(andrea_main(*args, "--source", "b.txt", "--json").stdout)
    assert [s["name"] for s in only["sources"]] == [str(b)]
    assert only["loss"] == pytest.approx(lb, rel=1e-6)
    from conftest import assert_user_error

    assert_user_error(andrea_main(*args, "--source", "c.txt"), "--source c.txt", str(a))

    runs = andrea_main("runs", str(tmp_path / "mix"))
    assert f"mix: val loss by source at step 1: {a} {la:.4f}, {b} {lb:.4f}" in runs.stdout
    runs_json = json.loads(andrea_main("runs", str(tmp_path / "mix"), "--json").stdout)
    assert runs_json[0]["last_val_sources"] == {str(a): la, str(b): lb}

    pytest.importorskip("matplotlib")
    from andrea.plot import plot_runs

    svg = plot_runs([result.run_dir], tmp_path / "mix.svg").read_text()
    # Each source by its last part, which tells these two apart (andrea/plot.py)
    assert f"mix (finished): val {a.name}" in svg and f"mix (finished): val {b.name}" in svg


def test_a_mixture_has_no_bits_per_byte_when_one_source_has_no_bytes():
    """A source whose val targets decode to no bytes (every one end-of-text: its val records
    were empty texts) has no bits per byte, nor has the run's weighted figure; its loss still
    counts. Mutation round 3: the weighted figure given None only when every source had none
    (a TypeError at the first eval) passed every test."""
    from andrea.train.validation import SourceScore, ValScore

    score = ValScore([SourceScore("a", 0.25, 2.0, 4, 0), SourceScore("b", 0.75, 4.0, 4, 8)])
    assert score.bits_per_byte is None and score.loss == 0.25 * 0.5 + 0.75 * 1.0
    record = score.record()
    assert record["val_bpb"] is None and record["val_sources"]["a"]["bpb"] is None
    assert record["val_sources"]["b"]["bpb"] == pytest.approx(4.0 / 8 / 0.6931471805599453)
