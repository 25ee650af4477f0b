"""Several processes under torchrun (gloo on the CPU): train.parallel: fsdp gives ddp's losses, the
tied LM head stays tied, checkpoints reshard between process counts and modes, a resume with the
same processes and mode is exact; two "nodes" equal one process. Each torchrun launch costs
seconds: few of them, tiny runs, and the trainings whose processes are not the point share two
launches (the `launched` fixture, conftest.run_torchrun_each)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import (
    Result,
    andrea_main,
    assert_user_error,
    config_file,
    free_port,
    run_torchrun,
    run_torchrun_each,
    tiny_config,
    torchrun_command,
    wait_until,
)
from safetensors.torch import load_file

from andrea import faults
from andrea.config import load_config
from andrea.train.checkpoint import read_trainer_state
from andrea.train.loop import TrainResult, train
from andrea.train.rundir import step_of_dir

STEPS = 20
SETS = (f"train.max_steps={STEPS}", "train.precision=fp32", "train.micro_batch_size=4",
        "train.global_batch_tokens=512", "train.checkpoint_every=10", "train.keep_last=5",
        "train.log_every=1", "train.eval_every=10")


def succeeded(result: Result) -> str:
    """A launch's (or one of its commands') stdout, once it exited 0."""
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> train loss; a resumed step's newer record replaces the older one."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["event"] == "train"}


def rewound(run_dir: Path, to: Path, step: int) -> Path:
    """A copy of the run whose latest checkpoint is `step`, as if it had stopped there."""
    shutil.copytree(run_dir, to)
    for later in to.glob("step-*"):
        if (step_of_dir(later) or 0) > step:
            shutil.rmtree(later)
    (to / "latest").write_text(f"step-{step:06d}\n")
    return to


MUON = ("train.optimizer=muon", "train.muon_ns_precision=fp32")
# 2 steps of 512 tokens, then 1,024, the first 3 in windows of 16 tokens (a checkpoint at 2).
WARMUP = ("train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=0",
          "train.global_batch_tokens=1024", "train.batch_warmup_tokens=512",
          "train.batch_warmup_steps=2", "train.seq_warmup_length=16", "train.seq_warmup_steps=3")
FP16 = ("train.max_steps=3", "train.precision=fp16", "train.micro_batch_size=2",
        "train.global_batch_tokens=256", "train.eval_every=0", "train.checkpoint_every=0")
AUTO = ("train.micro_batch_size=auto", "train.global_batch_tokens=1024", "train.max_steps=4",
        "train.checkpoint_every=2", "train.eval_every=0")


@dataclass
class Launched:
    """The two-process trainings of several tests below, in two torchrun launches (a launch's
    start-up is most of a tiny run's time): `runs` the first launch's commands by name, then
    the one-process runs the second launch resumes on two processes, then `resumes` its
    commands. Tests read the run folders under `root` and copy them (`rewound`) to change."""

    root: Path
    runs: dict[str, Result]
    one: dict[str, TrainResult]
    resumes: dict[str, Result]


def script(folder: Path, name: str, text: str) -> Path:
    (folder / name).write_text(text)
    return folder / name


@pytest.fixture(scope="module")
def launched(tmp_path_factory, data_dir) -> Launched:
    root = tmp_path_factory.mktemp("launched")

    def command(name: str, *sets: str) -> list[str]:
        cfg = tiny_config(root, data_dir, *SETS, *sets, name=name)
        return ["train", "-c", str(config_file(cfg, root)), "--no-progress"]

    runs = run_torchrun_each(root / "first", {
        "ddp": command("ddp"),
        "fsdp": command("fsdp", "train.parallel=fsdp"),
        "muon-fsdp": command("muon-fsdp", "train.parallel=fsdp", *MUON),
        **{f"warmup-{p}": command(f"warmup-{p}", *WARMUP, f"train.parallel={p}")
           for p in ("ddp", "fsdp")},
        **{f"fp16-{p}": command(f"fp16-{p}", *FP16, f"train.parallel={p}")
           for p in ("ddp", "fsdp")},
        "zero": [str(script(root, "patched_andrea.py", PATCHED_PEAK)), *command(
            "zero", "train.global_batch_tokens=0", "train.max_steps=4",
            "train.checkpoint_every=2", "train.eval_every=0")],
        "tied": [str(script(root, "tied.py", TIED))],
    }, envs={"fp16-ddp": {"ANDREA_FAULTS": "overflow@2"},
             "fp16-fsdp": {"ANDREA_FAULTS": "overflow@2"}})

    one = {
        "grow": train(tiny_config(root, data_dir, *SETS, "train.max_steps=10", name="grow"),
                      progress=False),
        "muon": train(tiny_config(root, data_dir, *SETS, *MUON, name="muon-one"), progress=False),
        "warmup": train(tiny_config(root, data_dir, *SETS, *WARMUP, "train.parallel=fsdp",
                                    name="warmup-one"), progress=False),
        "auto": train(tiny_config(root, data_dir, *SETS, *AUTO, name="auto"), progress=False),
    }
    faults.install("overflow@2")  # rank 0's backward of step 2, as ANDREA_FAULTS above
    try:
        one["fp16"] = train(tiny_config(root, data_dir, *SETS, *FP16, name="fp16-one"),
                            progress=False)
    finally:
        faults.install(None)

    fsdp_yaml = str(root / "fsdp.yaml")
    resumes = run_torchrun_each(root / "second", {
        # Same processes, same mode: an exact resume.
        "again": ["train", "-c", fsdp_yaml, "--no-progress", "--resume",
                  str(rewound(root / "fsdp", root / "again", 10))],
        # ddp (2 processes) -> fsdp (2).
        "mixed": ["train", "-c", fsdp_yaml, "--no-progress", "--resume",
                  str(rewound(root / "ddp", root / "mixed", 10)), "--set",
                  "train.parallel=fsdp"],
        # 1 process -> fsdp (2), with activation checkpointing.
        "grow": ["train", "-c", fsdp_yaml, "--no-progress", "--resume", str(root / "grow"),
                 "--set", f"train.max_steps={STEPS}", "--set", "train.parallel=fsdp", "--set",
                 "train.activation_checkpointing=blocks"],
        # Muon, 1 process -> fsdp (2), from whole tensors.
        "muon-grow": ["train", "-c", str(root / "muon-fsdp.yaml"), "--no-progress", "--resume",
                      str(rewound(root / "muon-one", root / "muon-grow", 10)), "--set",
                      "train.parallel=fsdp"],
        # 1 process -> 2 inside the warm-ups (fsdp, which reshards too), and with an auto
        # micro-batch (ddp).
        **{name: ["train", "--resume", str(rewound(root / run, root / name, 2)), "--no-progress"]
           for name, run in (("warmup-again", "warmup-one"), ("auto-again", "auto"))},
    })
    return Launched(root, runs, one, resumes)


def test_fsdp_matches_ddp_reshards_and_resumes_exactly(launched, tmp_path, capsys):
    root = launched.root
    succeeded(launched.runs["ddp"])
    out = succeeded(launched.runs["fsdp"])
    assert "parallel: fsdp, parameters, gradients and optimizer state sharded over 2" in out
    ddp, fsdp = losses(root / "ddp"), losses(root / "fsdp")
    assert sorted(fsdp) == list(range(1, STEPS + 1))
    for step in fsdp:
        assert math.isclose(fsdp[step], ddp[step], rel_tol=1e-5), (step, fsdp[step], ddp[step])

    # Same processes, same mode: the resumed half repeats the uninterrupted run bit for bit.
    succeeded(launched.resumes["again"])
    assert {s: v for s, v in losses(root / "again").items() if s > 10} == {
        s: v for s, v in fsdp.items() if s > 10}

    # ddp (2 processes) -> fsdp (2): allowed, said, and the same run continues.
    out = succeeded(launched.resumes["mixed"])
    assert "resume: train.parallel ddp -> fsdp" in out
    assert "resharding the checkpoint written by 2 processes (ddp) for 2 processes (fsdp)" in out
    for step, loss in losses(root / "mixed").items():
        assert math.isclose(loss, ddp[step], rel_tol=1e-4), (step, loss, ddp[step])

    # fsdp (2) -> 1 process: nothing to shard, and it says so.
    alone = rewound(root / "fsdp", tmp_path / "alone", 10)
    capsys.readouterr()
    result = train(load_config(alone / "config.yaml"), resume=str(alone), progress=False)
    out = capsys.readouterr().out
    assert "parallel: fsdp with 1 process: nothing to shard" in out
    assert "resharding the checkpoint written by 2 processes (fsdp) for 1 process\n" in out
    assert result.steps == STEPS
    for step in range(11, STEPS + 1):
        assert math.isclose(result.losses[step], fsdp[step], rel_tol=1e-4), step

    # Bad input: a missing shard file is named; a config of another shape names the tensor.
    bad = rewound(root / "fsdp", tmp_path / "bad", 10)
    shard = "shard-00002-model-00001-of-00001.safetensors"
    (bad / "step-000010" / "shards" / shard).unlink()
    assert_user_error(andrea_main("train", "--resume", str(bad)), shard, "missing")
    shape = rewound(root / "fsdp", tmp_path / "shape", 10)
    (shape / "config.yaml").write_text((shape / "config.yaml").read_text()
                                       .replace("head_dim: 16", "head_dim: 8")
                                       .replace("d_model: 64", "d_model: 32"))
    # Found in the weights file's header before a model is built (resume.check_checkpoint_shape).
    assert_user_error(andrea_main("train", "--resume", str(shape)),
                      f"{shape / 'config.yaml'}: the config does not describe the stored weights",
                      "vocab_size x d_model 320 x 32 (tok_emb.weight is [320, 64])")

    # 1 process -> fsdp (2), with activation checkpointing: the same gradients, recomputed.
    out = succeeded(launched.resumes["grow"])
    assert "resharding the checkpoint written by 1 process for 2 processes (fsdp)" in out
    assert "train.activation_checkpointing none -> blocks" in out
    for step, loss in losses(root / "grow").items():
        assert math.isclose(loss, ddp[step], rel_tol=1e-4), (step, loss, ddp[step])


TIED = """
import pytest
import torch
from andrea.config import load_config
from andrea.model.transformer import Andrea
from andrea.train.process_group import init_distributed, shutdown
from andrea.train.sharding import shard_model
from torch.distributed.tensor import DTensor

info = init_distributed("cpu")
torch.manual_seed(0)
model = Andrea(load_config("andrea-tiny").model)
shard_model(model, info, torch.device("cpu"), bf16_params=False)
assert isinstance(model.tok_emb.weight, DTensor)
assert model.lm_head.weight is model.tok_emb.weight
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
x = torch.randint(0, 320, (2, 16))
for _ in range(2):
    model(x, x)[1].backward()
    optimizer.step()
    optimizer.zero_grad()
assert model.lm_head.weight is model.tok_emb.weight
assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
if info.rank == 0:
    print("tied", sum(p.to_local().numel() for p in model.parameters()))
shutdown(info)  # torchrun_runs.py's next command joins a process group of its own
"""


def test_fsdp_keeps_the_lm_head_tied_to_the_embedding(launched):
    """TIED, on two processes."""
    out = succeeded(launched.runs["tied"])
    # Each rank holds half of the 123,200 parameters (the tied matrix once).
    assert "tied 61600" in out


def launch_nodes(
    path: Path | None, folders: list[Path], *args: str, timeout: float = 150,
    launcher: tuple[str, ...] = (), env: dict[str, str] | None = None,
) -> list[tuple[int, str, str]]:
    """`andrea train [-c PATH] ARGS` as two torchrun "nodes" (one process each) on 127.0.0.1,
    node i working in folders[i], torchrun given LAUNCHER too; (exit code, stdout, stderr) per
    node. A hang is a failure after `timeout` seconds, not a stuck test."""
    port = free_port()
    nodes = [
        subprocess.Popen(
            torchrun_command("--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1",
                             "--master_addr=127.0.0.1", f"--master_port={port}", *launcher,
                             entry=["-m", "andrea", "train",
                                    *(["-c", str(path)] if path else []), "--no-progress",
                                    *args]),
            cwd=folder, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        for rank, folder in enumerate(folders)
    ]
    try:
        outputs = [node.communicate(timeout=timeout) for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            os.killpg(node.pid, 9)
        raise AssertionError(f"the two nodes did not finish in {timeout} s (a hang)") from None
    return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outputs, strict=True)]


def own_disks(tmp_path: Path, cfg) -> tuple[Path, list[Path]]:
    """The config as a file, and an empty working folder per node (node0, node1): with a
    relative runs_dir each node's runs live on its own "disk"."""
    path = config_file(cfg, tmp_path)
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        folder.mkdir()
    return path, folders


# All six steps are inside the tiny preset's 10 warm-up steps, so the lr of each step does not
# depend on max_steps: the same reference serves runs of 2 to 6 steps.
NODE_SETS = ("train.checkpoint_every=0", "train.eval_every=0")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data_dir) -> dict[int, float]:
    """The losses of one process training 6 steps of 2 micro-steps (4 x 64 each): what two
    processes of one micro-step each must give."""
    root = tmp_path_factory.mktemp("one")
    return train(tiny_config(root, data_dir, *SETS, "train.max_steps=6", *NODE_SETS, name="one"),
                 progress=False).losses


def test_two_nodes_match_one_process_and_one_process_resumes(tmp_path, data_dir, one_process):
    """Two torchrun launches as two "nodes" (one process each) on 127.0.0.1 train the losses of
    one process taking two micro-steps; only rank 0 speaks; stopped at step 3, the run is
    continued by one process alone, with the same losses."""
    cfg = tiny_config(tmp_path, data_dir, *SETS, "train.max_steps=6", *NODE_SETS, name="nodes")
    path = config_file(cfg, tmp_path)
    outputs = launch_nodes(path, [tmp_path, tmp_path], "--stop-after", "3")
    for code, _, err in outputs:
        assert code == 0, err[-3000:]
    assert "x 2 processes" in outputs[0][1] and outputs[1][1].strip() == ""  # rank 0 speaks
    assert outputs[0][1].count("stopped: 3 steps") == 1
    assert records(tmp_path / "nodes", "start")[0]["world_size"] == 2
    two = losses(tmp_path / "nodes")
    assert sorted(two) == [1, 2, 3]
    for step, loss in two.items():
        assert math.isclose(loss, one_process[step], rel_tol=1e-5), (step, loss, one_process)
    rest = train(cfg, resume=str(tmp_path / "nodes"), progress=False)  # one process takes over
    for step in (4, 5, 6):
        assert math.isclose(rest.losses[step], one_process[step], rel_tol=1e-4), step


def test_two_nodes_with_their_own_runs_dir_resume_as_one_run(tmp_path, data_dir, one_process):
    """ddp with train.runs_dir on each node's own disk (a relative path, two working folders):
    node 1 never sees the checkpoint, yet `--resume auto` continues both ranks from rank 0's
    step 2 (weights, AdamW state, lr, data position), so the losses are those of one process
    trained straight to step 4, and the step-4 checkpoint is written without a hang. Then
    `--resume runs/local` without --config: node 1 takes the run's config from rank 0."""
    cfg = tiny_config(tmp_path, data_dir, *SETS, "train.max_steps=2", "train.checkpoint_every=2",
                      "train.eval_every=0", "train.runs_dir=runs", name="local")
    one = one_process
    path, folders = own_disks(tmp_path, cfg)
    for code, _, err in launch_nodes(path, folders):
        assert code == 0, err[-3000:]
    run0, run1 = (folder / "runs" / "local" for folder in folders)
    assert (run0 / "latest").read_text().strip() == "step-000002"
    assert not (run1 / "latest").exists()  # node 1's own runs_dir holds no checkpoint

    outputs = launch_nodes(path, folders, "--resume", "auto", "--set", "train.max_steps=4")
    for code, _, err in outputs:
        assert code == 0, err[-3000:]
    assert "resuming from runs/local/step-000002" in outputs[0][1]
    assert "starting a new run" not in outputs[0][1] + outputs[1][1]
    assert (run0 / "latest").read_text().strip() == "step-000004"
    resumed = losses(run0)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert math.isclose(resumed[step], one[step], rel_tol=1e-5), (resumed, one)

    # Each node started with the run's name only: node 1 has no config.yaml to read.
    outputs = launch_nodes(None, folders, "--resume", "runs/local", "--set", "train.max_steps=5")
    for code, _, err in outputs:
        assert code == 0, err[-3000:]
    assert (run0 / "latest").read_text().strip() == "step-000005"
    assert math.isclose(losses(run0)[5], one[5], rel_tol=1e-5), (losses(run0), one)


def test_fsdp_with_a_runs_dir_on_each_node_is_one_error_on_every_node(tmp_path, data_dir):
    """fsdp writes every rank's shards into rank 0's run folder: a folder node 1 cannot see is
    refused before any step, on both nodes, in one line."""
    cfg = tiny_config(tmp_path, data_dir, *SETS, "train.parallel=fsdp", "train.max_steps=2",
                      "train.runs_dir=runs", name="sharded")
    path, folders = own_disks(tmp_path, cfg)
    for code, _, err in launch_nodes(path, folders):
        # andrea's own output is one line, exit code 2; torchrun then adds its failure report.
        assert code != 0 and "exitcode  : 2" in err, err[-3000:]
        ours = err[:err.index("torch/distributed/elastic")].strip().splitlines()[:-1]
        assert len(ours) == 1 and ours[0].startswith("error: runs: "), err[-3000:]
        assert "must be shared by every node for fsdp, and rank 1 cannot see it" in ours[0]
    assert not list((folders[0] / "runs").glob("sharded/step-*"))


def andreas_lines(err: str) -> list[str]:
    """A failed torchrun launch's stderr without torchrun's own failure report after it."""
    return err[:err.index("torch/distributed/elastic")].strip().splitlines()[:-1]


def test_nodes_given_different_configs_are_one_error_on_every_node(tmp_path, data_dir):
    """Each node reads its own copy of the config: a stale copy on node 1 (another lr) trained
    each rank with its own lr, silently, the run recording rank 0's; another n_layer was DDP's
    traceback. Now both nodes stop before any step with one line naming the key."""
    cfg = tiny_config(tmp_path, data_dir, *SETS, "train.max_steps=2", "train.runs_dir=runs",
                      name="t")
    _, folders = own_disks(tmp_path, cfg)
    (folders[0] / "t.yaml").write_text(cfg.to_yaml())
    stale = load_config("andrea-tiny", [f"{k}={v}" for k, v in (
        ("data.dir", data_dir), ("train.runs_dir", "runs"), ("train.name", "t"))] + list(SETS) + [
        "train.max_steps=2", "train.lr=0.01", "model.n_layer=3",
        "train.join_timeout=500", "train.tensorboard=true"])  # these two may differ
    (folders[1] / "t.yaml").write_text(stale.to_yaml())
    for code, _, err in launch_nodes(Path("t.yaml"), folders):
        assert code != 0 and "exitcode  : 2" in err, err[-3000:]
        assert andreas_lines(err) == [
            "error: rank 1 was given another config than rank 0: model.n_layer 3 where rank 0 "
            "has 2; train.lr 0.01 where rank 0 has 0.003; give every process of the run the "
            "same config file and --set options"], err[-3000:]
    assert not (folders[0] / "runs").exists()


def test_data_missing_on_another_node_is_its_one_line_on_every_node(tmp_path, data_dir):
    """Nodes with their own disks: rank 0 prepares on node 0 alone. A node 1 without its copy
    stopped with its own line while rank 0 went on into DDP's first collective, a traceback of
    gloo's "Connection closed by peer". Now every node stops with node 1's line, which says to
    prepare there."""
    cfg = tiny_config(tmp_path, data_dir, *SETS, "train.max_steps=2", "train.runs_dir=runs",
                      "data.dir=data/own", name="t")
    path, folders = own_disks(tmp_path, cfg)
    shutil.copytree(data_dir, folders[0] / "data" / "own")
    for code, _, err in launch_nodes(path, folders):
        assert code != 0 and "exitcode  : 2" in err, err[-3000:]
        assert andreas_lines(err) == [
            f"error: rank 1: data/own: no prepared data on this node; rank 0 prepares only on "
            f"its own: run andrea prepare --config {path} on this node first (the same config), "
            f"or put the data folder on storage every node shares"], err[-3000:]


def test_a_failed_prepare_on_rank_0_is_its_one_line_on_every_rank(tmp_path):
    """Rank 0 prepares the data while the others wait. A prepare that failed (a missing input)
    was rank 0's one line, but rank 1 waited at a barrier that broke: a traceback of gloo's
    "Connection closed by peer". Now every rank stops with rank 0's line."""
    cfg = load_config("andrea-tiny", [f"train.runs_dir={tmp_path / 'runs'}", "train.name=nodata",
                                      "train.max_steps=2", f"data.source={tmp_path / 'nope.txt'}"])
    proc = run_torchrun("train", "-c", str(config_file(cfg, tmp_path)), "--no-progress")
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    ours = proc.stderr[:proc.stderr.index("torch/distributed/elastic")].strip().splitlines()[:-1]
    assert ours == [f"error: {tmp_path / 'nope.txt'}: no such file or directory"] * 2, ours
    assert "Traceback" not in proc.stderr[:proc.stderr.index("torch/distributed/elastic")]


def test_a_rank_killed_while_writing_shards_leaves_the_previous_checkpoint(tmp_path, data_dir):
    cfg = tiny_config(tmp_path, data_dir, *SETS, "train.parallel=fsdp", "train.max_steps=4",
                      "train.checkpoint_every=2", "train.eval_every=0", name="killed")
    path = config_file(cfg, tmp_path)
    # Rank 1 dies by SIGKILL with its shards of step 4 on disk, before the checkpoint is whole.
    proc = run_torchrun("train", "-c", str(path), "--no-progress",
                        env={"ANDREA_FAULTS": "kill-rank@1:step-000004"})
    assert proc.returncode != 0, proc.stdout[-2000:]
    run_dir = tmp_path / "killed"
    assert (run_dir / "latest").read_text().strip() == "step-000002"
    assert not (run_dir / "step-000004").exists()
    assert list(run_dir.glob("step-000004.partial-*"))  # the half-written one, never latest
    # The previous checkpoint still loads: one process resumes from it and finishes the run.
    resumed = andrea_main("train", "--resume", str(run_dir), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert "step-000002" in resumed.stdout
    assert (run_dir / "latest").read_text().strip() == "step-000004"
    assert not list(run_dir.glob("*.partial-*"))


def records(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def resumed_on_two_matches(result: Result, again: Path, step: int,
                           expected: dict[int, float]) -> str:
    """A one-process run rewound to checkpoint `step` (at `again`), resumed on two processes
    (`result`): every later step's loss is `expected`'s (rel 1e-5). Returns its stdout."""
    out = succeeded(result)
    resumed = losses(again)
    assert sorted(resumed) == sorted(expected)
    for s in range(step + 1, max(expected) + 1):
        assert math.isclose(resumed[s], expected[s], rel_tol=1e-5), (resumed, expected)
    return out


def test_auto_micro_batch_is_chosen_again_on_another_process_count(launched):
    """A run whose auto micro-batch was 16 x 64 on one process resumes under 2 processes: auto
    chooses again (8 each) instead of reusing 16, which 1,024 tokens over 2 processes cannot
    hold; the global batch and the data order stay, so the losses are the one process's."""
    one, run = launched.one["auto"], launched.root / "auto"
    state = json.loads((run / "step-000002" / "trainer_state.json").read_text())
    assert (state["micro_batch_size"], state["world_size"]) == (16, 1)
    again = launched.root / "auto-again"
    out = resumed_on_two_matches(launched.resumes["auto-again"], again, 2, one.losses)
    assert "micro-batch: auto -> 8 x 64 (1 accumulation step)" in out
    state = json.loads((again / "step-000004" / "trainer_state.json").read_text())
    assert (state["micro_batch_size"], state["tokens_per_step"]) == (8, 1024)
    # Rank 1, which the checkpoint had no generator state for, was seeded with its own seed
    # (seed + rank, as in a new run; nothing in the tiny model draws from it since).
    rng = load_file(again / "step-000004" / "rng.safetensors")
    torch.manual_seed(cfg_seed(again) + 1)
    assert torch.equal(rng["cpu.rank1"], torch.get_rng_state())
    assert not torch.equal(rng["cpu.rank0"], rng["cpu.rank1"])


def cfg_seed(run_dir: Path) -> int:
    return load_config(run_dir / "config.yaml").train.seed


PEAK = 2e11  # FLOP/s: a GPU's, patched in (a CPU has none, so its MFU is n/a)
PATCHED_PEAK = f"""
import andrea.train.flops as flops
from andrea.cli import main
cpus = flops.peak_flops
flops.peak_flops = lambda device, dtype: {PEAK}
try:
    main()
finally:
    flops.peak_flops = cpus  # torchrun_runs.py's later commands
"""


def assert_mfu_per_device(run_dir: Path, cfg, peak: float) -> None:
    """MFU = one device's tokens/s x FLOPs per token / one device's peak: with 2 processes, half
    the global tokens/s."""
    from andrea.model.transformer import Andrea
    from andrea.train.flops import flops_per_token

    per_token = flops_per_token(cfg.model, Andrea(cfg.model).num_params())
    steps = records(run_dir, "train")
    assert len(steps) == cfg.train.max_steps
    for r in steps:
        per_device = r["tokens_per_s"] / 2 * per_token / peak
        assert r["mfu"] is not None and math.isclose(r["mfu"], per_device, abs_tol=1.5e-4), r


def test_global_batch_zero_keeps_its_tokens_per_step_on_fewer_processes(launched, tmp_path):
    """global_batch_tokens: 0 is one micro-batch per process when the run starts (2 x 4 x 64 =
    512 tokens/step); resumed on one process it keeps 512 (2 micro-batches) and the same
    losses; a micro-batch that cannot keep it says so in one line, and the plan adds up. The
    two processes' MFU is per device (a GPU's peak patched in: PATCHED_PEAK)."""
    succeeded(launched.runs["zero"])
    run = launched.root / "zero"
    assert_mfu_per_device(run, load_config(launched.root / "zero.yaml"), PEAK)
    two = losses(run)
    fewer = rewound(run, tmp_path / "fewer", 2)
    proc = andrea_main("train", "--resume", str(fewer), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "512 tokens/step (4 x 64 x 2 accumulation x 1 process)" in proc.stdout
    assert "plan: 4 steps x 512 tokens/step = 2,048 tokens" in proc.stdout
    assert records(fewer, "end")[-1]["tokens"] == 2048
    for step in (3, 4):
        assert math.isclose(losses(fewer)[step], two[step], rel_tol=1e-5), (step, two)

    odd = rewound(run, tmp_path / "odd", 2)
    proc = andrea_main("train", "--resume", str(odd), "--no-progress",
                       "--set", "train.micro_batch_size=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume: tokens/step 512 -> 192 (global_batch_tokens: 0" in proc.stdout
    assert ("plan: 1,024 tokens in 2 steps + 2 steps x 192 tokens/step = 1,408 tokens"
            in proc.stdout)
    assert records(odd, "end")[-1]["tokens"] == 1024 + 2 * 192


def test_fsdp_muon_matches_one_process_and_reshards(launched, tmp_path, capsys):
    """Muon under fsdp (each rank orthogonalises its share of whole matrices, the momentum stays
    sharded): one process's losses; its state in the shards; resumes 2 -> 1 (from the shards)
    and 1 -> 2 (from whole tensors, as a ddp checkpoint holds them too: ddp -> fsdp is
    test_fsdp_matches_ddp_reshards_and_resumes_exactly's) continue the same run."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    root, one = launched.root, launched.one["muon"].losses
    succeeded(launched.runs["muon-fsdp"])
    fsdp = losses(root / "muon-fsdp")
    assert sorted(fsdp) == list(range(1, STEPS + 1))
    for step in fsdp:
        assert math.isclose(fsdp[step], one[step], rel_tol=1e-5), (step, fsdp[step], one[step])
    stored = HuggingFaceStorageReader(str(root / "muon-fsdp" / "step-000010" / "shards")
                                      ).read_metadata().state_dict_metadata
    assert "optimizer.blocks.0.attn.qkv.weight.momentum_buffer" in stored
    assert "optimizer.blocks.0.attn.qkv.weight.exp_avg" not in stored
    assert "optimizer.tok_emb.weight.exp_avg" in stored

    def continues(run_dir: Path) -> None:
        got = losses(run_dir)
        assert sorted(got) == list(range(1, STEPS + 1))
        for step in range(11, STEPS + 1):
            assert math.isclose(got[step], one[step], rel_tol=1e-5), (run_dir, step, got[step])

    # fsdp (2) -> 1 process, from the shards.
    alone = rewound(root / "muon-fsdp", tmp_path / "alone", 10)
    capsys.readouterr()
    train(load_config(alone / "config.yaml"), resume=str(alone), progress=False)
    assert "written by 2 processes (fsdp) for 1 process\n" in capsys.readouterr().out
    continues(alone)
    # 1 process -> fsdp (2), from whole tensors.
    out = succeeded(launched.resumes["muon-grow"])
    assert "written by 1 process for 2 processes (fsdp)" in out
    continues(root / "muon-grow")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_batch_and_seq_warmup_on_two_processes_matches_one(launched, parallel):
    """2 steps of 512 tokens, then 1,024: one process takes 2 then 4 micro-batches of 4 x 64,
    two processes 1 then 2 each; the same windows, so the same losses. The first 3 steps cut
    each micro-batch into 16 windows of 16 tokens (a sequence-length warm-up). The one process's
    checkpoint at step 2, inside both warm-ups, resumed on two processes (fsdp, which reshards
    it too) gives its steps 3-4."""
    one, name = launched.one["warmup"], f"warmup-{parallel}"
    out = succeeded(launched.runs[name])
    assert "batch warm-up: steps 1-2 take 512 tokens (1 accumulation), then 1,024" in out
    assert ("sequence warm-up: steps 1-3 train on windows of 16 tokens (16 x 16 a "
            "micro-batch), then 64") in out
    two = losses(launched.root / name)
    assert sorted(two) == [1, 2, 3, 4]
    for step, loss in two.items():
        assert math.isclose(loss, one.losses[step], rel_tol=1e-5), (step, loss, one.losses)
    tokens = [r["tokens"] for r in records(launched.root / name, "train")]
    assert tokens == [512, 1024, 2048, 3072] and one.tokens == 3072
    if parallel == "fsdp":  # resuming inside the warm-ups does not depend on the mode: once
        out = resumed_on_two_matches(launched.resumes["warmup-again"],
                                     launched.root / "warmup-again", 2, one.losses)
        assert "sequence warm-up: steps 1-3 train on windows of 16 tokens" in out


# The mode and the torchrun environment, in-process (no launch).

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_RUN_ID": "job7",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_the_torchrun_environment_is_one_record(monkeypatch):
    from andrea.train.torchrun import TorchrunEnv, torchrun_env

    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    read = torchrun_env.__wrapped__  # uncached: the process's own reading is kept
    assert read() == TorchrunEnv(rank=3, local_rank=1, world_size=4, local_world_size=2,
                                 restart_count=2, max_restarts=3, run_id="job7",
                                 master_addr="node0", master_port=29500, agent_store=True)
    for key in TORCHRUN:
        monkeypatch.delenv(key)
    assert read() == TorchrunEnv()  # not under torchrun: rank 0 of 1
    assert TorchrunEnv().world_size == 1 and not TorchrunEnv().agent_store


def test_the_mode_is_decided_once_from_the_config_and_the_processes():
    from andrea.train.parallel import parallel_for
    from andrea.train.torchrun import DistInfo

    one, two = DistInfo(), DistInfo(0, 0, 2, 2)
    for asked in ("ddp", "fsdp"):  # one process trains whole, whatever was asked
        alone = parallel_for(asked, one)
        assert (alone.name, alone.sharded) == ("none", False)
    ddp, fsdp = parallel_for("ddp", two), parallel_for("fsdp", two)
    assert [(p.name, p.sharded) for p in (ddp, fsdp)] == [("ddp", False), ("fsdp", True)]
    assert parallel_for("ddp", one).lines() == ddp.lines() == []
    assert parallel_for("fsdp", one).lines() == [
        "parallel: fsdp with 1 process: nothing to shard, the model runs whole"]
    assert fsdp.lines() == [
        "parallel: fsdp, parameters, gradients and optimizer state sharded over 2 processes"]


def test_the_layout_change_line_names_what_wrote_the_checkpoint_and_what_happens_to_it():
    from andrea.train.parallel import parallel_for
    from andrea.train.rundir import TrainerState
    from andrea.train.torchrun import DistInfo

    def written(**keys):
        return TrainerState.from_dict({"step": 10, **keys})

    one, two = DistInfo(), DistInfo(0, 0, 2, 2)
    # Checkpoints from before the mode was recorded: ddp on several processes, else none.
    assert parallel_for("ddp", two).layout_change_line(written(world_size=2)) is None
    assert parallel_for("fsdp", one).layout_change_line(written()) is None
    assert parallel_for("fsdp", two).layout_change_line(written(world_size=2)) == (
        "resume: resharding the checkpoint written by 2 processes (ddp) for 2 processes (fsdp)")
    assert parallel_for("fsdp", two).layout_change_line(written(world_size=1)) == (
        "resume: resharding the checkpoint written by 1 process for 2 processes (fsdp)")
    assert parallel_for("ddp", one).layout_change_line(written(world_size=2, parallel="fsdp")) == (
        "resume: resharding the checkpoint written by 2 processes (fsdp) for 1 process")
    # Whole weights on both sides: nothing is resharded, and the line does not say it is.
    assert parallel_for("ddp", one).layout_change_line(written(world_size=2, parallel="ddp")) == (
        "resume: the checkpoint written by 2 processes (ddp) goes on with 1 process")
    four = DistInfo(0, 0, 4, 4)
    assert parallel_for("ddp", four).layout_change_line(written(world_size=2, parallel="ddp")) == (
        "resume: the checkpoint written by 2 processes (ddp) goes on with 4 processes (ddp)")


def test_one_process_clips_and_accumulates_as_torch_does():
    from andrea.train.parallel import parallel_for
    from andrea.train.torchrun import DistInfo

    alone = parallel_for("fsdp", DistInfo())
    gen = torch.Generator().manual_seed(0)
    model, twin = torch.nn.Linear(4, 3).double(), torch.nn.Linear(4, 3).double()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        q.grad = p.grad.clone()
    norm = alone.clip(model, 0.5)
    assert norm == torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                           twin.parameters(), strict=True))
    assert alone.wrap(model, None, torch.device("cpu")) is model
    # Two micro-batches' backward under gradient_sync: the gradients add up, as torch's do.
    model.zero_grad(set_to_none=True)
    xs = [torch.randn(5, 4, generator=gen, dtype=torch.float64) for _ in range(2)]
    for i, x in enumerate(xs):
        with alone.gradient_sync(model, model, last=i == 1):
            (model(x).square().sum() / 2).backward()
    weight, bias = model.weight.detach(), model.bias.detach()
    expected_w = sum((x @ weight.T + bias).T @ x for x in xs)  # d/dW of sum(y²)/2
    expected_b = sum((x @ weight.T + bias).sum(0) for x in xs)
    torch.testing.assert_close(model.weight.grad, expected_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.bias.grad, expected_b, rtol=1e-12, atol=1e-12)


def test_no_module_but_the_strategy_names_a_mode():
    """`"ddp"`/`"fsdp"` as a string in the package: only the parallel strategy and the
    declaration of train.parallel may hold one, so no other module decides by the name."""
    import ast

    from conftest import REPO

    found = []
    for path in sorted((REPO / "andrea").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel == "andrea/train/parallel.py" or rel.startswith("andrea/config"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in ("ddp", "fsdp"):
                found.append(f"{rel}:{node.lineno}")
    assert found == []


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_fp16_on_two_processes_skips_the_overflow_everywhere_and_keeps_the_scale(
        launched, parallel):
    """fp16, rank 0's backward of step 2 overflowing (overflow@2): every rank skips step 2 and
    halves its scale (ddp's all-reduce and fsdp's reduce-scatter carry the inf into every rank's
    gradients; fsdp's inf check is reduced over the ranks too), so the losses are one process's.
    The checkpoint records the halved scale and the count (a resume's test: test_fp16.py)."""
    one, run = launched.one["fp16"], launched.root / f"fp16-{parallel}"
    succeeded(launched.runs[f"fp16-{parallel}"])
    assert [r["step"] for r in records(run, "overflow")] == [2]
    two = losses(run)
    for step in (1, 2, 3):
        assert math.isclose(two[step], one.losses[step], rel_tol=1e-3), (step, two, one.losses)
    state = read_trainer_state(run / "step-000003")[0]
    assert (state.loss_scaling["scale"], state.loss_scaling["overflows"]) == (2.0**15, 1)


def test_a_process_group_of_one_runs_the_several_process_path(tmp_path, data_dir):
    """ANDREA_PROCESS_GROUP_OF_ONE=1 under torchrun with one process: a real process group (the
    NCCL path on a machine with one GPU; gloo here), so fsdp shards over it and writes shards;
    without it the one process trains whole, as before."""
    cfg = tiny_config(tmp_path, data_dir, *SETS, "train.parallel=fsdp", "train.max_steps=2",
                      "train.checkpoint_every=2", "train.eval_every=0", name="one")
    path = str(config_file(cfg, tmp_path))
    # One launch of one process for both (conftest.run_torchrun_each), grouped first.
    launched = run_torchrun_each(tmp_path / "launch", {
        "grouped": ["train", "-c", path, "--no-progress"],
        "alone": ["train", "-c", path, "--no-progress", "--set", "train.name=alone"],
    }, nproc=1, envs={"grouped": {"ANDREA_PROCESS_GROUP_OF_ONE": "1"}})
    grouped, alone = launched["grouped"], launched["alone"]
    assert grouped.returncode == 0, grouped.stdout[-2000:] + grouped.stderr[-3000:]
    assert "parallel: fsdp, parameters, gradients and optimizer state sharded over 1 process" \
        in grouped.stdout
    assert (tmp_path / "one" / "step-000002" / "shards").is_dir()
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "fsdp with 1 process: nothing to shard" in alone.stdout
    assert (tmp_path / "alone" / "step-000002").is_dir()
    assert not (tmp_path / "alone" / "step-000002" / "shards").exists()


def worker_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun agent AGENT's worker of rank RANK, from /proc, or None."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # ended while being read
            continue
        if parent == str(agent) and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker in /proc")
def test_a_signal_to_one_rank_stops_every_rank_as_interrupted(tmp_path, data_dir):
    """A scheduler that stops one node sends SIGTERM to its workers alone. Every rank stops after
    the same step and checkpoints it, and every rank ends the run as stopped by it: rank 0 said
    "finished" with exit code 0 and an end record of a finished run, so a requeue script that
    asks node 0 took the job for done."""
    cfg = tiny_config(tmp_path, data_dir, *SETS, "train.max_steps=100000",
                      "train.eval_every=0", "train.checkpoint_every=0", name="one")
    metrics = tmp_path / "one" / "metrics.jsonl"
    agent = subprocess.Popen(
        torchrun_command("--nproc_per_node=2", "--master_addr=127.0.0.1",
                         f"--master_port={free_port()}",
                         entry=["-m", "andrea", "train", "-c", str(config_file(cfg, tmp_path)),
                                "--no-progress"]),
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: metrics.exists() and '"step": 3,' in metrics.read_text(),
                   what="step 3", proc=agent, timeout=120)
        os.kill(worker_pid(agent.pid, 1), signal.SIGTERM)
        out, err = agent.communicate(timeout=120)
    finally:
        agent.kill()
    end = records(tmp_path / "one", "end")[-1]
    assert (end["state"], end["signal"]) == ("interrupted", "SIGTERM"), end
    step = end["step"]
    assert 3 <= step < 100000
    assert (f"stopped by SIGTERM (sent to another process of the run) after step {step}; "
            f"checkpoint {tmp_path / 'one' / f'step-{step:06d}'}") in err, out + err[-3000:]
    assert f"interrupted: {step} steps, " in out and "finished" not in out, out
    assert (tmp_path / "one" / "latest").read_text().strip() == f"step-{step:06d}"
    assert agent.returncode != 0  # both workers exited 143: torchrun reports the failure
