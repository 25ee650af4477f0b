"""The conventions users bring to a command line: `--version`/`-V`, `-h` as `--help` on every
command, every option described and no value placeholder beside a flag, and every error, the
parser's own included, as one line on stderr with exit code 2. In-process (cheap) except one real
process for the exit code and stderr as a shell sees them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from conftest import assert_user_error, run_andrea
from typer.testing import CliRunner

import andrea
from andrea.cli import app, main


def all_commands() -> list[tuple[list[str], object]]:
    """(path, command) for the app, every command and every sub-command."""
    found, todo = [], [([], typer.main.get_command(app))]
    while todo:
        path, cmd = todo.pop()
        found.append((path, cmd))
        for name, sub in getattr(cmd, "commands", {}).items():
            todo.append(([*path, name], sub))
    return found


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    """`andrea ARGV` through the real entry point, in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out = capsys.readouterr()
    return exited.value.code, out.out, out.err


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(capsys, flag):
    assert run_main(capsys, flag) == (0, f"andrea {andrea.__version__}\n", "")


def test_every_command_takes_h_and_describes_every_option():
    commands = all_commands()
    assert len(commands) > 12  # the app, its verbs, config and its sub-commands
    runner = CliRunner()
    for path, cmd in commands:
        shown = runner.invoke(app, [*path, "-h"])
        assert shown.exit_code == 0 and "Usage: " in shown.output, (path, shown.output)
        ctx = typer.Context(cmd, info_name=" ".join(["andrea", *path]))
        for param in cmd.get_params(ctx):
            where = (path, param.name)
            assert (param.help or "").strip(), f"{where}: an option without a description"
            if param.param_type_name != "option":
                continue
            names = param.get_help_record(ctx)[0]
            # No type placeholder (<str>, <list[str]>): each value option names its value.
            assert "<" not in names, where
            if param.is_flag:  # only its spellings: "-V, --version", "--val / --no-val"
                words = names.replace(",", " ").replace(";", " ").replace(" / ", " ").split()
                assert all(w.startswith("-") for w in words), (where, names)


def test_train_help_spells_resume_as_the_readme_does(capsys):
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    spelled = re.search(r"\[--resume ([^\]]+)\]", readme)[1].replace("\\|", "|")
    assert spelled == "RUN|STEP_DIR|auto"
    code, out, _ = run_main(capsys, "train", "-h")
    assert code == 0 and f"--resume {spelled} " in out, out


def test_the_help_lists_what_the_registries_hold(capsys, monkeypatch):
    """`--input`, `--tokenizer`, `--task` and bench's lists are the registries' names, read when
    the help is shown: every input format (CSV and Arrow too), and a kind a registry gains."""
    from andrea import bench, tasks
    from andrea.data.readers import READERS
    from andrea.data.tokenizer import KINDS

    def shown(*argv: str) -> str:
        code, out, _ = run_main(capsys, *argv, "-h")
        assert code == 0
        return " ".join(out.split())

    prepare = shown("prepare")
    assert ("A file, directory, glob or datasets folder: text, JSON Lines, Parquet, CSV or Arrow "
            "(text, JSON Lines and CSV also .gz/.zst).") in prepare
    assert [r.title or r.kind for r in READERS] == ["text", "JSON Lines", "Parquet", "CSV", "Arrow"]
    assert "gpt2, bpe (default) or byte." in prepare and list(KINDS) == ["gpt2", "bpe", "byte"]
    monkeypatch.setitem(tasks.TASKS, "arc_easy", tasks.TASKS["arc"])
    assert "hellaswag, choice, lambada, arc or arc_easy, scored on the FILE" in shown("eval")
    monkeypatch.setattr(bench, "DTYPES", {**bench.DTYPES, "fp8": None})
    assert "--dtype bf16|fp32|fp16|fp8 bf16, fp32, fp16 or fp8 (repeatable" in shown("bench")


def modules_after(cwd: Path, commands: list[list[str]], modules: tuple[str, ...]
                  ) -> tuple[list[str], list[bool]]:
    """`andrea COMMAND` for each of `commands`, in order, in a fresh interpreter (start-up is
    the point), each ending with exit code 0: (the lines they printed, whether each of
    `modules` was imported by then)."""
    code = (f"import json, sys\nfrom andrea.cli import main\nfor argv in {commands!r}:\n"
            "    try:\n        main(argv)\n    except SystemExit as exc:\n"
            "        assert not exc.code, (argv, exc.code)\n"
            f"print(json.dumps([m in sys.modules for m in {list(modules)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    *printed, loaded = done.stdout.splitlines()
    return printed, json.loads(loaded)


def test_the_cli_starts_without_torch_or_numpy(tmp_path):
    """The help's lists come from registries that import torch and numpy; a start that shows no
    help (`andrea --version`) imports neither."""
    assert modules_after(tmp_path, [["--version"]], ("torch", "numpy"))[1] == [False, False]


def test_scoring_sampling_and_exchange_never_import_the_compiler(tmp_path, trained_tiny):
    """`andrea eval`, `generate`, `export` and `import` load and run the model without torch's
    compiler front end (dynamo: 1.4 s of a start, a third of it); a training imports it, through
    torch's optimizer and train.compile."""
    run, hf = tmp_path / "run", tmp_path / "hf"
    shutil.copytree(trained_tiny.run_dir, run)
    commands = [["eval", "--checkpoint", str(run), "--max-tokens", "512"],
                ["generate", "--checkpoint", str(run), "--prompt", "A", "-n", "4"],
                ["export", "--checkpoint", str(run), "--format", "hf", "--out", str(hf)],
                ["import", "--format", "hf", str(hf), "--out", str(tmp_path / "imported")]]
    loaded = modules_after(tmp_path, commands, ("torch._dynamo", "torch"))[1]
    assert (tmp_path / "imported" / "latest").is_file()
    assert loaded == [False, True]


def test_listing_runs_never_imports_torch(tmp_path, trained_tiny):
    """`andrea runs` reads JSON and YAML; it imported torch for a dtype table and two number
    formats (2.9 s a listing, 0.4 s without)."""
    shutil.copytree(trained_tiny.run_dir, tmp_path / "runs" / "t")
    listing, loaded = modules_after(tmp_path, [["runs", "--json"]], ("torch",))
    (run,) = json.loads("\n".join(listing))
    assert (run["name"], run["precision"], run["state"]) == ("t", "fp32", "finished")
    assert loaded == [False]


def test_preparing_an_input_never_imports_torch(tmp_path):
    """`andrea prepare --input` tokenizes text; it imported torch (for the registries a config
    is checked against, which --input loads none of): 238 MB and 3.5 s for a small file, 50 MB
    and 0.8 s without, and docs/data.md's peak memory per worker."""
    (tmp_path / "a.txt").write_text("some text to prepare, line by line.\n" * 200)
    command = ["prepare", "-i", "a.txt", "-t", "byte", "--out", "out"]
    assert modules_after(tmp_path, [command], ("torch",))[1] == [False]
    assert (tmp_path / "out" / "manifest.json").is_file()


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--stop-after", "0"], "'--stop-after'"),
    (["train", "--bogus"], "--bogus"),
    (["plot"], "Missing argument"),
    (["eval", "--split"], "--split"),
    (["generate", "--seed", "x"], "--seed"),
    (["config", "nope"], "nope"),
    (["count-params"], "--config"),
])
def test_parser_errors_are_one_line(capsys, argv, fragment):
    code, out, err = run_main(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, (argv, err)
    assert lines[0].startswith("error: ") and fragment in lines[0], (argv, err)


def test_a_parser_error_in_a_real_process_is_one_line_exit_2():
    line = assert_user_error(run_andrea("train", "--stop-after", "0"), "--stop-after")
    assert "andrea train --help" in line


def test_an_empty_config_is_an_error_naming_the_file_and_the_preset_meant(capsys, tmp_path):
    shadow, mine, defaults = (tmp_path / n for n in ("andrea-12m.yaml", "mine.yaml", "all.yaml"))
    shadow.write_text("")
    mine.write_text("# only a comment\n")
    defaults.write_text("{}\n")  # asks for every default in so many words
    code, _, err = run_main(capsys, "config", "show", "-c", str(shadow))
    assert code == 2 and err.startswith(f"error: {shadow}: the config file is empty")
    assert "--config andrea-12m," in err and len(err.splitlines()) == 1
    code, _, err = run_main(capsys, "config", "show", "-c", str(mine))
    assert code == 2 and f"{mine}: the config file is empty" in err and "andrea-tiny" in err
    code, out, _ = run_main(capsys, "config", "show", "-c", str(defaults))
    assert code == 0 and "name: all" in out


def test_resume_with_overwrite_is_refused(capsys):
    code, out, err = run_main(capsys, "train", "--resume", "auto", "--overwrite")
    assert (code, out) == (2, "") and err.startswith("error: --resume auto --overwrite: give one")


def test_prepare_input_takes_data_keys_by_set(capsys, tmp_path):
    import json

    records = tmp_path / "in.jsonl"
    records.write_text("".join(json.dumps({"body": f"record {i} " * 20}) + "\n"
                               for i in range(40)))
    out = tmp_path / "shards"
    code, _, err = run_main(capsys, "prepare", "--input", str(records), "--tokenizer", "byte",
                            "--workers", "1", "--out", str(out), "--set", "data.text_field=body",
                            "--set", "data.shard_tokens=1000", "--set", "data.val_fraction=0.25")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shard_tokens"] == 1000 and manifest["split"]["val_fraction"] == 0.25
    assert len(list(out.glob("train_*.bin"))) > 1  # cut at 1,000 tokens
    code, _, err = run_main(capsys, "prepare", "--input", str(records), "--set", "model.n_layer=2")
    assert code == 2 and "data keys only" in err and "--set model.n_layer=2" in err


def test_a_vocabulary_mismatch_names_the_set_that_fixes_it(capsys, tmp_path):
    code, _, err = run_main(capsys, "prepare", "--config", "andrea-12m", "--set",
                            "data.tokenizer=gpt2", "--out", str(tmp_path / "never"))
    assert code == 2 and "--set model.vocab_size=50257" in err, err
    assert not (tmp_path / "never").exists()


def test_the_help_has_no_typer_internals_nor_cut_phrases(capsys):
    """Before: `andrea -h` cut descriptions mid-phrase (`Count parameters by group (built on
    the meta device;...`), eval/plot/import showed `[[FILE]...]...`, `<list[str]>`, `{SRC}`."""
    for path, _ in all_commands():
        code, out, _ = run_main(capsys, *path, "-h")
        assert code == 0
        usage = out.splitlines()[0]
        assert "{" not in usage and "[[" not in usage, (path, usage)
        assert not re.search(r"<(str|int|float|bool|list\[\w+\])>", out), (path, out)
        listed = out.split("Commands:\n")[1].splitlines() if "Commands:\n" in out else []
        for line in filter(None, listed):
            assert not line.rstrip().endswith("..."), (path, line)
    usages = {name: run_main(capsys, *name.split(), "-h")[1].splitlines()[0]
              for name in ("eval", "plot", "import", "runs")}
    assert usages == {"eval": "Usage: andrea eval [OPTIONS] [FILE]...",
                      "plot": "Usage: andrea plot [OPTIONS] RUN...",
                      "import": "Usage: andrea import [OPTIONS] SRC",
                      "runs": "Usage: andrea runs [OPTIONS] [DIR]"}


def test_each_default_is_explained_first(capsys):
    """Before: generate's --precision explained auto first, its default being fp32."""
    _, out, _ = run_main(capsys, "generate", "-h")
    precision = " ".join(out.split("--precision")[1].split())
    assert precision.startswith("fp32|auto|bf16|fp16 fp32 (the default):"), precision
    _, out, _ = run_main(capsys, "eval", "-h")
    assert " ".join(out.split("--precision")[1].split()).startswith("auto|fp32|bf16|fp16 auto:")


@pytest.mark.parametrize("argv", [["--version"], ["-h"], []])
def test_the_cli_starts_without_torch_for_its_version_and_help(tmp_path, argv):
    """`andrea --version`, `andrea -h` and a bare `andrea` (its help) import neither torch nor
    numpy. A fresh interpreter: start-up is the point."""
    code = (f"import sys\nfrom andrea.cli import main\ntry:\n    main({argv!r})\n"
            "except SystemExit:\n    pass\nprint(sorted({'torch', 'numpy'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.stdout.splitlines()[-1] == "[]", done.stdout + done.stderr


def test_only_train_runs_under_torchrun_with_several_processes(tmp_path):
    """Any other verb started by torchrun would run once per process, each writing the same
    files at once: prepare's shards here. Refused in one line on each rank, nothing written;
    torchrun with one process is a plain start."""
    from conftest import andrea_main

    from andrea.train.torchrun import torchrun_env

    text = tmp_path / "in.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 200)
    prepare = ["prepare", "--input", str(text), "--tokenizer", "byte", "--workers", "1"]
    try:
        torchrun_env.cache_clear()
        proc = andrea_main(*prepare, "--out", str(tmp_path / "two"),
                           env={"WORLD_SIZE": "2", "RANK": "1"})
        assert_user_error(proc, "andrea prepare runs as one process", "rank 1 of 2",
                          "WORLD_SIZE=2", "without torchrun")
        assert not (tmp_path / "two").exists()
        torchrun_env.cache_clear()
        proc = andrea_main("runs", str(tmp_path), env={"WORLD_SIZE": "2"})
        assert_user_error(proc, "andrea runs runs as one process")
        torchrun_env.cache_clear()
        proc = andrea_main(*prepare, "--out", str(tmp_path / "one"),
                           env={"WORLD_SIZE": "1", "RANK": "0"})
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "one" / "manifest.json").is_file()
    finally:
        torchrun_env.cache_clear()
