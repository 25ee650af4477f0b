"""`andrea export --format hf` and `andrea import --format hf`: Hugging Face GPT-2 directories.

ANDREA is GPT-2's architecture, so a checkpoint maps onto `transformers.GPT2LMHeadModel` name by
name. GPT-2 stores its projections as Conv1D, weight [in, out]: the transpose of nn.Linear's
[out, in]. ANDREA has no biases by default; the export writes zeros where GPT-2 has a bias, and
the import drops biases that are all zero (and refuses non-zero ones unless the config enables
biases, since dropping them would change the model). The activation maps as "gelu" (exact erf
form) <-> transformers "gelu", and "gelu_tanh" <-> "gelu_new" (the tanh approximation). Both use
LayerNorm eps 1e-5. Dropout maps to all three GPT-2 dropouts (resid, embd, attn).

Export writes (into a temporary folder renamed into place):
- config.json, model.safetensors (float32, GPT-2 key names, LM head tied: stored once as wte);
- the tokenizer: gpt2 -> vocab.json + merges.txt (GPT-2's own files); bpe -> its tokenizer.json
  (byte for byte, so its identity survives); byte -> no tokenizer files (transformers has no
  such tokenizer; andrea.json names it);
- andrea.json: the full andrea config (its data.dir and data.tokenizer_file, folders of the
  exporter's machine, left empty), tokenizer identity and step, so an import restores them.

Import makes a run directory `runs/<name>/` (config.yaml, `latest`, step-000000/ with the weights,
an empty optimizer state and step 0) that `andrea eval`/`generate`/`export` read and that
`andrea train --resume runs/<name>` fine-tunes (the run's config.yaml holds the schedule; change
it with --set at import or resume). A bpe tokenizer.json is copied into the run directory, and
the run's config points `data.tokenizer_file` at that copy (absolute path) with `data.dir` reset
to the derived default: the fine-tuning data is then prepared with the model's own tokenizer
(same identity) instead of a newly trained BPE, in data/<source>-bpe-tok<hash>. Every import
drops the exporter's `data.dir` (andrea.json is untrusted: it would name the folder the run's
eval, generate and train write) for the derived default, unless `--set data.dir=...` names one.
`andrea eval`, `generate` and `train` prepare a missing data folder from the run's config. Pick
the data with `--set data.source=...` at import (or at resume). The shape config.json gives
must be the shape model.safetensors holds (checked from its header before anything is built).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes

from andrea.config import Config, config_from_dict, parse_override
from andrea.config.load import RUN_NAME_MAX_BYTES
from andrea.data.tokenizer import (
    BPE_FILE,
    EOT_TEXT,
    KINDS,
    BpeTokenizer,
    ByteTokenizer,
    Gpt2Tokenizer,
    gpt2_vocab_files,
    read_tokenizer_file,
)
from andrea.errors import UserError, quoted
from andrea.fileio import atomic_write_bytes, atomic_write_text, file_in_the_way
from andrea.model.params import check_stored_shape
from andrea.model.transformer import Andrea
from andrea.train import checkpoint as ckpt_io
from andrea.train.rundir import (
    CONFIG,
    TrainerState,
    describe_run,
    is_run,
    not_a_run,
    step_dir_name,
    step_dirs,
    stored_shapes,
)
from andrea.train.runlock import RunLock

EXPORT_FORMAT = "andrea-hf-export/1"
ANDREA_FILE = "andrea.json"
WEIGHTS_FILE = "model.safetensors"
LN_EPS = 1e-5  # torch.nn.LayerNorm's default, which ANDREA uses; GPT-2's layer_norm_epsilon
ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new"}  # ours -> transformers
ACTIVATIONS_IN = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
GPT2_IDENTITY = Gpt2Tokenizer.identity
# Model keys the shape comes from; at import they are read from config.json, never --set.
SHAPE_KEYS = ("n_layer", "n_head", "head_dim", "d_model", "block_size", "vocab_size",
              "activation")

# (ours, GPT-2's, is Conv1D) per block; ours without "blocks.{i}.", GPT-2's without "h.{i}.".
BLOCK_MAP = [
    ("ln1.weight", "ln_1.weight", False),
    ("ln1.bias", "ln_1.bias", False),
    ("attn.qkv.weight", "attn.c_attn.weight", True),
    ("attn.qkv.bias", "attn.c_attn.bias", False),
    ("attn.out.weight", "attn.c_proj.weight", True),
    ("attn.out.bias", "attn.c_proj.bias", False),
    ("ln2.weight", "ln_2.weight", False),
    ("ln2.bias", "ln_2.bias", False),
    ("mlp.up.weight", "mlp.c_fc.weight", True),
    ("mlp.up.bias", "mlp.c_fc.bias", False),
    ("mlp.down.weight", "mlp.c_proj.weight", True),
    ("mlp.down.bias", "mlp.c_proj.bias", False),
]
TOP_MAP = [
    ("tok_emb.weight", "wte.weight"),
    ("pos_emb.weight", "wpe.weight"),
    ("ln_f.weight", "ln_f.weight"),
    ("ln_f.bias", "ln_f.bias"),
]


def key_map(n_layer: int) -> list[tuple[str, str, bool]]:
    """(ANDREA key, GPT-2 key without the 'transformer.' prefix, transpose?) for every tensor."""
    out = [(ours, theirs, False) for ours, theirs in TOP_MAP]
    for i in range(n_layer):
        out += [(f"blocks.{i}.{o}", f"h.{i}.{t}", conv) for o, t, conv in BLOCK_MAP]
    return out


def bias_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Shapes of the biases a GPT-2 of this shape has, by ANDREA key."""
    d = cfg.model.d_model
    sizes = {"ln1": d, "ln2": d, "attn.qkv": 3 * d, "attn.out": d, "mlp.up": 4 * d, "mlp.down": d}
    out = {"ln_f.bias": (d,)}
    for i in range(cfg.model.n_layer):
        out.update({f"blocks.{i}.{name}.bias": (n,) for name, n in sizes.items()})
    return out


# ----------------------------------------------------------------------------- export


def hf_config(cfg: Config, eot_id: int) -> dict[str, Any]:
    m = cfg.model
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab_size,
        "n_positions": m.block_size,
        "n_ctx": m.block_size,
        "n_embd": m.d_model,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_inner": None,  # 4 * n_embd, as ANDREA
        "activation_function": ACTIVATIONS[m.activation],
        "resid_pdrop": m.dropout,
        "embd_pdrop": m.dropout,
        "attn_pdrop": m.dropout,
        "layer_norm_epsilon": LN_EPS,
        "initializer_range": m.init_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def to_hf_tensors(tensors: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """ANDREA weights -> GPT-2 names and layout (float32; zero biases where ANDREA has none)."""
    biases = bias_shapes(cfg)
    out = {}
    for ours, theirs, conv in key_map(cfg.model.n_layer):
        if ours in tensors:
            t = tensors[ours].to(torch.float32)
        elif ours in biases:
            t = torch.zeros(biases[ours], dtype=torch.float32)
        else:
            raise UserError(f"checkpoint lacks tensor '{ours}'")
        out[f"transformer.{theirs}"] = (t.t() if conv else t).contiguous()
    return out


def _write_tokenizer(tok, out: Path, cfg: Config) -> str | None:
    """The tokenizer's files in the export; where transformers has none, why, in words."""
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
    kind = KINDS[tok.name]
    if kind.hf_class is None:  # byte: andrea.json names it
        return (f"transformers has no {tok.name} tokenizer; its ids are the text's UTF-8 bytes, "
                f"end-of-text {tok.eot_id}")
    for name, path in kind.hf_files(tok).items():
        shutil.copyfile(path, out / name)
    config: dict[str, Any] = {"tokenizer_class": kind.hf_class}
    if kind.hf_vocab is not None:  # GPT-2's own files: its tokenizer's settings
        config["add_prefix_space"] = False
    config.update(special, model_max_length=cfg.model.block_size)
    atomic_write_text(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    atomic_write_text(out / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
    return None


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished tmp folder to out, replacing what is there only at the last moment."""
    if out.exists() or out.is_symlink():
        stale = _beside(out, "stale")
        out.rename(stale)
        tmp.rename(out)
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    else:
        tmp.rename(out)


def export_entries() -> frozenset[str]:
    """Every name an export folder holds, whatever its tokenizer (export_hf writes them)."""
    tokenizer_files = {name for kind in KINDS.values()
                       for name in ([kind.file] if kind.file else
                                    kind.hf_vocab() if kind.hf_vocab else [])}
    return frozenset({WEIGHTS_FILE, "config.json", "generation_config.json", ANDREA_FILE,
                      "tokenizer_config.json", "special_tokens_map.json", *tokenizer_files})


class HoldsUsersFiles(Exception):
    """What --force would replace is andrea's, but it holds a user's files too (said in
    words): --force would delete them with it."""


def _earlier_export(out: Path) -> str | None:
    """What an earlier `andrea export` folder at `out` holds, in words; None when `out` is not
    one (andrea.json of this format is how an export says it is one). HoldsUsersFiles when
    anything was added to it since (a model card, notes)."""
    try:
        andrea = json.loads((out / ANDREA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(andrea, dict) or andrea.get("format") != EXPORT_FORMAT:
        return None
    written = export_entries()
    added = sorted(e.name for e in out.iterdir() if e.name not in written)
    if added:
        shown = ", ".join(added[:3]) + (", ..." if len(added) > 3 else "")
        raise HoldsUsersFiles(f"holds an earlier export and {shown}, which no export holds")
    return f"the export in {out} (of {andrea.get('source_checkpoint')})"


def _earlier_run(out: Path) -> str | None:
    """What an andrea run folder at `out` holds, in words; None when nothing of a run is
    there. HoldsUsersFiles when it also holds what a run never does (rundir.not_a_run)."""
    if not (is_run(out) or step_dirs(out)):
        return None
    if (problem := not_a_run(out)) is not None:
        raise HoldsUsersFiles(problem)
    return f"the run in {out} ({describe_run(out)})"


def _replacing(out: Path, force: bool, earlier: Callable[[Path], str | None],
               said: str = "", instead: str = "pick another path") -> str | None:
    """What writing `out` will replace, said in a line before it goes; None when nothing is
    there (or an empty folder). --force replaces only what this command wrote there before
    (`earlier` describes it): a file, a link or a folder of anything else is never deleted,
    so a mistyped --out cannot take a user's own folder with it. `said`: how the refusal names
    `out` (its --out by default); `instead`: the way out it offers besides --force."""
    said = said or f"--out {out}"
    if not (out.exists() or out.is_symlink()):
        return None
    is_folder = out.is_dir() and not out.is_symlink()
    if is_folder and not any(out.iterdir()):
        return None
    try:
        what = earlier(out) if is_folder else None
    except HoldsUsersFiles as exc:
        raise UserError(f"{said}: {exc}; --force replaces only what andrea wrote, never a "
                        f"user's files: {instead}, or move them away by hand") from None
    if what is None:
        held = sorted(p.name for p in out.iterdir())[:3] if is_folder else []
        kind = (f"a folder holding {', '.join(held)}{', ...' if len(held) == 3 else ''}"
                if is_folder else "a link" if out.is_symlink() else "a file")
        raise UserError(f"{said}: already exists as {kind}, which this command did not write "
                        f"and never replaces; {instead}, or move it away by hand")
    if not force:
        raise UserError(f"{said}: already exists; {instead}, or pass --force to replace it")
    return f"--force: replacing {what}"


def _out_folder(out: Path, said: str, instead: str) -> Path:
    """The folder to write for `out`: refused in one line when it is the working directory
    or holds it. Export and import assemble a folder beside `out` (`_beside`) and rename
    it into place, so `.` or `..` named nothing to write beside (a ValueError traceback), and
    replacing the working directory would leave the shell in a deleted folder. `said`: how the
    refusal names `out`; `instead`: the way out it offers."""
    here, where = Path.cwd().resolve(), out.resolve()
    if where == here:
        raise UserError(f"{said}: is the working directory, {where}, which this command cannot "
                        f"write in place (it writes a new folder and renames it there); "
                        f"{instead}, or run it from {where.parent} with --out {where.name}")
    if where in here.parents:
        raise UserError(f"{said}: holds the working directory; {where} cannot be written in "
                        f"place (the command writes a new folder and renames it there); "
                        f"{instead}")
    out = where if out.name in ("", ".", "..") else out  # 'a/..': the folder it names
    if (size := len(os.fsencode(out.name))) > RUN_NAME_MAX_BYTES:
        raise UserError(f"{said}: its name is {size} bytes long; a folder name takes at most "
                        f"{RUN_NAME_MAX_BYTES} bytes: {instead}")
    return out


def _beside(out: Path, what: str) -> Path:
    """A hidden folder beside `out`, named for it, `what` it is ("tmp": the export or import
    being written, renamed to `out` when whole; "stale": the `out` it replaces, on its way out)
    and this process: `.NAME.WHAT-PID`, NAME cut to keep it within a folder name's 255 bytes
    (an `out` of 250 bytes was an OSError traceback)."""
    suffix = f".{what}-{os.getpid()}"
    name = os.fsencode(out.name)[:RUN_NAME_MAX_BYTES - 1 - len(suffix)]
    return out.with_name(f".{os.fsdecode(name)}{suffix}")


def export_hf(checkpoint: str | None, out: str | Path, force: bool = False) -> Path:
    """Write a transformers GPT2LMHeadModel directory for the checkpoint; returns the dir."""
    from andrea.trained import find_checkpoint, tokenizer_for_checkpoint

    out = _out_folder(Path(out), f"--out {out}", "pick another path")
    replacing = _replacing(out, force, _earlier_export)
    ckpt = find_checkpoint(
        checkpoint, use=f"andrea export --checkpoint {{}} --out {shlex.quote(str(out))}")
    tensors, cfg, metadata = ckpt_io.read_model_checkpoint(ckpt)
    # An export is made to be shared: a diverged model is not one to hand on.
    ckpt_io.check_weights(tensors, ckpt / ckpt_io.MODEL_FILE,
                          "export another checkpoint (an earlier step of the run)")
    tok = tokenizer_for_checkpoint(ckpt, cfg, metadata)
    tmp = _beside(out, "tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:  # under a file, or a folder that may not be written
        why = file_in_the_way(tmp.parent) or exc.strerror or exc
        raise UserError(f"--out {out}: cannot write there: {why}") from None
    try:
        hf_tensors = to_hf_tensors(tensors, cfg)
        # transformers reads safetensors only with metadata format "pt".
        blob = safetensors_bytes(hf_tensors, {"format": "pt"})
        atomic_write_bytes(tmp / WEIGHTS_FILE, blob)
        config = hf_config(cfg, tok.eot_id)
        atomic_write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        generation = {"bos_token_id": tok.eot_id, "eos_token_id": tok.eot_id}
        atomic_write_text(tmp / "generation_config.json", json.dumps(generation, indent=2) + "\n")
        without = _write_tokenizer(tok, tmp, cfg)
        config = cfg.to_dict()
        # Folders of this machine, which an import derives anew (the tokenizer is the export's
        # own file): not written into a folder meant for others.
        config["data"].update(dir="", tokenizer_file="")
        andrea = {
            "format": EXPORT_FORMAT,
            "tokenizer": metadata["tokenizer"],
            "step": int(metadata.get("step", 0)),
            "source_checkpoint": str(ckpt),
            "config": config,
        }
        atomic_write_text(tmp / ANDREA_FILE, json.dumps(andrea, indent=2) + "\n")
        if replacing:
            print(replacing, flush=True)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if without:
        print(f"note: no tokenizer files in {out}: {without}", flush=True)
    return out


# ----------------------------------------------------------------------------- import


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


# GPT2Config's defaults for the keys import reads, where a config.json leaves one out (a
# dropout excepted: 0, ANDREA's, rather than GPT2Config's 0.1).
HF_DEFAULTS: dict[str, Any] = {
    "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257,
    "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
    "resid_pdrop": 0.0, "initializer_range": 0.02, "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
    "tie_word_embeddings": True,
}
HF_WHOLE = ("n_embd", "n_head", "n_layer", "n_positions", "vocab_size")
HF_FLAGS = ("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "add_cross_attention",
            "tie_word_embeddings")


def _is_number(value: Any) -> bool:
    """A finite JSON number (json.loads reads NaN and Infinity too; a bool is no number)."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _hf_types(hf: dict[str, Any]) -> list[str]:
    """What is wrong with the type or range of each key import reads from config.json, in
    words naming the key and its value; checked before any of them is computed with (a
    stranger's n_head of 0 or "12" was a ZeroDivisionError or TypeError traceback)."""
    problems = []
    for key in HF_WHOLE:
        value = hf.get(key, HF_DEFAULTS[key])
        if not (_is_number(value) and isinstance(value, int) and value >= 1):
            problems.append(f"{key} {quoted(value)} is not a whole number of at least 1")
    inner = hf.get("n_inner")
    if inner is not None and not (_is_number(inner) and isinstance(inner, int)):
        problems.append(f"n_inner {quoted(inner)} is not a whole number (or null: 4 * n_embd)")
    act = hf.get("activation_function", HF_DEFAULTS["activation_function"])
    if not isinstance(act, str) or act not in ACTIVATIONS_IN:
        problems.append(f"activation_function {quoted(act)} is not one of "
                        f"{', '.join(ACTIVATIONS_IN)}")
    eps = hf.get("layer_norm_epsilon", HF_DEFAULTS["layer_norm_epsilon"])
    if not _is_number(eps):
        problems.append(f"layer_norm_epsilon {quoted(eps)} is not a number (ANDREA's is {LN_EPS})")
    dropout = hf.get("resid_pdrop", HF_DEFAULTS["resid_pdrop"])
    if not (_is_number(dropout) and 0 <= dropout < 1):
        problems.append(f"resid_pdrop {quoted(dropout)} is not a dropout probability in [0, 1)")
    std = hf.get("initializer_range", HF_DEFAULTS["initializer_range"])
    if not (_is_number(std) and std > 0):
        problems.append(f"initializer_range {quoted(std)} is not a positive number")
    for key in HF_FLAGS:
        if not isinstance(hf.get(key, HF_DEFAULTS[key]), bool):
            problems.append(f"{key} {quoted(hf[key])} is not true or false")
    return problems


def read_hf_config(src: Path) -> dict[str, Any]:
    """config.json of a GPT-2 model, checked for what ANDREA can represent, with
    HF_DEFAULTS for the keys it leaves out: every key import_config reads is there, of the
    type and in the range it needs."""
    path = src / "config.json"
    if not path.is_file():
        raise UserError(f"{src}: not a Hugging Face model directory (no config.json)")
    hf = _read_json(path)
    archs = hf.get("architectures")
    if archs is None:
        archs = []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise UserError(f'{path}: architectures {quoted(archs)} is not a list of model class '
                        f'names, as ["GPT2LMHeadModel"]; andrea imports only GPT-2-architecture '
                        f'models')
    if hf.get("model_type") != "gpt2" or any(not a.startswith("GPT2") for a in archs):
        raise UserError(
            f"{path}: model_type {hf.get('model_type')!r} "
            f"({', '.join(archs) or 'no architectures'}) is not GPT-2; andrea imports only "
            "GPT-2-architecture models (GPT2LMHeadModel)"
        )
    problems = _hf_types(hf)
    if problems:
        raise UserError(f"{path}: cannot import: {'; '.join(problems)}; write "
                        f"{'it' if len(problems) == 1 else 'each'} as transformers' GPT2Config "
                        f"does")
    hf = {**HF_DEFAULTS, **hf}
    n_embd, n_head = hf["n_embd"], hf["n_head"]
    if n_embd % n_head:
        problems.append(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
    if hf["n_inner"] not in (None, 4 * n_embd):
        problems.append(f"n_inner {hf['n_inner']} is not 4 * n_embd (ANDREA's MLP width)")
    if abs(hf["layer_norm_epsilon"] - LN_EPS) > 1e-12:
        problems.append(f"layer_norm_epsilon {hf['layer_norm_epsilon']} is not ANDREA's {LN_EPS}")
    if not hf["scale_attn_weights"] or hf["scale_attn_by_inverse_layer_idx"]:
        problems.append("attention scaling other than 1/sqrt(head_dim)")
    if hf["add_cross_attention"]:
        problems.append("cross-attention layers")
    if not hf["tie_word_embeddings"]:
        problems.append("an LM head not tied to the token embedding")
    if problems:
        raise UserError(f"{path}: cannot import: {'; '.join(problems)}")
    return hf


def hf_shapes(src: Path) -> dict[str, list[int]]:
    """Each tensor's shape in model.safetensors by GPT-2 key (no 'transformer.' prefix), from
    its header alone: a forged or truncated header is refused before anything is read."""
    path = src / WEIGHTS_FILE
    if not path.is_file():
        other = [p.name for p in src.glob("*.bin")] + [p.name for p in src.glob("*.index.json")]
        hint = (f" (found {', '.join(other)}: save it with safe_serialization, unsharded)"
                if other else "")
        raise UserError(f"{src}: no {WEIGHTS_FILE}{hint}")
    return {key.removeprefix("transformer."): shape for key, shape in stored_shapes(path).items()}


def read_hf_weights(src: Path) -> dict[str, torch.Tensor]:
    """model.safetensors as GPT-2 keys without the 'transformer.' prefix (attention-mask
    buffers dropped; an untied lm_head refused)."""
    path = src / WEIGHTS_FILE
    hf_shapes(src)  # the header is sound before the file is read
    try:
        raw = safetensors_load(path.read_bytes())
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable safetensors file: {exc}") from None
    kept = {key: value for key, value in raw.items()
            # old transformers saved the causal mask as a buffer
            if not (key.endswith((".attn.bias", ".attn.masked_bias")) and value.dim() != 1)}
    # Before any tensor is compared or converted (to float32), named as the file names it:
    # NaN differs from itself (the lm_head check below), and integers would import as if
    # they were weights.
    ckpt_io.check_weights(kept, path, "export or save the model again from sound weights")
    tensors = {key.removeprefix("transformer."): value for key, value in kept.items()}
    head = tensors.pop("lm_head.weight", None)
    wte = tensors.get("wte.weight")
    if head is not None and wte is not None and not torch.equal(head, wte):
        raise UserError(f"{path}: lm_head.weight differs from wte.weight; ANDREA ties them")
    return tensors


def detect_tokenizer(src: Path, andrea: dict[str, Any] | None) -> tuple[str, Path | None]:
    """(tokenizer identity, tokenizer.json to copy or None) from the directory's files."""
    vocab = src / "vocab.json"
    found: tuple[str, Path | None] | None = None
    if vocab.is_file():
        ours = json.loads(gpt2_vocab_files()[0].read_text(encoding="utf-8"))
        if _read_json(vocab) == ours:
            found = (GPT2_IDENTITY, None)
    if found is None and (src / BPE_FILE).is_file():
        # The checks of data.tokenizer_file, which the run's copy of it becomes: a file that
        # fine-tuning would refuse is refused here, named as the import's.
        tok = read_tokenizer_file(src / BPE_FILE, key="")[1]
        found = (tok.identity, src / BPE_FILE)
    said = andrea.get("tokenizer") if andrea else None
    if said == ByteTokenizer.identity:
        return said, None
    if found is None:
        raise UserError(
            f"{src}: no tokenizer andrea can use (GPT-2's vocab.json + merges.txt, or a "
            f"byte-level BPE tokenizer.json with {EOT_TEXT} as its last id)"
        )
    if said is not None and said != found[0]:
        raise UserError(
            f"{src / ANDREA_FILE}: names tokenizer {said}, but the directory's files are {found[0]}"
        )
    return found


def import_config(
    src: Path, hf: dict[str, Any], andrea: dict[str, Any] | None, tokenizer: str,
    name: str, runs_dir: str, overrides: list[str], tokenizer_file: str = "",
) -> Config:
    """The run's config: andrea.json's (if exported by andrea) or the defaults, with the
    model's shape from config.json and the --set overrides. `tokenizer_file` (bpe): the run's
    copy of the model's tokenizer.json, which the run's data is then prepared with. `hf`:
    read_hf_config's (its keys checked, with defaults)."""
    data = json.loads(json.dumps(andrea.get("config"))) if andrea else {}
    sections = ("model", "data", "train")
    if not (isinstance(data, dict) and all(isinstance(data.get(s, {}), dict) for s in sections)):
        raise UserError(
            f"{src / ANDREA_FILE}: 'config' is not an object of model, data and train sections "
            f"as andrea export writes it; the file is damaged: export the model again (a model "
            f"with its tokenizer's files imports from config.json alone, {ANDREA_FILE} moved "
            f"away)")
    for section in sections:
        data.setdefault(section, {})
    n_embd, n_head = hf["n_embd"], hf["n_head"]  # read_hf_config's: checked, defaults in
    data["model"].update(
        n_layer=hf["n_layer"], n_head=n_head, head_dim=n_embd // n_head, d_model=n_embd,
        block_size=hf["n_positions"], vocab_size=hf["vocab_size"],
        activation=ACTIVATIONS_IN[hf["activation_function"]],
    )
    if andrea is None:
        data["model"].update(dropout=float(hf["resid_pdrop"]),
                             init_std=float(hf["initializer_range"]))
    data["data"]["tokenizer"] = tokenizer.split(":", 1)[0]
    data["data"]["tokenizer_file"] = tokenizer_file
    # andrea.json is untrusted: its data.dir names a folder of the exporter's choosing, which
    # the run's eval, generate and train would then write. The run's data folder is derived
    # here (data/<source>-<tokenizer>...), unless --set data.dir names one.
    data["data"]["dir"] = ""
    data["train"].update(name=name, runs_dir=runs_dir)
    for text in overrides:
        section, key, value = parse_override(text)
        if section == "model" and key in SHAPE_KEYS:
            raise UserError(f"--set {text}: the model's shape comes from {src / 'config.json'}")
        data[section][key] = value  # parse_override allows only model, data, train
    return config_from_dict(data, f"{src} (imported{' with --set overrides' if overrides else ''})")


def from_hf_tensors(
    hf_tensors: dict[str, torch.Tensor], cfg: Config, src: Path
) -> dict[str, torch.Tensor]:
    """GPT-2 tensors -> ANDREA names and layout; biases kept only when cfg enables them."""
    biases = bias_shapes(cfg)
    out = {}
    for ours, theirs, conv in key_map(cfg.model.n_layer):
        t = hf_tensors.get(theirs)
        if t is None:
            if ours in biases:
                continue  # a GPT-2 without biases: ANDREA's own layout
            raise UserError(f"{src / WEIGHTS_FILE}: tensor '{theirs}' is missing")
        t = t.to(torch.float32)
        if ours in biases and not cfg.model.bias:
            if torch.count_nonzero(t):
                raise UserError(
                    f"{src / WEIGHTS_FILE}: '{theirs}' is non-zero (max |b| "
                    f"{t.abs().max().item():.3g}) and ANDREA's config has no biases; dropping "
                    f"them would change the model: import with --set model.bias=true"
                )
            continue
        out[ours] = (t.t() if conv else t).contiguous()
    if cfg.model.bias:
        for ours, shape in biases.items():  # a bias-free source into a biased config: zeros
            out.setdefault(ours, torch.zeros(shape))
    known = {theirs for _, theirs, _ in key_map(cfg.model.n_layer)}
    extra = sorted(set(hf_tensors) - known)
    if extra:
        raise UserError(
            f"{src / WEIGHTS_FILE}: unexpected tensors for GPT-2: {', '.join(extra[:5])}"
        )
    return out


def import_hf(
    src: str | Path, out: str | Path | None = None, overrides: list[str] | None = None,
    force: bool = False,
) -> Path:
    """Make a run directory (default runs/<src name>) from a GPT-2 directory; returns the
    checkpoint folder (see the module doc)."""
    src = Path(src)
    if not src.is_dir():
        what = "not a directory" if src.exists() else "no such directory"
        raise UserError(f"{src}: {what}; give the folder an export or a GPT-2 model is in")
    hf = read_hf_config(src)
    andrea_path = src / ANDREA_FILE
    andrea = _read_json(andrea_path) if andrea_path.is_file() else None
    if andrea is not None and andrea.get("format") != EXPORT_FORMAT:
        raise UserError(
            f"{andrea_path}: format {andrea.get('format')!r}, expected {EXPORT_FORMAT!r}"
        )
    run_dir = Path(out) if out is not None else Path("runs") / src.resolve().name
    # A folder the user never named is said to be the default, as the way out.
    said = "" if out is not None else (
        f"{run_dir} (the default --out, named after {src.resolve().name})")
    run_dir = _out_folder(run_dir, said or f"--out {out}", "pass --out runs/NAME")
    replacing = _replacing(run_dir, force, _earlier_run, said,
                           "pass --out runs/NAME for another run")
    # The run's lock first, as a training takes it: a run a training writes is never replaced.
    with RunLock(run_dir, instead="import into another run with --out runs/NAME"):
        return _import_into(src, run_dir, hf, andrea, list(overrides or []), replacing)


def _import_into(
    src: Path, run_dir: Path, hf: dict[str, Any], andrea: dict[str, Any] | None,
    overrides: list[str], replacing: str | None,
) -> Path:
    """import_hf's work, holding the run's lock: the config and weights read and checked, the
    run assembled in a temporary folder beside `run_dir`, then put in its place (`replacing`
    said first); the checkpoint folder."""
    identity, tokenizer_json = detect_tokenizer(src, andrea)
    # The run's own copy of a BPE tokenizer.json prepares its fine-tuning data (same identity).
    run_tokenizer = str((run_dir / BPE_FILE).resolve()) if tokenizer_json is not None else ""
    cfg = import_config(src, hf, andrea, identity, run_dir.name, str(run_dir.parent),
                        overrides, run_tokenizer)
    from andrea.data.prepare import check_vocab

    n_ids = KINDS[cfg.data.tokenizer].fixed_vocab
    if tokenizer_json is not None:
        n_ids = BpeTokenizer(tokenizer_json).vocab_size
    check_vocab(n_ids or 0, cfg.model.vocab_size, f"{src / 'config.json'}: vocab_size")
    check_stored_shape(cfg.model, hf_shapes(src), str(src / "config.json"),
                       names=("wte.weight", "wpe.weight", "h."))
    tensors = from_hf_tensors(read_hf_weights(src), cfg, src)
    ckpt_io.load_weights(Andrea(cfg.model), tensors, src / WEIGHTS_FILE)  # names and shapes

    tmp = _beside(run_dir, "tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        rng = {"cpu.rank0": torch.Generator().manual_seed(cfg.train.seed).get_state()}
        state = TrainerState(
            step=0, seed=cfg.train.seed, preset="imported", imported_from=str(src.resolve()),
            imported_sha256=hashlib.sha256((src / WEIGHTS_FILE).read_bytes()).hexdigest(),
        )
        carried = {BPE_FILE: tokenizer_json.read_bytes()} if tokenizer_json is not None else {}
        ckpt_io.save_checkpoint(tmp, state, cfg, identity, model=tensors, optimizer={}, rng=rng,
                                keep_last=1, files=carried)
        atomic_write_text(tmp / CONFIG, cfg.to_yaml())
        if tokenizer_json is not None:
            shutil.copyfile(tokenizer_json, tmp / BPE_FILE)
        if replacing:
            print(replacing, flush=True)
        _replace_dir(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run_dir / step_dir_name(0)
