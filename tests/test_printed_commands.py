"""Every command andrea prints for the user to run works as printed (issue 51, item 5): each
test takes the command from an error line, runs it as a shell would split it, and checks that
it did what the line said. The resume command of a shard changed under a training is pasted in
test_shard_damage.py, the disk-room command in test_diskspace.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
from conftest import andrea_main, assert_user_error, make_checkpoint
from test_prepare import corpus  # noqa: F401  (a fixture)
from test_shard_damage import set_token

from andrea.data import verify
from andrea.data.loader import TokenSplit
from andrea.data.shards import MANIFEST, DamagedFolder


def commands(line: str) -> list[list[str]]:
    """Each `command` of a line (in backticks), split as a shell splits it."""
    return [shlex.split(c) for c in re.findall(r"`([^`]+)`", line)]


def paste(argv: list[str], cwd: Path):
    """Run a pasted command: `andrea ...` in this process, `rm ...` as rm does."""
    if argv[0] == "rm":
        for path in argv[1:]:
            os.remove(cwd / path)
        return None
    assert argv[0] == "andrea", argv
    result = andrea_main(*argv[1:], cwd=cwd)
    assert result.returncode == 0, (argv, result.stderr)
    return result


def cut_short(shard: Path, nbytes: int = 8192) -> None:
    os.truncate(shard, shard.stat().st_size - nbytes)


def test_eval_prepares_the_runs_damaged_val_split_again_as_train_does(data_dir, tmp_path):
    """Before: `error: ...: token shard truncated ...; re-run `andrea prepare --force``, which
    fails as printed. Now eval prepares the run's own folder (under ./data) again, saying why
    on stderr, and scores the same val set as before the damage."""
    ckpt = make_checkpoint(tmp_path)  # the tiny preset: its data is ./data/shakespeare-byte
    local = tmp_path / "data" / "shakespeare-byte"
    shutil.copytree(data_dir, local)
    argv = ("eval", "--checkpoint", str(ckpt), "--max-tokens", "512", "--no-progress",
            "--precision", "fp32", "--json")
    intact = andrea_main(*argv, cwd=tmp_path)
    assert intact.returncode == 0, intact.stderr
    cut_short(local / "val_000000.bin")
    again = andrea_main(*argv, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert ("data/shakespeare-byte/val_000000.bin: token shard truncated: " in again.stderr
            and "preparing data/shakespeare-byte again from the same inputs" in again.stderr)
    assert json.loads(again.stdout)[0]["loss"] == json.loads(intact.stdout)[0]["loss"]


def test_eval_on_a_damaged_data_folder_names_a_command_that_prepares_it(data_dir, tmp_path):
    """--data names a folder eval never writes: its line names the command that prepares it
    again, built from what the folder records; pasted, it does, and eval then runs."""
    ckpt = make_checkpoint(tmp_path)
    data = tmp_path / "shards"
    shutil.copytree(data_dir, data)
    cut_short(data / "val_000000.bin")
    argv = ("eval", "--checkpoint", str(ckpt), "--data", "shards", "--max-tokens", "256",
            "--no-progress", "--precision", "fp32")
    line = assert_user_error(andrea_main(*argv, cwd=tmp_path),
                             "shards/val_000000.bin: token shard truncated")
    (command,) = commands(line)
    assert command == ["andrea", "prepare", "--input", "shakespeare", "--tokenizer", "byte",
                       "--out", "shards"]
    out = paste(command, tmp_path)
    assert "preparing shards again from the same inputs" in out.stdout
    assert andrea_main(*argv, cwd=tmp_path).returncode == 0


def prepare_bpe(corpus: Path, tmp_path: Path, *extra: str) -> Path:  # noqa: F811
    """A BPE folder prepared ad hoc, with settings other than the defaults."""
    argv = ["prepare", "--input", str(corpus), "--tokenizer", "bpe", "--vocab-size", "300",
            "--out", "bpe", "--set", "data.shard_tokens=300", "--set", "data.val_fraction=0.2",
            *extra]
    assert andrea_main(*argv, cwd=tmp_path).returncode == 0
    return tmp_path / "bpe"


def test_a_bpe_folder_cut_short_is_prepared_again_by_its_command_keeping_its_tokenizer(
        corpus, tmp_path):  # noqa: F811
    """The command carries the folder's own settings (vocab size, shard size, val fraction),
    so pasted it prepares the same folder again, keeping its BPE, never a --force that would
    train another."""
    out = prepare_bpe(corpus, tmp_path)
    identity = json.loads((out / MANIFEST).read_text())["tokenizer"]["identity"]
    cut_short(out / "train_000001.bin", 4)
    with pytest.raises(DamagedFolder) as caught:
        TokenSplit(out, "train")
    (command,) = commands(str(caught.value))
    assert command == ["andrea", "prepare", "--input", str(corpus), "--tokenizer", "bpe",
                       "--vocab-size", "300", "--out", str(out), "--set",
                       "data.val_fraction=0.2", "--set", "data.shard_tokens=300"]
    result = paste(command, tmp_path)
    assert "keeping its tokenizer.json" in result.stdout
    assert json.loads((out / MANIFEST).read_text())["tokenizer"]["identity"] == identity
    assert verify.verify_folder(out).endswith(")")


def test_a_given_tokenizer_folder_names_its_tokenizer_file(corpus, tmp_path,  # noqa: F811
                                                          monkeypatch):
    """A folder prepared with --tokenizer-file: its command gives the same file again."""
    monkeypatch.chdir(tmp_path)
    given = prepare_bpe(corpus, tmp_path) / "tokenizer.json"
    shutil.copy(given, tmp_path / "tok.json")
    argv = ["prepare", "--input", str(corpus), "--tokenizer-file", "tok.json", "--out", "given"]
    assert andrea_main(*argv, cwd=tmp_path).returncode == 0
    out = tmp_path / "given"
    (out / "val_000000.bin").unlink()
    (command,) = commands(str(pytest.raises(DamagedFolder, TokenSplit, out, "val").value))
    assert command[command.index("--tokenizer-file") + 1] == "tok.json"
    assert "keeping its tokenizer.json" in paste(command, tmp_path).stdout


def test_a_checksum_mismatchs_commands_delete_and_prepare_the_shard_again(data_dir, tmp_path):
    """`prepare --verify` of a shard damaged in range: its `rm ...` and `andrea prepare ...`,
    pasted, leave the folder intact."""
    data = tmp_path / "shards"
    shutil.copytree(data_dir, data)
    if set_token(data / "train_000000.bin", 1000, 0) == 0:
        set_token(data / "train_000000.bin", 1000, 1)
    line = assert_user_error(andrea_main("prepare", "--verify", "shards", cwd=tmp_path),
                             "shards: 1 of 2 shards damaged")
    pasted = commands(line)
    assert [c[0] for c in pasted] == ["rm", "andrea"]
    for argv in pasted:
        paste(argv, tmp_path)
    assert "2 shards" in verify.verify_folder(data) and "intact" in verify.verify_folder(data)


def test_the_training_line_for_a_damaged_shard_names_commands_that_run(data_dir, tmp_path,
                                                                        monkeypatch):
    """The line a training stops with (a checksum found damaged; verify.remedy) names `rm` and
    the prepare command; pasted, the folder is intact again."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "shards"
    shutil.copytree(data_dir, data)
    line = f"error: x: checksum mismatch; {verify.remedy(Path('shards/train_000000.bin'))}"
    set_token(data / "train_000000.bin", 5, 7)
    pasted = commands(line)
    assert [c[:2] for c in pasted] == [["rm", "shards/train_000000.bin"], ["andrea", "prepare"]]
    for argv in pasted:
        paste(argv, tmp_path)
    assert "intact" in verify.verify_folder(data)


def test_verify_on_a_folder_of_text_names_the_command_that_prepares_it(corpus, tmp_path):  # noqa: F811
    """Before: `prepare text into it: andrea prepare --input PATH --out in`, which is refused,
    the folder holding the user's files. Now the command that prepares that text elsewhere;
    pasted, it writes a folder that verifies, and leaves the text as it was."""
    before = {p: p.read_bytes() for p in corpus.rglob("*") if p.is_file()}
    line = assert_user_error(andrea_main("prepare", "--verify", "in", cwd=tmp_path),
                             "in: no prepared data here", "it holds a.txt, ")
    (command,) = commands(line)
    out = paste(command, tmp_path).stdout
    written = re.search(r"data/in-[\w-]+", out)
    assert written, out
    assert "intact" in verify.verify_folder(tmp_path / written.group())
    assert {p: p.read_bytes() for p in corpus.rglob("*") if p.is_file()} == before


def test_a_folder_without_checksums_names_the_command_that_records_them(data_dir, tmp_path):
    data = tmp_path / "shards"
    shutil.copytree(data_dir, data)
    manifest = json.loads((data / MANIFEST).read_text())
    manifest.pop("shard_checksum")
    for entries in manifest["shards"].values():
        for entry in entries:
            entry.pop("checksum")
    (data / MANIFEST).write_text(json.dumps(manifest))
    said = andrea_main("prepare", "--verify", "shards", cwd=tmp_path)
    assert said.returncode == 0 and "no checksums recorded" in said.stdout
    (command,) = commands(said.stdout)
    assert command[-1] == "--force"
    paste(command, tmp_path)
    assert "crc32 checksums match" in verify.verify_folder(data)


def test_a_folder_of_another_request_names_the_command_that_replaces_it(corpus, tmp_path):  # noqa: F811
    """Before: `andrea prepare ... --force`, which is no command. Now the request's own
    command with --force; pasted, it replaces the data."""
    prepare_bpe(corpus, tmp_path)
    argv = ["prepare", "--input", str(corpus), "--tokenizer", "byte", "--out", "bpe"]
    line = assert_user_error(andrea_main(*argv, cwd=tmp_path), "andrea does not overwrite it")
    (command,) = commands(line)
    assert command == ["andrea", *argv, "--force"]
    # What it was prepared with, added to a training's command, trains on it as it is.
    sets = shlex.split(re.search(r"prepared with \(([^)]+)\); else", line).group(1))
    vocab = next(s for s in sets if s.startswith("model.vocab_size="))
    assert sets[:2] == ["--set", "data.tokenizer=bpe"]
    run = andrea_main("train", "-c", "andrea-tiny", "--set", f"data.source={corpus}", *sets,
                      "--set", "data.dir=bpe", "--set", "train.max_steps=1", "--set",
                      "train.runs_dir=runs", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert vocab and (tmp_path / "runs" / "andrea-tiny" / "latest").is_file()
    paste(command, tmp_path)
    assert json.loads((tmp_path / "bpe" / MANIFEST).read_text())["tokenizer"]["kind"] == "byte"
