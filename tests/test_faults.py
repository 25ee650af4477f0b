"""ANDREA_FAULTS, the one variable tests inject faults with: its parser and its no-op default.
(The faults firing inside real runs are tested where each one matters: test_train,
test_stop_messages, test_spike, test_parallel, test_data_folder, test_formats.)"""

from __future__ import annotations

import errno
import math
import signal

import pytest
import torch
from conftest import REPO, andrea_main, assert_user_error

from andrea import faults
from andrea.errors import UserError


def test_a_spec_with_every_kind_parses_into_its_faults():
    got = faults.parse("nan@7, sigint@3.1,spike@12-13x50,kill-rank@1:step-000004,"
                       "kill-after@0:step-000002,"
                       "checkpoint-delay@2.5,prepare-pause@train_000002.bin:/tmp/a:b,"
                       "disk-full@checkpoint:step-000004,overflow@4")
    assert got == faults.Faults(
        nan_at_step=7, overflow_at_step=4, sigint_after=(3, 1), spike=(12, 13, 50.0),
        kill_rank=(1, "step-000004"),
        kill_after=(0, "step-000002"),
        checkpoint_delay=2.5, prepare_pause=("train_000002.bin", "/tmp/a:b"),
        disk_full="checkpoint:step-000004")
    assert faults.parse("spike@21").spike == (21, 21, 1.0)
    assert faults.parse("spike@118x1000").spike == (118, 118, 1000.0)
    assert faults.parse("prepare-pause@train_000003.bin").prepare_pause == (
        "train_000003.bin", None)


def test_installed_faults_fire_only_where_asked(inject_faults):
    inject_faults("nan@7,spike@12-13x50,overflow@3")
    loss = torch.tensor(2.0)
    assert [faults.overflow_factor(step, 0) for step in (2, 3, 4)] == [1.0, math.inf, 1.0]
    assert faults.overflow_factor(3, 1) == 1.0  # rank 0's backward only
    assert faults.poison_loss(loss, 6) is loss and math.isnan(faults.poison_loss(loss, 7))
    # data positions are 0-based, the spike's 1-based as steps are counted
    assert [faults.spike_scale(d) for d in (10, 11, 12, 13)] == [None, 50.0, 50.0, None]
    x, y = torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)
    gx, gy = faults.garble(x, y, 256, 11)
    assert torch.equal(gx[:, 1:], gy[:, :-1]) and gx.shape == x.shape
    assert torch.equal(faults.garble(x, y, 256, 11)[0], gx)  # the same on every run
    inject_faults("disk-full@prepare:train_000003.bin")
    faults.disk_full("prepare", "train_000002.bin")
    faults.disk_full("checkpoint", "train_000003.bin")
    with pytest.raises(OSError) as err:
        faults.disk_full("prepare", "train_000003.bin")
    assert err.value.errno == errno.ENOSPC


@pytest.mark.parametrize("spec", [None, "", " , "])
def test_unset_every_hook_does_nothing(inject_faults, spec):
    inject_faults(spec)
    assert faults._active == faults.Faults()
    loss = torch.tensor(2.0)
    assert faults.poison_loss(loss, 1) is loss
    assert faults.spike_scale(0) is None
    assert faults.overflow_factor(1, 0) == 1.0
    faults.after_micro_batch(0, 0)  # would SIGINT this process
    faults.after_shards_written(0, "step-000001")  # would SIGKILL it
    faults.after_checkpoint(0, "runs/r/step-000001")  # would SIGKILL it
    faults.after_model_file()
    faults.in_shard("train_000000.bin")  # would wait forever
    faults.disk_full("checkpoint", "step-000001")  # would raise


@pytest.mark.parametrize("item, says", [
    ("nan@x", "'nan@x' is not nan@STEP"),
    ("nan", "unknown fault 'nan'"),
    ("sigint@3", "'sigint@3' is not sigint@STEP.MICRO"),
    ("spike@a-b", "is not spike@FIRST[-LAST][xSCALE]"),
    ("kill-rank@1", "is not kill-rank@RANK:step-NNNNNN"),
    ("kill-rank@1:4", "is not kill-rank@RANK:step-NNNNNN"),
    ("kill-after@1", "is not kill-after@RANK:step-NNNNNN"),
    ("checkpoint-delay@soon", "is not checkpoint-delay@SECONDS"),
    ("prepare-pause@", "is not prepare-pause@SHARD[:UNTIL_FILE]"),
    ("disk-full@step-000004", "is not disk-full@AREA:NAME"),
    ("disk-full@checkpoint:", "is not disk-full@AREA:NAME"),
    ("overflow@", "is not overflow@STEP"),
    ("nap@7", "unknown fault 'nap@7'; the kinds are nan@STEP, sigint@STEP.MICRO"),
    ("nan@7,nan@8", "nan is given twice"),
])
def test_a_malformed_item_is_named(item, says):
    with pytest.raises(UserError, match="ANDREA_FAULTS") as err:
        faults.parse(item)
    assert says in str(err.value)


def test_the_cli_refuses_a_malformed_spec_in_one_line_before_anything_runs():
    proc = andrea_main("config", "show", "-c", "andrea-tiny", env={"ANDREA_FAULTS": "nan@7,boom"})
    assert_user_error(proc, "ANDREA_FAULTS", "'boom'")
    assert proc.stdout == ""


def test_no_production_module_reads_a_fault_from_the_environment():
    sources = {p: p.read_text() for p in (REPO / "andrea").rglob("*.py")}
    assert not [p for p, s in sources.items() if "ANDREA_TEST" in s or "ANDREA_PREPARE" in s]
    assert "os.environ" not in sources[REPO / "andrea" / "train" / "loop.py"]


def test_each_signal_fault_sends_its_own_signal_at_its_micro_batch(inject_faults, monkeypatch):
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    inject_faults("sigint@1.0,sigterm@2.1,sigkill@5.1")
    for step in range(7):
        for micro in range(2):
            faults.after_micro_batch(step, micro)
    pid = faults.os.getpid()
    assert sent == [(pid, signal.SIGINT), (pid, signal.SIGTERM), (pid, signal.SIGKILL)]
    with pytest.raises(UserError, match="is not sigkill@STEP.MICRO"):
        faults.parse("sigkill@5")


def test_the_faults_installed_before_a_command_come_back_after_it(monkeypatch):
    """A test that installed faults and then runs a command in-process (which reads
    ANDREA_FAULTS, here unset) has its own faults again afterwards, not none."""
    monkeypatch.delenv(faults.VARIABLE, raising=False)
    faults.install("nan@3")
    try:
        with faults.installed_from_environment():
            assert faults.poison_loss(1.0, 3) == 1.0
        assert math.isnan(faults.poison_loss(1.0, 3))
    finally:
        faults.install(None)
