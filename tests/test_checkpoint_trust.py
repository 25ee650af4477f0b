"""Checkpoints are untrusted input and a damaged one must not block the rest (issue 20, cases 4
and 5, checkpoint side), all through the real `andrea` command:

- a checkpoint (or an imported andrea.json) naming data.dir=<a folder of the user's> never makes
  eval, generate or import write or delete there; data is prepared under ./data instead;
- damaged or forged checkpoint files (a truncated or oversized safetensors header, a shard index
  leading out of shards/, a config asking for 10^6 layers) are one line, exit 2, nothing written;
- a damaged `latest` is named with the newest intact step and the command that uses it, a step
  folder is accepted by --checkpoint and --resume, and `andrea runs` says `damaged`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    Result,
    andrea_main,
    assert_user_error,
    config_file,
    fake_cgroup,
    make_checkpoint,
    python_command,
    tiny_config,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from andrea.config import load_config
from andrea.fileio import size_text
from andrea.model.params import closed_form_total
from andrea.train import memory
from andrea.train.rundir import checkpoint_problem

# The user's own files in a folder a forged checkpoint names as its data.dir: prepare's old
# clean-up deleted tokenizer.json and *.tmp and wrote shards beside them.
USER_FILES = {"tokenizer.json": '{"mine": true}', "draft.tmp": "half a thought",
              "main.py": "print('hi')\n"}


def snapshot(root: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under root, each file with its size and modification time: what 'nothing
    written' means. A folder's own time is left out: train's run lock is a file made and
    removed again (andrea/train/runlock.py), which touches its folder and writes nothing."""
    return {str(p.relative_to(root)): None if p.is_dir() else (p.stat().st_size,
                                                                p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def user_folder(root: Path) -> Path:
    folder = root / "precious"
    folder.mkdir(parents=True)
    for name, text in USER_FILES.items():
        (folder / name).write_text(text)
    return folder


def rewrite_metadata(ckpt: Path, edit) -> None:
    """Rewrite the checkpoint's model.safetensors with edit(config dict) applied to its config."""
    path = ckpt / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    config = json.loads(metadata["config"])
    edit(config)
    save_file(tensors, str(path), {**metadata, "config": json.dumps(config)})


def run_limited(*commands: list[str], cwd: Path, memory: int = 2_000_000_000) -> list[Result]:
    """Each of COMMANDS (`andrea ARGS` as a list of ARGS) through andrea.cli.main, one after the
    other in one process whose address space is capped at MEMORY bytes beyond what importing
    torch maps: a model of 10^6 layers built by mistake fails fast (MemoryError) instead of
    taking the machine's memory from everyone. (A CUDA build of torch maps more than 2 GB of
    libraries on import, a CPU build far less.)"""
    code = ("import contextlib, io, json, resource, sys\n"
            "import torch\n"
            "from andrea.cli import main\n"
            "mapped = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
            f"resource.setrlimit(resource.RLIMIT_AS, (mapped + {memory}, mapped + {memory}))\n"
            "results = []\n"
            f"for argv in {[list(c) for c in commands]!r}:\n"
            "    out, err = io.StringIO(), io.StringIO()\n"
            "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
            "        try:\n"
            "            main(argv)\n"
            "        except SystemExit as exited:\n"
            "            results.append([exited.code, out.getvalue(), err.getvalue()])\n"
            "print(json.dumps(results))\n")
    proc = subprocess.run(python_command("-c", code), cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [Result(*result) for result in json.loads(proc.stdout)]


# ----------------------------------------------------------------------------- case 4: data.dir


def test_a_checkpoint_naming_a_users_folder_never_writes_there(tmp_path):
    """eval and generate of a checkpoint whose data.dir is a folder of the user's: the data is
    prepared under ./data, the folder keeps every file as it was. The run's text is a small
    file of its own, not the preset's Shakespeare: what is prepared where is the point, and
    learning a BPE from all of Shakespeare took most of this test's time."""
    precious = user_folder(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("".join(f"Note {j}: the quick brown fox jumps over the lazy dog.\n"
                            for j in range(1500)))
    ckpt = make_checkpoint(tmp_path / "stranger", f"data.dir={precious}", f"data.source={text}")
    home = tmp_path / "home"
    home.mkdir()
    before = snapshot(precious)
    proc = andrea_main("eval", "--checkpoint", str(ckpt), "--max-tokens", "64", "--no-progress",
                       "--json", cwd=home)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["data_dir"] == "data/notes-byte"
    assert f"the run's data, {precious}, is not here (andrea writes a checkpoint's data only" \
        " under ./data)" in proc.stderr
    assert (home / "data/notes-byte/manifest.json").is_file()
    assert snapshot(precious) == before

    # generate of a BPE run: the tokenizer is looked for and prepared, again never in there.
    bpe = make_checkpoint(tmp_path / "stranger-bpe", f"data.dir={precious}",
                          f"data.source={text}", "data.tokenizer=bpe", "model.vocab_size=320",
                          tokenizer="bpe:0123abcd")
    proc = andrea_main("generate", "--checkpoint", str(bpe), "-n", "4", cwd=home)
    notice, error = proc.stderr.splitlines()  # the prepare under ./data, then no such BPE
    assert proc.returncode == 2 and notice.startswith("preparing data/notes-bpe-320 ")
    assert error.startswith("error: ") and "bpe:0123abcd" in error
    assert snapshot(precious) == before
    assert (home / "data/notes-bpe-320/manifest.json").is_file()


def test_an_imported_andrea_json_never_names_the_data_folder(tmp_path):
    """An export whose andrea.json names a folder of the user's (one that exists here) as its
    data.dir: import derives the run's own, and eval of the import writes only under ./data."""
    precious = user_folder(tmp_path)
    export = tmp_path / "export"
    proc = andrea_main("export", "--checkpoint", str(make_checkpoint(tmp_path / "src")),
                       "--out", str(export))
    assert proc.returncode == 0, proc.stderr
    andrea_json = json.loads((export / "andrea.json").read_text())
    andrea_json["config"]["data"]["dir"] = str(precious)
    (export / "andrea.json").write_text(json.dumps(andrea_json))
    home = tmp_path / "home"
    home.mkdir()
    before = snapshot(precious)
    assert andrea_main("import", str(export), cwd=home).returncode == 0
    assert load_config(home / "runs/export/config.yaml").data.dir == ""
    proc = andrea_main("eval", "--checkpoint", "runs/export", "--max-tokens", "64",
                       "--no-progress", cwd=home)
    assert proc.returncode == 0, proc.stderr
    assert " on data/shakespeare-byte (val split, " in proc.stdout
    assert snapshot(precious) == before


# ----------------------------------------------------------------------------- case 4: fuzzing


def _cut(blob: bytes) -> bytes:
    return blob[:5]


def _length_past_the_end(blob: bytes) -> bytes:
    return struct.pack("<Q", len(blob)) + blob[8:]


def _oversized(blob: bytes) -> bytes:
    return struct.pack("<Q", 2**62) + blob[8:]


def _data_cut(blob: bytes) -> bytes:
    return blob[:-10]


def _not_json(blob: bytes) -> bytes:
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[:8] + b"\xff" * n + blob[8 + n:]


DAMAGE = {"truncated": (_cut, "shorter than the 8-byte header length"),
          "length past the end": (_length_past_the_end, "does not fit the file"),
          "oversized header": (_oversized, "4,611,686,018,427,387,904 bytes does not fit"),
          "tensor data cut": (_data_cut, "the tensors need"),
          "header not JSON": (_not_json, "not JSON")}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_model_file_is_one_line_and_writes_nothing(tmp_path, data_dir, damage):
    """Every damage is found by checkpoint_problem, which every verb asks before it reads a
    checkpoint; on two of them, the verbs themselves say so in one line and write nothing."""
    mutate, says = DAMAGE[damage]
    ckpt = make_checkpoint(tmp_path, f"data.dir={data_dir}")
    path = ckpt / "model.safetensors"
    path.write_bytes(mutate(path.read_bytes()))
    assert says in (checkpoint_problem(ckpt) or ""), checkpoint_problem(ckpt)
    before = snapshot(tmp_path)
    verbs = []
    if damage in ("oversized header", "tensor data cut"):
        verbs += [("eval", "--checkpoint", str(ckpt)),
                  ("generate", "--checkpoint", str(ckpt.parent)),
                  ("train", "--resume", str(ckpt.parent))]
    for args in verbs:
        assert_user_error(andrea_main(*args, cwd=tmp_path), str(ckpt.name), "model.safetensors",
                          says)
        assert snapshot(tmp_path) == before, args


def test_a_damaged_hf_model_file_is_one_line_and_writes_nothing(tmp_path):
    export = tmp_path / "export"
    assert andrea_main("export", "--checkpoint", str(make_checkpoint(tmp_path / "src")),
                       "--out", str(export)).returncode == 0
    weights = export / "model.safetensors"
    blob = weights.read_bytes()
    for damage in ("truncated", "oversized header", "tensor data cut"):
        mutate, says = DAMAGE[damage]
        weights.write_bytes(mutate(blob))
        before = snapshot(tmp_path)
        assert_user_error(andrea_main("import", str(export), "--out", "runs/x", cwd=tmp_path),
                          str(weights), says)
        assert snapshot(tmp_path) == before


def test_a_config_asking_for_a_million_layers_is_refused_before_allocating(tmp_path):
    """The andrea checkpoint's metadata and an HF config.json alike: refused from the file's
    header in one line, under an address-space cap the old code blew through."""
    ckpt = make_checkpoint(tmp_path / "src")
    export = tmp_path / "export"
    assert andrea_main("export", "--checkpoint", str(ckpt), "--out", str(export)).returncode == 0
    rewrite_metadata(ckpt, lambda c: c["model"].update(n_layer=10**6))
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "n_layer": 10**6}))
    before = snapshot(tmp_path)
    *verbs, imported = run_limited(["eval", "--checkpoint", str(ckpt)],
                                   ["generate", "--checkpoint", str(ckpt)],
                                   ["import", str(export), "--out", "runs/x"], cwd=tmp_path)
    for result in verbs:
        assert_user_error(result, "n_layer 1000000 (the file holds 2 blocks)",
                          "no model is built")
    assert_user_error(imported, f"{export / 'config.json'}",
                      "n_layer 1000000 (the file holds 2 blocks)")
    assert snapshot(tmp_path) == before


@pytest.fixture(scope="module")
def too_big(tmp_path_factory, data_dir) -> dict:
    """The trainings of models too big and the resume of a config edited to 10^6 layers, each
    command in turn in one process capped at 500 MB of address space (run_limited): each is
    refused from sizes alone, so none leaves anything the next could read, and one process
    spares two starts of torch. The folder, the config file, the resume's checkpoint, its
    folder as it was before, and each command's Result by name."""
    folder = tmp_path_factory.mktemp("too-big")
    cfg = config_file(tiny_config(folder / "runs", data_dir), folder)
    ckpt = make_checkpoint(folder / "resume", "train.max_steps=10")
    config = ckpt.parent / "config.yaml"
    config.write_text(config.read_text().replace("n_layer: 2", "n_layer: 1000000"))
    before = snapshot(folder / "resume")
    commands = {
        "vocab": ["train", "-c", str(cfg), "--set", "model.vocab_size=1000000000"],
        "layers": ["train", "-c", str(cfg), "--set", "model.n_layer=100000"],
        "machine": ["train", "-c", str(cfg), "--set", "model.n_layer=1000000",
                    "--set", "train.max_steps=1"],
        "resume": ["train", "--resume", str(ckpt.parent)],
    }
    results = run_limited(*commands.values(), cwd=folder, memory=500_000_000)
    return {"folder": folder, "cfg": cfg, "ckpt": ckpt, "before": before,
            **dict(zip(commands, results, strict=True))}


def test_a_model_too_big_for_memory_is_one_line_naming_its_keys(too_big):
    """Before: a traceback ending in DefaultCPUAllocator's "can't allocate memory", exit 1."""
    for name, fragment in (("vocab", "64,000,102,720 parameters"),
                           ("layers", "model.n_layer 100000")):
        assert_user_error(too_big[name], fragment, "do not fit in this machine's memory",
                          "make the model smaller", "model.head_dim 16")
    assert not (too_big["folder"] / "runs" / "t").exists()


def test_a_model_too_big_for_the_machine_is_refused_before_it_is_built(too_big):
    """Before: model.n_layer 10^6 did not fail to build, it took memory without end (11 GB
    after a minute); only an address-space cap (as here) made it fail, after the allocations.
    Now its size is compared with the machine's memory before anything is allocated."""
    n = closed_form_total(load_config(str(too_big["cfg"]), ["model.n_layer=1000000"]).model)
    assert_user_error(too_big["machine"], f"model: {n:,} parameters ({size_text(16 * n)} of "
                      "float32 weights, gradients and AdamW's two moments) do not fit in this "
                      "machine's memory (", "make the model smaller (model.n_layer 1000000")
    assert not (too_big["folder"] / "runs" / "t").exists()


def test_the_bound_never_refuses_a_model_that_fits(monkeypatch):
    """The bytes counted are what training certainly holds: on the CPU float32 weights,
    gradients and the optimizer's state (Muon keeps one buffer where AdamW keeps two), on a GPU
    or sharded only the float32 weights built on the host first; against RAM and swap."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert memory.host_need(10, cpu, "adamw", sharded=False).needed == 160
    assert memory.host_need(10, cpu, "muon", sharded=False).needed == 120
    assert memory.host_need(10, cpu, "adamw", sharded=True).needed == 40
    assert memory.host_need(10, gpu, "adamw", sharded=False).needed == 40
    monkeypatch.setattr(memory, "machine_memory", lambda: 160)
    assert memory.host_need(10, cpu, "adamw", sharded=False).fits
    assert not memory.host_need(11, cpu, "adamw", sharded=False).fits
    monkeypatch.undo()
    assert memory.machine_memory() >= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("version", [2, 1])
def test_a_model_too_big_for_the_containers_limit_is_refused_naming_it(
        tmp_path, data_dir, monkeypatch, version):
    """In a container (`docker run --memory ...`) the kernel kills a process past the limit
    without a word, however much the machine has: the bound was the machine's RAM and swap
    alone, so such a model was built and the run killed. Now a container's limit, with the
    machine's swap, is the bound where it is less, and the line names it."""
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path / "cg")
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "cg" / "self-cgroup")
    meminfo = tmp_path / "meminfo"  # a 64 GiB machine with 16 MiB of swap
    meminfo.write_text("MemTotal: 67108864 kB\nMemAvailable: 60000000 kB\nSwapTotal: 16384 kB\n")
    monkeypatch.setattr(memory, "PROC_MEMINFO", meminfo)
    fake_cgroup(tmp_path / "cg", version, str(48 * 2**20), usage=0, cache=0)  # 48 MiB
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir), tmp_path)
    n = closed_form_total(load_config(str(cfg), ["model.n_layer=100"]).model)
    assert 64 * 2**20 < 16 * n < 2**30  # fits the machine, not the container and its swap
    result = andrea_main("train", "-c", str(cfg), "--set", "model.n_layer=100",
                         "--set", "train.max_steps=1")
    assert_user_error(result, f"model: {n:,} parameters ({size_text(16 * n)} of float32 "
                      "weights, gradients and AdamW's two moments) do not fit in this "
                      "container's memory limit (cgroup) (64.0 MiB)", "model.n_layer 100")
    assert not (tmp_path / "runs" / "t").exists()
    # Without a limit the machine's memory is the bound, as before.
    limit = tmp_path / "cg" / ("job/memory.max" if version == 2 else
                               "memory/memory.limit_in_bytes")
    limit.write_text("max\n" if version == 2 else f"{2**63 - 4096}\n")
    assert memory.memory_ceiling() == (64 * 2**30 + 16 * 2**20, "this machine's memory")


def test_a_resume_checks_the_runs_config_against_the_checkpoint_before_building(too_big):
    """Before: a run whose config.yaml was edited to model.n_layer 10^6 was resumed by building
    that model (the checkpoint's shapes were compared only once it existed); now the weights
    file's header is compared with the config first, and nothing is written."""
    ckpt = too_big["ckpt"]
    assert_user_error(too_big["resume"], f"{ckpt.parent / 'config.yaml'}: the config does not "
                      "describe the stored weights: n_layer 1000000 (the file holds 2 blocks)",
                      f"{ckpt / 'model.safetensors'} holds another model, so none is built")
    assert snapshot(too_big["folder"] / "resume") == too_big["before"]


@pytest.mark.parametrize("entry", ["../model.safetensors", "/etc/passwd"])
def test_a_shard_index_leading_out_of_shards_is_refused(tmp_path, data_dir, entry):
    """A sharded (fsdp) checkpoint's shards/index.json is untrusted: a name with '..' or an
    absolute path is refused by train --resume, naming it; nothing is written."""
    ckpt = make_checkpoint(tmp_path, f"data.dir={data_dir}")
    (ckpt / "shards").mkdir()
    # The size of the file the entry leads to, so only the name gives it away.
    target = (ckpt / "shards" / entry) if not entry.startswith("/") else Path(entry)
    size = target.stat().st_size if target.is_file() else 0
    (ckpt / "shards/index.json").write_text(json.dumps({"files": {entry: size}}))
    before = snapshot(tmp_path)
    assert_user_error(andrea_main("train", "--resume", str(ckpt.parent), cwd=tmp_path),
                      "index.json", repr(entry), "not a .safetensors file name inside shards/")
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- case 5: damage


def losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return {r["step"]: r["loss"] for r in records if r["event"] == "train"}


def test_a_damaged_latest_names_the_newest_intact_step_and_the_command(tmp_path, trained_tiny):
    run = tmp_path / "runs" / "x"
    shutil.copytree(trained_tiny.run_dir, run)
    (run / "step-000040" / "model.safetensors").unlink()
    intact = "runs/x/step-000020"
    for verb, use in (("eval", f"andrea eval --checkpoint {intact}"),
                      ("generate", f"andrea generate --checkpoint {intact}")):
        assert_user_error(andrea_main(verb, "--checkpoint", "runs/x", cwd=tmp_path),
                          "runs/x: the latest checkpoint, step-000040, is damaged",
                          "model.safetensors is missing", use)
    # Without --checkpoint: the most recent run is this one, damaged; never silently another.
    assert_user_error(andrea_main("eval", cwd=tmp_path), "step-000040, is damaged",
                      f"andrea eval --checkpoint {intact}")
    before = snapshot(tmp_path)
    assert_user_error(andrea_main("train", "--resume", "runs/x", cwd=tmp_path),
                      "step-000040, is damaged", f"andrea train --resume {intact}")
    assert snapshot(tmp_path) == before

    # The step folder works for eval, and --resume from it repeats the lost steps exactly.
    proc = andrea_main("eval", "--checkpoint", intact, "--max-tokens", "64", "--no-progress",
                       cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith(f"{intact} on "), proc.stderr
    proc = andrea_main("train", "--resume", intact, "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"resuming from {intact}" in proc.stdout
    assert (run / "latest").read_text().strip() == "step-000040"
    assert (run / "step-000040" / "model.safetensors").is_file()
    assert losses(run) == losses(trained_tiny.run_dir)  # steps 21..40 again, bit for bit

    # No `latest` at all: the run's checkpoints are still found and named.
    (run / "latest").unlink()
    assert_user_error(andrea_main("eval", "--checkpoint", "runs/x", cwd=tmp_path),
                      "runs/x: no usable 'latest' file",
                      "andrea eval --checkpoint runs/x/step-000040")


def test_the_resume_a_latest_naming_nothing_suggests_puts_it_right_in_a_finished_run(
        tmp_path, trained_tiny):
    """A finished run whose `latest` names a folder that is not there: the refusal's command
    (`--resume` of the newest intact step) had nothing to train and left `latest` as it was,
    so the run stayed damaged for eval, generate and `andrea runs`."""
    run = tmp_path / "runs" / "x"
    shutil.copytree(trained_tiny.run_dir, run)
    (run / "latest").write_text("step-000999\n")
    said = assert_user_error(andrea_main("train", "--resume", "runs/x", cwd=tmp_path),
                             "the folder does not exist")
    command = shlex.split(said.split(": ")[-1])
    assert command[:3] == ["andrea", "train", "--resume"]
    proc = andrea_main(*command[1:], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ("its 'latest' file, which named 'step-000999' (damaged or missing), now names "
            "step-000040") in proc.stdout
    assert (run / "latest").read_text() == "step-000040\n"
    assert andrea_main("eval", "--checkpoint", "runs/x", "--max-tokens", "64", "--no-progress",
                       cwd=tmp_path).returncode == 0
    # A resume of an older intact step than the newest leaves `latest` to the user.
    resume_20 = ("train", "--resume", "runs/x/step-000020", "--set", "train.max_steps=20")
    (run / "latest").write_text("step-000999\n")
    assert andrea_main(*resume_20, cwd=tmp_path).returncode == 0
    assert (run / "latest").read_text() == "step-000999\n"
    # A newest checkpoint that only a resume refuses (its optimizer state lost): step 20 is the
    # one a resume takes, and `latest` names step 40, which eval and generate still read ...
    (run / "step-000040" / "optimizer.safetensors").unlink()
    assert andrea_main(*resume_20, cwd=tmp_path).returncode == 0
    assert (run / "latest").read_text() == "step-000040\n"
    # ... and where it already does, it stays (a review found it moved back to step 20).
    assert andrea_main(*resume_20, cwd=tmp_path).returncode == 0
    assert (run / "latest").read_text() == "step-000040\n"


def test_runs_shows_a_damaged_run(tmp_path, trained_tiny):
    runs = tmp_path / "runs"
    for name in ("ok", "no-model", "no-latest", "no-state"):
        shutil.copytree(trained_tiny.run_dir, runs / name)
    (runs / "no-model" / "step-000040" / "model.safetensors").unlink()
    (runs / "no-latest" / "latest").unlink()
    (runs / "no-state" / "step-000040" / "trainer_state.json").write_text("{")
    proc = andrea_main("runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    states = {line.split()[0]: [w for w in line.split() if w in ("finished", "damaged")]
              for line in proc.stdout.splitlines()[1:5]}
    assert states == {"ok": ["finished"], "no-model": ["damaged"], "no-latest": ["damaged"],
                      "no-state": ["finished"]}
    # A checkpoint whose model opens but that --resume refuses: finished still, but said (it
    # was listed as any other), naming the checkpoint a resume takes.
    assert ("no-state: ! latest points to step-000040, which eval and generate open but a "
            "resume cannot (trainer_state.json is unreadable: ") in proc.stdout
    assert "the newest that resumes: step-000020" in proc.stdout
    assert ("no-model: ! latest points to step-000040, whose model.safetensors is missing; "
            "newest intact checkpoint: step-000020") in proc.stdout
    assert ("no-latest: ! no latest file naming the newest checkpoint; newest intact "
            "checkpoint: step-000040") in proc.stdout
    data = {r["name"]: r for r in json.loads(andrea_main("runs", "--json", cwd=tmp_path).stdout)}
    assert {n: (r["state"], r["intact_checkpoint"]) for n, r in data.items()} == {
        "ok": ("finished", None), "no-model": ("damaged", "step-000020"),
        "no-latest": ("damaged", "step-000040"), "no-state": ("finished", None)}


def test_a_trainer_state_that_parses_but_is_damaged_is_damaged_to_runs_and_restarts(
        tmp_path, trained_tiny):
    """A trainer_state.json that is JSON but not the one written (`{}`, a counter edited: its
    checksum differs) passed checkpoint_problem, which only parsed it: `andrea runs` showed the
    run `finished` with no note, and a torchrun restart took that checkpoint as the newest
    intact one, then failed on it in every restart. Now all of them ask the one test: runs
    notes it, --resume auto refuses naming the newest intact step, and a restart continues
    from that step, naming the checkpoint it passed over."""

    runs = tmp_path / "runs"
    for name in ("empty", "edited"):
        shutil.copytree(trained_tiny.run_dir, runs / name)
    (runs / "empty" / "step-000040" / "trainer_state.json").write_text("{}")
    edited = runs / "edited" / "step-000040" / "trainer_state.json"
    text = edited.read_text()
    assert '"tokens": 20480,' in text  # 40 steps of 512 tokens
    edited.write_text(text.replace('"tokens": 20480,', '"tokens": 20481,'))
    damage = ("trainer_state.json is damaged: its sha256 is not the one checksums.json recorded "
              "when it was written (a copy damaged on its way?)")

    proc = andrea_main("runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in ("empty", "edited"):
        assert (f"{name}: ! latest points to step-000040, which eval and generate open but a "
                f"resume cannot ({damage}); the newest that resumes: step-000020"
                ) in proc.stdout, proc.stdout
    # Without a checksum record (a checkpoint from before them) the content itself is judged.
    (runs / "empty" / "step-000040" / "checksums.json").unlink()
    assert checkpoint_problem(runs / "empty" / "step-000040", for_resume=True) == (
        "trainer_state.json is damaged: not a trainer state (no 'step')")

    auto = ("train", "-c", "runs/edited/config.yaml", "--set", "train.runs_dir=runs",
            "--set", "train.name=edited", "--resume", "auto", "--no-progress")
    before = snapshot(tmp_path)
    assert_user_error(andrea_main(*auto, cwd=tmp_path),
                      f"runs/edited: the latest checkpoint, step-000040, is damaged "
                      f"({damage})",
                      "andrea train --resume runs/edited/step-000020")
    assert snapshot(tmp_path) == before

    # A worker torchrun restarted: nobody is there to choose, so it takes step 20.
    proc = as_torchrun_restart(*auto, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (f"torchrun restart 1: continuing from runs/edited/step-000020, the run's newest "
            f"intact checkpoint; passed over step-000040, which 'latest' names: "
            f"{damage}\n") in proc.stdout, proc.stdout
    assert losses(runs / "edited") == losses(trained_tiny.run_dir)  # 21..40 again, the same
    assert checkpoint_problem(runs / "edited" / "step-000040", for_resume=True) is None


def as_torchrun_restart(*args: str, cwd: Path) -> Result:
    """`andrea ARGS` in this process as the first restart of a torchrun worker, the cached
    torchrun environment read afresh before and after."""
    from andrea.train import restarts, torchrun

    try:
        torchrun.torchrun_env.cache_clear()
        restarts.attempt.cache_clear()
        return andrea_main(*args, cwd=cwd, env={"TORCHELASTIC_RESTART_COUNT": "1"})
    finally:
        torchrun.torchrun_env.cache_clear()
        restarts.attempt.cache_clear()


def flip_a_byte(path: Path) -> None:
    """A copy damaged on its way: one byte of the tensors' data, every header still sound."""
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0x01
    path.write_bytes(bytes(blob))


def test_a_flipped_byte_is_passed_over_by_a_torchrun_restart(tmp_path, trained_tiny):
    """A byte flipped in the newest checkpoint's optimizer state keeps every header sound, so
    checkpoint_problem, which reads files and headers, calls it intact; only its checksum
    differs. Before: a torchrun restart picked it as the newest intact checkpoint, its load
    refused it (exit 2), and torchrun restarted onto it again until no restart was left. Now
    a restart verifies the checksums of the one it picks and continues from the newest that
    verifies, naming the one it passed over; a first launch is still refused in one line
    naming the file and the checkpoint to use, nothing written."""

    run = tmp_path / "runs" / "x"
    shutil.copytree(trained_tiny.run_dir, run)
    flip_a_byte(run / "step-000040" / "optimizer.safetensors")
    auto = ("train", "-c", "runs/x/config.yaml", "--set", "train.runs_dir=runs",
            "--set", "train.name=x", "--resume", "auto", "--no-progress")
    before = snapshot(tmp_path)
    assert_user_error(andrea_main(*auto, "--set", "train.max_steps=41", cwd=tmp_path),
                      "runs/x/step-000040/optimizer.safetensors: damaged: its sha256",
                      "(the newest other intact one is runs/x/step-000020)")
    assert snapshot(tmp_path) == before

    # A worker torchrun restarted: nobody is there to choose, so it takes step 20.
    proc = as_torchrun_restart(*auto, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ("torchrun restart 1: continuing from runs/x/step-000020, the run's newest intact "
            "checkpoint; passed over step-000040, which 'latest' names: optimizer.safetensors "
            "is damaged: its sha256 is not the one checksums.json recorded when it was written "
            "(a copy damaged on its way?)\n") in proc.stdout, proc.stdout
    assert losses(run) == losses(trained_tiny.run_dir)  # 21..40 again, the same
    assert checkpoint_problem(run / "step-000040", for_resume=True, verify=True) is None


def test_runs_verify_finds_a_flipped_byte_that_headers_do_not_show(tmp_path, trained_tiny):
    """`andrea runs` reads files and headers, never hashes (seconds a GB, every run of a
    listing): a byte flipped in a checkpoint's tensors is not its to see. Before, nothing
    short of loading the checkpoint found it; now `andrea runs --verify` hashes each latest
    checkpoint against its checksums.json: an optimizer state that differs is the `!` note of
    a checkpoint a resume refuses, a model file that differs a damaged run."""
    runs = tmp_path / "runs"
    for name in ("model", "optimizer"):
        shutil.copytree(trained_tiny.run_dir, runs / name)
        flip_a_byte(runs / name / "step-000040" / f"{name}.safetensors")
    plain = andrea_main("runs", cwd=tmp_path)
    assert plain.returncode == 0 and "notes:" not in plain.stdout, plain.stdout
    listed = andrea_main("runs", "--verify", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    damage = ("is damaged: its sha256 is not the one checksums.json recorded when it was "
              "written (a copy damaged on its way?)")
    assert ("optimizer: ! latest points to step-000040, which eval and generate open but a "
            f"resume cannot (optimizer.safetensors {damage}); the newest that resumes: "
            "step-000020") in listed.stdout, listed.stdout
    assert (f"model: ! latest points to step-000040, whose model.safetensors {damage}; newest "
            "intact checkpoint: step-000020") in listed.stdout, listed.stdout
    data = json.loads(andrea_main("runs", "--verify", "--json", cwd=tmp_path).stdout)
    assert {r["name"]: (r["state"], r["intact_checkpoint"]) for r in data} == {
        "model": ("damaged", "step-000020"), "optimizer": ("finished", None)}


def test_a_checkpoint_pruned_between_latest_and_its_files_says_so(tmp_path, trained_tiny):
    """A live training with train.keep_last prunes the checkpoint `latest` named a moment
    before: once in some 30 reads a user's generate called it "missing; the checkpoint is
    incomplete", a damaged checkpoint, and it was whole when pruned."""
    from andrea.errors import UserError
    from andrea.train.checkpoint import read_model_checkpoint
    from andrea.train.rundir import resolve_checkpoint

    run = shutil.copytree(trained_tiny.run_dir, tmp_path / "x")
    ckpt = resolve_checkpoint(run)
    shutil.rmtree(ckpt)  # what the training's prune did meanwhile
    with pytest.raises(UserError, match="removed while being read .* run the command again"):
        read_model_checkpoint(ckpt)


def test_a_checkpoint_read_while_it_is_pruned_is_gone_never_half_deleted(
        tmp_path, trained_tiny, monkeypatch):
    """The prune deleted a checkpoint folder in place, file by file: `eval --all-steps` reading
    the run meanwhile found the folder without its model file and called the checkpoint
    "missing; the checkpoint is incomplete", a damaged one. Now the folder is taken out of the
    run first (renamed), so a reader finds it gone and says so; a crash while deleting leaves
    only a .stale- folder, which the next training removes."""
    from andrea.errors import UserError
    from andrea.train import rundir
    from andrea.train.checkpoint import read_model_checkpoint

    run = shutil.copytree(trained_tiny.run_dir, tmp_path / "x")
    oldest = rundir.step_dirs(run)[0]
    said: list[str] = []
    delete = shutil.rmtree

    def reader_mid_deletion(folder, *args, **kwargs):
        (Path(folder) / "model.safetensors").unlink()  # the deletion half done
        with pytest.raises(UserError) as exc:
            read_model_checkpoint(oldest)
        said.append(str(exc.value))
        raise OSError("killed while deleting")

    monkeypatch.setattr(rundir.shutil, "rmtree", reader_mid_deletion)
    with contextlib.suppress(OSError):
        rundir.prune_checkpoints(run, keep_last=1)
    monkeypatch.setattr(rundir.shutil, "rmtree", delete)
    assert len(said) == 1 and "removed while being read" in said[0], said
    assert not oldest.exists() and [p.name for p in rundir.step_dirs(run)] == ["step-000040"]
    rundir.clean_partials(run)
    assert sorted(p.name for p in run.glob("step-*")) == ["step-000040"]


# ----------------------------------------------------------------------------- weights' values


def rewrite_model_file(ckpt: Path, tensors=None, metadata=None) -> None:
    """Rewrite the checkpoint's model.safetensors, `tensors` and `metadata` (each edits its
    dict in place) applied, and its sha256 in checksums.json with it: a forged file, which the
    checksums cannot tell from a sound one."""
    from andrea.train.rundir import file_sha256

    path = ckpt / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        stored = f.metadata()
    weights = load_file(str(path))
    (tensors or (lambda t: None))(weights)
    (metadata or (lambda m: None))(stored)
    save_file(weights, str(path), stored)
    record = json.loads((ckpt / "checksums.json").read_text())
    record["files"]["model.safetensors"] = file_sha256(path)
    (ckpt / "checksums.json").write_text(json.dumps(record))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_where_they_are_loaded(tmp_path, data_dir, value):
    """Before: generate's traceback `RuntimeError: probability tensor contains either inf,
    nan`, and eval a NaN loss; now one line naming the tensor and the file."""
    ckpt = make_checkpoint(tmp_path, f"data.dir={data_dir}")
    rewrite_model_file(ckpt, tensors=lambda t: t["blocks.1.mlp.up.weight"][3, :2].fill_(value))
    for args in (("generate", "--checkpoint", str(ckpt), "-n", "4"),
                 ("eval", "--checkpoint", str(ckpt), "--max-tokens", "64", "--no-progress")):
        assert_user_error(andrea_main(*args, cwd=tmp_path), str(ckpt / "model.safetensors"),
                          "tensor 'blocks.1.mlp.up.weight' holds 2 NaN or infinite values",
                          "use another checkpoint")


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8])
def test_weights_that_are_not_floating_point_are_refused(tmp_path, dtype):
    """Before: an integer or bool tensor was converted silently, and generate sampled from a
    model that was never trained; now one line naming the tensor, its type and the file.
    Another floating width (bfloat16 here) loads, converted, as before."""
    ckpt = make_checkpoint(tmp_path)
    rewrite_model_file(ckpt, tensors=lambda t: t.update(
        {"ln_f.weight": t["ln_f.weight"].to(dtype), "pos_emb.weight":
         t["pos_emb.weight"].to(torch.bfloat16)}))
    kind = str(dtype).removeprefix("torch.")
    assert_user_error(andrea_main("generate", "--checkpoint", str(ckpt), "-n", "4",
                                  cwd=tmp_path), str(ckpt / "model.safetensors"),
                      f"tensor 'ln_f.weight' is {kind}, not floating point")
    rewrite_model_file(ckpt, tensors=lambda t: t.update(
        {"ln_f.weight": t["ln_f.weight"].to(torch.float32)}))
    proc = andrea_main("generate", "--checkpoint", str(ckpt), "-n", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("step", ["abc", "-5", "", "1.5", "²"])
def test_a_step_in_the_metadata_that_is_no_step_is_refused(tmp_path, step):
    """Before: export's `ValueError: invalid literal for int()` traceback for "abc", and "-5"
    exported as step -5; now one line naming the file and the value, where the checkpoint's
    metadata is read (so generate and eval too)."""
    ckpt = make_checkpoint(tmp_path)
    rewrite_model_file(ckpt, metadata=lambda m: m.update(step=step))
    for args in (("export", "--checkpoint", str(ckpt), "--out", "hf"),
                 ("generate", "--checkpoint", str(ckpt), "-n", "4")):
        assert_user_error(andrea_main(*args, cwd=tmp_path), str(ckpt / "model.safetensors"),
                          f"the step in the metadata is {step!r}, not a whole number")
    assert not (tmp_path / "hf").exists()


class PowerLoss:
    """What a power loss leaves of the files a process writes, as POSIX promises it: a file's
    bytes as of its last fsync, a folder's entries as of the folder's last fsync, nothing
    else. `fsync` stands in for os.fsync and records the disk after every call: the states a
    power loss may leave (between two fsyncs nothing more becomes durable). Every inode it sees
    is held open to the end, so none is reused under another file."""

    def __init__(self, fsync) -> None:
        self.real_fsync = fsync
        self.contents: dict[int, bytes] = {}  # inode -> its bytes at its last fsync
        self.entries: dict[int, dict[str, tuple[int, bool]]] = {}  # folder -> name: inode, folder?
        self.states: list[tuple[dict, dict]] = []
        self.held: list[int] = []

    def fsync(self, fd: int) -> None:
        self.real_fsync(fd)
        info = os.fstat(fd)
        self.held.append(os.dup(fd))
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            found = {}
            for name in os.listdir(fd):
                entry = os.stat(name, dir_fd=fd, follow_symlinks=False)
                self.held.append(os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=fd))
                found[name] = (entry.st_ino, os.path.stat.S_ISDIR(entry.st_mode))
            self.entries[info.st_ino] = found
        else:
            with open(f"/proc/self/fd/{fd}", "rb") as f:  # opened for writing alone
                self.contents[info.st_ino] = f.read()
        self.states.append((dict(self.contents), dict(self.entries)))

    def leave(self, state: tuple[dict, dict], folder: int, out: Path) -> None:
        """Write into `out` what state left of `folder` (an inode): a name whose bytes were
        never made durable is an empty file, a folder never fsynced an empty folder."""
        contents, entries = state
        out.mkdir(parents=True)
        for name, (inode, is_dir) in entries.get(folder, {}).items():
            if is_dir:
                self.leave(state, inode, out / name)
            else:
                (out / name).write_bytes(contents.get(inode, b""))

    def close(self) -> None:
        for fd in self.held:
            os.close(fd)


def test_a_power_loss_at_any_moment_leaves_latest_naming_a_whole_checkpoint(
        tmp_path, data_dir, monkeypatch):
    """`latest` is moved to a checkpoint only once every byte of it is on the disk, and a
    checkpoint's files are renamed into their folder whole: whenever the power goes while a
    run checkpoints (at each fsync: nothing becomes durable in between), the run as the disk
    keeps it resumes from the newest checkpoint that was whole, its files checked against
    checksums.json; never a `latest` naming a folder that is not there, or files that are
    empty or cut short."""
    from andrea.train import checkpoint as ckpt_io
    from andrea.train.loop import train
    from andrea.train.rundir import read_latest, resolve_checkpoint

    disk = PowerLoss(os.fsync)
    monkeypatch.setattr(os, "fsync", disk.fsync)
    try:
        cfg = tiny_config(tmp_path / "runs", data_dir, "train.max_steps=3",
                          "train.checkpoint_every=1", "train.keep_last=2")
        result = train(cfg, progress=False)
        run = os.stat(result.run_dir).st_ino
        steps = []
        for k, state in enumerate(disk.states):
            left = tmp_path / "left" / str(k)
            disk.leave(state, run, left)
            if not (left / "latest").exists():  # no checkpoint on the disk yet
                assert not steps, f"power loss {k}: the run lost its checkpoints"
                continue
            ckpt = resolve_checkpoint(left, use="{}", for_resume=True)
            assert ckpt == read_latest(left), f"power loss {k}"
            for name in (ckpt_io.MODEL_FILE, ckpt_io.OPTIMIZER_FILE, ckpt_io.RNG_FILE):
                ckpt_io.read_safetensors(ckpt / name)  # its bytes as checksums.json has them
            state_read, _ = ckpt_io.read_trainer_state(ckpt)
            assert ckpt.name == f"step-{state_read.step:06d}"
            steps.append(state_read.step)
    finally:
        disk.close()
    assert steps == sorted(steps) and set(steps) == {1, 2, 3}, steps


def test_a_latest_leading_out_of_its_run_is_never_followed(tmp_path, trained_tiny):
    """`latest` names a step folder of its own run, nothing else: one edited or forged to lead
    elsewhere (../y/step-000040, another run's intact checkpoint) is refused as unusable, naming
    the run's own newest intact step, never evaluated or sampled as if it were the run's."""
    for name in ("x", "y"):
        shutil.copytree(trained_tiny.run_dir, tmp_path / "runs" / name)
    (tmp_path / "runs" / "x" / "latest").write_text("../y/step-000040\n")
    for verb in ("eval", "generate"):
        assert_user_error(andrea_main(verb, "--checkpoint", "runs/x", cwd=tmp_path),
                          "runs/x: no usable 'latest' file",
                          f"andrea {verb} --checkpoint runs/x/step-000040")
