"""A new user's first hour: every verb through the real `andrea` command, as README shows it,
in its default output form (tables and summary lines, not --json), on the tiny preset.

prepare -> train -> runs -> plot -> eval -> generate -> export -> import (elsewhere) -> eval the
import -> train --resume (more steps). Each step checks what the user reads: numbers parse and
agree with each other, files exist, losses are finite and equal where the weights are the same.
The project trained once (prepare, then 20 steps) is shared: each test walks on in a copy of it.
`andrea bench --quick` is walked in tests/test_cuda_backend.py (table and --json), at the small
shape and the tiny preset: its CPU defaults train andrea-12m, most of a minute here.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import Result, andrea_main, run_andrea

pytest.importorskip("matplotlib", reason="andrea plot needs the optional [plot] extra")
from PIL import Image  # noqa: E402  (Pillow comes with matplotlib)

NUM = r"[\d,]+"
EVAL_LINE = re.compile(
    rf"(?P<ckpt>\S+) on (?P<data>\S+) \(val split, {NUM} tokens spread over it as "
    rf"train.eval_tokens=\d+ scores\): loss (?P<loss>[\d.]+), perplexity (?P<ppl>[\d.]+), "
    rf"bits/byte (?P<bpb>[\d.]+), (?P<tokens>{NUM}) tokens \((?P<bytes>{NUM}) bytes\), "
    rf"(?P<dtype>\w+), cpu"
)
EVAL_TOKENS = 4096  # README: [--max-tokens N]; the whole val split takes a minute here


VERBS_STARTED: set[str] = set()


def andrea(cwd: Path, *args: str) -> subprocess.CompletedProcess | Result:
    # Each verb's first call starts a process of its own, as a user's shell does: start-up and
    # the verb's own imports are part of the journey. Its later calls run in this process (3 s
    # of imports less each).
    if args[0] in VERBS_STARTED:
        proc = andrea_main(*args, cwd=cwd)
    else:
        VERBS_STARTED.add(args[0])
        proc = run_andrea(*args, cwd=cwd, timeout=300)
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def number(text: str) -> int:
    return int(text.replace(",", ""))


def eval_result(cwd: Path, run: str) -> tuple[re.Match, str]:
    """The parsed summary line of `andrea eval` (checked for consistency), and its stderr."""
    proc = andrea(cwd, "eval", "--checkpoint", run, "--max-tokens", str(EVAL_TOKENS))
    (line,) = proc.stdout.splitlines()
    found = EVAL_LINE.fullmatch(line)
    assert found, line
    loss, tokens, n_bytes = float(found["loss"]), number(found["tokens"]), number(found["bytes"])
    assert tokens == EVAL_TOKENS and 0 < n_bytes <= tokens and math.isfinite(loss)
    assert float(found["ppl"]) == pytest.approx(math.exp(loss), rel=1e-3)
    assert float(found["bpb"]) == pytest.approx(loss * tokens / math.log(2) / n_bytes, rel=1e-3)
    return found, proc.stderr


def table_row(stdout: str, name: str) -> list[str]:
    (row,) = [line for line in stdout.splitlines() if line.split()[:1] == [name]]
    return row.split()


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """A new user's project after `prepare` (twice) and 20 steps of `train`, evaluated and
    checkpointed every 10; and those three commands' processes."""
    home = tmp_path_factory.mktemp("journey") / "project"
    home.mkdir()
    procs = [andrea(home, "prepare", "--config", "andrea-tiny") for _ in range(2)]
    procs.append(andrea(home, "train", "--config", "andrea-tiny", "--set", "train.max_steps=20",
                        "--set", "train.eval_every=10", "--set", "train.checkpoint_every=10"))
    return home, procs


def project_copy(first_steps: tuple[Path, list], tmp_path: Path) -> Path:
    """A copy of the shared project (runs and data name their folders relative to it)."""
    home = tmp_path / "project"
    shutil.copytree(first_steps[0], home, symlinks=True)
    return home


def test_every_verb_as_a_new_user_runs_it(tmp_path, first_steps):
    home = project_copy(first_steps, tmp_path)
    prepared, again, proc = first_steps[1]

    # prepare: the tiny preset's data (bytes of the embedded corpus), then nothing to redo.
    found = re.fullmatch(rf"data/shakespeare-byte: ({NUM}) train \+ ({NUM}) val tokens, "
                         r"tokenizer byte:v1 \(257 ids\)", prepared.stdout.strip())
    assert found, prepared.stdout
    assert number(found[1]) > 9 * number(found[2]) > 0  # val fraction 0.1
    assert (home / "data/shakespeare-byte/manifest.json").is_file()
    assert again.stdout.strip() == "data/shakespeare-byte: up to date (inputs unchanged; " \
                                   "--force redoes it)"

    # train: 20 steps, evaluated and checkpointed every 10.
    vals = {int(s): float(v) for s, v in re.findall(r"step (\d+): val loss ([\d.]+)", proc.stdout)}
    assert sorted(vals) == [10, 20] and vals[20] < vals[10] < math.log(257)  # it learns
    best_step = min(vals, key=vals.get)
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"finished: 20 steps, 10,240 tokens in [\d.]+ s; best val loss {vals[best_step]:.4f} "
        rf"at step {best_step}; checkpoint runs/andrea-tiny/step-000020", last), last
    records = [json.loads(line) for line in (home / "runs/andrea-tiny/metrics.jsonl").open()]
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert losses and all(math.isfinite(x) for x in losses)

    # runs: the table a user reads.
    proc = andrea(home, "runs")
    assert proc.stdout.split()[:3] == ["RUN", "MODEL", "STEPS"]
    row = table_row(proc.stdout, "andrea-tiny")
    assert row[1:3] == ["andrea-tiny", "2L/4H/d64/ctx64"] and row[3] == "20/20"
    assert f"{vals[best_step]:.4f} @{best_step}" in " ".join(row)
    assert row[-2:] == ["finished", "step-000020"]

    # plot: a real image of the run's curves.
    proc = andrea(home, "plot", "andrea-tiny", "--out", "curves.png")
    assert proc.stdout.strip() == "wrote curves.png"
    assert Image.open(home / "curves.png").size == (1300, 850)

    # eval and generate: numbers that agree; a seed repeats.
    trained, _ = eval_result(home, "runs/andrea-tiny")
    assert trained["ckpt"] == "runs/andrea-tiny/step-000020"
    assert trained["data"] == "data/shakespeare-byte"
    gen = ("generate", "--prompt", "ROMEO:", "-n", "40", "--seed", "7")
    sample = andrea(home, *gen, "--checkpoint", "runs/andrea-tiny").stdout
    assert sample.startswith("ROMEO:") and len(sample) > len("ROMEO:\n")
    assert andrea(home, *gen, "--checkpoint", "runs/andrea-tiny").stdout == sample

    # export, then import where the user has nothing else: no data, no runs.
    proc = andrea(home, "export", "--checkpoint", "runs/andrea-tiny", "--format", "hf",
                  "--out", "exported")
    assert proc.stdout.splitlines() == [  # the tiny preset's byte tokenizer has no HF files
        "note: no tokenizer files in exported: transformers has no byte tokenizer; its ids are "
        "the text's UTF-8 bytes, end-of-text 256", "wrote exported"]
    assert {"config.json", "model.safetensors", "andrea.json"} <= {
        p.name for p in (home / "exported").iterdir()}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = andrea(elsewhere, "import", "--format", "hf", str(home / "exported"))
    assert proc.stdout.strip() == ("wrote runs/exported/step-000000; fine-tune with: "
                                   "andrea train --resume runs/exported")

    # eval of the import prepares its data (one line) and equals eval of the exported run.
    imported, stderr = eval_result(elsewhere, "runs/exported")
    assert [line for line in stderr.splitlines() if "prepar" in line] == [
        "preparing data/shakespeare-byte from the embedded Shakespeare corpus with the byte "
        "tokenizer: the run's data, data/shakespeare-byte, is not here"]
    assert (elsewhere / "data/shakespeare-byte/manifest.json").is_file()
    assert imported["ckpt"] == "runs/exported/step-000000"
    for key in ("loss", "ppl", "bpb", "tokens", "bytes", "dtype"):
        assert imported[key] == trained[key], key
    assert andrea(elsewhere, *gen, "--checkpoint", "runs/exported").stdout == sample

    # runs and plot with an imported run beside a trained one.
    (home / "runs/exported").symlink_to(elsewhere / "runs/exported")
    proc = andrea(home, "runs")
    assert table_row(proc.stdout, "exported")[-2:] == ["imported", "step-000000"]
    proc = andrea(home, "plot", "andrea-tiny", "exported", "--out", "both.png")
    assert proc.stdout.strip() == "wrote both.png"
    assert proc.stderr.splitlines() == [
        "warning: runs/exported: no metrics.jsonl (an imported run, not trained yet); "
        "run left out"]
    (home / "runs/exported").unlink()

    # train --resume to more steps: the run continues from its checkpoint.
    proc = andrea(home, "train", "--resume", "runs/andrea-tiny", "--set", "train.max_steps=30")
    last = proc.stdout.strip().splitlines()[-1]
    assert last.endswith("checkpoint runs/andrea-tiny/step-000030"), last
    assert "resuming from runs/andrea-tiny/step-000020" in proc.stdout
    records = [json.loads(line) for line in (home / "runs/andrea-tiny/metrics.jsonl").open()]
    steps = [r["step"] for r in records if r["event"] == "train"]
    assert steps[-1] == 30 and all(math.isfinite(r["loss"]) for r in records
                                   if r["event"] == "train")
    row = table_row(andrea(home, "runs").stdout, "andrea-tiny")
    assert row[3] == "30/30" and row[-2:] == ["finished", "step-000030"]
    resumed, _ = eval_result(home, "runs/andrea-tiny")
    assert resumed["ckpt"] == "runs/andrea-tiny/step-000030"
    assert resumed["loss"] != trained["loss"]  # ten more steps changed the weights


def test_a_strangers_checkpoint_as_a_user_meets_it(tmp_path, first_steps):
    """A stranger's checkpoint and export name a folder of the user's as their data folder:
    eval reads the user's own prepared data, and nothing in that folder is touched. (A run whose
    newest checkpoint is lost, and the error's own command that gets the user going again, is
    walked through the real command in tests/test_checkpoint_trust.py.)"""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    home = project_copy(first_steps, tmp_path)
    stranger = tmp_path / "stranger-step"
    stranger.mkdir()
    blob = (home / "runs/andrea-tiny/step-000020/model.safetensors").read_bytes()

    # A stranger's checkpoint whose config names the user's notes folder as its data folder.
    notes = home / "notes"
    notes.mkdir()
    for name in ("tokenizer.json", "draft.tmp", "main.py"):
        (notes / name).write_text(f"the user's {name}\n")
    before = {p.name: p.read_text() for p in notes.iterdir()}
    (stranger / "model.safetensors").write_bytes(blob)
    with safe_open(str(stranger / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
    config = json.loads(metadata["config"])
    config["data"]["dir"] = str(notes)
    save_file(load_file(str(stranger / "model.safetensors")), str(stranger / "model.safetensors"),
              {**metadata, "config": json.dumps(config)})
    found, _ = eval_result(home, str(stranger))
    assert found["data"] == "data/shakespeare-byte"  # the user's own prepared data, read only
    andrea(home, "export", "--checkpoint", str(stranger), "--out", "from-stranger")
    exported = home / "from-stranger/andrea.json"
    record = json.loads(exported.read_text())
    assert record["config"]["data"]["dir"] == ""  # an export names no folder of its machine
    record["config"]["data"]["dir"] = str(notes)  # as a stranger's export may, all the same
    exported.write_text(json.dumps(record))
    andrea(home, "import", "from-stranger")
    assert "dir: ''" in (home / "runs/from-stranger/config.yaml").read_text()
    eval_result(home, "runs/from-stranger")
    assert {p.name: p.read_text() for p in notes.iterdir()} == before
