"""Config loading: presets, overrides, and every error class through the real command."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import textwrap

import pytest
import yaml
from conftest import REPO, andrea_main, assert_user_error

from andrea.config import PRECISIONS, SECTIONS, TrainConfig, key_spec, key_specs, load_config
from andrea.config.declare import ResumeChange, key, section_keys
from andrea.config.reference import REGENERATE, default_text, keys_markdown
from andrea.errors import UserError
from andrea.train import optim, parallel  # noqa: F401  (their registries: keys' allowed values)
from andrea.train.resume import check_resume_changes


def write(tmp_path, text: str):
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_presets_match_design_table():
    small = load_config("andrea-12m.yaml").model
    assert (small.n_layer, small.n_head, small.head_dim, small.d_model) == (6, 12, 32, 384)
    assert (small.block_size, small.vocab_size) == (256, 4096)
    big = load_config("andrea-120m").model  # the .yaml suffix is optional
    assert (big.n_layer, big.n_head, big.head_dim, big.d_model) == (12, 12, 64, 768)
    assert (big.block_size, big.vocab_size) == (1024, 50304)
    assert load_config("andrea-120m").data.tokenizer == "gpt2"


def test_overrides_are_typed_and_applied():
    cfg = load_config("andrea-12m", ["train.lr=3e-4", "model.n_layer=4", "train.compile=true"])
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.model.n_layer == 4
    assert cfg.train.compile is True
    with pytest.raises(UserError, match="model.n_layer: expected an integer"):
        load_config("andrea-12m", ["model.n_layer=four"])


def test_path_and_d_model_derivation(tmp_path):
    path = write(tmp_path, "model: {n_head: 2, head_dim: 8, d_model: 16}\n")
    cfg = load_config(str(path))
    assert cfg.model.d_model == 16
    assert cfg.train.name == "cfg"  # run name defaults to the file's stem
    # Emptied by --set too, as docs/config.md says; before, the run was train.runs_dir itself.
    assert load_config(str(path), ["train.name="]).train.name == "cfg"
    assert load_config("andrea-tiny", ["train.name="]).train.name == "andrea-tiny"


def test_values_at_the_edges_of_their_rules_are_taken():
    """min_lr equal to lr (a constant rate after warm-up); a --set value holding '=' is the
    value. Mutation round 3: min_lr >= lr refused and a value cut at its '=' each passed every
    test."""
    cfg = load_config("andrea-tiny", ["train.lr=1e-3", "train.min_lr=1e-3"])
    assert cfg.train.min_lr == cfg.train.lr == 1e-3
    with pytest.raises(UserError, match=r"train\.min_lr: 0\.002 is above train\.lr = 0\.001"):
        load_config("andrea-tiny", ["train.lr=1e-3", "train.min_lr=2e-3"])
    assert load_config("andrea-tiny", ["data.source=in/a=b.txt"]).data.source == "in/a=b.txt"


def test_an_empty_source_is_refused_not_the_working_directory(tmp_path):
    """Before: `--set data.source=` prepared and trained on every file in the working
    directory (runs/ included)."""
    assert_user_error(andrea_main("config", "show", "-c", "andrea-tiny", "--set", "data.source="),
                      "data.source: must be shakespeare, or a file, directory or glob, got ''")
    assert_user_error(andrea_main("config", "show", "-c", "andrea-tiny", "--set",
                                  'data.sources=[{path: "", weight: 1}, {path: a.txt}]'),
                      "data.sources[0].path: must be a file, directory or glob, got ''")
    assert_user_error(andrea_main("prepare", "--input", "", cwd=tmp_path), "--input")
    assert list(tmp_path.iterdir()) == []


def test_a_bpe_vocab_too_small_names_model_vocab_size_before_anything_runs(tmp_path):
    """Before: `tokenizer bpe: vocab size 100 is too small`, after preparing began, naming
    neither key."""
    line = assert_user_error(andrea_main("train", "-c", "andrea-tiny", "--set",
                                         "data.tokenizer=bpe", "--set", "model.vocab_size=100",
                                         cwd=tmp_path),
                             "model.vocab_size: 100 is too small for data.tokenizer bpe",
                             "at least 258 ids")
    assert "preparing" not in line and list(tmp_path.iterdir()) == []
    load_config("andrea-tiny", ["data.tokenizer=bpe", "model.vocab_size=258"])
    load_config("andrea-tiny", ["data.tokenizer=byte", "model.vocab_size=257"])


def test_a_quoted_value_of_a_key_that_takes_it_bare_says_to_drop_the_quotes(tmp_path):
    for dotted, typed in (("train.compile", "true"), ("train.micro_batch_size", "8"),
                          ("train.loss_chunk_rows", "0")):
        said = assert_user_error(
            andrea_main("config", "show", "-c", "andrea-tiny", "--set", f'{dotted}="{typed}"'),
            f"got '{typed}' in quotes, which makes it text; give it without them")
        bare = said.split("give it without them: --set ")[1].split(" (")[0]
        load_config("andrea-tiny", [bare])  # as it says, it works
    path = write(tmp_path, "train:\n  compile: 'false'\n")
    assert_user_error(andrea_main("config", "show", "-c", str(path)), "(compile: false in a file)")
    # A number of the wrong kind names what the key takes, not "an integer or a string".
    assert_user_error(andrea_main("config", "show", "-c", "andrea-tiny", "--set",
                                  "train.micro_batch_size=8.0"),
                      "train.micro_batch_size: must be auto or a positive integer, got 8.0")


def test_config_show_prints_resolved_yaml():
    proc = andrea_main("config", "show", "--config", "andrea-12m.yaml", "--set", "train.lr=2e-4")
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["model"]["d_model"] == 384
    assert shown["train"]["lr"] == pytest.approx(2e-4)
    assert set(shown) == {"model", "data", "train"}
    # and what train.precision: auto means on this machine, as a comment
    assert re.search(r"\n# train\.precision: auto -> (bf16|fp32) on cpu \(auto: this CPU has",
                     proc.stdout), proc.stdout[-300:]


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("model:\n  n_haed: 4\n", ["model.n_haed", "did you mean 'model.n_head'"]),
        ("modle:\n  n_head: 4\n", ["unknown section 'modle'", "did you mean 'model'"]),
        ("model:\n  n_head: four\n", ["model.n_head", "expected an integer", "'four'"]),
        ("train:\n  compile: 3\n", ["train.compile", "true or false"]),
        ("model:\n  n_layer: 0\n", ["model.n_layer", "positive"]),
        ("model:\n  block_size: -5\n", ["model.block_size", "positive"]),
        ("model:\n  dropout: 1.0\n", ["model.dropout", "[0, 1)"]),
        ("model:\n  dropout: -0.1\n", ["model.dropout", "[0, 1)"]),
        (
            "model:\n  n_head: 12\n  head_dim: 64\n  d_model: 512\n",
            ["model.d_model", "512", "12 * 64 = 768"],
        ),
        ("train:\n  schedule: cosin\n", ["train.schedule", "did you mean 'cosine'"]),
        ("model:\n  n_head: 4\n   head_dim: 8\n", ["YAML syntax error", "line 3"]),
        # A key given twice: PyYAML kept the last silently (a second `train:` dropped the
        # first's keys).
        ("train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", ["line 3", "'lr' is given twice (also at "
                                                  "line 2); keep one"]),
        ("train:\n  lr: 1.0e-3\nmodel: {}\ntrain:\n  max_steps: 3\n",
         ["line 4", "'train' is given twice (also at line 1)"]),
        ("train:\n  name: ../elsewhere\n", ["train.name", "'../elsewhere'", "not a folder name"]),
        ("train:\n  name: ..\n", ["train.name", "not a folder name"]),
        # A misspelt weight was dropped for the default 1 (mutation round 3).
        ("data:\n  sources:\n    - {path: a.txt, wieght: 3}\n",
         ["data.sources[0]: expected {path: FILE|DIR|GLOB, weight: NUMBER}", "'wieght': 3"]),
    ],
)
def test_config_errors_name_the_file_and_the_key(tmp_path, text, fragments):
    """Each a UserError (the CLI's one line, exit 2: test_missing_file_names_it_and_the_presets
    and test_override_errors_through_the_cli show it on the real command)."""
    path = write(tmp_path, text)
    with pytest.raises(UserError) as raised:
        load_config(str(path))
    for fragment in (str(path), *fragments):
        assert fragment in str(raised.value), (fragment, str(raised.value))


def test_a_run_name_longer_than_a_folder_name_is_refused_in_one_line(tmp_path):
    """Before: `andrea train --set train.name=<300 a's>` ended in a traceback, OSError: [Errno
    36] File name too long, when the run folder was made. The limit is bytes, not characters."""
    assert load_config("andrea-tiny", ["train.name=" + "a" * 255]).train.name == "a" * 255
    proc = andrea_main("train", "--config", "andrea-tiny.yaml", "--set", "train.name=" + "a" * 300,
                       cwd=tmp_path)
    assert_user_error(proc, "andrea-tiny.yaml (with --set overrides): train.name: 'aaaa",
                      "is 300 bytes long", "at most 255 bytes", "shorten train.name")
    assert not (tmp_path / "runs").exists()
    with pytest.raises(UserError, match="is 256 bytes long"):
        load_config("andrea-tiny", ["train.name=" + "é" * 128])  # 128 characters, 2 bytes each
    path = write(tmp_path, 'train:\n  name: "\\ud800"\n')  # a lone surrogate: no bytes at all
    assert_user_error(andrea_main("config", "show", "-c", str(path)),
                      f"{path}: train.name: '\\ud800' cannot be written as a folder name")


def test_missing_file_names_it_and_the_presets(tmp_path):
    missing = tmp_path / "nope.yaml"
    proc = andrea_main("count-params", "--config", str(missing))
    assert_user_error(proc, str(missing), "andrea-12m.yaml")


def test_override_errors_through_the_cli():
    proc = andrea_main("config", "show", "-c", "andrea-12m", "--set", "model.n_layer=2.5")
    assert_user_error(proc, "--set model.n_layer=2.5", "expected an integer")
    with pytest.raises(UserError, match=r"trian.lr.*did you mean 'train.lr'\?"):
        load_config("andrea-12m", ["trian.lr=1"])
    with pytest.raises(UserError, match="SECTION.KEY=VALUE"):
        load_config("andrea-12m", ["train.lr"])


def test_a_key_twice_is_refused_but_a_merge_key_is_not(tmp_path):
    """Duplicates are found on YAML's nodes, before a merge key (`<<: *anchor`) is expanded: a
    merge that then overrides a key is no duplicate, and loads as it did."""
    path = write(tmp_path, "data:\n  sources:\n    - &s {path: a.txt, weight: 2}\n"
                           "    - {<<: *s, path: b.txt}\n")
    assert load_config(str(path)).data.sources == [{"path": "a.txt", "weight": 2.0},
                                                   {"path": "b.txt", "weight": 2.0}]
    with pytest.raises(UserError) as raised:
        load_config("andrea-tiny", ["data.sources=[{path: a.txt, path: b.txt}]"])
    assert str(raised.value) == ("--set data.sources=[{path: a.txt, path: b.txt}]: line 1: "
                                 "'path' is given twice (also at line 1); keep one")


def test_a_text_key_given_a_bare_number_or_yes_says_how_to_quote_it(tmp_path):
    """Before: `expected a string, got 123` (a run named 123), `got True` for train.wandb=true
    (no choices named), and `--set train=3` suggested 'train' itself."""
    proc = andrea_main("config", "show", "-c", "andrea-tiny", "--set", "train.name=123")
    said = assert_user_error(proc, "train.name: expected a string, got 123, which YAML reads as "
                             "a number; quote it for text: --set 'train.name=\"123\"'")
    quoted = shlex.split(said.split("quote it for text: ")[1].split(" (")[0])
    assert load_config("andrea-tiny", [quoted[1]]).train.name == "123"  # as it says, it works
    path = write(tmp_path, "train:\n  name: yes\n")
    assert_user_error(andrea_main("config", "show", "-c", str(path)),
                      f"{path}: train.name: expected a string, got True, which YAML reads as a "
                      "boolean", 'name: "yes" in a file')
    # The hint quotes the value as typed: YAML reads yes as true, 1.50 as 1.5, on as true.
    for typed in ("yes", "1.50", "007"):
        said = assert_user_error(andrea_main("config", "show", "-c", "andrea-tiny", "--set",
                                             f"train.name={typed}"),
                                 f"--set 'train.name=\"{typed}\"'")
        quoted = shlex.split(said.split("quote it for text: ")[1].split(" (")[0])
        assert load_config("andrea-tiny", [quoted[1]]).train.name == typed
    path.write_text("train:\n  wandb: on\n")
    assert_user_error(andrea_main("config", "show", "-c", str(path)),
                      "train.wandb: 'on' is not one of off, online, offline")
    assert_user_error(andrea_main("config", "show", "-c", "andrea-tiny", "--set",
                                  "train.wandb=true"),
                      "train.wandb: 'true' is not one of off, online, offline")
    line = assert_user_error(andrea_main("config", "show", "-c", "andrea-tiny", "--set",
                                         "train=3"), "'train' is not SECTION.KEY")
    assert "did you mean 'train'?" not in line and "e.g. 'train." in line


FLOAT_KEYS = [spec.dotted for spec in key_specs() if spec.type is float]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", ".inf", ".nan", "1e999"])
@pytest.mark.parametrize("dotted", FLOAT_KEYS)
def test_every_float_key_refuses_a_number_that_is_not_finite(dotted, value):
    """inf passed `positive()` (train.lr=inf trained 2 steps, then a non-finite loss, exit 1),
    and nan passed a key without a check: now every float key is finite at load."""
    with pytest.raises(UserError) as raised:
        load_config("andrea-tiny", [f"{dotted}={value}"])
    assert str(raised.value) == (f"--set {dotted}={value}: {dotted}: must be a finite number, "
                                 f"got {value.lstrip('.')}")  # YAML's .inf is inf


def test_a_number_out_of_range_is_one_line_before_anything_runs(tmp_path):
    proc = andrea_main("train", "-c", "andrea-tiny", "--set", "train.lr=inf", "--no-progress",
                       "--set", f"train.runs_dir={tmp_path / 'runs'}")
    assert_user_error(proc, "--set train.lr=inf: train.lr: must be a finite number, got inf")
    assert proc.stdout == "" and not (tmp_path / "runs").exists()
    path = write(tmp_path, "train:\n  eps: .nan\n")  # in a file, as YAML writes it
    assert_user_error(andrea_main("config", "show", "-c", str(path)),
                      f"{path}: train.eps: must be a finite number, got nan")
    # data.sources' weights are numbers of a config too.
    with pytest.raises(UserError, match=r"data.sources\[0\].weight: must be a finite number"):
        load_config("andrea-tiny", ["data.sources=[{path: a.txt, weight: .inf}]"])
    # Integers: numpy's generators take no negative seed, and nothing takes more than 64 bits.
    with pytest.raises(UserError, match=r"train.seed: must be a non-negative integer, got -1"):
        load_config("andrea-tiny", ["train.seed=-1"])
    with pytest.raises(UserError, match=r"train.max_steps: 1" + "0" * 20 + " is out of range"):
        load_config("andrea-tiny", ["train.max_steps=1" + "0" * 20])


def test_unknown_keys_suggest_only_close_matches_else_list_the_section():
    def err(key: str) -> str:
        with pytest.raises(UserError) as raised:
            load_config("andrea-tiny", [f"{key}=1"])
        assert f"'{key}'" in str(raised.value)
        return str(raised.value)

    assert err("train.max_step").endswith("did you mean 'train.max_steps'?")
    # A key nested one level too deep: the key its last part names (before: "did you mean
    # 'train'?", the section it was already in).
    assert err("train.optimzer.lr").endswith("did you mean 'train.lr'?")
    assert err("model.attn.n_head").endswith("did you mean 'model.n_head'?")
    assert err("train.optimizer.betas").endswith("did you mean 'train.optimizer'?")
    for far in ("train.nope", "train.steps"):  # once 'train.compile' and 'train.eps'
        line = err(far)
        assert "did you mean" not in line
        assert line.endswith("; the train keys are: " + ", ".join(
            f.name for f in dataclasses.fields(TrainConfig)))
    assert "the model keys are: n_layer, n_head, head_dim, d_model," in err("model.layers")


def test_every_key_is_declared_with_a_one_line_description():
    for spec in key_specs():
        text = spec.rule.description
        assert text and "\n" not in text and text == text.strip(), spec.dotted
        # A default the declaration itself refuses would make every config fail.
        default = spec.default
        assert not spec.rule.choices or default in spec.rule.choices, spec.dotted
        check = spec.rule.check
        assert check is None or default is None or check.holds(default), spec.dotted
    # Every field of every section is a key (none left out of the declarations).
    fields = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert [spec.dotted for spec in key_specs()] == fields


def test_a_field_without_a_declaration_has_no_description():
    @dataclasses.dataclass
    class Section:
        declared: int = key(1, "a key")
        bare: int = 2

    rules = {spec.name: spec.rule for spec in section_keys("x", Section)}
    assert rules["declared"].description == "a key" and rules["bare"].description == ""


def test_docs_key_table_is_generated_from_the_declarations():
    on_disk = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert on_disk == keys_markdown(), f"docs/config.md is stale: run {REGENERATE}"
    for spec in key_specs():
        assert f"| `{spec.dotted}` | `{default_text(spec)}` |" in on_disk


def test_resumable_keys_are_the_ones_resume_always_allowed():
    resumable = {spec.dotted for spec in key_specs() if spec.rule.resumable is True}
    assert resumable == {
        "train.max_steps", "train.eval_every", "train.eval_tokens", "train.eval_batches",
        "train.checkpoint_every", "train.keep_last", "train.join_timeout", "train.log_every",
        "train.tensorboard",
        "train.wandb", "train.wandb_project", "train.wandb_name", "train.wandb_entity",
        "train.skip_nonfinite", "train.spike_guard", "train.spike_z", "train.spike_window",
        "train.spike_patience", "train.spike_lr_factor", "train.spike_lr_steps", "train.compile",
        "train.compile_mode",
        "train.zero_init_output", "train.muon_ns_coefficients",
        "train.muon_cautious_weight_decay", "train.micro_batch_size", "train.loss_chunk_rows",
        "train.activation_checkpointing", "train.parallel", "train.device", "model.attention",
        "data.dir", "data.workers",
    }
    located = {spec.dotted for spec in key_specs() if spec.rule.location}
    assert located == {"train.name", "train.runs_dir"}
    in_part = {spec.dotted for spec in key_specs() if isinstance(spec.rule.resumable, ResumeChange)}
    assert in_part == {"data.sources"}


def test_an_auto_recorded_as_it_resolved_names_a_trainer_state_key():
    """A key whose `auto` a resume may pin to what it resolved to names the trainer_state.json
    key that records it (train.resume reads it there)."""
    from andrea.train.rundir import TrainerState

    recorded = {spec.dotted: spec.rule.recorded_auto for spec in key_specs()
                if spec.rule.recorded_auto is not None}
    assert recorded == {"train.precision": "precision",
                        "train.muon_ns_precision": "muon_ns_precision"}
    assert set(recorded.values()) <= {f.name for f in dataclasses.fields(TrainerState)}


def test_resume_accepts_declared_changes_and_names_every_refused_key(tmp_path):
    stored = load_config("andrea-tiny")
    given = load_config("andrea-tiny", ["train.max_steps=7", "train.name=elsewhere",
                                        "model.attention=math"])
    assert check_resume_changes(stored, given, tmp_path, trained=True) == {
        "train.max_steps": [stored.train.max_steps, 7], "model.attention": ["auto", "math"]}
    given = load_config("andrea-tiny", ["train.lr=0.5", "train.optimizer=muon"])
    with pytest.raises(UserError, match=r"cannot change train\.lr \(.* -> 0\.5\), "
                                        r"train\.optimizer \(adamw -> muon\)"):
        check_resume_changes(stored, given, tmp_path, trained=True)
    # Before the first step (an import) only the model is fixed.
    assert "train.lr" in check_resume_changes(stored, given, tmp_path, trained=False)


def test_declared_choices_and_constraints_are_checked():
    spec = key_spec("train.precision")
    assert spec.rule.choices == PRECISIONS and spec.allowed == "auto, bf16, fp16, fp32"
    with pytest.raises(UserError, match=r"train\.precision: 'fp8' is not one of auto, bf16"):
        load_config("andrea-tiny", ["train.precision=fp8"])
    with pytest.raises(UserError, match=r"muon_ns_precision: 'fp16' is not one of auto, bf16"):
        load_config("andrea-tiny", ["train.muon_ns_precision=fp16"])
    assert key_spec("train.spike_window").allowed == "an integer of at least 2"
    assert key_spec("data.dir").allowed == "a string"
    assert key_spec("data.text_field").allowed == "a field's name"
    assert key_spec("train.micro_batch_size").allowed == "auto or a positive integer"
    with pytest.raises(UserError, match=r"train\.micro_batch_size: must be auto or a positive"):
        load_config("andrea-tiny", ["train.micro_batch_size=0"])
    assert load_config("andrea-tiny", ["train.spike_guard=off"]).train.spike_guard == "off"


def test_config_keys_lists_every_key_with_default_and_description():
    proc = andrea_main("config", "keys")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["key", "default", "description"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == [spec.dotted for spec in key_specs()]
    assert rows["train.lr"].split(None, 2)[1:] == ["0.0006", "peak learning rate (AdamW's)"]
    proc = andrea_main("config", "keys", "--json")
    records = {r["key"]: r for r in json.loads(proc.stdout)}
    assert records["train.schedule"]["choices"] == ["cosine", "constant", "wsd"]
    assert records["train.max_steps"]["on_resume"] == "may change"
    assert records["train.lr"]["on_resume"] == "fixed"
    assert records["data.sources"]["default"] == []


def test_an_optimizer_is_one_entry_in_its_registry(monkeypatch):
    """A throwaway optimizer added to optim.OPTIMIZERS (its class's empty state in EMPTY_STATE
    beside it), and nowhere else: config validation accepts its name, the key reference lists
    it, and a checkpoint's state would be read into the empty state it makes. Gone again, its
    name is refused."""
    import torch

    from andrea.model.transformer import Andrea

    class Plain(torch.optim.SGD):
        pass

    made = []

    def empty_state(opt, p, group):
        made.append(p)
        return {"momentum_buffer": torch.zeros_like(p)}

    monkeypatch.setitem(optim.OPTIMIZERS, "plain", lambda model, cfg, device, world, sharded:
                        Plain(model.parameters(), lr=cfg.train.lr, momentum=0.9))
    monkeypatch.setitem(optim.EMPTY_STATE, Plain, empty_state)
    cfg = load_config("andrea-tiny", ["train.optimizer=plain"])
    assert key_spec("train.optimizer").allowed == "adamw, muon, plain"
    model = Andrea(cfg.model)
    opt = optim.build_optimizer(model, cfg, torch.device("cpu"))
    optim.make_empty_state(opt)
    assert len(made) == len(list(model.parameters())) > 0
    assert all(opt.state[p]["momentum_buffer"].shape == p.shape for p in model.parameters())
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"train\.optimizer: 'plain' is not one of adamw, muon"):
        load_config("andrea-tiny", ["train.optimizer=plain"])


def test_a_path_starting_with_a_tilde_is_in_the_home_folder(tmp_path, monkeypatch, data_dir):
    """A shell expands ~ only where a word starts: not in `--set train.runs_dir=~/runs`, and
    YAML never does. Such a path was taken as it is, a folder named ~ in the working directory
    (one `rm -rf ~` away from the home folder). Now every path key, a mixture's paths too,
    starts at the home folder."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "mix.yaml").write_text(
        "data:\n  sources:\n    - {path: ~/a.txt, weight: 1}\n    - {path: b.txt, weight: 2}\n")
    cfg = load_config(str(tmp_path / "mix.yaml"), [
        "train.runs_dir=~/runs", "data.dir=~/data", "data.source=~/notes",
        "data.tokenizer_file=~/tok/tokenizer.json"])
    assert (cfg.train.runs_dir, cfg.data.dir, cfg.data.source, cfg.data.tokenizer_file) == (
        f"{home}/runs", f"{home}/data", f"{home}/notes", f"{home}/tok/tokenizer.json")
    assert [s["path"] for s in cfg.data.sources] == [f"{home}/a.txt", "b.txt"]
    work = tmp_path / "work"
    work.mkdir()
    result = andrea_main("train", "-c", "andrea-tiny", "--set", "train.runs_dir=~/runs",
                         "--set", f"data.dir={data_dir}", "--set", "train.max_steps=1",
                         "--set", "train.name=t", "--no-progress", cwd=work)
    assert result.returncode == 0, result.stderr
    assert (home / "runs" / "t" / "step-000001").is_dir() and not list(work.iterdir())
