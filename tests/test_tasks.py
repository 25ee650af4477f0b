"""Downstream tasks (`andrea eval --task`): the scoring rule against float64 hand computations,
the same choices through transformers on the HF export, the CLI's lines, bad task files, and
several checkpoints in one table."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import andrea_main, assert_user_error

from andrea.data.tokenizer import ByteTokenizer
from andrea.evaluate import EvalSettings, evaluate_checkpoints
from andrea.tasks import TASKS, read_task, run_task
from andrea.trained import load_model

# Endings of very different lengths: the summed loss favours the short one, the mean loss per
# token the long natural one, so acc and acc_norm differ.
HELLASWAG = [  # each fits the tiny model's block of 64 tokens (bytes)
    {"ctx": "First Citizen: hear me", "label": 1,
     "endings": ["zq", "speak. All: Speak, speak."]},
    {"ctx": "KING HENRY: my lord of", "label": 0,
     "endings": ["York?", "qqqqxz", "Westmoreland, and the lords"]},
    {"ctx": "To be, or not to be, that is the", "label": 0,
     "endings": ["question", "xkcd", "answer of the king and"]},
    {"ctx": "", "label": 1, "endings": ["zzzz", "And the king"]},  # empty context: from EOT
]
LAMBADA = [{"text": "I will go to the king, and the king will see the"},
           {"text": "What is your name, good sir? My name is the"}]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def hand_nats(model, context: str, continuation: str) -> list[float]:
    """-log p of each continuation byte given everything before, a float64 forward of the
    whole sequence (no batching, no padding)."""
    ctx = list(context.encode()) if context else [ByteTokenizer.eot_id]
    cont = list(continuation.encode())
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[:, :-1])[0][0], dim=-1)
    return [-logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont)]


def test_multiple_choice_scoring_rule_by_hand(tmp_path, trained_tiny):
    model = load_model(trained_tiny.checkpoint)[0].double()
    task = read_task("hellaswag", write_jsonl(tmp_path / "hs.jsonl", HELLASWAG))
    f32 = load_model(trained_tiny.checkpoint)[0]
    result, scored = run_task(task, lambda x: f32(x)[0], ByteTokenizer(), block_size=64,
                              batch_size=3, device=torch.device("cpu"))
    by_sum, by_mean = [], []
    for ex, got in zip(HELLASWAG, scored, strict=True):
        space = " " if ex["ctx"] else ""
        hand = [hand_nats(model, ex["ctx"], space + e) for e in ex["endings"]]
        for h, g in zip(hand, got, strict=True):
            assert len(g.nats) == len(h)
            np.testing.assert_allclose(g.nats, h, rtol=1e-5)
        by_sum.append(int(np.argmin([sum(h) for h in hand])) == ex["label"])
        by_mean.append(int(np.argmin([np.mean(h) for h in hand])) == ex["label"])
    assert by_sum != by_mean, "the file should tell the two rules apart"
    assert result.acc == np.mean(by_sum) and result.acc_norm == np.mean(by_mean)
    assert (result.examples, result.truncated, result.skipped) == (4, 0, 0)

    # The same file as a generic choice file scores the same.
    choice = [{"context": r["ctx"], "choices": r["endings"], "label": r["label"]}
              for r in HELLASWAG]
    again, _ = run_task(read_task("choice", write_jsonl(tmp_path / "c.jsonl", choice)),
                        lambda x: f32(x)[0], ByteTokenizer(), block_size=64, batch_size=8,
                        device=torch.device("cpu"))
    assert (again.acc, again.acc_norm) == (result.acc, result.acc_norm)


def test_lambada_last_word_greedy_and_loss_by_hand(tmp_path, trained_tiny):
    model = load_model(trained_tiny.checkpoint)[0].double()
    f32 = load_model(trained_tiny.checkpoint)[0]
    task = read_task("lambada", write_jsonl(tmp_path / "l.jsonl", LAMBADA))
    result, scored = run_task(task, lambda x: f32(x)[0], ByteTokenizer(), block_size=64,
                              batch_size=2, device=torch.device("cpu"))
    greedy, losses = [], []
    for rec, (got,) in zip(LAMBADA, scored, strict=True):
        context, word = rec["text"].rsplit(" ", 1)
        ids = torch.tensor([list(rec["text"].encode())])
        with torch.no_grad():
            logits = model(ids[:, :-1])[0][0]
        n = len(word) + 1  # " " + the word, one byte each
        rows, targets = logits[-n:], ids[0, -n:]
        greedy.append(bool((rows.argmax(-1) == targets).all()))
        losses.append(-torch.log_softmax(rows, -1)[torch.arange(n), targets].sum().item())
        assert got.total == pytest.approx(losses[-1], rel=1e-5) and got.greedy == greedy[-1]
    assert result.acc == np.mean(greedy) and result.loss == pytest.approx(np.mean(losses))


# ARC-Easy's records as the issue quotes them (letter labels), one with "1".."4" labels, one
# as AI2's files nest it and one as Hugging Face writes it; each fits the block of 64 bytes.
ARC = [
    {"question": {"stem": "Who is the king?"}, "answerKey": "B",
     "choices": {"text": ["a fish", "Henry", "blue"], "label": ["A", "B", "C"]}},
    {"question": {"stem": "What is thy name?"}, "answerKey": "3",
     "choices": {"text": ["qqq", "zz", "Romeo", "xkcd"], "label": ["1", "2", "3", "4"]}},
    {"question": {"stem": "Where is my lord?",
                  "choices": [{"text": "in the court", "label": "A"},
                              {"text": "zqzq", "label": "B"}]}, "answerKey": "A"},
    {"question": "What shall I say?", "answerKey": "B",
     "choices": {"text": ["xx", "speak, speak"], "label": ["A", "B"]}},
]


def test_arc_records_and_their_scores_by_hand(tmp_path, trained_tiny):
    """Each ARC choice's summed log-likelihood after "Question: <stem>\nAnswer:", a float64
    forward by hand; the task picks the most likely choice (and the most likely per token)."""
    task = read_task("arc", write_jsonl(tmp_path / "arc.jsonl", ARC))
    assert [ex.label for ex in task.examples] == [1, 2, 0, 1]
    assert task.examples[2].continuations == ["in the court", "zqzq"]
    model = load_model(trained_tiny.checkpoint)[0].double()
    f32 = load_model(trained_tiny.checkpoint)[0]
    result, scored = run_task(task, lambda x: f32(x)[0], ByteTokenizer(), block_size=64,
                              batch_size=3, device=torch.device("cpu"))
    by_sum, by_mean = [], []
    for rec, ex, got in zip(ARC, task.examples, scored, strict=True):
        stem = rec["question"]["stem"] if isinstance(rec["question"], dict) else rec["question"]
        context = f"Question: {stem}\nAnswer:"
        hand = [hand_nats(model, context, " " + text) for text in ex.continuations]
        for h, g in zip(hand, got, strict=True):
            np.testing.assert_allclose(g.nats, h, rtol=1e-5)
        by_sum.append(int(np.argmax([-sum(h) for h in hand])) == ex.label)
        by_mean.append(int(np.argmax([-np.mean(h) for h in hand])) == ex.label)
    assert result.acc == np.mean(by_sum) and result.acc_norm == np.mean(by_mean)
    assert (result.task, result.examples, result.skipped) == ("arc", 4, 0)


def test_bad_arc_records_are_skipped_with_their_reason(tmp_path):
    good = ARC[0]
    bad = [
        {**good, "answerKey": "D"},
        {**good, "answerKey": None},
        {**good, "choices": {"text": ["a", "b"], "label": ["A"]}},
        {"stem": "no question", "choices": good["choices"], "answerKey": "A"},
    ]
    task = read_task("arc", write_jsonl(tmp_path / "arc.jsonl", [good, *bad]))
    assert len(task.examples) == 1 and task.skipped == {
        "answerKey is none of the choices' labels": [2],
        "no answerKey (arc needs one: a test split without answers cannot be scored)": [3],
        f"not an arc record {TASKS['arc'].format}": [4, 5],
    }


def test_hf_export_makes_the_same_choices(tmp_path, trained_tiny):
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    proc = andrea_main("export", "--checkpoint", str(trained_tiny.checkpoint), "--format", "hf",
                       "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf",
                                                      dtype=torch.float32).eval()
    ours = load_model(trained_tiny.checkpoint)[0]
    file = write_jsonl(tmp_path / "hs.jsonl", HELLASWAG)
    scores = {}
    for name, logits in (("andrea", lambda x: ours(x)[0]), ("hf", lambda x: hf(x).logits)):
        scores[name] = run_task(read_task("hellaswag", file), logits, ByteTokenizer(),
                                block_size=64, batch_size=4, device=torch.device("cpu"))
    (a, a_scored), (h, h_scored) = scores["andrea"], scores["hf"]
    assert (a.acc, a.acc_norm) == (h.acc, h.acc_norm)
    for a_ex, h_ex in zip(a_scored, h_scored, strict=True):
        assert np.argmin([c.total for c in a_ex]) == np.argmin([c.total for c in h_ex])
        assert np.argmin([c.mean for c in a_ex]) == np.argmin([c.mean for c in h_ex])
        for ac, hc in zip(a_ex, h_ex, strict=True):
            np.testing.assert_allclose(ac.nats, hc.nats, rtol=1e-4)


def test_eval_task_lines_json_limit_and_truncation(tmp_path, trained_tiny):
    long = {"ctx": "O Romeo, " * 20, "endings": ["wherefore art thou", "zz"], "label": 0}
    hs = write_jsonl(tmp_path / "hs.jsonl", [*HELLASWAG, long])
    lam = write_jsonl(tmp_path / "l.jsonl", LAMBADA)
    args = ("eval", "--checkpoint", str(trained_tiny.run_dir), "--precision", "fp32",
            "--no-progress", "--task", "hellaswag", hs, "--task", "lambada", lam)
    proc = andrea_main(*args)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{trained_tiny.checkpoint}: float32, cpu"  # no val pass with --task
    assert lines[1].startswith(f"hellaswag {hs}: acc ") and "acc_norm" in lines[1]
    assert lines[1].endswith("(5 examples, 1 truncated from the left to fit the block)")
    assert lines[2].startswith(f"lambada {lam}: acc ") and "loss" in lines[2]
    (out,) = json.loads(
        andrea_main(*args, "--json", "--limit", "2", "--val", "--max-tokens", "256").stdout)
    assert [t["examples"] for t in out["tasks"]] == [2, 2] and out["loss"] > 0
    direct = evaluate_checkpoints(
        [str(trained_tiny.checkpoint)], EvalSettings(precision="fp32", progress=False, val=False),
        tasks=[("hellaswag", hs)], limit=2)[0]
    assert direct.tasks[0]["acc"] == out["tasks"][0]["acc"]


def test_bad_task_files(tmp_path, trained_tiny):
    ckpt = str(trained_tiny.checkpoint)

    def task(kind, name, text):
        (tmp_path / name).write_text(text)
        return andrea_main("eval", "--checkpoint", ckpt, "--no-progress", "--task", kind,
                           str(tmp_path / name))

    lam = "".join(json.dumps(r) + "\n" for r in LAMBADA)
    assert_user_error(task("hellaswag", "lam.jsonl", lam), "lam.jsonl",
                      "no hellaswag example can be scored", "2 not a hellaswag record")
    assert_user_error(task("choice", "empty.jsonl", "\n"), "empty.jsonl: empty")
    out_of_range = {"context": "a", "choices": ["b", "c"], "label": 2}
    assert_user_error(task("choice", "range.jsonl", json.dumps(out_of_range)),
                      "label out of range (first at line 1)")
    assert_user_error(task("choice", "notjson.jsonl", "{nope\n"), "1 not JSON")
    assert_user_error(task("trivia", "lam.jsonl", lam), "--task trivia", "hellaswag")
    mismatch = andrea_main("eval", "--checkpoint", ckpt, "--task", "lambada")
    assert_user_error(mismatch, "1 task(s) but 0 file(s)")
    # Some records bad, some good: the good ones are scored, one warning line per reason.
    too_long = {"context": "a", "choices": ["b" * 70, "c"], "label": 0}
    mixed = [{"context": "To be", "choices": [" or", " zz"], "label": 0}, out_of_range,
             out_of_range, too_long]
    proc = task("choice", "mixed.jsonl", "".join(json.dumps(r) + "\n" for r in mixed))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"warning: {tmp_path / 'mixed.jsonl'}: 2 records skipped, label out of range "
        "(line 2, ...)",
        f"warning: {tmp_path / 'mixed.jsonl'}: 1 record skipped, continuation longer than "
        "the block of 64 tokens (line 4)",
    ]
    assert proc.stdout.splitlines()[1].endswith("(1 example, 3 skipped)")


def test_the_blocks_edges_and_a_negative_label(tmp_path):
    """A sequence of exactly block_size + 1 tokens fits (no truncation counted); one whose
    continuation alone is that long is left out (its first token would have nothing before
    it); a negative label is out of range, not a choice counted from the end. Mutation round
    3: each edge off by one passed every test."""
    from andrea.tasks import Example, encode_pairs

    examples = [Example("abcdefg", ["x"], 0, 1),  # 7 + " x" = 9 = block_size + 1 ids
                Example("abcdefgh", ["x"], 0, 2),  # 10: loses a context byte
                Example("ab", ["xyzw"], 0, 3)]  # " xyzw" = 5 = block_size + 1: no context
    pairs, truncated, too_long = encode_pairs(ByteTokenizer(), examples, block_size=8)
    assert pairs[0] == [(list(b"abcdefg x"), 2)]
    assert pairs[1] == [(list(b"bcdefgh x"), 2)]
    assert (truncated, too_long) == (1, [])
    pairs, truncated, too_long = encode_pairs(ByteTokenizer(), examples[2:], block_size=4)
    assert (pairs, truncated, too_long) == ([[]], 0, [3])
    records = [{"context": "a", "choices": ["b", "c"], "label": label}
               for label in (1, -1, "-2", 2)]
    task = read_task("choice", write_jsonl(tmp_path / "c.jsonl", records))
    assert [ex.line for ex in task.examples] == [1]
    assert task.skipped == {"label out of range": [2, 3, 4]}


def test_several_checkpoints_in_one_table(tmp_path, trained_tiny):
    hs = write_jsonl(tmp_path / "hs.jsonl", HELLASWAG)
    run = trained_tiny.run_dir
    common = ("--max-tokens", "256", "--precision", "fp32", "--no-progress", "--val",
              "--task", "hellaswag", hs)
    proc = andrea_main("eval", "--checkpoint", str(run), "--all-steps", *common)
    assert proc.returncode == 0, proc.stderr
    header, *rows, val_set = proc.stdout.splitlines()
    assert header.split()[:6] == ["CHECKPOINT", "STEP", "VAL", "LOSS", "PERPLEXITY", "BITS/BYTE"]
    assert "hellaswag (hs.jsonl) ACC / NORM" in header
    assert val_set.startswith("VAL LOSS: on ")  # which val set the column is
    assert [r.split()[:2] for r in rows] == [[str(run / "step-000020"), "20"],
                                             [str(run / "step-000040"), "40"]]
    settings = EvalSettings(max_tokens=256, precision="fp32", progress=False)
    for row, step in zip(rows, ("step-000020", "step-000040"), strict=True):
        (one,) = evaluate_checkpoints([str(run / step)], settings, tasks=[("hellaswag", hs)])
        assert row.split()[2:7] == [f"{one.loss:.4f}", f"{one.perplexity:.3f}",
                                    f"{one.bits_per_byte:.4f}", f"{one.tasks[0]['acc']:.4f}", "/"]
    both = json.loads(andrea_main("eval", "--checkpoint", str(run / "step-000020"),
                                  "--checkpoint", str(run), "--json", *common).stdout)
    assert [r["step"] for r in both] == [20, 40]
    assert both[0]["tokens"] == both[1]["tokens"] == 256  # the same val set for each
    assert_user_error(andrea_main("eval", "--checkpoint", str(tmp_path), "--all-steps"),
                      "--all-steps", "no step-N checkpoint folders")
    assert_user_error(andrea_main("eval", "--checkpoint", str(run / "step-000020"),
                                  "--all-steps"),
                      "a checkpoint's step folder; --all-steps takes its run's folder: "
                      f"{run}")
    # A run given as eval's argument (where --checkpoint was meant) was counted as a task file:
    # '0 task(s) but 1 file(s); give one file per --task'.
    assert_user_error(andrea_main("eval", str(run)), "eval's arguments are task files",
                      f"andrea eval --checkpoint {run}")
    # --limit counts task examples: without a task it was ignored without a word.
    assert_user_error(andrea_main("eval", "--checkpoint", str(run), "--limit", "3"),
                      "--limit 3: counts the examples of a task", "--task KIND FILE")
    # --max-tokens and --source choose the val set, which --task skips without --val: they
    # were ignored without a word (docs/evaluation.md's own example gave one so).
    for option in (["--max-tokens", "256"], ["--source", "x"], ["--data", str(tmp_path)],
                   ["--split", "train"]):
        assert_user_error(andrea_main("eval", "--checkpoint", str(run), *option, "--task",
                                      "hellaswag", hs),
                          f"{' '.join(option)}: chooses the val set, which this eval skips "
                          "(--task without --val, or --no-val); add --val to score it too, or "
                          "drop it")


def test_a_task_file_from_windows_or_with_a_lone_surrogate(tmp_path, trained_tiny):
    """A byte-order mark (Windows editors write one) made line 1 "not JSON"; a record whose
    JSON holds a \\ud800 escape (valid JSON, no Unicode text) was a traceback from inside the
    tokenizer after the model had loaded. Now the mark is skipped and such a record is skipped
    with its reason, as other bad records are."""
    good = {"context": "To be", "choices": [" or", " zz"], "label": 0}
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(good).encode() + b"\n")
    (tmp_path / "sur.jsonl").write_text(
        json.dumps(good) + "\n" + '{"context": "\\ud800 a", "choices": ["x", "y"], "label": 0}\n')
    proc = andrea_main("eval", "--checkpoint", str(trained_tiny.checkpoint), "--no-progress",
                       "--task", "choice", str(tmp_path / "bom.jsonl"), "--task", "choice",
                       str(tmp_path / "sur.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"warning: {tmp_path / 'sur.jsonl'}: 1 record skipped, not Unicode text (a lone "
        "surrogate) (line 2)"]
    lines = proc.stdout.splitlines()
    assert lines[1].endswith("(1 example)") and lines[2].endswith("(1 example, 1 skipped)")
