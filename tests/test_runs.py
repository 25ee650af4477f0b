"""`andrea runs`: summaries of fabricated run directories in every state, damaged ones included.
Also the optional TensorBoard sink (andrea/train/metrics.py) and the run's one tokens/s."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import andrea_main, assert_user_error

from andrea.config import load_config
from andrea.errors import UserError
from andrea.runs import current_history, list_runs, read_metrics, read_run
from andrea.train.metrics import MetricsLog, open_tensorboard

TOKENS_PER_STEP = 512


def train_record(step: int, loss: float | None = None, **extra) -> dict:
    rec = {
        "event": "train",
        "step": step,
        "tokens": step * TOKENS_PER_STEP,
        "loss": 5.0 - step / 100 if loss is None else loss,
        "lr": 1e-3 * min(1.0, step / 20),
        "grad_norm": 10.0 / step,
        "tokens_per_s": 1000.0 + step,
        "mfu": None,
        "time": 1.7e9 + step,
    }
    rec.update(extra)
    return rec


def start_record(
    step: int = 0, max_steps: int = 100, pid: int = 1, host: str | None = None,
    preset: str = "andrea-tiny", at: float | None = None,
):
    """A start event; `at`: its time (a live pid's run started after its process did)."""
    return {
        "event": "start", "time": 1.7e9 + step if at is None else at, "step": step,
        "max_steps": max_steps, "pid": pid,
        "host": host or socket.gethostname(), "resumed_from": None if step == 0 else "x",
        "n_params": 1234, "preset": preset,
    }


def end_record(step: int, state: str, signal: str | None = None, checkpoint=None) -> dict:
    return {
        "event": "end", "time": 1.7e9 + step, "step": step, "tokens": step * TOKENS_PER_STEP,
        "state": state, "signal": signal, "message": f"ended: {state}",
        "best_val_loss": None, "best_val_step": None, "checkpoint": checkpoint,
    }


def write_run(
    root: Path,
    name: str,
    records: list[dict],
    *,
    checkpoints: tuple[int, ...] = (),
    config: str | None = None,
    tail: str = "",
) -> Path:
    """A run directory as the trainer writes it; `tail` is appended raw (e.g. a cut-off line)."""
    run = root / name
    run.mkdir(parents=True)
    if config is None:
        config = load_config("andrea-tiny", ["train.max_steps=100"]).to_yaml()
    if config != "<none>":
        (run / "config.yaml").write_text(config)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (run / "metrics.jsonl").write_text(text)
    for step in checkpoints:
        (run / f"step-{step:06d}").mkdir()
        # The smallest sound safetensors files (no tensors) and trainer state (a step alone):
        # the checkpoint counts as intact, for a resume too.
        for name in ("model", "optimizer", "rng"):
            (run / f"step-{step:06d}" / f"{name}.safetensors").write_bytes(
                b"\x02" + bytes(7) + b"{}")
        (run / f"step-{step:06d}" / "trainer_state.json").write_text(f'{{"step": {step}}}')
    if checkpoints:
        (run / "latest").write_text(f"step-{max(checkpoints):06d}\n")
    return run


def normal_history(last_step: int, first_step: int = 0) -> list[dict]:
    """Train every 10 steps, eval every 50 (val loss lowest at step 50), from first_step+10."""
    out = []
    for s in range(first_step + 10, last_step + 1, 10):
        out.append(train_record(s))
        if s % 50 == 0:
            out.append({"event": "eval", "step": s, "tokens": s * TOKENS_PER_STEP,
                        "val_loss": 3.0 + abs(s - 50) / 100, "time": 1.7e9 + s})
    return out


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize(
    "state, signal, last",
    [
        ("finished", None, 100),
        ("stopped", None, 60),
        ("interrupted", "SIGTERM", 70),
        ("nonfinite", None, 80),
        ("failed", None, 30),
    ],
)
def test_ended_runs(tmp_path, state, signal, last):
    records = [start_record(), *normal_history(last), end_record(last, state, signal)]
    run = write_run(tmp_path, f"r-{state}", records, checkpoints=(20, last))
    r = read_run(run)
    assert r.state == state and r.signal == signal and r.problems == []
    assert (r.step, r.max_steps, r.tokens) == (last, 100, last * TOKENS_PER_STEP)
    assert r.preset == "andrea-tiny" and r.shape == "2L/4H/d64/ctx64"
    assert r.model == "andrea-tiny 2L/4H/d64/ctx64"
    assert r.last_train_loss == pytest.approx(5.0 - last / 100)
    speeds = [1000.0 + s for s in range(10, last + 1, 10)]
    assert r.median_tokens_per_s == pytest.approx(statistics.median(speeds))
    assert r.tokens_per_s is None and r.mfu is None  # older records: no run figure to show
    if last >= 50:
        assert (r.best_val_loss, r.best_val_step) == (pytest.approx(3.0), 50)
    else:
        assert r.best_val_loss is None and r.best_val_step is None
    assert r.latest_checkpoint == f"step-{last:06d}"


def test_running_and_crashed(tmp_path):
    alive = write_run(tmp_path, "alive", [start_record(pid=os.getpid(), at=time.time()),
                                          *normal_history(40)])
    dead = write_run(tmp_path, "dead", [start_record(pid=dead_pid()), *normal_history(40)])
    elsewhere = write_run(
        tmp_path, "elsewhere",
        [start_record(pid=os.getpid(), host="other-host-xyz", at=time.time())]
    )
    assert read_run(alive).state == "running"
    assert read_run(dead).state == "crashed"
    # A dead run's pid given again to a later process (container restarts hand out the same low
    # pids): alive, but not the process that started the run. Read "running" before.
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reused = write_run(tmp_path, "reused", [start_record(pid=later.pid,
                                                             at=time.time() - 60),
                                                *normal_history(40)])
        assert read_run(reused).state == "crashed"
        assert read_run(write_run(tmp_path, "its_own", [
            start_record(pid=later.pid, at=time.time()), *normal_history(40)])).state == "running"
    finally:
        later.kill()
        later.wait()
    r = read_run(elsewhere)
    assert r.state == "unknown" and "other-host-xyz" in r.problems[0]


def test_a_crashed_run_says_how_to_go_on_and_one_without_a_checkpoint_is_not_called_no_run(
        tmp_path):
    """Before: `andrea runs` gave a crashed run no note (while --resume's refusal pointed to it
    for how the run stopped), and eval called a run killed before its first checkpoint "not a
    run directory"."""
    early = write_run(tmp_path, "early", [start_record(pid=dead_pid()), *normal_history(10)])
    late = write_run(tmp_path, "late", [start_record(pid=dead_pid()), *normal_history(40)],
                     checkpoints=(20,))
    notes = andrea_main("runs", str(tmp_path)).stdout
    assert (f"  early: its process ended without a word (killed?) before its first checkpoint; "
            f"nothing to continue; start it over: andrea train --config {early}/config.yaml "
            f"--set train.runs_dir={tmp_path} --set train.name=early" in notes), notes
    assert f"  late: its process ended without a word (killed?); continue it: andrea train " \
           f"--resume {late}" in notes, notes
    assert_user_error(andrea_main("eval", "--checkpoint", str(early)),
                      f"{early}: the run has no checkpoint yet", f"andrea runs {early}")


def test_the_commands_of_a_crashed_runs_notes_quote_a_folder_with_a_space(tmp_path):
    """Before: `andrea runs "my runs"` noted `continue it: andrea train --resume my runs/late`
    and `start it over: andrea train --config my runs/early/config.yaml`, which a shell splits
    at the space; eval's refusal of the early run named `andrea runs my runs/early` alike. Now
    each command's paths are quoted; the run named as the line's subject is not."""
    root = tmp_path / "my runs"
    early = write_run(root, "early", [start_record(pid=dead_pid()), *normal_history(10)])
    late = write_run(root, "late", [start_record(pid=dead_pid()), *normal_history(40)],
                     checkpoints=(20,))
    notes = andrea_main("runs", "my runs", cwd=tmp_path).stdout
    said = {line.split(": ")[0].strip(): line.rsplit(": ", 1)[1]
            for line in notes.splitlines() if "without a word" in line}
    assert shlex.split(said["late"]) == ["andrea", "train", "--resume", "my runs/late"], notes
    assert shlex.split(said["early"])[:3] == ["andrea", "train", "--config"], notes
    assert "my runs/early/config.yaml" in shlex.split(said["early"]), notes
    line = assert_user_error(andrea_main("eval", "--checkpoint", str(early)),
                             f"{early}: the run has no checkpoint yet")
    assert f"); {shlex.join(['andrea', 'runs', str(early)])} says how it stands" in line, line
    line = assert_user_error(andrea_main("train", "--resume", "my runs/early", cwd=tmp_path),
                             "--resume my runs/early: the run was started but stopped")
    assert shlex.join(["andrea", "runs", "my runs/early"]) in line, line
    assert "start it over with: " + shlex.join(["andrea", "train", "--config",
                                                "my runs/early/config.yaml"]) in line, line
    assert late.is_dir()


def test_starting_over_a_moved_run_trains_that_run(tmp_path, data_dir):
    """Before: a run killed before its first checkpoint, moved to archive/, was to be started
    over with `andrea train --config archive/early2/config.yaml`: its config's runs_dir is
    relative (runs), so pasted, it trained a new runs/early2 and left archive/early2 crashed.
    Now the command sets train.runs_dir (and train.name, for a renamed one) to where the run
    is; pasted, it trains that run, as `andrea runs` and --resume's refusal say alike."""
    from conftest import tiny_config

    config = tiny_config(Path("runs"), data_dir, "train.max_steps=2", name="early2").to_yaml()
    write_run(tmp_path / "runs", "early2", [start_record(pid=dead_pid())], config=config)
    write_run(tmp_path / "runs", "early3", [start_record(pid=dead_pid())], config=config)
    (tmp_path / "archive").mkdir()
    (tmp_path / "runs" / "early2").rename(tmp_path / "archive" / "early2")
    (tmp_path / "runs" / "early3").rename(tmp_path / "archive" / "2024")  # and renamed
    notes = andrea_main("runs", "archive", cwd=tmp_path).stdout
    said = {line.split(": ")[0].strip(): line.split("start it over: ")[1]
            for line in notes.splitlines() if "start it over: " in line}
    assert said == {
        "early2": "andrea train --config archive/early2/config.yaml --set "
                  "train.runs_dir=archive",
        "2024": "andrea train --config archive/2024/config.yaml --set train.runs_dir=archive "
                "--set 'train.name=\"2024\"'"}, notes  # a name YAML reads as a number, quoted
    for name, command in said.items():
        refused = assert_user_error(andrea_main("train", "--resume", f"archive/{name}",
                                                cwd=tmp_path), "nothing to continue")
        assert refused.endswith(f"start it over with: {command}"), refused
        argv = shlex.split(command)
        done = andrea_main(*argv[1:], "--no-progress", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert read_run(tmp_path / "archive" / name).state == "finished"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_resumed_run_keeps_only_the_current_history(tmp_path):
    # Died (no end) at step 150, resumed from the checkpoint at 100, interrupted at 120.
    records = [
        start_record(max_steps=200, pid=dead_pid()),
        *normal_history(150),
        # The trainer restarts from the run's own config.yaml, so the stem is "config".
        start_record(step=100, max_steps=200, pid=dead_pid(), preset="config"),
        *normal_history(120, first_step=100),
        end_record(120, "interrupted", "SIGINT"),
    ]
    r = read_run(write_run(tmp_path, "resumed", records, checkpoints=(100,)))
    assert r.state == "interrupted" and r.signal == "SIGINT"
    assert (r.step, r.tokens, r.n_segments) == (120, 120 * TOKENS_PER_STEP, 2)
    assert (r.preset, r.max_steps) == ("andrea-tiny", 200)
    # Steps 130..150 of the first attempt were thrown away by the resume.
    assert r.last_train_loss == pytest.approx(5.0 - 120 / 100)
    speeds = [1000.0 + s for s in range(10, 121, 10)]
    assert r.median_tokens_per_s == pytest.approx(statistics.median(speeds))
    # A resumed run whose new segment has not ended is judged by the new segment's pid.
    records = [start_record(), *normal_history(50), end_record(50, "interrupted", "SIGINT"),
               start_record(step=50, pid=os.getpid(), at=time.time())]
    assert read_run(write_run(tmp_path, "again", records)).state == "running"


def test_a_val_loss_that_is_not_finite_is_never_the_best(tmp_path):
    """An evaluation whose loss overflowed (fp16) or is NaN is recorded as such, and the best
    val loss is the trainer's: the lowest finite one. A NaN first evaluation was the best for
    good (no loss is below NaN)."""
    records = [start_record(pid=dead_pid()), *normal_history(100)]
    for rec in records:
        if rec["event"] == "eval" and rec["step"] == 50:
            rec["val_loss"] = float("inf")
    records.insert(1, {"event": "eval", "step": 5, "val_loss": float("nan"), "time": 1.7e9})
    records.append(end_record(100, "finished"))
    r = read_run(write_run(tmp_path, "nan", records))
    assert (r.best_val_loss, r.best_val_step) == (pytest.approx(3.5), 100)
    assert r.last_val_loss == pytest.approx(3.5)


def test_a_segment_after_a_line_cut_short_by_a_kill_keeps_its_start(tmp_path):
    # kill -9 while a record was being written: its line ends mid-way. The resumed segment's
    # start was appended onto it and lost with it, so the run read as the killed segment
    # (crashed, its dead pid) while the resumed one trained, and the resume's steps went uncut.
    records = [start_record(pid=dead_pid()), *normal_history(150)]
    run = write_run(tmp_path, "killed", records, checkpoints=(100,),
                    tail='{"event": "train", "step": 160, "lo')
    log = MetricsLog(run / "metrics.jsonl")
    log.write("start", **{k: v for k, v in start_record(step=100, pid=os.getpid(),
                                                         at=time.time()).items()
                          if k not in ("event", "time")})
    log.write("train", **{k: v for k, v in train_record(110).items() if k not in ("event", "time")})
    log.close()
    r = read_run(run)
    assert (r.state, r.n_segments, r.pid, r.step) == ("running", 2, os.getpid(), 110)
    assert r.problems == ["metrics.jsonl: 1 unreadable line(s) skipped"]
    # A file that ends whole gets no blank line between segments.
    log = MetricsLog(run / "metrics.jsonl")
    log.write("end", step=110, state="stopped")
    log.close()
    assert "\n\n" not in (run / "metrics.jsonl").read_text()
    assert read_metrics(run / "metrics.jsonl")[1] == 1


def test_the_current_history_reads_each_record_once_not_once_a_segment():
    # A run of days requeued every hour: hundreds of segments. Each start filtered every record
    # kept before it: segments x records reads, seconds of `andrea runs` and twice that of
    # `andrea plot` for 200 segments of 1M steps.
    class Counted(dict):
        reads = 0

        def get(self, *args):
            Counted.reads += 1
            return super().get(*args)

    records = []
    for seg in range(200):  # each segment dies 10 steps past the checkpoint the next resumes
        records.append(start_record(step=seg * 50, pid=dead_pid()))
        records += normal_history(seg * 50 + 60, first_step=seg * 50)
    history = current_history([Counted(r) for r in records])
    assert Counted.reads <= 2 * len(records)
    steps = [r["step"] for r in history if r["event"] == "train"]
    assert steps == list(range(10, 199 * 50 + 61, 10))  # each step once, the last as resumed


def test_read_metrics_counts_unreadable_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [start_record(), train_record(10), train_record(20, loss=float("nan"))]
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in good)
        + "\n"  # blank: ignored, not counted
        + "[1, 2]\n"  # JSON but not an event object
        + '{"step": 3}\n'  # no "event" key
        + '{"event": "train", "step": 30, "lo'  # cut off mid-write
    )
    records, skipped = read_metrics(path)
    assert [r["event"] for r in records] == ["start", "train", "train"]
    assert skipped == 3
    assert records[2]["loss"] != records[2]["loss"]  # NaN survives the round trip


def test_damaged_runs_are_listed_with_the_reason(tmp_path):
    good = [start_record(pid=dead_pid()), *normal_history(50), end_record(50, "finished")]
    write_run(tmp_path, "empty", [])
    write_run(tmp_path, "truncated", good, tail='{"event": "train", "step": 60, "loss": 2.')
    write_run(tmp_path, "no-config", good, config="<none>")
    write_run(tmp_path, "bad-config", good, config="model: [unclosed\n  : :")
    write_run(tmp_path, "list-config", good, config="- 1\n- 2\n")
    dangling = write_run(tmp_path, "dangling", good)
    (dangling / "latest").write_text("step-000900\n")
    (tmp_path / "not-a-run").mkdir()  # no config, no metrics: ignored

    runs = {r.name: r for r in list_runs(tmp_path)}
    assert set(runs) == {"empty", "truncated", "no-config", "bad-config", "list-config",
                         "dangling"}
    assert runs["empty"].state == "unknown" and runs["empty"].problems == ["metrics.jsonl is empty"]
    t = runs["truncated"]
    assert t.state == "finished" and t.step == 50
    assert t.problems == ["metrics.jsonl: 1 unreadable line(s) skipped"]
    # Without a readable config the metrics still give steps and state, and the preset name.
    for name, reason in [("no-config", "no config.yaml"), ("bad-config", "config.yaml unreadable"),
                         ("list-config", "config.yaml is not a mapping")]:
        r = runs[name]
        assert r.state == "finished" and r.step == 50 and r.shape is None, name
        assert r.model == "andrea-tiny" and r.problems[0].startswith(reason), (name, r.problems)
    d = runs["dangling"]
    assert d.latest_checkpoint == "step-000900" and d.state == "damaged"
    assert d.problems == ["latest points to step-000900, which does not exist; no intact "
                          "checkpoint"]


def test_a_copied_runs_notes_name_its_own_checkpoint_and_command(tmp_path):
    """Before: a run copied (cp -r, as docs/training.md invites) or moved kept the recorded
    message of the run it came from, naming that run's checkpoint and --resume command. Only
    the folder its start event recorded is replaced, and only as a whole path."""

    def note(recorded: str | None, message: str, name: str) -> str | None:
        start = start_record(pid=dead_pid())
        if recorded is not None:
            start["run_dir"] = recorded
        end = end_record(50, "stopped", checkpoint="step-000050")
        end["message"] = message
        write_run(tmp_path / name, "t", [start, *normal_history(50), end], checkpoints=(50,))
        return list_runs(tmp_path / name)[0].message

    moved = str(tmp_path / "moved" / "t")
    said = ("token shard changed, first read at step 3; stopped after step 50, checkpoint "
            "{run}/step-000050; continue: andrea train --resume {quoted} (it names a shard)")
    for recorded in ("/old/place/runs/t", "/old/my runs/t", "t"):  # "first" keeps its t
        got = note(recorded, said.format(run=recorded, quoted=shlex.quote(recorded)), "moved")
        assert got == said.format(run=moved, quoted=shlex.quote(moved)), got
        shutil.rmtree(tmp_path / "moved")
    # A run where it trained, or one recorded before start events named their folder: as is.
    here = str(tmp_path / "here" / "t")
    assert note(here, said.format(run=here, quoted=here), "here") == said.format(run=here,
                                                                                 quoted=here)
    old = said.format(run="/old/t", quoted="/old/t")
    assert note(None, old, "old") == old


def test_list_runs_of_a_missing_folder_is_a_user_error(tmp_path):
    assert list_runs(tmp_path) == []  # a folder with no run yet: nothing to list, no error
    with pytest.raises(UserError, match="no such directory"):
        list_runs(tmp_path / "missing")
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # a file: it exists, it is no folder
    with pytest.raises(UserError, match="metrics.jsonl: a file, not a folder; pass the folder"):
        list_runs(tmp_path / "metrics.jsonl")


def test_runs_cli_table_json_and_errors(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "done", [start_record(), *normal_history(100), end_record(100, "finished")],
              checkpoints=(100,))
    write_run(root, "live", [start_record(pid=os.getpid(), at=time.time()), *normal_history(30)])
    write_run(root, "cut", [start_record(pid=dead_pid()), *normal_history(20)], tail='{"eve')
    # A NaN loss must come out as valid JSON (null), not the non-standard NaN token.
    write_run(root, "nan", [start_record(), train_record(10, loss=float("nan")),
                            end_record(10, "nonfinite")])

    proc = andrea_main("runs", str(root))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["RUN", "MODEL", "STEPS"]
    rows = {line.split()[0]: line for line in lines[1:5]}
    assert "100/100" in rows["done"] and "finished" in rows["done"]
    assert "step-000100" in rows["done"] and "3.0000 @50" in rows["done"]
    assert "running" in rows["live"] and "crashed !" in rows["cut"]
    assert "nonfinite" in rows["nan"]
    assert "cut: ! metrics.jsonl: 1 unreadable line(s) skipped" in proc.stdout

    proc = andrea_main("runs", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    def reject(token):
        raise AssertionError(f"non-standard JSON token {token}")

    data = {r["name"]: r for r in json.loads(proc.stdout, parse_constant=reject)}
    assert {n: r["state"] for n, r in data.items()} == {
        "done": "finished", "live": "running", "cut": "crashed", "nan": "nonfinite"}
    assert data["nan"]["last_train_loss"] is None
    assert data["done"]["tokens"] == 100 * TOKENS_PER_STEP
    assert data["done"]["model"] == "andrea-tiny 2L/4H/d64/ctx64"



def test_runs_of_a_folder_without_runs_says_so_and_succeeds(tmp_path):
    """Before: `andrea runs` of an existing runs folder with no run in it yet (a new project,
    every run deleted) was an error, exit 2, as a mistyped path is; a script listing its runs
    stopped on it. As `ls` of an empty folder, it is an answer: one line, exit 0, and `[]`
    with --json. A folder that does not exist stays an error naming it."""
    empty = tmp_path / "runs"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a run\n")  # a user's own file: still no run
    proc = andrea_main("runs", str(empty))
    assert (proc.returncode, proc.stderr) == (0, ""), proc
    assert proc.stdout == (f"no runs under {empty} (a run is a folder with config.yaml and "
                           "metrics.jsonl, which `andrea train` writes)\n")
    proc = andrea_main("runs", "--json", cwd=tmp_path)  # the default folder, ./runs
    assert (proc.returncode, json.loads(proc.stdout)) == (0, []), proc
    assert_user_error(andrea_main("runs", str(tmp_path / "missing")),
                      f"{tmp_path / 'missing'}: no such directory", "pass the folder")


# --- TensorBoard -----------------------------------------------------------------------------


def test_a_run_given_as_dot_from_inside_it_is_named_by_its_folder(tmp_path):
    """Before: `andrea runs .` inside a run folder showed an empty name: a blank RUN cell, the
    note `  : ended: ...` and the val-set footer `()`, as Path(".").name is "". Now the run is
    named by its folder there, and from a folder inside it (`..`)."""
    run = write_run(tmp_path, "mine", [start_record(), *normal_history(80),
                                       end_record(87, "interrupted", "SIGTERM")],
                    checkpoints=(80,))
    (run / "sub").mkdir()
    for where, given in ((run, "."), (run / "sub", "..")):
        out = andrea_main("runs", given, cwd=where).stdout
        assert out.splitlines()[1].startswith("mine  "), out
        assert "  mine: ended: interrupted" in out and "(mine);" in out, out


def test_tensorboard_disabled_or_missing_returns_none(tmp_path, monkeypatch, capsys):
    assert open_tensorboard(tmp_path, enabled=False) is None
    assert capsys.readouterr().err == ""
    # None in sys.modules makes the import fail as if the package were not installed.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert open_tensorboard(tmp_path, enabled=True) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "pip install -e '.[tensorboard]' (or pip install tensorboard)" in err[0]


def test_tensorboard_writer_maps_records_to_scalars(tmp_path, monkeypatch):
    calls = []

    class FakeSummaryWriter:
        def __init__(self, log_dir):
            calls.append(("init", log_dir))

        def add_scalar(self, tag, value, global_step):
            calls.append((tag, value, global_step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    fake = type(sys)("torch.utils.tensorboard")
    fake.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    tb = open_tensorboard(tmp_path, enabled=True)
    tb.log(start_record())
    tb.log(train_record(10, loss=float("nan"), mfu=0.25))
    tb.log({"event": "eval", "step": 50, "tokens": 1, "val_loss": 3.5, "time": 0})
    tb.close()
    assert calls[0] == ("init", str(tmp_path / "tensorboard"))
    scalars = {c[0]: (c[1], c[2]) for c in calls[1:-1]}
    assert "train/loss" not in scalars  # NaN left out
    assert scalars["train/lr"] == (pytest.approx(1e-3 * 10 / 20), 10)
    assert scalars["train/mfu"] == (0.25, 10)
    assert scalars["val/loss"] == (3.5, 50)
    assert calls[-1] == ("close",)


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional package, not installed")
    tb = open_tensorboard(tmp_path, enabled=True)
    tb.log(train_record(10))
    tb.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def imported_run(tmp_path: Path, name: str = "imp") -> Path:
    """A run as `andrea import` makes it (config, step 0 checkpoint, no metrics.jsonl)."""
    from conftest import make_checkpoint

    from andrea.hf import export_hf, import_hf

    ckpt = make_checkpoint(tmp_path / "src", "model.n_layer=1")
    return import_hf(export_hf(str(ckpt), tmp_path / "hf"), tmp_path / "runs" / name).parent


def test_an_imported_run_has_its_own_state(tmp_path):
    run = imported_run(tmp_path)
    write_run(tmp_path / "runs", "done", [start_record(), *normal_history(100),
                                          end_record(100, "finished")], checkpoints=(100,))
    r = read_run(run)
    assert (r.state, r.step, r.tokens, r.problems) == ("imported", 0, 0, [])
    assert r.model == "imported 1L/4H/d64/ctx64"  # d_model, not head_dim (16)
    assert r.latest_checkpoint == "step-000000"
    proc = andrea_main("runs", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("imp "))
    assert row.split()[-2:] == ["imported", "step-000000"] and "!" not in row
    assert f"imp: imported from {(tmp_path / 'hf').resolve()}; not trained here yet" in proc.stdout
    data = {r["name"]: r for r in json.loads(andrea_main("runs", str(tmp_path / "runs"),
                                                         "--json").stdout)}
    assert data["imp"]["state"] == "imported" and data["done"]["state"] == "finished"


def test_a_bare_name_is_the_run_not_an_export_folder_of_that_name(tmp_path, monkeypatch):
    from andrea.train.rundir import run_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "imp").mkdir()  # e.g. `andrea export --out imp`, then `andrea import imp`
    (tmp_path / "imp" / "config.json").write_text("{}")
    (tmp_path / "runs" / "imp").mkdir(parents=True)
    (tmp_path / "runs" / "imp" / "config.yaml").write_text("model: {}\n")
    assert run_path("imp") == Path("runs/imp")
    (tmp_path / "runs" / "other").mkdir()
    (tmp_path / "other").mkdir()
    assert run_path("other") == Path("other")  # neither is a run: the path as given
    assert run_path("missing") == Path("missing")


def test_a_failed_runs_end_record_keeps_its_speed(tmp_path, data_dir, monkeypatch):
    """A failure's end record carries the segment's speed, best val loss and checkpoint as a
    finished run's does (docs/metrics.md): it had only the state and the message."""
    from conftest import tiny_config

    import andrea.train.loop as loop

    real = loop.maybe_evaluate

    def failing_at_step_4(s, bar):
        if s.step == 4:
            raise RuntimeError("injected")
        real(s, bar)

    monkeypatch.setattr(loop, "maybe_evaluate", failing_at_step_4)
    cfg = tiny_config(tmp_path, data_dir, "train.max_steps=6", "train.checkpoint_every=2",
                      "train.eval_every=2", name="f")
    with pytest.raises(RuntimeError, match="injected"):
        loop.train(cfg, progress=False)
    records, _ = read_metrics(tmp_path / "f" / "metrics.jsonl")
    end, trains = records[-1], [r for r in records if r["event"] == "train"]
    assert (end["event"], end["state"], end["message"]) == ("end", "failed",
                                                            "RuntimeError: injected")
    assert end["checkpoint"] == "step-000002" and end["best_val_step"] == 2
    assert (end["train_tokens"], end["warmup_steps"]) == (3 * TOKENS_PER_STEP, 1)
    assert end["train_seconds"] == trains[-1]["train_seconds"] > 0
    assert end["tokens_per_s"] == round(end["train_tokens"] / end["train_seconds"], 1)
    assert end["median_tokens_per_s"] is not None and "mfu" in end
    assert read_run(tmp_path / "f").tokens_per_s == end["tokens_per_s"]


def test_a_segment_of_its_warm_up_step_alone_has_no_speed(tmp_path, data_dir):
    """One step is the warm-up step, left out of the figure: its end record says null, and
    `andrea runs` shows "-", not that step's own rate through the median of logged steps."""
    from conftest import tiny_config

    from andrea.runs import format_table
    from andrea.train.loop import train

    assert train(tiny_config(tmp_path, data_dir, "train.max_steps=1", name="one"),
                 progress=False).state == "finished"
    records, _ = read_metrics(tmp_path / "one" / "metrics.jsonl")
    end = records[-1]
    assert end["tokens_per_s"] is None and end["median_tokens_per_s"] is None
    assert end["warmup_steps"] == 1 and end["train_tokens"] == 0
    summary = read_run(tmp_path / "one")
    assert summary.tokens_per_s is None and summary.median_tokens_per_s is None
    header, row = format_table([summary]).splitlines()[:2]
    speed = row[header.index("TOK/S"):header.index("MFU")].strip()
    assert speed == "-", row


def test_one_tokens_per_s_in_the_bar_the_end_record_and_runs(tmp_path, data_dir, capsys):
    """A real run with evaluations and checkpoints: the bar's last rate, the end record, and
    `andrea runs` give one figure, the steps' tokens over the steps' wall time."""
    from tqdm import tqdm

    from andrea.runs import format_json, format_table
    from andrea.train.loop import train

    cfg = load_config("andrea-tiny", [
        f"data.dir={data_dir}", f"train.runs_dir={tmp_path}", "train.name=s",
        "train.max_steps=4", "train.log_every=1", "train.eval_every=2",
        "train.checkpoint_every=2"])
    assert train(cfg, progress=True).state == "finished"
    records, _ = read_metrics(tmp_path / "s" / "metrics.jsonl")
    end, trains = records[-1], [r for r in records if r["event"] == "train"]
    assert end["event"] == "end" and len(trains) == 4
    # The definition, from the records alone: each step's tokens over its seconds, summed,
    # the first step (the warm-up of the run's one window length) left out and kept apart.
    seconds = sum(512 / r["tokens_per_s"] for r in trains[1:])
    assert end["train_tokens"] == 3 * 512 and end["train_seconds"] == trains[-1]["train_seconds"]
    # The end record keeps 4 decimals of seconds: on a fast machine a 20 ms warm-up's rounding
    # (up to 5e-5 s) is more than 1e-3 of it, so the bound is the rounding's, not a ratio.
    assert end["train_seconds"] == pytest.approx(seconds, rel=1e-3, abs=6e-5)
    assert end["warmup_steps"] == 1
    assert end["warmup_seconds"] == pytest.approx(512 / trains[0]["tokens_per_s"], rel=1e-3,
                                                  abs=6e-5)
    assert end["tokens_per_s"] == round(3 * 512 / end["train_seconds"], 1)
    # Evaluations and checkpoints are not in it: the run took longer than its steps.
    assert end["train_seconds"] < end["time"] - records[0]["time"]
    shown = tqdm.format_sizeof(end["tokens_per_s"])
    last_bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert f", {shown}tok/s, step 4/4" in last_bar and "mfu n/a" in last_bar, last_bar
    listed = json.loads(format_json(list_runs(tmp_path)))[0]
    assert (listed["tokens_per_s"], listed["mfu"]) == (end["tokens_per_s"], end["mfu"])
    # The steps' median, too, is one figure: the end record's, every step as timed (the train
    # records' rates are rounded), whatever the logging interval.
    assert listed["median_tokens_per_s"] == end["median_tokens_per_s"] is not None
    # train.precision auto, as the start record has it: fp32, or bf16 on a CPU with bf16 units
    assert listed["precision"] == {"float32": "fp32", "bfloat16": "bf16"}[records[0]["precision"]]
    header, row = format_table(list_runs(tmp_path)).splitlines()[:2]
    assert row[header.index("TOK/S"):].split()[:2] == [shown, "n/a"]


def test_one_mapping_of_records_to_scalars_for_both_sinks():
    """train.metrics.scalars: what TensorBoard and W&B draw of each record, events included
    (an event kind's *_total counters, so fp16's overflow events need no entry of their own)."""
    from andrea.train.metrics import scalars

    assert scalars(start_record()) is None and scalars({"event": "train", "loss": 1.0}) is None
    step, values = scalars(train_record(10, loss=float("nan"), mfu=None))
    assert step == 10 and "train/loss" not in values and "train/mfu" not in values
    assert values["train/tokens_seen"] == 10 * TOKENS_PER_STEP
    _, values = scalars({"event": "eval", "step": 5, "val_loss": 3.5, "val_bpb": 1.2,
                         "val_sources": {"a": {"loss": 3.0}, "b": {"loss": float("nan")}}})
    assert values == {"val/loss": 3.5, "val/bits_per_byte": 1.2, "val/source/a/loss": 3.0}
    assert scalars({"event": "end", "step": 7, "tokens_per_s": 539.1, "mfu": None}) == (
        7, {"run/tokens_per_s": 539.1})
    assert scalars({"event": "overflow", "step": 3, "loss": 2.0, "loss_scale": 32768.0,
                    "overflows_total": 2}) == (3, {"events/overflows_total": 2.0})
    assert scalars({"event": "spike", "step": 4, "spikes_total": 1, "action": "skip"}) == (
        4, {"events/spikes_total": 1.0})


def test_the_table_names_the_val_set_best_val_is_on(tmp_path, capsys):
    """Before: BEST VAL 4.6614 here and 4.6935 from `andrea eval` for the same checkpoint,
    nothing saying the first is on train.eval_tokens tokens and the second on the whole split."""
    config = load_config("andrea-tiny", ["train.max_steps=100"]).to_yaml()
    whole = load_config("andrea-tiny", ["train.max_steps=100", "train.eval_tokens=0"]).to_yaml()
    write_run(tmp_path, "a", [start_record(), *normal_history(100), end_record(100, "finished")],
              config=config)
    write_run(tmp_path, "b", [start_record(), *normal_history(100), end_record(100, "finished")],
              config=whole)
    write_run(tmp_path, "c", [start_record(), train_record(10)], config=config)  # no eval yet
    out = andrea_main("runs", str(tmp_path)).stdout
    legend = out.splitlines()[-1].strip()
    assert legend == (
        "BEST VAL is each run's own val set, train.eval_tokens: 2,048 tokens spread over the val "
        "split (a); the whole val split (b); `andrea eval --max-tokens N` scores that set (N: "
        "its tokens), `andrea eval` without it the whole val split")
    assert json.loads(andrea_main("runs", str(tmp_path), "--json").stdout)[0]["eval_tokens"] == 2048
