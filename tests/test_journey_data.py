"""A user's data through the real `andrea` command, as tests/test_journey.py walks the verbs:
nothing the user owns is lost.

The user's text lives in data/, where the derived data folder (data/data-byte) lands too. A sweep
starts two `andrea train` runs at once on that unprepared data: one prepares, the other waits and
trains on the result. `train --resume` re-checks the data and leaves it alone (the folder holding
the output is not input). A second experiment pointed at that folder with another tokenizer is
refused, and so is a prepare into a folder of the user's own files; both leave every file as it
was.
"""

from __future__ import annotations

from pathlib import Path

from conftest import andrea_main, assert_user_error
from test_data_folder import SHARDS, snapshot, take_turns, write_corpus

from andrea.data.shards import read_manifest

TRAIN = ("train", "-c", "andrea-tiny", "--set", "data.source=data/", *SHARDS,
         "--set", "train.runs_dir=runs", "--set", "train.max_steps=2", "--set",
         "train.eval_every=2", "--set", "train.checkpoint_every=2")


def test_a_users_data_survives_a_sweep_a_resume_and_mistakes(tmp_path):
    write_corpus(tmp_path / "data")
    waiting, first, second, [(out1, err1), (out2, err2)] = take_turns(
        (*TRAIN, "--set", "train.name=a"),
        (*TRAIN, "--set", "train.name=b", "--set", "train.seed=1"), tmp_path, "stdout",
        timeout=300)
    assert "data/data-byte: another andrea process" in waiting, waiting
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    assert "preparing data/data-byte from data/ (first run only)" in out1
    assert "data/data-byte: prepared by the other process meanwhile; using it" in out2
    for out in (out1, out2):
        assert "finished: 2 steps" in out, out
    prepared = tmp_path / "data/data-byte"
    inputs = [Path(i["name"]).name for i in read_manifest(prepared)["inputs"]]
    assert inputs == ["a.txt", "b.txt"]
    before = snapshot(prepared)

    r = andrea_main("train", "--resume", "runs/a", "--set", "train.max_steps=3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "data/: skipping data/data-byte: prepared data or the output folder" in r.stdout
    assert "finished: 3 steps" in r.stdout
    assert snapshot(prepared) == before

    r = andrea_main(*TRAIN, "--set", "train.name=c", "--set", "data.tokenizer=gpt2", "--set",
                    "model.vocab_size=50304", "--set", "data.dir=data/data-byte", cwd=tmp_path)
    assert_user_error(r, "data/data-byte: holds data prepared with tokenizer byte",
                      "asks for tokenizer gpt2", "--force")
    assert snapshot(prepared) == before

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "main.py").write_text("print('mine')\n")
    r = andrea_main("prepare", "-i", "data/", "-t", "byte", "-o", "notes", cwd=tmp_path)
    assert_user_error(r, "notes: the folder holds files andrea did not write (main.py)")
    assert [p.name for p in notes.iterdir()] == ["main.py"]
    assert snapshot(prepared) == before
