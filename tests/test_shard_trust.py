"""A sharded (fsdp) checkpoint is held to the checks a whole one is held to
(tests/test_checkpoint_trust.py): a shard cut short, deleted or with a damaged header is a
damaged checkpoint, named with the run's newest intact one and the command that resumes it.
One torchrun launch writes the run every test damages a copy of; the resumes run in this
process (one process reads the shards as DCP reshards them), where the process is not the
point."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import andrea_main, assert_user_error, config_file, run_torchrun, tiny_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from andrea.train.rundir import file_sha256, newest_intact, tiling_problem

SHARD = "shards/shard-00002-model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, data_dir) -> Path:
    """A 2-process fsdp run of 4 steps with checkpoints at steps 2 and 4. Never change it: copy
    it first (damaged_copy)."""
    folder = tmp_path_factory.mktemp("fsdp")
    cfg = tiny_config(folder / "runs", data_dir, "train.parallel=fsdp", "train.max_steps=4",
                      "train.checkpoint_every=2", "train.precision=fp32", name="f")
    proc = run_torchrun("train", "-c", str(config_file(cfg, folder)), "--no-progress")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return folder / "runs" / "f"


def damaged_copy(fsdp_run: Path, tmp_path: Path) -> Path:
    """A copy of the run under tmp_path/runs/f."""
    run = tmp_path / "runs" / "f"
    shutil.copytree(fsdp_run, run)
    return run


@pytest.mark.parametrize("damage, says", [
    ("truncated", f"{SHARD} is 748,"),
    ("deleted", f"{SHARD} is missing"),
    ("header", f"{SHARD} is unreadable: header length 1,152,921,504,606,846,976 bytes does not "
               "fit the file"),
], ids=["truncated", "deleted", "header"])
def test_a_damaged_shard_names_the_newest_intact_checkpoint(fsdp_run, tmp_path, damage, says):
    """Before: a shard cut short or deleted was refused only once the model was built, naming
    no checkpoint to resume from ('resume from another checkpoint'); one with a damaged header
    (and no checksums.json to find it) was a SafetensorError traceback; a torchrun restart
    took it as the newest intact one and `andrea runs` said nothing. Now, as for a damaged
    optimizer.safetensors: one line naming the newest intact checkpoint and the command that
    resumes it, which does."""
    run = damaged_copy(fsdp_run, tmp_path)
    shard = run / "step-000004" / SHARD
    if damage == "truncated":
        os.truncate(shard, shard.stat().st_size - 1000)
    elif damage == "deleted":
        shard.unlink()
    else:  # the file's size kept: a header length far past its end, no checksums to see it
        with open(shard, "r+b") as f:  # (a checkpoint written before them, or a stranger's)
            f.write(struct.pack("<Q", 2**60))
        (run / "step-000004" / "checksums.json").unlink()
    resume = ("train", "--resume", "runs/f", "--set", "train.max_steps=6")
    line = assert_user_error(andrea_main(*resume, cwd=tmp_path),
                             "runs/f: the latest checkpoint, step-000004, is damaged", says,
                             "the newest intact checkpoint is runs/f/step-000002: "
                             "andrea train --resume runs/f/step-000002")
    assert newest_intact(run, for_resume=True) == run / "step-000002"  # a torchrun restart's
    listed = andrea_main("runs", "runs/f", cwd=tmp_path)
    assert ("f: ! latest points to step-000004, which eval and generate open but a resume "
            f"cannot ({says}") in listed.stdout
    if damage == "deleted":
        command = shlex.split(line.split(": ")[-1])
        resumed = andrea_main(*command[1:], "--no-progress", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        assert "resuming from runs/f/step-000002" in resumed.stdout
        assert (run / "latest").read_text() == "step-000004\n"


def rewrite_header(shard: Path, edit) -> None:
    """Rewrite a shard's safetensors header with edit(header dict) applied, its tensor bytes
    kept, as a forged or damaged file has it."""
    blob = shard.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + length:])


def no_ln1_offsets(header: dict) -> None:
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    del info["blocks.0.ln1.weight"]
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)


def ln1_offsets_of_two_dimensions(header: dict) -> None:
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    info["blocks.0.ln1.weight"]["saved_offsets"] = [32, 0]
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)


@pytest.mark.parametrize("edit, says, way", [
    (lambda h: h["blocks.0.ln1.weight"].update(shape=[10**6]),
     f"{SHARD}: not a valid safetensors file (truncated or damaged?): Error while deserializing "
     "header: invalid shape", "the checkpoint is damaged: resume from another step folder"),
    (no_ln1_offsets, f"is damaged ({SHARD}: its metadata gives no offsets of some tensor "
                     "(DCP_SHARDING_INFO): damaged or forged)",
     "andrea train --resume runs/f/step-000002"),
    (ln1_offsets_of_two_dimensions, f"is damaged ({SHARD}: tensor 'blocks.0.ln1.weight' has "
                                    "offsets [32, 0] for its shape [32]: damaged or forged)",
     "andrea train --resume runs/f/step-000002"),
], ids=["shape", "offsets", "dimensions"])
def test_a_forged_shard_header_is_one_line(fsdp_run, tmp_path, edit, says, way):
    """A header whose length and offsets fit the file (so the checkpoint is intact as files go)
    but that safetensors or DCP refuses: a tensor's shape that is not its bytes, a slice
    without its offsets in DCP's metadata. Before, with no checksums.json to find it (a
    checkpoint written before them, or a stranger's): a SafetensorError or KeyError traceback.
    The offsets, read from the headers alone, make the checkpoint damaged to `andrea runs` and
    a restart's pick too, so the line names the checkpoint to resume from."""
    run = damaged_copy(fsdp_run, tmp_path)
    ckpt = run / "step-000004"
    rewrite_header(ckpt / SHARD, edit)
    index = json.loads((ckpt / "shards/index.json").read_text())
    index["files"][Path(SHARD).name] = (ckpt / SHARD).stat().st_size
    (ckpt / "shards/index.json").write_text(json.dumps(index))
    (ckpt / "checksums.json").unlink()
    assert_user_error(andrea_main("train", "--resume", "runs/f", "--set", "train.max_steps=6",
                                  cwd=tmp_path),
                      says, way)


@pytest.mark.parametrize("damage, says", [
    ("unlisted", "is damaged (shards/shard-00003-model-00001-of-00001.safetensors is not listed "
                 "in index.json, yet the shards' reader would load it"),
    ("unlisted and missing", "is damaged (shards: the slices of tensor "
                             "'blocks.0.attn.out.weight' hold 2,048 values of its 4,096 (a shard "
                             "missing, or one of another checkpoint)); the newest intact "
                             "checkpoint is runs/f/step-000002"),
], ids=["unlisted", "unlisted-and-missing"])
def test_shards_that_do_not_make_the_tensors_whole_are_refused(fsdp_run, tmp_path, damage, says):
    """torch.distributed.checkpoint reads every .safetensors file in shards/, listed or not, and
    leaves a slice it finds no bytes for as the model has it. Before, both resumed and trained
    silently: with step 2's copy of a shard beside step 4's (a copy merged into an older one),
    or on the fresh weights of the slices of a shard the index no longer lists (a checkpoint
    without checksums.json: an older or a stranger's)."""
    run = damaged_copy(fsdp_run, tmp_path)
    ckpt = run / "step-000004"
    if damage == "unlisted":
        shutil.copy(run / "step-000002" / SHARD,
                    ckpt / "shards/shard-00003-model-00001-of-00001.safetensors")
    else:
        first = "shard-00001-model-00001-of-00001.safetensors"
        (ckpt / "shards" / first).unlink()
        index = json.loads((ckpt / "shards/index.json").read_text())
        del index["files"][first]
        (ckpt / "shards/index.json").write_text(json.dumps(index))
        (ckpt / "checksums.json").unlink()
    assert_user_error(andrea_main("train", "--resume", "runs/f", "--set", "train.max_steps=6",
                                  cwd=tmp_path), says)


def moved_slice(header: dict) -> None:
    """Rank 1's rows of the token embedding (0 to 159 of 320) said to start at row 60: as many
    values as the tensor has and its whole extent, rows 160 to 219 held twice (rank 2 holds
    160 to 319) and 0 to 59 not at all."""
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    assert info["tok_emb.weight"] == {"saved_offsets": [0, 0]}
    info["tok_emb.weight"]["saved_offsets"] = [60, 0]
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)


def test_slices_that_overlap_and_leave_a_gap_are_refused(fsdp_run, tmp_path):
    """The shards' count of each tensor's values (above) passed slices that overlap by as much
    as they leave uncovered: DCP read the overlap from either and left the gap as the model's
    fresh weights, and the run trained on from them without a word (a checkpoint without
    checksums.json: an older one or a stranger's). Now the slices must tile the tensor: read
    from the shards' headers, so that `andrea runs` and a torchrun restart's pick call the
    checkpoint damaged too, and the resume names the one to resume from."""
    run = damaged_copy(fsdp_run, tmp_path)
    ckpt = run / "step-000004"
    first = ckpt / "shards/shard-00001-model-00001-of-00001.safetensors"
    rewrite_header(first, moved_slice)
    index = json.loads((ckpt / "shards/index.json").read_text())
    index["files"][first.name] = first.stat().st_size
    (ckpt / "shards/index.json").write_text(json.dumps(index))
    (ckpt / "checksums.json").unlink()
    assert_user_error(andrea_main("train", "--resume", "runs/f", "--set", "train.max_steps=6",
                                  cwd=tmp_path),
                      "runs/f: the latest checkpoint, step-000004, is damaged (shards: the "
                      "slices of tensor 'tok_emb.weight' at offsets [60, 0] and [160, 0] "
                      "overlap, which leaves part of it in no slice); the newest intact "
                      "checkpoint is runs/f/step-000002: andrea train --resume "
                      "runs/f/step-000002")
    assert not (run / "step-000006").exists()
    assert newest_intact(run, for_resume=True) == run / "step-000002"  # a torchrun restart's


@pytest.mark.parametrize("slices, shape, says", [
    ([((0, 0), (2, 4)), ((2, 0), (2, 4))], (4, 4), None),
    ([((0, 0), (4, 2)), ((0, 2), (2, 2)), ((2, 2), (2, 2))], (4, 4), None),  # columns, then rows
    ([((0, 0), (4, 2)), ((0, 2), (2, 2)), ((1, 2), (3, 2))], (4, 4),
     "hold 18 values of its 16 (a shard missing, or one of another checkpoint)"),
    ([((0, 0), (4, 2)), ((0, 2), (3, 2)), ((2, 2), (1, 2))], (4, 4),
     "at offsets [0, 2] and [2, 2] overlap, which leaves part of it in no slice"),
    ([((0,), (3,)), ((3,), (0,)), ((3,), (2,))], (5,), None),  # an empty slice overlaps nothing
    ([((0,), (3,)), ((3,), (3,))], (5,),
     "include one at offsets [3] of size [3], outside its shape [5]"),
    ([((), ())], (), None),
], ids=["rows", "blocks", "count", "overlap", "empty", "outside", "scalar"])
def test_slices_tile_a_tensor_exactly_once(slices, shape, says):
    """tiling_problem, which both the shards' header check and the load's ask: inside the
    tensor, as many values as it has, none overlapping another (a gap then follows)."""
    assert tiling_problem(slices, shape) == says


def rewrite_shard(ckpt: Path, edit) -> None:
    """Rewrite the checkpoint's second shard with edit(its tensors) applied, its DCP metadata
    kept, and record its size and sha256 as if written so: damage no checksum can see."""
    path = ckpt / SHARD
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata)
    index = json.loads((ckpt / "shards/index.json").read_text())
    index["files"][path.name] = path.stat().st_size
    (ckpt / "shards/index.json").write_text(json.dumps(index))
    record = json.loads((ckpt / "checksums.json").read_text())
    record["files"]["shards/index.json"] = file_sha256(ckpt / "shards/index.json")
    record["files"][SHARD] = file_sha256(path)
    (ckpt / "checksums.json").write_text(json.dumps(record))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_shards_of_weights_that_are_not_floating_point_are_refused(fsdp_run, tmp_path, dtype):
    """Before: DCP converted an integer or bool slice into the float weights silently, and the
    run trained on from a model that was never trained; now the line a whole checkpoint's
    weights of that type get (check_weights), naming the tensor and the shards."""
    run = damaged_copy(fsdp_run, tmp_path)
    rewrite_shard(run / "step-000004", lambda t: t.update(
        {"ln_f.weight": t["ln_f.weight"].to(dtype)}))
    kind = str(dtype).removeprefix("torch.")
    assert_user_error(andrea_main("train", "--resume", "runs/f", "--set", "train.max_steps=6",
                                  cwd=tmp_path),
                      f"runs/f/step-000004/shards: tensor 'ln_f.weight' is {kind}, not floating "
                      "point", "use another checkpoint (an earlier step of the run)")


def test_non_finite_weights_in_the_shards_are_every_ranks_one_line(fsdp_run, tmp_path):
    """Before: loaded, and the first step stopped on a NaN loss (`non-finite loss or gradient
    norm at step 5`, exit 1) as if the run had diverged; now refused where they are loaded, as
    a whole checkpoint's are: every rank sees the tensor whole (the check gathers it), so every
    rank says the same line and none waits for another. One process in this process, then two
    under torchrun."""
    run = damaged_copy(fsdp_run, tmp_path)
    rewrite_shard(run / "step-000004", lambda t: t["blocks.1.mlp.up.weight"][3, :2].fill_(
        float("nan")))
    says = ("runs/f/step-000004/shards: tensor 'blocks.1.mlp.up.weight' holds 2 NaN or "
            "infinite values (of 16,384): a diverged or damaged model; use another checkpoint")
    assert_user_error(andrea_main("train", "--resume", "runs/f", "--set", "train.max_steps=6",
                                  cwd=tmp_path), says)
    proc = run_torchrun("train", "--resume", str(run), "--set", "train.max_steps=6",
                        "--no-progress")
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    ours = proc.stderr[:proc.stderr.index("torch/distributed/elastic")].strip().splitlines()[:-1]
    assert [line.startswith("error: ") and says in line for line in ours] == [True, True], ours
    assert "Traceback" not in proc.stderr[:proc.stderr.index("torch/distributed/elastic")]


SHARDED_CHECK = """
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from andrea.errors import UserError
from andrea.train.checkpoint import check_sharded_weights

def gathered(self, *args, **kwargs):
    raise AssertionError("a weight gathered whole")

dist.init_process_group("gloo")
rank, mesh = dist.get_rank(), init_device_mesh("cpu", (2,))
DTensor.full_tensor = gathered
for case in ("clean", "rank 1's rows", "a row rank 1 has none of"):
    rows5, row1 = torch.zeros(5, 3), torch.zeros(1, 4)  # rows 0-2 on rank 0, 3-4 on rank 1
    if case == "rank 1's rows":
        rows5[4, :2] = float("nan")
    elif case == "a row rank 1 has none of":
        row1[0, 1], rows5[0, 0] = float("inf"), 1.0
    weights = {name: distribute_tensor(t, mesh, [Shard(0)])
               for name, t in (("rows5", rows5), ("row1", row1))}
    try:
        check_sharded_weights(weights, "shards", "use another")
        said = "nothing"
    except UserError as exc:
        said = str(exc)
    os.write(1, f"{rank} {case}: {said}\\n".encode())  # one write: the ranks share the pipe
dist.destroy_process_group()
"""


def test_the_sharded_weights_check_gathers_no_weight_and_every_rank_says_the_same(tmp_path):
    """The NaN and infinity check of a sharded resume gathered each weight whole on every rank
    (a 1.5B model's embedding: 0.2 GB more on each, for a check). Now each rank counts its own
    slice's and one all-reduce sums the counts: the same decision and the same line on every
    rank, with no weight gathered (DTensor.full_tensor fails here), also for a value on one
    rank's rows alone and for a tensor of fewer rows than ranks."""
    script = tmp_path / "check.py"
    script.write_text(SHARDED_CHECK)
    proc = run_torchrun(str(script), script=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = {"clean": "nothing",
            "rank 1's rows": "shards: tensor 'rows5' holds 2 NaN or infinite values (of 15): a "
                             "diverged or damaged model; use another",
            "a row rank 1 has none of": "shards: tensor 'row1' holds 1 NaN or infinite value "
                                        "(of 4): a diverged or damaged model; use another"}
    assert sorted(proc.stdout.splitlines()) == sorted(
        f"{rank} {case}: {line}" for rank in (0, 1) for case, line in said.items())


def test_a_damaged_model_file_of_a_sharded_checkpoint_is_refused_as_a_whole_ones_is(
    fsdp_run, tmp_path
):
    """An fsdp checkpoint holds its weights twice: in its shards, which a resume reads, and
    whole in model.safetensors, which eval, generate and export open. Before: a byte flipped in
    model.safetensors (its header still sound) resumed without a word, the resume reading
    that file's header alone, while eval refused the same checkpoint as damaged. Now the
    resume checks it against checksums.json, as a whole checkpoint's resume does: the one
    line eval gives, naming the newest other intact checkpoint, and nothing trained."""
    run = damaged_copy(fsdp_run, tmp_path)
    model = run / "step-000004" / "model.safetensors"
    blob = bytearray(model.read_bytes())
    blob[-1000] ^= 0xFF  # in the tensors' bytes: the header still reads
    model.write_bytes(bytes(blob))
    says = ("runs/f/step-000004/model.safetensors: damaged: its sha256 is not the one "
            "step-000004/checksums.json recorded when the checkpoint was written")
    assert_user_error(andrea_main("eval", "--checkpoint", "runs/f", cwd=tmp_path), says)
    assert_user_error(andrea_main("train", "--resume", "runs/f", "--set", "train.max_steps=6",
                                  "--no-progress", cwd=tmp_path),
                      says, "(the newest other intact one is runs/f/step-000002)")
    assert (run / "latest").read_text() == "step-000004\n"
    assert not (run / "step-000005").exists() and not (run / "step-000006").exists()
