"""A non-editable install ships the presets and kernels and works from any directory."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from conftest import REPO, andrea_main

from andrea.cuda.launch import kernel_source


def test_wheel_ships_configs_and_kernels_and_runs_elsewhere(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(dist)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = dist.glob("andrea-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for preset in ("andrea-12m.yaml", "andrea-120m.yaml"):
        assert f"andrea/configs/{preset}" in names
    kernels = {f"andrea/kernels/{p.relative_to(REPO / 'kernels').as_posix()}"
               for p in (REPO / "kernels").rglob("*") if p.is_file()}
    assert "andrea/kernels/microgpt_cuda.cu" in kernels and kernels <= set(names)  # its parts too
    # Every module of the package, subpackages included: a .gitignore pattern once kept
    # andrea/data/ out of the wheel (hatchling leaves out what git ignores).
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "andrea").rglob("*.py")}
    assert modules <= set(names), sorted(modules - set(names))
    assert "andrea/kernels/cpu/cuda_emulator.h" in names

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, text=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PYTHONPATH": str(target), "PATH": f"{target / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    where = subprocess.run(
        [sys.executable, "-c", "import andrea, andrea.resources as r; "
         "from andrea.cuda.launch import kernel_source; "
         "print(andrea.__file__); print(r.configs_dir()); print(len(kernel_source()))"],
        cwd=elsewhere, env={**os.environ, **env}, capture_output=True, text=True, check=True,
    ).stdout.split()
    assert where[0].startswith(str(target)), where  # the installed copy, not the checkout
    assert where[1] == str(target / "andrea" / "configs")
    assert int(where[2]) == len(kernel_source())  # the installed parts, written in place
    proc = subprocess.run(
        [str(target / "bin" / "andrea"), "count-params", "--config", "andrea-12m.yaml"],
        cwd=elsewhere, env={**os.environ, **env}, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "12,292,992" in proc.stdout


def test_help_lists_the_verbs():
    proc = andrea_main("--help")
    assert proc.returncode == 0
    verbs = ("train", "eval", "generate", "count-params", "prepare", "export", "import",
             "bench", "runs", "plot", "config")
    for verb in verbs:
        assert verb in proc.stdout
