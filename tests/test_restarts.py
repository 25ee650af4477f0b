"""torchrun restarts and a dead peer (docs/faults.md): a job with --max-restarts whose worker is
SIGKILLed after a checkpoint finishes by itself with an uninterrupted run's losses, on one
machine and as two "nodes"; a worker lost with no restart left is one line on the survivor;
a first launch on an existing run is still refused. Real torchrun launches are the expensive
part: two in all, each checking as much as it can."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import andrea_main, free_port, run_torchrun, tiny_config
from test_parallel import SETS as PARALLEL_SETS
from test_parallel import launch_nodes, losses

from andrea.errors import UserError
from andrea.train import process_group, restarts, torchrun
from andrea.train.loop import train

SETS = ("train.max_steps=6", "train.checkpoint_every=2", "train.eval_every=0")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_dir) -> dict[int, float]:
    """One process with 2 micro-steps: what 2 processes log, to float rounding."""
    where = tmp_path_factory.mktemp("one")
    return train(tiny_config(where, data_dir, *PARALLEL_SETS, *SETS, name="one"),
                 progress=False).losses


def same_losses(got: dict[int, float], expected: dict[int, float], steps: range) -> None:
    for step in steps:
        assert math.isclose(got[step], expected[step], rel_tol=1e-5), (step, got, expected)


def test_a_restarted_worker_continues_the_run_by_itself(tmp_path, data_dir, uninterrupted):
    """--standalone (the launch the report found hanging), rank 1 SIGKILLed once step 4 is
    complete: torchrun restarts both, rank 0 says from where, and the run finishes."""
    cfg = tiny_config(tmp_path, data_dir, *PARALLEL_SETS, *SETS, name="job")
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    proc = run_torchrun("train", "-c", str(path), "--no-progress", timeout=240,
                        launcher=("--standalone", "--max-restarts=1"),
                        env={"ANDREA_FAULTS": "kill-after@1:step-000004"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "error: " not in proc.stderr, proc.stderr[-3000:]  # nothing for the user to do
    run_dir = tmp_path / "job"
    assert (f"torchrun restart 1: continuing from {run_dir}/step-000004, the run's newest "
            f"intact checkpoint") in proc.stdout
    assert (run_dir / "latest").read_text().strip() == "step-000006"
    same_losses(losses(run_dir), uninterrupted, range(1, 7))

    # A first launch (no restart) on the run is refused as before: nothing is replaced.
    with pytest.raises(UserError, match="already holds a run; continue it with --resume"):
        train(cfg, progress=False)
    assert (run_dir / "latest").read_text().strip() == "step-000006"


def test_two_nodes_restart_then_a_lost_peer_is_one_line(tmp_path, data_dir, uninterrupted):
    """Two --nnodes 2 launches, --max-restarts 1, fsdp (every rank writes): rank 1 is killed
    once step 4 is complete, and node 0's survivor says so in one line; both nodes restart and
    continue; then, with no restart left, rank 1 dies writing its step-6 shards and the
    survivor's line names the rank, the newest intact checkpoint and how to continue, not the
    transport's message; `andrea runs` notes that line."""
    cfg = tiny_config(tmp_path, data_dir, *PARALLEL_SETS, *SETS, "train.parallel=fsdp",
                      name="nodes")
    path = tmp_path / "nodes.yaml"
    path.write_text(cfg.to_yaml())
    outputs = launch_nodes(path, [tmp_path, tmp_path], launcher=("--max-restarts=1",),
                           env={"ANDREA_FAULTS": "kill-after@1:step-000004,"
                                                 "kill-rank@1:step-000006"})
    run_dir = tmp_path / "nodes"
    (code, out, err), (code1, _, _) = outputs
    assert code != 0 and code1 != 0, err[-3000:]
    assert f"torchrun restart 1: continuing from {run_dir}/step-000004" in out
    assert (run_dir / "latest").read_text().strip() == "step-000004"
    same_losses(losses(run_dir), uninterrupted, range(1, 7))

    lines = [line for line in err.splitlines() if line.startswith(("error: ", "rank 1 was"))]
    lost = (f"rank 1 was lost (its process ended, or its node went down) after step {{}}; the "
            f"newest intact checkpoint is {run_dir}/step-000004; ")
    assert lines == [  # a restart left: said as one; none left: the way on
        lost.format(4) + "torchrun restarts the job (restart 1 of 1)",
        "error: " + lost.format(6) + f"continue with the same launch and --resume {run_dir} "
        "(torchrun --max-restarts N continues by itself)"], err[-3000:]
    assert "Connection" not in err and "[rank0]" not in err, err[-3000:]
    runs = andrea_main("runs", str(tmp_path))
    assert f"nodes: {lines[1][len('error: '):]}" in runs.stdout


# In-process: the lost rank's line, the attempt's number, and the watchdog (no launch).

def test_a_lost_rank_with_a_restart_left_is_no_error(tmp_path):
    """The line names the lost ranks and the checkpoint; with a restart left (attempt 1 of
    --max-restarts 3) it says torchrun restarts the job (a Restarting, which the CLI prints
    as it is: test_two_nodes_...); with none left, or the ranks unknown, it is the error line
    saying how to continue."""
    run, ckpt = tmp_path / "r", tmp_path / "r" / "step-000004"
    head = (f"ranks 1, 2 were lost (their processes ended, or their nodes went down) "
            f"after step 5; the newest intact checkpoint is {ckpt}; ")
    manual = (f"continue with the same launch and --resume {run} (torchrun --max-restarts N "
              f"continues by itself)")
    words = restarts.lost_peer_words
    assert words([1, 2], 5, ckpt, run, attempt_number=1, max_restarts=3) == (
        head + "torchrun restarts the job (restart 2 of 3)", True)
    assert words([1, 2], 5, ckpt, run, attempt_number=3, max_restarts=3) == (head + manual,
                                                                           False)
    # A run folder with a space is quoted as the shell reads it back.
    spaced = tmp_path / "my runs" / "r"
    assert f"--resume '{spaced}' (torchrun" in words([1], 5, ckpt, spaced, attempt_number=1,
                                                        max_restarts=1)[0]
    assert words([1, 2], 5, ckpt, run, attempt_number=0, max_restarts=0) == (head + manual,
                                                                           False)
    # Before any checkpoint --resume has nothing to continue (it is refused): the same launch.
    assert words(None, 5, None, run, attempt_number=0, max_restarts=3) == (
        "a process on another node was lost (its process ended, or its node went down) after "
        "step 5; no checkpoint was written yet; start it again with the same launch (there is "
        "nothing to resume; torchrun --max-restarts N restarts it by itself)", False)




def test_each_rank_numbers_its_attempts_as_every_other_does(monkeypatch):
    """Under c10d across machines a node restarts its workers without counting (its restart
    count stays 0 while the failed node's is 1): each rank takes the first number from its
    count on that it has not started under, so both meet as attempt 1."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setattr(restarts, "torchrun_env", lambda: env)

    def number(rank: int, count: int) -> int:
        nonlocal env
        env = torchrun.TorchrunEnv(rank=rank, world_size=2, restart_count=count,
                                      master_addr="127.0.0.1", master_port=port,
                                      agent_store=True)
        return restarts.attempt.__wrapped__().number

    env = torchrun.TorchrunEnv()
    assert [number(0, 0), number(1, 0)] == [0, 0]  # the first launch
    assert [number(0, 0), number(1, 1)] == [1, 1]  # node 0 did not count its restart
    assert [number(0, 2), number(1, 2)] == [2, 2]  # torchrun's count, when it agrees
    del server


def test_a_restart_continues_the_first_launchs_run_from_its_newest_checkpoint(monkeypatch,
                                                                           tmp_path):
    from andrea.train import resume

    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("")
    given = [(None, False), ("auto", True), (str(run / "step-000002"), True), (str(run), True)]
    monkeypatch.setattr(resume, "attempt", lambda: restarts.Attempt(0, None))
    assert [resume.restart_resume(*g) for g in given] == given  # a first launch: as given
    monkeypatch.setattr(resume, "attempt", lambda: restarts.Attempt(1, None))
    assert [resume.restart_resume(*g) for g in given] == [
        ("auto", False), ("auto", False), (str(run), False), (str(run), False)]


def test_a_process_the_others_never_join_stops_with_one_line(monkeypatch, capfd):
    ended = threading.Event()
    codes: list[int] = []
    monkeypatch.setattr(process_group.os, "_exit", lambda code: (codes.append(code), ended.set()))
    env = torchrun.TorchrunEnv(rank=1, world_size=4)
    with process_group.join_watchdog(0.05, env):
        assert ended.wait(30)
    assert codes == [2]
    line = capfd.readouterr().err.strip()
    assert line.startswith("error: rank 1 of 4: the processes did not all join within 0.05 s "
                           "(train.join_timeout)") and "--master-addr HOST" in line
    assert "\n" not in line


def test_a_failure_in_a_process_group_of_one_is_not_a_lost_peer(monkeypatch):
    """Alone in its process group (ANDREA_PROCESS_GROUP_OF_ONE, the NCCL check on one GPU) no
    peer can be lost: the failure is raised as it is, not hidden behind a lost-peer line (the
    GPU's first NCCL run said "a process on another node was lost" for its own error)."""
    monkeypatch.setattr(restarts, "attempt", lambda: restarts.Attempt(0, None))
    alone = torchrun.DistInfo(group_of_one=True)
    assert restarts.lost_peer_line(alone, RuntimeError("nccl: bad tensor"), 4, None,
                                   Path("r")) is None
    two = torchrun.DistInfo(rank=0, world_size=2)  # the store gone: a peer may be lost
    assert isinstance(restarts.lost_peer_line(two, RuntimeError("x"), 4, None, Path("r")),
                      UserError)
