"""A prepare stopped short keeps what it finished (issue 33): SIGTERM is the clean stop Ctrl-C
is, workers included; a full disk is one line, keeps every complete shard (an earlier
interruption's too), and the same command then finishes byte-identical to an uninterrupted
prepare. Each through the real `andrea` command; each fails on the code before it (SIGTERM killed
the process with a leaked-semaphore warning, a full disk cleared the folder)."""

from __future__ import annotations

import filecmp
import re
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import andrea_main, small_disk
from test_data_folder import SHARDS, finish, start, wait_for_line, write_corpus

from andrea.data import stops
from andrea.data.documents import documents

ARGS = ("prepare", "-c", "andrea-tiny", "--set", "data.source=in", *SHARDS)
# The corpus makes 5 train shards of 40 KiB and 2 val ones: a tmpfs of 160 KiB holds the lock,
# the progress record and 4 of them, not all 7.
SMALL_DISK = "160k"


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """The corpus and its uninterrupted prepare (data/clean), shared by the module's tests."""
    root = tmp_path_factory.mktemp("stops")
    write_corpus(root / "in")
    r = andrea_main(*ARGS, "-o", "data/clean", cwd=root)
    assert r.returncode == 0, r.stderr
    return root


def same_shards(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir() if p.suffix in (".bin", ".json"))
    assert names == sorted(p.name for p in b.iterdir() if p.suffix in (".bin", ".json"))
    bins = [n for n in names if n.endswith(".bin")]
    assert filecmp.cmpfiles(a, b, bins, shallow=False)[0] == bins


def pause_and_signal(cwd: Path, out: str, sig: int, *extra: str) -> tuple[int, str]:
    """`andrea prepare` into `out`, paused in its third train shard, then sent `sig`: (exit
    code, what it printed on stderr after the pause)."""
    proc = start(*ARGS, "-o", out, *extra, cwd=cwd,
                 env={"ANDREA_FAULTS": "prepare-pause@train_000002.bin"})
    try:
        paused, seen = wait_for_line(proc.stderr, "paused in")
        assert paused, seen
        proc.send_signal(sig)
    finally:
        ((_, err),) = finish(proc, timeout=60)
    return proc.returncode, err


def test_sigterm_is_the_clean_stop_of_ctrl_c(clean):
    """Workers in a pool (--workers 2): one line from andrea, exit 143, two shards kept; the
    rerun resumes and ends byte-identical to the uninterrupted prepare."""
    code, err = pause_and_signal(clean, "data/term", signal.SIGTERM, "--workers", "2")
    assert err.strip() == ("stopped by SIGTERM: data/term keeps 2 complete shards (40,000 "
                           "tokens); run the same command again to continue from there"), err
    assert code == 143
    assert sorted(p.name for p in (clean / "data/term").iterdir()) == [
        ".andrea-prepare.lock", "progress.json", "train_000000.bin", "train_000001.bin"]
    r = andrea_main(*ARGS, "-o", "data/term", cwd=clean)  # the shards do not depend on it
    assert r.returncode == 0, r.stderr
    assert "resuming after 2 complete shards (40,000 tokens)" in r.stdout
    same_shards(clean / "data/term", clean / "data/clean")


def test_full_disk_keeps_every_complete_shard_and_the_rerun_finishes(clean):
    """The issue's case: a prepare killed (-9) with 2 complete shards, run again on a disk too
    small for the rest: one line (what, free space, kept, the command), exit 2, every complete
    shard kept; the same command with room finishes byte-identical to an uninterrupted one."""
    with small_disk(clean / "small", SMALL_DISK) as mounted:
        code, _ = pause_and_signal(clean, "small/prep", signal.SIGKILL)
        assert code == -signal.SIGKILL
        full = {} if mounted else {"ANDREA_FAULTS": "disk-full@prepare:train_000003.bin"}
        r = andrea_main(*ARGS, "-o", "small/prep", cwd=clean, env=full)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "resuming after 2 complete shards" in r.stdout
        lines = r.stderr.splitlines()
        assert len(lines) == (2 if mounted else 1), r.stderr
        if mounted:  # the estimate warned before the first byte
            assert lines[0].startswith("warning: small/prep: the rest of the shards needs about")
        kept = re.fullmatch(
            r"error: small/prep: disk full writing small/prep/(train_00000\d.bin) \(.* free; the "
            r"rest of the shards needs about .*\); small/prep keeps (\d) complete shards "
            r"\(([\d,]+) tokens\): free space \(or choose a data folder on a larger disk\) and "
            r"run `andrea prepare -c andrea-tiny .* -o small/prep` to continue", lines[-1])
        assert kept, lines[-1]
        files = sorted(p.name for p in (clean / "small/prep").iterdir())
        shards = [n for n in files if n.endswith(".bin")]
        assert len(shards) == int(kept[2]) >= 3 and "progress.json" in files, files
        assert not [n for n in files if n.endswith(".tmp")] and kept[1] not in files
        for name in shards:  # each complete one is the clean prepare's, byte for byte
            assert filecmp.cmp(clean / "small/prep" / name, clean / "data/clean" / name, False)
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=4m", str(clean / "small")], check=True)
        r = andrea_main(*ARGS, "-o", "small/prep", cwd=clean)
        assert r.returncode == 0 and not r.stderr, r.stderr
        assert f"resuming after {kept[2]} complete shards ({kept[3]} tokens)" in r.stdout
        same_shards(clean / "small/prep", clean / "data/clean")


def test_the_estimate_warns_when_the_disk_is_short(tmp_path, monkeypatch, capsys):
    """Byte ids are uint16: 2 bytes a text byte; a gzip input counts as 2.6 times its size."""
    (tmp_path / "a.txt").write_bytes(b"x" * 1000)
    (tmp_path / "b.txt.gz").write_bytes(b"y" * 100)
    docs = documents(str(tmp_path / "*.txt*"))
    assert stops.estimate_bytes(docs, "byte", None) == 2 * 1000 + 2 * 260
    assert stops.estimate_bytes(docs, "bpe", 100_000) == int(1260 * 0.33 * 4)
    monkeypatch.setattr(stops, "free_bytes", lambda path: 2519)
    stops.warn_if_short(tmp_path / "out", 2520, "byte", resuming=False)
    assert capsys.readouterr().err == (
        f"warning: {tmp_path / 'out'}: the shards need about 2.5 KiB (estimated from the input "
        "size for tokenizer byte) but the disk has 2.5 KiB free; a full disk stops the prepare, "
        "keeping its complete shards\n")
    stops.warn_if_short(tmp_path / "out", 2519, "byte", resuming=False)
    assert capsys.readouterr().err == ""
