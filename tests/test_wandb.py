"""Weights & Biases (train.wandb, andrea/train/metrics.py) with the real package, offline: the
run folder's W&B files read back, a resume continuing the same W&B run. Skipped without wandb."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from andrea.config import load_config
from andrea.train.loop import train

BLOCK = 32 * 1024  # W&B's transaction log is leveldb's log format: 32 KiB blocks
HEADER = struct.Struct("<IHB")  # checksum, length, chunk type (1 full, 2 first, 3 middle, 4 last)


def read_wandb_file(path: Path) -> list:
    """The protobuf records of a .wandb file (wandb 0.31 has no Python reader left; its Go core
    writes the leveldb log format after a 7-byte ':W&B' header, records of wandb.proto)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, records, parts = 7, [], b""
    while pos + HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = HEADER.unpack_from(data, pos)
        if kind == 0:
            break
        parts += data[pos + HEADER.size:pos + HEADER.size + length]
        pos += HEADER.size + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def history(records: list) -> list[dict]:
    rows = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in row.item} for row in rows]


def test_offline_run_logs_the_scalars_and_a_resume_continues_it(tmp_path, data_dir, capfd):
    """...and W&B prints nothing to the terminal (its banner, summary and sync hints): andrea
    says one line of it per segment."""
    pytest.importorskip("wandb", reason="optional: pip install -e '.[wandb]'")
    cfg = load_config("andrea-tiny", [
        f"data.dir={data_dir}", f"train.runs_dir={tmp_path}", "train.name=w", "train.max_steps=2",
        "train.log_every=1", "train.eval_every=1", "train.wandb=offline",
        "train.wandb_project=p"])
    assert train(cfg, progress=False, stop_after=1).state == "stopped"
    assert train(cfg, resume="auto", progress=False).state == "finished"
    import wandb

    wandb.teardown()  # W&B's service writes the last run's file out as it stops (a CLI: at exit)
    run_id = (tmp_path / "w" / "wandb_run_id").read_text().strip()
    folders = sorted((tmp_path / "w" / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith("-" + run_id) for f in folders)
    out, err = capfd.readouterr()
    assert "wandb:" not in out + err, out + err
    said = [line for line in out.splitlines() if line.startswith("W&B: ")]
    assert said == [f"W&B: offline run {run_id} in {f}; upload it with: wandb sync {f}"
                    for f in folders], out
    first, second = (read_wandb_file(next(f.glob("*.wandb"))) for f in folders)
    runs = [r.run for r in first + second if r.WhichOneof("record_type") == "run"]
    assert {(r.run_id, r.project, r.display_name) for r in runs} == {(run_id, "p", "w")}
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert config["train"]["max_steps"] == 2 and config["model"]["n_layer"] == 2
    rows = history(first) + history(second)
    metrics = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").open()]
    trains = [r for r in metrics if r["event"] == "train"]
    logged = {row["step"]: row for row in rows if "train/loss" in row}
    assert sorted(logged) == [1, 2]  # the first run's step, the resumed run's second
    for rec in trains:
        assert logged[rec["step"]]["train/loss"] == pytest.approx(rec["loss"])
        assert logged[rec["step"]]["train/lr"] == pytest.approx(rec["lr"])
    evals = [r for r in metrics if r["event"] == "eval"]
    assert [(row["step"], row["val/loss"]) for row in rows if "val/loss" in row] == [
        (r["step"], pytest.approx(r["val_loss"])) for r in evals]
    end = [r for r in metrics if r["event"] == "end"][-1]
    assert [row["run/tokens_per_s"] for row in rows if "run/tokens_per_s" in row][-1] == (
        pytest.approx(end["tokens_per_s"]))


def test_wandb_without_the_package_is_a_one_line_error(tmp_path, monkeypatch):
    from andrea.errors import UserError
    from andrea.train.metrics import open_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # the import fails as if not installed
    cfg = load_config("andrea-tiny", ["train.wandb=online"])
    with pytest.raises(UserError, match=r"online needs .* pip install -e '.\[wandb\]'"):
        open_wandb(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything is written
    assert open_wandb(load_config("andrea-tiny", []), tmp_path / "run") is None  # off


def test_wandb_is_asked_for_silence_and_andrea_says_one_line(tmp_path, monkeypatch, capsys):
    """Without the package too (a stand-in module records what wandb.init is given): W&B's own
    output off (silent: no banner, run summary or sync hints; console off: the terminal not
    copied), and one line of andrea's per mode."""
    from types import SimpleNamespace

    from andrea.train.metrics import open_wandb

    given: dict = {}

    def init(**kwargs):
        given.update(kwargs)
        return SimpleNamespace(id=kwargs["id"], url="https://wandb.example/r",
                               define_metric=lambda *a, **kw: None,
                               settings=SimpleNamespace(sync_dir=str(tmp_path / "sync")))

    fake = SimpleNamespace(Settings=lambda **kw: kw, init=init)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    offline = open_wandb(load_config("andrea-tiny", ["train.wandb=offline"]), tmp_path / "r")
    assert given["settings"] == {"console": "off", "silent": True}
    run_id = (tmp_path / "r" / "wandb_run_id").read_text().strip()
    assert offline.line == (f"W&B: offline run {run_id} in {tmp_path / 'sync'}; upload it "
                            f"with: wandb sync {tmp_path / 'sync'}")
    online = open_wandb(load_config("andrea-tiny", ["train.wandb=online"]), tmp_path / "r")
    assert online.line == f"W&B: run {run_id}: https://wandb.example/r"
