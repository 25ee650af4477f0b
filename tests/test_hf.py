"""`andrea export/import --format hf`: transformers' GPT-2 computes our logits; round trips."""

from __future__ import annotations

import json
import os
import shlex
import shutil

import pytest
import torch
from conftest import andrea_main, assert_user_error, make_checkpoint

from andrea.config import load_config
from andrea.data.tokenizer import Gpt2Tokenizer, gpt2_vocab_files, train_bpe
from andrea.errors import UserError
from andrea.hf import export_hf, import_hf
from andrea.train import checkpoint as ckpt_io
from andrea.trained import load_model, tokenizer_for_checkpoint

os.environ["HF_HUB_OFFLINE"] = "1"  # transformers is a test-only dependency; never the network
os.environ["TRANSFORMERS_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers", reason="transformers (test extra) missing")


def hf_logits(path, idx: torch.Tensor) -> torch.Tensor:
    hf = transformers.GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(idx).logits


def ours(ckpt, idx: torch.Tensor) -> torch.Tensor:
    model, _, _ = load_model(ckpt)
    with torch.no_grad():
        return model(idx)[0]


def assert_first_loss_is_the_imported_weights(result, ckpt, cfg, data_dir) -> None:
    """Step 1's loss of the fine-tuning run is the imported weights' loss on step 0's batch."""
    from andrea.data.loader import TokenSplit, train_batch

    x, y = train_batch(TokenSplit(data_dir, "train"), seed=cfg.train.seed, step=0, micro_step=0,
                       rank=0, accum_steps=1, world_size=1,
                       micro_batch_size=cfg.train.micro_batch_size,
                       block_size=cfg.model.block_size)
    model, _, _ = load_model(ckpt)
    with torch.no_grad():
        assert result.losses[1] == pytest.approx(model(x, y)[1].item(), rel=1e-5)


@pytest.mark.parametrize("act, hf_act, vocab, tokenizer", [
    ("gelu", "gelu", 320, "byte:v1"),  # exact GELU
    ("gelu_tanh", "gelu_new", 50304, Gpt2Tokenizer.identity),  # tanh; padded GPT-2 vocab
])
def test_round_trip(tmp_path, act, hf_act, vocab, tokenizer):
    ckpt = make_checkpoint(tmp_path, "model.init_std=0.1", f"model.activation={act}",
                           f"model.vocab_size={vocab}", "model.dropout=0.125",
                           tokenizer=tokenizer)
    out = export_hf(str(ckpt), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["activation_function"] == hf_act and config["vocab_size"] == vocab
    # The model's dropout is each of GPT-2's three, for fine-tuning it with transformers
    # (mutation round 3: resid_pdrop written as 0 passed every test).
    assert [config[k] for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")] == [0.125] * 3
    assert (config["n_layer"], config["n_head"], config["n_embd"], config["n_positions"]) == (
        2, 4, 64, 64)

    idx = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0))
    expected = ours(ckpt, idx)
    torch.testing.assert_close(hf_logits(out, idx), expected, rtol=0, atol=1e-5)

    back = import_hf(out, tmp_path / "runs" / "back")
    a, cfg_a, _ = ckpt_io.read_model_checkpoint(ckpt)
    b, cfg_b, meta = ckpt_io.read_model_checkpoint(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cfg_a.model == cfg_b.model and cfg_b.train.name == "back"
    assert meta["tokenizer"] == tokenizer and meta["step"] == "0"
    torch.testing.assert_close(ours(back, idx), expected, rtol=0, atol=0)

    if tokenizer.startswith("gpt2"):
        hf_tok = transformers.AutoTokenizer.from_pretrained(out)
        text = "Hello, wörld! It's 2024 ✓"
        assert hf_tok(text)["input_ids"] == Gpt2Tokenizer().encode(text)
        assert hf_tok.eos_token_id == config["eos_token_id"] == 50256


def test_biases_and_a_transformers_made_gpt2(tmp_path):
    """A GPT-2 as transformers makes it (biases, gelu_new, unprefixed names) imports exactly;
    its non-zero biases are refused unless the config enables them."""
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=32,
                                  vocab_size=50257)
    torch.manual_seed(1)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    src = tmp_path / "gpt2"
    hf.save_pretrained(src)
    encoder, merges = gpt2_vocab_files()
    shutil.copyfile(encoder, src / "vocab.json")
    shutil.copyfile(merges, src / "merges.txt")

    with pytest.raises(UserError, match=r"non-zero .* --set model.bias=true"):
        import_hf(src, tmp_path / "runs" / "nobias")
    assert not (tmp_path / "runs" / "nobias").exists()
    ckpt = import_hf(src, tmp_path / "runs" / "g", ["model.bias=true", "train.lr=1e-4"])
    model, run_cfg, meta = load_model(ckpt)
    assert run_cfg.model.activation == "gelu_tanh" and run_cfg.model.dropout == 0.1
    assert run_cfg.model.bias and run_cfg.train.lr == 1e-4
    assert tokenizer_for_checkpoint(ckpt, run_cfg, meta).name == "gpt2"
    idx = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf(idx).logits, rtol=0, atol=1e-5)
    # And back out: the biases survive the export.
    again = export_hf(str(ckpt), tmp_path / "again")
    torch.testing.assert_close(hf_logits(again, idx), hf(idx).logits, rtol=0, atol=1e-5)


def test_bpe_tokenizer_travels(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    bpe = train_bpe(iter(["the cat sat on the mat ✓\n"] * 40), 300, data / "tokenizer.json")
    ckpt = make_checkpoint(tmp_path, f"data.dir={data}", "data.tokenizer=bpe",
                           tokenizer=bpe.identity)
    out = export_hf(str(ckpt), tmp_path / "hf")
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    assert hf_tok("the mat ✓")["input_ids"] == bpe.encode("the mat ✓")
    back = import_hf(out, tmp_path / "runs" / "back")
    shutil.rmtree(data)  # the import carries its own tokenizer.json
    _, cfg, meta = ckpt_io.read_model_checkpoint(back)
    assert tokenizer_for_checkpoint(back, cfg, meta).identity == bpe.identity
    # The run's data will be prepared with the run's own copy of the model's tokenizer.
    run_cfg = load_config(back.parent / "config.yaml")
    assert run_cfg.data.tokenizer_file == str((back.parent / "tokenizer.json").resolve())
    assert run_cfg.data.dir == ""  # not the exporter's data dir


def test_force_replaces_only_what_the_command_wrote_and_says_what(tmp_path):
    """`--force` deleted whatever --out named, silently: a folder of the user's own files, a
    file (replaced by a folder), a trained run. It now replaces only an earlier export
    (export) or an andrea run (import), in a line naming it first; anything else is refused
    with or without --force, and an empty folder needs no --force."""
    ckpt = make_checkpoint(tmp_path)

    def export(out, *force: str):
        return andrea_main("export", "--checkpoint", str(ckpt), "--format", "hf", "--out",
                           str(out), *force)

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    note = tmp_path / "notes.md"
    note.write_text("mine")
    for target in (mine, note):
        for force in ((), ("--force",)):
            assert_user_error(export(target, *force), str(target), "already exists",
                              "keep.txt" if target == mine else "as a file",
                              "never replaces")
    assert (mine / "keep.txt").read_text() == "mine" and note.read_text() == "mine"
    assert_user_error(andrea_main("export", "--checkpoint", str(ckpt), "--format", "hf",
                                  "--out", str(ckpt.parent), "--force"), "never replaces")
    assert (ckpt / "model.safetensors").is_file()  # the run exported is not its export
    # A folder that cannot be made: one line, as import says it (it was a traceback).
    assert_user_error(export(note / "sub"), f"--out {note / 'sub'}: cannot write there: {note} "
                      f"is a file, not a folder; move it away")
    assert note.read_text() == "mine" and not list(tmp_path.glob(".sub.tmp-*"))

    empty = tmp_path / "empty"
    empty.mkdir()
    first = export(empty)
    assert first.returncode == 0 and (empty / "model.safetensors").is_file()
    assert (f"note: no tokenizer files in {empty}: transformers has no byte tokenizer; its ids "
            "are the text's UTF-8 bytes, end-of-text 256") in first.stdout  # said, not silent
    assert_user_error(export(empty), str(empty), "already exists", "--force")
    again = export(empty, "--force")
    assert again.returncode == 0, again.stderr
    assert f"--force: replacing the export in {empty} (of {ckpt})" in again.stdout

    # import: a run is replaced with --force, saying what it held; other folders never.
    run = tmp_path / "runs" / "r"
    for force in ((), ("--force",)):
        assert_user_error(andrea_main("import", "--format", "hf", str(empty), "--out",
                                      str(mine), *force), "keep.txt", "never replaces")
    assert (mine / "keep.txt").read_text() == "mine"
    assert_user_error(andrea_main("import", "--format", "hf", str(empty), "--out",
                                  str(empty), "--force"), "never replaces")
    assert (empty / "andrea.json").is_file()  # an import never replaces its own source
    imported = andrea_main("import", "--format", "hf", str(empty), "--out", str(run), "--force")
    assert imported.returncode == 0, imported.stderr
    assert (f"--force: replacing the run in {run} (1 checkpoint, the newest at step 5, "
            in imported.stdout)
    assert [p.name for p in run.glob("step-*")] == ["step-000000"]


def test_force_never_takes_a_users_files_in_what_looks_like_a_run_or_an_export(tmp_path):
    """A folder counted as a run when it held a config.yaml or a metrics.jsonl (or a step-*
    folder), and as an export when it held andrea.json: `import --force` deleted a project
    folder with its config.yaml and sources, `export --force` a model card added to an earlier
    export. Both are now refused, naming the files; an export as written is still replaced."""
    ckpt = make_checkpoint(tmp_path)
    export = tmp_path / "export"
    assert andrea_main("export", "--checkpoint", str(ckpt), "--format", "hf", "--out",
                       str(export)).returncode == 0
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "config.yaml").write_text("lr: 1\n")
    (project / "src" / "main.py").write_text("print('mine')\n")
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "metrics.jsonl").write_text("{}\n")
    (thesis / "thesis.tex").write_text("mine")
    own_yaml = tmp_path / "own_yaml"
    own_yaml.mkdir()
    (own_yaml / "config.yaml").write_text("lr: 1\n")  # nothing else, but not andrea's
    results = tmp_path / "results"
    (results / "step-1").mkdir(parents=True)
    (results / "notes.md").write_text("mine")
    for folder, named in ((project, "holds src, which no andrea run holds"),
                          (thesis, "holds thesis.tex, which no andrea run holds"),
                          (own_yaml, "its config.yaml is not an andrea config"),
                          (results, "holds notes.md, which no andrea run holds")):
        before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
        assert_user_error(andrea_main("import", "--format", "hf", str(export), "--out",
                                      str(folder), "--force"),
                          f"--out {folder}: {named}", "never a user's files")
        assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before, folder

    (export / "README.md").write_text("my model card")
    assert_user_error(andrea_main("export", "--checkpoint", str(ckpt), "--format", "hf",
                                  "--out", str(export), "--force"),
                      "holds an earlier export and README.md, which no export holds",
                      "never a user's files")
    assert (export / "README.md").read_text() == "my model card"
    (export / "README.md").unlink()
    again = andrea_main("export", "--checkpoint", str(ckpt), "--format", "hf", "--out",
                        str(export), "--force")
    assert again.returncode == 0 and "--force: replacing the export in" in again.stdout


@pytest.mark.parametrize("config", [None, 3, {"model": 3}, {"train": ["x"]}])
def test_an_andrea_json_without_its_config_sections_is_one_line(tmp_path, config):
    """An andrea.json of the export format whose config is missing or not sections of keys
    (a stranger's, or a damaged one) was a KeyError or an AttributeError traceback."""
    hf = export_hf(str(make_checkpoint(tmp_path / "src")), tmp_path / "hf")
    andrea = json.loads((hf / "andrea.json").read_text())
    if config is None:
        del andrea["config"]
    else:
        andrea["config"] = config
    (hf / "andrea.json").write_text(json.dumps(andrea))
    assert_user_error(andrea_main("import", "--format", "hf", str(hf), "--out", "runs/x",
                                  cwd=tmp_path),
                      f"{hf / 'andrea.json'}: 'config' is not an object of model, data and train",
                      "export the model again")
    assert not (tmp_path / "runs").exists()


def test_bad_exports_and_imports(tmp_path):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert_user_error(andrea_main("import", "--format", "hf", str(llama)),
                      "llama", "LlamaForCausalLM", "not GPT-2")
    with pytest.raises(UserError, match="not a Hugging Face model directory"):
        import_hf(tmp_path)
    (tmp_path / "afile").write_text("x")  # a file is named as one, not as missing
    for given, said in [("afile", "afile: not a directory"), ("nothere", "nothere: no such")]:
        assert_user_error(andrea_main("import", "--format", "hf", str(tmp_path / given)), said,
                          "give the folder an export or a GPT-2 model is in")
    with pytest.raises(UserError, match="the only format"):
        from andrea.cli import _check_format

        _check_format("gguf")


def test_an_import_fine_tunes_with_resume(tmp_path, data_dir):
    from andrea.config import load_config
    from andrea.train.loop import train

    ckpt = make_checkpoint(tmp_path, f"data.dir={data_dir}", "model.init_std=0.1",
                           "train.precision=fp32")
    run = import_hf(export_hf(str(ckpt), tmp_path / "hf"), tmp_path / "runs" / "ft").parent
    cfg = load_config(run / "config.yaml")
    result = train(cfg, resume=str(run), progress=False, stop_after=1)
    assert result.steps == 1 and result.checkpoint == run / "step-000001"
    assert_first_loss_is_the_imported_weights(result, ckpt, cfg, data_dir)


def test_the_fine_tune_command_of_an_import_quotes_its_folder(tmp_path):
    """Before: `--out "imp ü/"` printed `fine-tune with: andrea train --resume imp ü`, which a
    shell splits into two paths. Now the folder is quoted as a shell reads it back."""
    ckpt = make_checkpoint(tmp_path)
    export_hf(str(ckpt), tmp_path / "ex ü" / "hf")
    out = andrea_main("import", "--format", "hf", "ex ü/hf/", "--out", "imp ü/", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    said = out.stdout.strip()
    assert said.startswith("wrote imp ü/step-000000; fine-tune with: "), said
    assert shlex.split(said.split("fine-tune with: ")[1]) == ["andrea", "train", "--resume",
                                                              "imp ü"]


def test_an_imported_bpe_model_fine_tunes_with_its_tokenizer(tmp_path, monkeypatch):
    """A BPE model's import prepares the fine-tuning data with the model's own tokenizer.json
    (not a newly trained BPE), so `train --resume` on it accepts the data and trains."""
    from andrea.data.prepare import data_dir_for, default_data_dir
    from andrea.data.shards import read_manifest
    from andrea.train.loop import train

    monkeypatch.chdir(tmp_path)  # the derived data dir goes under ./data
    lines = [f"line {i}: the cat sat on mat {i % 7} and the dog ran to {i % 5}.\n"
             for i in range(400)]
    (tmp_path / "text.txt").write_text("".join(lines))
    (tmp_path / "exporter").mkdir()
    bpe = train_bpe(iter(lines), 300, tmp_path / "exporter" / "tokenizer.json")
    ckpt = make_checkpoint(tmp_path, "data.tokenizer=bpe", f"data.dir={tmp_path / 'exporter'}",
                           "model.init_std=0.1", "train.precision=fp32", tokenizer=bpe.identity)
    hf = export_hf(str(ckpt), tmp_path / "hf")
    run = import_hf(hf, tmp_path / "runs" / "ft", [f"data.source={tmp_path / 'text.txt'}"]).parent
    cfg = load_config(run / "config.yaml")
    result = train(cfg, resume=str(run), progress=False, stop_after=2)
    assert result.steps == 2 and result.checkpoint == run / "step-000002"
    data = data_dir_for(cfg)
    assert read_manifest(data)["tokenizer"]["identity"] == bpe.identity
    assert data != default_data_dir(cfg.data.source, "bpe", cfg.model.vocab_size)
    assert_first_loss_is_the_imported_weights(result, ckpt, cfg, data)
    # Exported again, the run's config names no folder of this machine (its tokenizer_file was
    # the import's absolute path), and the export imports as before.
    again = export_hf(str(run), tmp_path / "hf-again")
    config = json.loads((again / "andrea.json").read_text())["config"]
    assert (config["data"]["dir"], config["data"]["tokenizer_file"]) == ("", "")
    back = import_hf(again, tmp_path / "runs" / "back").parent
    assert load_config(back / "config.yaml").data.tokenizer_file == str(back / "tokenizer.json")


def test_an_import_refuses_a_tokenizer_json_that_fine_tuning_would(tmp_path):
    """A tokenizer.json that is not a byte-level BPE (here one split at whitespace) is refused
    by the import, naming the folder's file, not taken and then refused by `train --resume` as
    the run's own copy (data.tokenizer_file runs/x/step-000000/tokenizer.json)."""
    from tokenizers import AddedToken, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HfTokenizer

    bpe = train_bpe(iter(["the cat sat on the mat\n"] * 40), 300, tmp_path / "tokenizer.json")
    ckpt = make_checkpoint(tmp_path, "data.tokenizer=bpe", f"data.dir={tmp_path}",
                           tokenizer=bpe.identity)
    hf = export_hf(str(ckpt), tmp_path / "hf")
    words = HfTokenizer(models.BPE(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(["the cat sat on the mat"] * 40,
                              trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    words.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    words.save(str(hf / "tokenizer.json"))
    with pytest.raises(UserError, match=r"hf/tokenizer.json: not a byte-level BPE; needs a "
                                        r"byte-level BPE tokenizer.json"):
        import_hf(hf, tmp_path / "runs" / "words", [])
    assert not (tmp_path / "runs" / "words").exists()


def test_an_import_never_keeps_the_exporters_data_dir(tmp_path, data_dir):
    """andrea.json is untrusted: its data.dir (a folder of the exporter's choosing, here or
    not) is never the run's data folder, which eval, generate and train would write; the run
    derives its own under ./data, unless the user's --set names one."""
    elsewhere = make_checkpoint(tmp_path, f"data.dir={tmp_path / 'not-here'}", "train.name=a")
    run = import_hf(export_hf(str(elsewhere), tmp_path / "hf-a"), tmp_path / "runs" / "ia")
    assert load_config(run.parent / "config.yaml").data.dir == ""
    here = make_checkpoint(tmp_path, f"data.dir={data_dir}", "train.name=b")
    run = import_hf(export_hf(str(here), tmp_path / "hf-b"), tmp_path / "runs" / "ib")
    assert load_config(run.parent / "config.yaml").data.dir == ""
    mine = tmp_path / "mine"
    run = import_hf(tmp_path / "hf-b", tmp_path / "runs" / "ic", [f"data.dir={mine}"])
    assert load_config(run.parent / "config.yaml").data.dir == str(mine)


def test_an_import_over_its_default_run_names_the_default(tmp_path):
    """Without --out the run folder is runs/<source name>; a clash says so, not '--out X'."""
    hf = export_hf(str(make_checkpoint(tmp_path / "src")), tmp_path / "model")
    assert andrea_main("import", str(hf), cwd=tmp_path).returncode == 0
    line = assert_user_error(andrea_main("import", str(hf), cwd=tmp_path),
                             "runs/model (the default --out, named after model): already exists",
                             "--out runs/NAME", "--force")
    assert not line.startswith("error: --out")


@pytest.mark.parametrize("key, value, says", [
    ("n_head", 0, "n_head 0 is not a whole number of at least 1"),  # was ZeroDivisionError
    ("n_embd", "16", 'n_embd "16" is not a whole number'),  # TypeError
    ("n_layer", True, "n_layer true is not a whole number"),
    ("n_inner", "64", 'n_inner "64" is not a whole number (or null'),  # "not 4 * n_embd"
    ("activation_function", ["gelu"], 'activation_function ["gelu"] is not one of gelu'),
    ("layer_norm_epsilon", "1e-5", 'layer_norm_epsilon "1e-5" is not a number'),
    ("resid_pdrop", "x", 'resid_pdrop "x" is not a dropout probability in [0, 1)'),
    ("resid_pdrop", float("nan"), "resid_pdrop NaN is not a dropout probability"),
    ("initializer_range", -1, "initializer_range -1 is not a positive number"),
    ("tie_word_embeddings", "false", 'tie_word_embeddings "false" is not true or false'),
    ("architectures", [1], "architectures [1] is not a list of model class names"),
    ("architectures", "GPT2LMHeadModel",  # was a list of its characters
     'architectures "GPT2LMHeadModel" is not a list of model class names'),
])
def test_a_config_json_of_odd_types_is_one_line(tmp_path, key, value, says):
    """A stranger's config.json with a value of another type or out of range was a traceback
    (ZeroDivisionError, TypeError, ValueError, AttributeError) or a misleading line; now one
    line naming the file, the key, the value as JSON spells it and what is expected."""
    hf = export_hf(str(make_checkpoint(tmp_path / "src")), tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, key: value}))
    assert_user_error(andrea_main("import", "--format", "hf", str(hf), "--out", "runs/x",
                                  cwd=tmp_path), str(hf / "config.json"), says)
    assert not (tmp_path / "runs" / "x").exists()


def _nan_at_1_1(t: torch.Tensor) -> torch.Tensor:
    t[1, 1] = float("nan")
    return t


@pytest.mark.parametrize("name, damage, said", [
    ("transformer.h.0.attn.c_attn.weight", _nan_at_1_1, "holds 1 NaN or infinite value"),
    ("transformer.wpe.weight", lambda t: t.to(torch.int64), "is int64, not floating point"),
])
def test_an_import_refuses_weights_that_are_no_trained_model(tmp_path, name, damage, said):
    """Before: a GPT-2 with NaN weights imported as if sound (its generate a traceback), and
    an int64 tensor was converted to float32 and imported as weights. Now one line naming the
    file's tensor, nothing written."""
    from safetensors.torch import load_file, save_file

    hf = export_hf(str(make_checkpoint(tmp_path / "src")), tmp_path / "hf")
    weights = load_file(str(hf / "model.safetensors"))
    weights[name] = damage(weights[name])
    save_file(weights, str(hf / "model.safetensors"), {"format": "pt"})
    assert_user_error(andrea_main("import", "--format", "hf", str(hf), "--out", "runs/x",
                                  cwd=tmp_path), str(hf / "model.safetensors"),
                      f"tensor '{name}' {said}")
    assert not (tmp_path / "runs").exists()


def test_an_export_refuses_weights_that_are_no_trained_model(tmp_path):
    """Before: a checkpoint whose weights hold NaN (a diverged model saved by a script of one's
    own, its checksums taken from the NaNs) was exported as if sound, to be shared, though eval,
    generate, resume and import refuse it. Now one line naming the tensor, nothing written."""
    from andrea.model.transformer import Andrea
    from andrea.train.rundir import TrainerState

    cfg = load_config("andrea-tiny", [f"train.runs_dir={tmp_path / 'runs'}", "train.name=r"])
    model = Andrea(cfg.model)
    with torch.no_grad():
        model.blocks[0].mlp.up.weight[2, 3] = float("inf")
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "config.yaml").write_text(cfg.to_yaml())
    ckpt = ckpt_io.save_checkpoint(
        tmp_path / "runs" / "r", TrainerState(step=5), cfg, "byte:v1",
        model=ckpt_io.model_state(model), optimizer={}, rng={"cpu.rank0": torch.get_rng_state()},
        keep_last=1)
    assert_user_error(andrea_main("export", "--checkpoint", str(ckpt), "--out", "hf",
                                  cwd=tmp_path), str(ckpt / "model.safetensors"),
                      "tensor 'blocks.0.mlp.up.weight' holds 1 NaN or infinite value",
                      "export another checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_an_out_of_the_longest_folder_name_is_written_and_replaced(tmp_path):
    """A folder name takes 255 bytes. Export and import write beside --out under a longer name
    (.NAME.tmp-PID, then .NAME.stale-PID for what --force replaces), so an --out of 243 to 255
    bytes was an OSError traceback; now those names are cut to fit, and an --out above 255
    bytes is one line."""
    ckpt = make_checkpoint(tmp_path / "src")
    name = "é" * 125  # 250 bytes in UTF-8
    for force in ([], ["--force"]):
        for args in (["export", "--checkpoint", str(ckpt), "--out", name],
                     ["import", "--format", "hf", name, "--out", f"runs/{name}"]):
            result = andrea_main(*args, *force, cwd=tmp_path)
            assert result.returncode == 0, result.stderr
    assert (tmp_path / name / "model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "runs" / name).glob("step-*")] == ["step-000000"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src", "runs", name])
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [name]
    for verb in (["export", "--checkpoint", str(ckpt), "--out"], ["import", name, "--out"]):
        assert_user_error(andrea_main(*verb, name + "ééé", cwd=tmp_path),  # 256 bytes
                          "its name is 256 bytes long; a folder name takes at most 255 bytes")


def test_an_out_of_dot_or_a_folder_above_is_one_line(tmp_path):
    """`cd DIR && andrea import ... --out . --force` (or export's) was `ValueError:
    PosixPath('.') has an empty name`: the folder is assembled beside --out and renamed into
    place, and '.' has no name to write beside (nor may the working directory be replaced
    under the shell). Now one line saying so and what to run instead; nothing is written."""
    hf = export_hf(str(make_checkpoint(tmp_path / "src")), tmp_path / "hf")
    run = import_hf(hf, tmp_path / "runs" / "r").parent
    empty = tmp_path / "empty"
    empty.mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    for cwd in (empty, run):
        for args in (["export", "--checkpoint", str(hf.parent / "src" / "runs" / "r")],
                     ["import", "--format", "hf", str(hf)]):
            assert_user_error(andrea_main(*args, "--out", ".", "--force", cwd=cwd),
                              f"--out .: is the working directory, {cwd}",
                              f"run it from {cwd.parent} with --out {cwd.name}")
    assert_user_error(andrea_main("import", str(hf), "--out", "..", cwd=run),
                      "--out ..: holds the working directory", "--out runs/NAME")
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not list(empty.iterdir())
    assert [p.name for p in run.glob("step-*")] == ["step-000000"]


def save_gpt2(src, **config):
    """A small GPT-2 as transformers makes and saves it (with GPT-2's tokenizer files), with
    CONFIG's GPT2Config keys; the model, in eval mode."""
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=32,
                                  vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, **config)
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(src)
    encoder, merges = gpt2_vocab_files()
    shutil.copyfile(encoder, src / "vocab.json")
    shutil.copyfile(merges, src / "merges.txt")
    return hf


def test_gpt2s_as_other_transformers_save_them_import_with_their_logits(tmp_path):
    """Two GPT-2s andrea can represent exactly, as transformers other than the test's own may
    write them: the tanh GELU spelled gelu_pytorch_tanh (the exact GELU instead was off by
    some 1e-3 in every logit), and an older transformers' model.safetensors holding each
    block's causal-mask buffers (attn.bias [1, 1, n, n], attn.masked_bias), which are no
    weights (kept, the import was refused as 'unexpected tensors')."""
    from safetensors.torch import load_file, save_file

    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(4))
    src = tmp_path / "tanh"
    # Weights of 0.3: pre-activations of order 1, where the two GELUs differ.
    hf = save_gpt2(src, activation_function="gelu_pytorch_tanh", initializer_range=0.3)
    ckpt = import_hf(src, tmp_path / "runs" / "tanh")
    with torch.no_grad():
        torch.testing.assert_close(ours(ckpt, idx), hf(idx).logits, rtol=0, atol=2e-5)

    src = tmp_path / "old"
    hf = save_gpt2(src)
    weights = load_file(str(src / "model.safetensors"))
    for i in range(2):
        weights[f"h.{i}.attn.bias"] = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)
        weights[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(weights, str(src / "model.safetensors"), {"format": "pt"})
    ckpt = import_hf(src, tmp_path / "runs" / "old")
    with torch.no_grad():
        torch.testing.assert_close(ours(ckpt, idx), hf(idx).logits, rtol=0, atol=2e-5)


@pytest.mark.parametrize("config, weights, says", [
    ({"tie_word_embeddings": False}, None, "an LM head not tied to the token embedding"),
    ({}, "lm_head", "lm_head.weight differs from wte.weight; ANDREA ties them"),
    ({"layer_norm_epsilon": 1e-6}, None, "layer_norm_epsilon 1e-06 is not ANDREA's 1e-05"),
    ({"scale_attn_by_inverse_layer_idx": True}, None,
     "attention scaling other than 1/sqrt(head_dim)"),
])
def test_a_gpt2_andrea_would_compute_otherwise_is_refused(tmp_path, config, weights, says):
    """An import computes the source model's logits or is refused in one line, nothing
    written: a GPT-2 whose LM head is its own (by its config, or a head in the file that is not
    the embedding), whose LayerNorm eps or attention scaling is not ANDREA's, imported as if it
    were, gave other logits than transformers' without a word."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "gpt2"
    hf = save_gpt2(src, **config)
    if weights == "lm_head":  # a head of its own in a file whose config says it is tied
        tensors = load_file(str(src / "model.safetensors"))
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 0.01
        save_file(tensors, str(src / "model.safetensors"), {"format": "pt"})
    elif config.get("tie_word_embeddings") is False:
        with torch.no_grad():
            hf.lm_head.weight.add_(0.01)  # untied: a head that differs from the embedding
        hf.save_pretrained(src)
    assert_user_error(andrea_main("import", "--format", "hf", str(src), "--out", "runs/x",
                                  cwd=tmp_path), says)
    assert not (tmp_path / "runs").exists()
