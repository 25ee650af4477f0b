"""scripts/gpu_speed.py and scripts/reference_gpt.py, the GPU speed call, checked on the CPU:
every part's settings load (so a misspelt key is found here, not on the GPU), the reference is
ANDREA-120M's model, and train.compile's auto decides as documented."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script

from andrea.config import load_config
from andrea.model.params import count_params
from andrea.train.compiled import choose_compile
from andrea.train.torchrun import DistInfo


@pytest.mark.parametrize("dry", [False, True])
def test_every_part_loads_its_config(tmp_path: Path, dry: bool) -> None:
    speed = load_script("gpu_speed")
    for name, _budget in speed.PARTS:
        command, env = speed.part_command(name, tmp_path, tmp_path, dry)
        if name == "reference":
            assert command[-1] == "--dry-run" if dry else command[-2] == "--json"
            continue
        preset = command[command.index("--preset") + 1]
        sets = command[command.index("--set") + 1:]
        cfg = load_config(preset, sets)  # a bad key or value is a UserError here
        assert cfg.train.runs_dir == str(tmp_path / "runs"), name
        if name in ("ddp", "fsdp"):
            assert env["ANDREA_PROCESS_GROUP_OF_ONE"] == "1"
            assert cfg.train.parallel == name
        assert (cfg.model.attention == "cuda") == (name.endswith("-cuda") and not dry), name


def test_the_resume_part_resumes_in_a_dry_run(tmp_path: Path) -> None:
    """The resume part (and fsdp's, which resumes ddp's run) pass --resume to --run-andrea,
    which must not ask train() to overwrite the run as well (it refuses the pair)."""
    speed = load_script("gpu_speed")
    command, env = speed.part_command("resume", tmp_path, tmp_path, True)
    proc = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, **env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "resume.json").read_text())["identical"] is True


def test_a_call_runs_the_parts_it_names_in_their_order(tmp_path: Path, monkeypatch) -> None:
    """`--parts` runs those parts only, in PARTS' order; a part that does not exist is one line
    naming it and the parts there are, exit code 2."""
    speed = load_script("gpu_speed")
    ran: list[str] = []

    def run(command, **kwargs):
        if isinstance(command, list):  # a part: its name is its --json file's
            ran.append(Path(command[command.index("--json") + 1]).stem)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(speed.subprocess, "run", run)
    monkeypatch.setattr(speed, "install_wheels", lambda work, outdir: "")
    monkeypatch.setattr(speed, "print_table", lambda results, rows: None)
    assert speed.run_parts(tmp_path, True, names=["12m-cuda", "12m"]) == 0
    assert ran == ["12m", "12m-cuda"]
    monkeypatch.setattr(sys, "argv", ["gpu_speed.py", str(tmp_path), "--parts", "12m,13m"])
    with pytest.raises(SystemExit) as stop:
        speed.main()
    assert stop.value.code == 2


def test_the_reference_is_andrea_120m() -> None:
    """The yardstick trains the same model: ANDREA-120M's exact parameter count."""
    reference = load_script("reference_gpt")
    with torch.device("meta"):
        model = reference.GPT()
    cfg = load_config("andrea-120m").model
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total == 124_373_760


def test_an_unwritable_cache_folder_compiles_in_torchs_own(tmp_path, monkeypatch) -> None:
    """A read-only home (some clusters) or a user with none: inductor's cache goes to torch's own
    folder, and the plan's compile line says why and what to set. It was inductor's traceback
    from the first compiled call (train.compile is on by default on one GPU)."""
    from pathlib import Path as PathType

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from andrea.train import compiled

    (tmp_path / "file").write_text("")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "file" / "cache"))  # cannot be made
    assert compiled.inductor_cache()[0] == default_cache_dir()
    line = compiled.compile_line("default", "asked for")
    assert f"inductor's cache ({default_cache_dir()}, torch's own: andrea's could not be " \
           f"written ([Errno 20] Not a directory: " in line
    assert "set ANDREA_CACHE_DIR to a writable folder" in line

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.delenv("ANDREA_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home() -> PathType:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(PathType, "home", no_home)
    assert compiled.inductor_cache()[0] == default_cache_dir()

    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "ours"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    # Writable: ours, and no reason given.
    assert compiled.inductor_cache() == (str(tmp_path / "ours" / "inductor"), None)
    assert "torch's own" not in compiled.compile_line("default", "asked for")


def test_compile_auto_is_one_cuda_process_only() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    one, two = DistInfo(), DistInfo(0, 0, 2, 2)
    assert choose_compile("auto", "default", cuda, one)[0] == "default"
    assert choose_compile("auto", "default", cpu, one) == (None, "auto: not on cpu")
    assert choose_compile("auto", "default", cuda, two)[0] is None
    assert choose_compile("auto", "default", cuda, DistInfo(group_of_one=True))[0] is None
    assert choose_compile(True, "default", cpu, two)[0] == "default"  # obeyed anywhere
    assert choose_compile(False, "reduce-overhead", cuda, one)[0] is None


def test_cuda_graphs_are_for_one_process_on_a_gpu() -> None:
    """reduce-overhead (the 12M preset's) where it was measured, one CUDA process; the default
    mode elsewhere, saying why, so a CPU run of the preset is what it was."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_compile("auto", "reduce-overhead", cuda, DistInfo()) == (
        "reduce-overhead", "auto: one CUDA process")
    mode, why = choose_compile(True, "reduce-overhead", cpu, DistInfo())
    assert mode == "default" and "CUDA graphs are for one process on a GPU" in why
    assert choose_compile(True, "reduce-overhead", cuda, DistInfo(0, 0, 2, 2))[0] == "default"
    assert choose_compile("auto", "reduce-overhead", cpu, DistInfo())[0] is None
    assert load_config("andrea-12m").train.compile_mode == "reduce-overhead"


def test_the_table_says_whether_the_same_120m_run_repeated_its_bits() -> None:
    """120m and 120m-warm train the same config and seed: the H100's ended at 8.971827 and
    8.971814, a step whose bits do not repeat; the table's last line says so."""
    speed = load_script("gpu_speed")
    same = speed.repeat_line({"120m": {"last_loss": 8.5}, "120m-warm": {"last_loss": 8.5}})
    assert same is not None and same.endswith("the same bits")
    differ = speed.repeat_line({"120m": {"last_loss": 8.971826553344727},
                                "120m-warm": {"last_loss": 8.971814155578613}})
    assert differ is not None and "DIFFER" in differ
    assert speed.repeat_line({"120m": {"last_loss": 8.5}, "120m-warm": None}) is None
