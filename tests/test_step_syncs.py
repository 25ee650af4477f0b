"""A step waits on the other ranks and on the device a fixed number of times, however many
micro-batches it has: on 2 gloo processes, andrea-tiny trained at 1 and at 8 micro-batches a step
calls `all_reduce` and reads tensors into Python equally often (ddp and fsdp). A SIGTERM inside
a step still stops within about two micro-batches under ddp. tests/sync_counter.py counts inside
the torchrun workers, the five runs in one launch (a launch costs seconds)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import config_file, run_torchrun, tiny_config

STEPS = 6
MICRO_TOKENS = 64 * 4  # 4 windows of 64 tokens


def config(tmp_path: Path, data_dir: Path, name: str, micro_batches: int, *sets: str) -> str:
    cfg = tiny_config(
        tmp_path / "runs", data_dir, "model.block_size=64", f"train.max_steps={STEPS}",
        "train.precision=fp32", f"train.micro_batch_size={8 // micro_batches}",
        f"train.global_batch_tokens={2 * 8 * 64}",  # 2 ranks x 8 windows of 64
        f"train.checkpoint_every={STEPS}", *sets, name=name)
    return str(config_file(cfg, tmp_path))


def test_a_step_waits_as_often_with_8_micro_batches_as_with_1(tmp_path, data_dir):
    runs = {
        "ddp1": config(tmp_path, data_dir, "ddp1", 1),
        "ddp8": config(tmp_path, data_dir, "ddp8", 8),
        "fsdp1": config(tmp_path, data_dir, "fsdp1", 1, "train.parallel=fsdp"),
        "fsdp8": config(tmp_path, data_dir, "fsdp8", 8, "train.parallel=fsdp"),
        "stop8": config(tmp_path, data_dir, "stop8", 8),
    }
    # SIGTERM on both ranks after micro-batch 1 of step 4's 8 (0-based step 3)
    faults = {"stop8": "sigterm@3.1"}
    out = tmp_path / "counts"
    # One torchrun launch for the five runs, each under keys of its own (tests/sync_counter.py)
    proc = run_torchrun(str(Path(__file__).with_name("sync_counter.py")), str(out), json.dumps(
        [[name, path, faults.get(name, "")] for name, path in runs.items()]), script=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    counts = {rank: json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)}
    for rank in (0, 1):
        for mode in ("ddp", "fsdp"):
            one, eight = counts[rank][f"{mode}1"], counts[rank][f"{mode}8"]
            assert one["exit_code"] == eight["exit_code"] == 0, counts
            assert eight["forward"] == 8 * one["forward"] == 8 * STEPS, counts  # it did train
            assert eight["all_reduce"] == one["all_reduce"], (mode, rank, counts)
            assert eight["read"] == one["read"], (mode, rank, counts)
        stop = counts[rank]["stop8"]
        assert stop["exit_code"] == 143, counts
        # 3 whole steps, then micro-batches 0 and 1 and the step's last one (a step is 8)
        assert stop["forward"] == 3 * 8 + 3, counts
    runs_dir = tmp_path / "runs"
    assert (runs_dir / "stop8" / "latest").read_text().strip() == "step-000003"
    for mode in ("ddp", "fsdp"):  # the same losses at either micro-batch count
        a, b = (train_losses(runs_dir / f"{mode}{n}") for n in (1, 8))
        assert len(a) == STEPS
        assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b, strict=True)), (a, b)


def train_losses(run_dir: Path) -> list[float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if r["event"] == "train"]
