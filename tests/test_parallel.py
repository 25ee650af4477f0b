"""Several processes under torchrun (gloo on the CPU): train.parallel: fsdp gives ddp's losses, the
tied LM head stays tied, checkpoints reshard between process counts and modes, a resume with the
same processes and mode is exact; two "nodes" equal one process. Each torchrun launch costs
seconds: few of them, tiny runs."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import assert_user_error, free_port, run_andrea, run_torchrun

from andrea.config import load_config
from andrea.train.loop import train

STEPS = 20
SETS = (f"train.max_steps={STEPS}", "train.precision=fp32", "train.micro_batch_size=4",
        "train.global_batch_tokens=512", "train.checkpoint_every=10", "train.keep_last=5",
        "train.log_every=1", "train.eval_every=10", "train.eval_batches=3")


def tiny(tmp_path: Path, data_dir: Path, name: str, *sets: str):
    return load_config("andrea-tiny", [f"data.dir={data_dir}", f"train.runs_dir={tmp_path}",
                                       f"train.name={name}", *SETS, *sets])


def launch(tmp_path: Path, cfg, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"{cfg.train.name}.yaml"
    path.write_text(cfg.to_yaml())
    proc = run_torchrun("train", "-c", str(path), "--no-progress", *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> train loss; a resumed step's newer record replaces the older one."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["event"] == "train"}


def rewound(run_dir: Path, to: Path, step: int) -> Path:
    """A copy of the run whose latest checkpoint is `step`, as if it had stopped there."""
    shutil.copytree(run_dir, to)
    for later in to.glob("step-*"):
        if int(later.name[5:]) > step:
            shutil.rmtree(later)
    (to / "latest").write_text(f"step-{step:06d}\n")
    return to


def test_fsdp_matches_ddp_reshards_and_resumes_exactly(tmp_path, data_dir, capsys):
    ddp_cfg = tiny(tmp_path, data_dir, "ddp")
    launch(tmp_path, ddp_cfg)
    fsdp_cfg = tiny(tmp_path, data_dir, "fsdp", "train.parallel=fsdp")
    out = launch(tmp_path, fsdp_cfg).stdout
    assert "parallel: fsdp, parameters, gradients and optimizer state sharded over 2" in out
    ddp, fsdp = losses(tmp_path / "ddp"), losses(tmp_path / "fsdp")
    assert sorted(fsdp) == list(range(1, STEPS + 1))
    for step in fsdp:
        assert math.isclose(fsdp[step], ddp[step], rel_tol=1e-5), (step, fsdp[step], ddp[step])

    # Same processes, same mode: the resumed half repeats the uninterrupted run bit for bit.
    again = rewound(tmp_path / "fsdp", tmp_path / "again", 10)
    launch(tmp_path, fsdp_cfg, "--resume", str(again))
    assert {s: v for s, v in losses(again).items() if s > 10} == {
        s: v for s, v in fsdp.items() if s > 10}

    # ddp (2 processes) -> fsdp (2): allowed, said, and the same run continues.
    mixed = rewound(tmp_path / "ddp", tmp_path / "mixed", 10)
    out = launch(tmp_path, fsdp_cfg, "--resume", str(mixed), "--set",
                 "train.parallel=fsdp").stdout
    assert "resume: train.parallel ddp -> fsdp" in out
    assert "resharding the checkpoint written by 2 processes (ddp) for 2 (fsdp)" in out
    for step, loss in losses(mixed).items():
        assert math.isclose(loss, ddp[step], rel_tol=1e-4), (step, loss, ddp[step])

    # fsdp (2) -> 1 process: nothing to shard, and it says so.
    alone = rewound(tmp_path / "fsdp", tmp_path / "alone", 10)
    capsys.readouterr()
    result = train(load_config(alone / "config.yaml"), resume=str(alone), progress=False)
    out = capsys.readouterr().out
    assert "parallel: fsdp with 1 process: nothing to shard" in out
    assert "resharding the checkpoint written by 2 processes (fsdp) for 1 (none)" in out
    assert result.steps == STEPS
    for step in range(11, STEPS + 1):
        assert math.isclose(result.losses[step], fsdp[step], rel_tol=1e-4), step

    # Bad input: a missing shard file is named; a checkpoint of another shape names the tensor.
    bad = rewound(tmp_path / "fsdp", tmp_path / "bad", 10)
    shard = "shard-00002-model-00001-of-00001.safetensors"
    (bad / "step-000010" / "shards" / shard).unlink()
    assert_user_error(run_andrea("train", "--resume", str(bad)), shard, "missing")
    shape = rewound(tmp_path / "fsdp", tmp_path / "shape", 10)
    (shape / "config.yaml").write_text((shape / "config.yaml").read_text()
                                       .replace("head_dim: 16", "head_dim: 8")
                                       .replace("d_model: 64", "d_model: 32"))
    assert_user_error(run_andrea("train", "--resume", str(shape)),
                      "tok_emb.weight", "[320, 64] in the checkpoint", "[320, 32] in the model")

    # 1 process -> fsdp (2), with activation checkpointing: the same gradients, recomputed.
    one_cfg = tiny(tmp_path, data_dir, "grow", "train.max_steps=10")
    train(one_cfg, progress=False)
    out = launch(tmp_path, fsdp_cfg, "--resume", str(tmp_path / "grow"), "--set",
                 f"train.max_steps={STEPS}", "--set", "train.parallel=fsdp", "--set",
                 "train.activation_checkpointing=blocks").stdout
    assert "resharding the checkpoint written by 1 process (none) for 2 (fsdp)" in out
    assert "train.activation_checkpointing none -> blocks" in out
    for step, loss in losses(tmp_path / "grow").items():
        assert math.isclose(loss, ddp[step], rel_tol=1e-4), (step, loss, ddp[step])


TIED = """
import torch
from andrea.config import load_config
from andrea.model.transformer import Andrea
from andrea.train.distributed import init_distributed, shard_model
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
"""


def test_fsdp_keeps_the_lm_head_tied_to_the_embedding(tmp_path):
    script = tmp_path / "tied.py"
    script.write_text(TIED)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each rank holds half of the 123,200 parameters (the tied matrix once).
    assert "tied 61600" in proc.stdout


def test_two_nodes_match_one_process_with_two_micro_steps(tmp_path, data_dir):
    """Two torchrun launches as two "nodes" (one process each) on 127.0.0.1."""
    sets = ("train.max_steps=3", "train.checkpoint_every=0", "train.eval_every=0")
    one = train(tiny(tmp_path, data_dir, "one", *sets), progress=False)  # 2 micro-steps
    cfg = tiny(tmp_path, data_dir, "nodes", *sets)
    path = tmp_path / "nodes.yaml"
    path.write_text(cfg.to_yaml())
    port = free_port()
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}",
             "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
             "-m", "andrea", "train", "-c", str(path), "--no-progress"],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    assert "x 2 processes" in outputs[0][0] and outputs[1][0].strip() == ""  # rank 0 speaks
    two = losses(tmp_path / "nodes")
    assert sorted(two) == [1, 2, 3]
    for step, loss in two.items():
        assert math.isclose(loss, one.losses[step], rel_tol=1e-5), (step, loss, one.losses)


def test_a_rank_killed_while_writing_shards_leaves_the_previous_checkpoint(tmp_path, data_dir):
    cfg = tiny(tmp_path, data_dir, "killed", "train.parallel=fsdp", "train.max_steps=4",
               "train.checkpoint_every=2", "train.eval_every=0")
    path = tmp_path / "killed.yaml"
    path.write_text(cfg.to_yaml())
    # Rank 1 dies by SIGKILL with its shards of step 4 on disk, before the checkpoint is whole.
    proc = run_torchrun("train", "-c", str(path), "--no-progress",
                        env={"ANDREA_TEST_KILL_RANK_IN_SHARDS": "1:step-000004"})
    assert proc.returncode != 0, proc.stdout[-2000:]
    run_dir = tmp_path / "killed"
    assert (run_dir / "latest").read_text().strip() == "step-000002"
    assert not (run_dir / "step-000004").exists()
    assert list(run_dir.glob("step-000004.partial-*"))  # the half-written one, never latest
    # The previous checkpoint still loads: one process resumes from it and finishes the run.
    resumed = run_andrea("train", "--resume", str(run_dir), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert "step-000002" in resumed.stdout
    assert (run_dir / "latest").read_text().strip() == "step-000004"
    assert not list(run_dir.glob("*.partial-*"))


def test_fsdp_muon_matches_one_process_and_reshards(tmp_path, data_dir, capsys):
    """Muon under fsdp (each rank orthogonalises its share of whole matrices, the momentum stays
    sharded): one process's losses; its state in the shards; resumes 2 -> 1, 1 -> 2 and
    ddp -> fsdp continue the same run."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    muon = ("train.optimizer=muon", "train.muon_ns_precision=fp32")
    one = train(tiny(tmp_path, data_dir, "one", *muon), progress=False).losses
    fsdp_cfg = tiny(tmp_path, data_dir, "fsdp", "train.parallel=fsdp", *muon)
    launch(tmp_path, fsdp_cfg)
    fsdp = losses(tmp_path / "fsdp")
    assert sorted(fsdp) == list(range(1, STEPS + 1))
    for step in fsdp:
        assert math.isclose(fsdp[step], one[step], rel_tol=1e-5), (step, fsdp[step], one[step])
    stored = HuggingFaceStorageReader(str(tmp_path / "fsdp" / "step-000010" / "shards")
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
    alone = rewound(tmp_path / "fsdp", tmp_path / "alone", 10)
    capsys.readouterr()
    train(load_config(alone / "config.yaml"), resume=str(alone), progress=False)
    assert "written by 2 processes (fsdp) for 1 (none)" in capsys.readouterr().out
    continues(alone)
    # 1 process -> fsdp (2), from whole tensors.
    grow = rewound(tmp_path / "one", tmp_path / "grow", 10)
    out = launch(tmp_path, fsdp_cfg, "--resume", str(grow), "--set", "train.parallel=fsdp").stdout
    assert "written by 1 process (none) for 2 (fsdp)" in out
    continues(grow)
    # ddp (2) -> fsdp (2).
    launch(tmp_path, tiny(tmp_path, data_dir, "ddp", "train.max_steps=10", *muon))
    out = launch(tmp_path, fsdp_cfg, "--resume", str(tmp_path / "ddp"), "--set",
                 f"train.max_steps={STEPS}", "--set", "train.parallel=fsdp").stdout
    assert "written by 2 processes (ddp) for 2 (fsdp)" in out
    continues(tmp_path / "ddp")
