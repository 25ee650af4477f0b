"""A run folder travels (issue 41): a small BPE run trained on its own text, copied elsewhere
with its text and data folder deleted, generates, scores a task file, exports and imports from a
third directory with nothing prepared; its checkpoint's files are checked against the checksums
written with them; the val loss and a resume without the data stop in one line whose command
works; a checkpoint written before all this still opens. One trained run is shared by the file;
every test works on its own copy, in this process."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shlex
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_cli import run_main

from andrea.cli import main

NAME = "own"
STEPS = 4
PROMPT = ("generate", "-p", "the cat", "-n", "12", "--seed", "3", "--temperature", "1.0")
TASK = [{"ctx": "the cat sat on", "label": 0, "endings": ["the mat", "zq xv"]},
        {"ctx": "a dog ran to", "label": 1, "endings": ["qqqq", "the park"]}]


def own_text() -> str:
    words = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "park", "and", "saw"]
    return "".join(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(9)) + ".\n"
                   for i in range(400))


def last_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def quiet_main(*argv: str) -> tuple[int, str, str]:
    """`andrea ARGV` in this process, its output caught here (capsys is per test; the shared
    run below is made once for the file)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            pytest.raises(SystemExit) as exited:
        main(list(argv))
    return exited.value.code, out.getvalue(), err.getvalue()


EVAL = ("eval", "--json", "--no-progress", "--max-tokens", "256", "--precision", "fp32",
        "--device", "cpu")


@pytest.fixture(scope="module")
def moved(tmp_path_factory) -> SimpleNamespace:
    """The run trained in its own folder (own.txt, data/, runs/) and what it gives there, then
    copied away (`cp -r`) and its folder, text and data included, deleted."""
    origin = tmp_path_factory.mktemp("origin")
    text = origin / "own.txt"
    text.write_text(own_text())
    (origin / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TASK))
    here = Path.cwd()
    os.chdir(origin)
    try:
        code, _, err = quiet_main(
            "train", "--config", "andrea-tiny", "--no-progress", "--set", "data.tokenizer=bpe",
            "--set", "model.vocab_size=300", "--set", f"data.source={text}",
            "--set", f"train.name={NAME}", "--set", f"train.max_steps={STEPS}",
            "--set", "train.checkpoint_every=2", "--set", "train.eval_every=0",
            "--set", "train.precision=fp32")
        assert code == 0, err
        assert [d.name for d in Path("data").iterdir()] == ["own-bpe-300"]
        code, sample, err = quiet_main(*PROMPT, "--checkpoint", f"runs/{NAME}")
        assert code == 0, err
        code, out, err = quiet_main(*EVAL, "--val", "--checkpoint", f"runs/{NAME}",
                                    "--task", "hellaswag", "task.jsonl")
        assert code == 0, err
    finally:
        os.chdir(here)
    away = tmp_path_factory.mktemp("away")
    shutil.copytree(origin / "runs" / NAME, away / NAME)
    tokenizer = (origin / "data/own-bpe-300/tokenizer.json").read_bytes()
    shutil.rmtree(origin)
    return SimpleNamespace(run=away / NAME, text=text, sample=sample,
                           scored=json.loads(out)[0], tokenizer=tokenizer)


@pytest.fixture
def copied(moved, tmp_path, monkeypatch) -> Path:
    """This test's own copy of the moved run, and the working directory a third one."""
    run = tmp_path / "copy" / NAME
    shutil.copytree(moved.run, run)
    third = tmp_path / "third"
    third.mkdir()
    monkeypatch.chdir(third)
    return run


def checkpoint_of(run: Path) -> Path:
    return run / (run / "latest").read_text().strip()


def flip_a_tensor_byte(path: Path) -> None:
    """One byte in the middle of the tensor data: the header (and so its sizes) stays valid."""
    blob = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", blob[:8])
    middle = 8 + length + (len(blob) - 8 - length) // 2
    blob[middle] ^= 0x40
    path.write_bytes(bytes(blob))


def test_a_moved_bpe_run_generates_scores_exports_and_imports_from_a_third_directory(
    capsys, moved, copied
):
    ckpt = checkpoint_of(copied)
    assert (ckpt / "tokenizer.json").read_bytes() == moved.tokenizer
    code, out, err = run_main(capsys, *PROMPT, "--checkpoint", str(copied), "--device", "cpu")
    assert (code, err) == (0, "") and out == moved.sample and out.startswith("the cat")
    Path("task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TASK))
    tasks_only = [a for a in EVAL if a not in ("--max-tokens", "256")]  # no val set: --task
    code, out, err = run_main(capsys, *tasks_only, "--checkpoint", str(copied),
                              "--task", "hellaswag", "task.jsonl")
    assert (code, err) == (0, ""), err
    (scored,) = json.loads(out)
    assert scored["tasks"] == moved.scored["tasks"]
    code, out, err = run_main(capsys, "export", "--checkpoint", str(copied), "--out", "exported")
    assert (code, err) == (0, ""), err
    assert Path("exported/tokenizer.json").read_bytes() == moved.tokenizer
    code, out, err = run_main(capsys, "import", "exported", "--out", "runs/back")
    assert (code, err) == (0, ""), err
    assert (Path("runs/back/step-000000/tokenizer.json").read_bytes() == moved.tokenizer)
    code, out, err = run_main(capsys, *PROMPT, "--checkpoint", "runs/back", "--device", "cpu")
    assert (code, err, out) == (0, "", moved.sample)
    assert not Path("data").exists()  # nothing was prepared


def test_a_checkpoint_damaged_on_its_way_is_named_and_never_used(capsys, copied):
    """Named with the run's newest other checkpoint whose model file its checksum finds
    intact (docs/evaluation.md promises it; the line named none): hashed only then."""
    ckpt = checkpoint_of(copied)
    *_, before, newest = sorted(copied.glob("step-*"))
    assert newest == ckpt
    flip_a_tensor_byte(ckpt / "model.safetensors")
    for verb in (PROMPT, ("eval", "--no-val", "--task", "hellaswag", "task.jsonl"),
                 ("export", "--out", "exported")):
        Path("task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TASK))
        code, out, err = run_main(capsys, *verb, "--checkpoint", str(copied))
        line = last_line(err)
        assert code == 2 and out == "", (verb, out)
        assert line == (
            f"error: {ckpt / 'model.safetensors'}: damaged: its sha256 is not the one "
            f"{ckpt.name}/checksums.json recorded when the checkpoint was written (a copy "
            f"damaged on its way?); copy {ckpt} again from where it was written, or use another "
            f"checkpoint of the run (the newest other intact one is {before})"), verb
    assert not Path("exported").exists()
    for older in sorted(copied.glob("step-*"))[:-1]:  # every other copy damaged too: none
        flip_a_tensor_byte(older / "model.safetensors")
    code, out, err = run_main(capsys, *PROMPT, "--checkpoint", str(copied))
    assert code == 2 and last_line(err).endswith("or use another checkpoint of the run"), err


def test_eval_without_the_data_or_its_text_says_how_to_prepare_it(capsys, moved, copied):
    ckpt = checkpoint_of(copied)
    args = (*EVAL, "--checkpoint", str(copied))
    code, out, err = run_main(capsys, *args)
    line = last_line(err)
    assert code == 2 and out == ""
    command = line.split("`")[1]
    target = f"data/own-bpe-tok{hashlib.sha256(moved.tokenizer).hexdigest()[:8]}"
    assert line == (
        f"error: {ckpt}: the val loss needs the run's data, data/own-bpe-300, which is not here, "
        f"nor is {moved.text}, the text it is prepared from; put that text there and prepare "
        f"the data with the run's own tokenizer: `{command}`, or pass --data DIR (shards "
        f"prepared with its tokenizer)")
    assert shlex.split(command) == [
        "andrea", "prepare", "-c", str(copied / "config.yaml"), "--tokenizer-file",
        str(ckpt / "tokenizer.json"), "--out", target]
    moved.text.parent.mkdir(parents=True, exist_ok=True)
    moved.text.write_text(own_text())
    try:
        code, _, err = run_main(capsys, *shlex.split(command)[1:])
        assert code == 0, err
        code, out, err = run_main(capsys, *args)
        assert (code, err) == (0, ""), err
        (result,) = json.loads(out)
        assert result["data_dir"] == target
        for key in ("loss", "tokens", "bits_per_byte"):
            assert result[key] == moved.scored[key], key
    finally:
        shutil.rmtree(moved.text.parent)


def test_eval_with_the_text_here_prepares_the_data_with_the_runs_own_tokenizer(
    capsys, moved, copied
):
    ckpt = checkpoint_of(copied)
    moved.text.parent.mkdir(parents=True, exist_ok=True)
    moved.text.write_text(own_text())
    try:
        code, out, err = run_main(capsys, *EVAL, "--checkpoint", str(copied))
    finally:
        shutil.rmtree(moved.text.parent)
    target = f"data/own-bpe-tok{hashlib.sha256(moved.tokenizer).hexdigest()[:8]}"
    assert code == 0 and err.splitlines() == [
        f"preparing {target} from {moved.text} with the run's own tokenizer "
        f"({ckpt / 'tokenizer.json'}): the run's data, data/own-bpe-300, is not here "
        f"(andrea writes a checkpoint's data only under ./data)"]
    (result,) = json.loads(out)
    for key in ("loss", "tokens", "bits_per_byte"):
        assert result[key] == moved.scored[key], key


def test_a_resume_without_the_data_or_its_text_says_how_to_prepare_it(capsys, moved, copied):
    ckpt = checkpoint_of(copied)
    resume = ("train", "--resume", str(copied), "--no-progress",
              "--set", f"train.max_steps={STEPS + 2}")
    code, out, err = run_main(capsys, *resume)
    line = last_line(err)
    assert code == 2
    command = line.split("`")[1]
    assert line == (
        f"error: {ckpt}: resuming needs the run's data, data/own-bpe-300, which is not here, "
        f"nor is {moved.text}, the text it is prepared from; put that text there and prepare "
        f"the data with the run's own tokenizer: `{command}`")
    assert shlex.split(command) == ["andrea", "prepare", "-c", str(copied / "config.yaml"),
                                    "--tokenizer-file", str(ckpt / "tokenizer.json")]
    moved.text.parent.mkdir(parents=True, exist_ok=True)
    moved.text.write_text(own_text())
    try:
        code, _, err = run_main(capsys, *shlex.split(command)[1:])
        assert code == 0, err
        # The optimizer state damaged on its way: named before any step, the run untouched.
        optimizer = ckpt / "optimizer.safetensors"
        pristine = optimizer.read_bytes()
        flip_a_tensor_byte(optimizer)
        code, out, err = run_main(capsys, *resume)
        assert code == 2 and last_line(err).startswith(f"error: {optimizer}: damaged: ")
        assert checkpoint_of(copied) == ckpt
        optimizer.write_bytes(pristine)
        code, out, err = run_main(capsys, *resume)
        assert code == 0, err
    finally:
        shutil.rmtree(moved.text.parent)
    assert checkpoint_of(copied).name == f"step-{STEPS + 2:06d}"
    assert sorted(p.name for p in Path("data").iterdir()) == [
        f"own-bpe-tok{hashlib.sha256(moved.tokenizer).hexdigest()[:8]}"]


def test_a_resume_whose_text_is_gone_trains_on_its_data_as_prepared(tmp_path, monkeypatch):
    """The run's data folder here, its text not (moved, deleted, or named relative to another
    working directory): a resume stopped at "own.txt: no such file or directory", though eval
    scored that data. Now it trains on the data as prepared, saying so, and gives the losses of
    the run that never stopped."""
    (tmp_path / "own.txt").write_text(own_text())
    monkeypatch.chdir(tmp_path)
    train = ("train", "--config", "andrea-tiny", "--no-progress", "--set", "data.source=own.txt",
             "--set", "data.tokenizer=byte", "--set", "train.max_steps=4", "--set",
             "train.checkpoint_every=2", "--set", "train.eval_every=0", "--set",
             "train.precision=fp32", "--set", "train.log_every=1")
    for name, stop in (("whole", ()), ("half", ("--stop-after", "2"))):
        code, _, err = quiet_main(*train, "--set", f"train.name={name}", *stop)
        assert code == 0, err
    (tmp_path / "own.txt").rename(tmp_path / "moved.txt")
    code, out, err = quiet_main("train", "--resume", "runs/half", "--no-progress")
    assert code == 0, err
    assert out.startswith("note: own.txt, the text the run's data was prepared from, is not "
                          "here; resuming on data/own-byte as it was prepared\n"), out

    def losses(run: str) -> dict[int, float]:
        records = map(json.loads, (tmp_path / "runs" / run / "metrics.jsonl").read_text()
                      .splitlines())
        return {r["step"]: r["loss"] for r in records if r["event"] == "train"}

    assert losses("half") == losses("whole") and sorted(losses("half")) == [1, 2, 3, 4]


def test_a_run_opened_from_another_project_never_reads_that_projects_data(
    tmp_path, monkeypatch
):
    """Two projects, each with its own own.txt and the data derived from it (data/own-byte,
    relative). A resume or eval of project a's run from project b trained on and scored b's
    data without a word: the same relative names found other data. Now both stop in one line
    naming both folders, until the command names the data; in the run's own folder, data
    prepared again from its changed text goes on with a note."""
    a, b = tmp_path / "a", tmp_path / "b"
    for project, shift in ((a, 0), (b, 5)):
        project.mkdir()
        (project / "own.txt").write_text(own_text()[shift:].upper() if shift else own_text())
    train = ("train", "--config", "andrea-tiny", "--no-progress", "--set", "data.source=own.txt",
             "--set", "data.tokenizer=byte", "--set", "train.max_steps=4", "--set",
             "train.checkpoint_every=2", "--set", "train.eval_every=0", "--set",
             "train.precision=fp32")
    monkeypatch.chdir(a)
    code, _, err = quiet_main(*train, "--stop-after", "2")
    assert code == 0, err
    run = a / "runs" / "andrea-tiny"
    ckpt = run / "step-000002"
    monkeypatch.chdir(b)
    code, _, err = quiet_main(*train, "--set", "train.max_steps=1")  # b's data, prepared
    assert code == 0, err
    ours, theirs = a / "data" / "own-byte", b / "data" / "own-byte"
    code, _, err = quiet_main("train", "--resume", str(run), "--no-progress")
    assert code == 2 and last_line(err) == (
        f"error: {ckpt}: resuming would read other data: the run trained on {ours}, and the "
        f"data here is {theirs}, which holds other shards (a relative data.dir names a folder "
        f"under the working directory); run it from the directory the run trained in, or read "
        f"this data by naming it: --set data.dir={theirs}")
    assert (run / "latest").read_text().strip() == ckpt.name
    code, _, err = quiet_main(*EVAL, "--checkpoint", str(run))
    assert code == 2 and last_line(err).startswith(
        f"error: {ckpt}: the val loss would read other data: the run trained on {ours}, ")
    assert last_line(err).endswith(f"read this data by naming it: --data {theirs}")
    code, _, err = quiet_main(*EVAL, "--checkpoint", str(run), "--data", str(theirs))
    assert code == 0, err
    monkeypatch.chdir(a)
    code, _, err = quiet_main(*EVAL, "--checkpoint", str(run))
    assert code == 0 and err == "", err
    with (a / "own.txt").open("a") as f:
        f.write(own_text()[:500])
    code, out, err = quiet_main("train", "--resume", str(run), "--no-progress")
    assert code == 0, err
    assert f"note: {ours} holds other shards than {ckpt} was trained on (prepared again since, "\
           f"from its text as it is now)\n" in out, out
    assert f"resume: the val split in {ours} is not the one the run evaluated on: a new val "\
           f"set, so the val losses after step 2 are not comparable with the earlier ones, and "\
           f"the best val starts again from them\n" in out, out
    monkeypatch.chdir(b)
    code, out, err = quiet_main("train", "--resume", str(run), "--no-progress", "--set",
                                f"data.dir={theirs}", "--set", "train.max_steps=6")
    assert code == 0, err


def test_a_checkpoint_from_before_without_tokenizer_or_checksums_still_opens(
    capsys, moved, copied
):
    """Written before checkpoints carried their tokenizer and checksums: its BPE is made again
    from the run's text, as before, in one line, and it generates what it did."""
    ckpt = checkpoint_of(copied)
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "checksums.json").unlink()
    moved.text.parent.mkdir(parents=True, exist_ok=True)
    moved.text.write_text(own_text())
    try:
        code, out, err = run_main(capsys, *PROMPT, "--checkpoint", str(copied))
    finally:
        shutil.rmtree(moved.text.parent)
    assert code == 0 and err.splitlines() == [
        f"preparing data/own-bpe-300 from {moved.text} with a BPE trained again, as the run's "
        f"config says ({ckpt} holds no tokenizer.json: written before checkpoints carried "
        f"their tokenizer): the run's data, data/own-bpe-300, is not here"]
    assert out == moved.sample
