"""Typed configuration: YAML sections `model`, `data`, `train` loaded into dataclasses.

Every error names the file (or the `--set` override) and the dotted key, in one line, and raises
`UserError`, which the CLI turns into exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from andrea.errors import UserError
from andrea.resources import configs_dir

# Keys whose values must come from a fixed set.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.activation": ("gelu", "gelu_tanh"),
    "model.attention": ("auto", "cuda", "sdpa", "math"),
    "data.tokenizer": ("gpt2", "bpe", "byte"),
    "data.errors": ("strict", "replace"),
    "train.precision": ("auto", "bf16", "fp32"),
    "train.schedule": ("cosine", "constant", "wsd"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.activation_checkpointing": ("none", "blocks"),
    "train.optimizer": ("adamw", "muon"),
    "train.muon_ns_precision": ("auto", "bf16", "fp32"),
    "train.muon_ns_coefficients": ("quintic", "polar_express"),
    "train.parallel": ("ddp", "fsdp"),
    "train.spike_guard": ("off", "skip", "rollback"),
}


def _positive(x: Any) -> bool:
    return x > 0


def _non_negative(x: Any) -> bool:
    return x >= 0


def _fraction(x: Any) -> bool:
    return 0 <= x < 1


def _auto_or_positive(x: Any) -> bool:
    return x == "auto" or (isinstance(x, int) and x > 0)


# Keys with a constraint beyond their type: (predicate, what the value must be).
CONSTRAINTS: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "model.n_layer": (_positive, "a positive integer"),
    "model.n_head": (_positive, "a positive integer"),
    "model.head_dim": (_positive, "a positive integer"),
    "model.d_model": (_positive, "a positive integer"),
    "model.block_size": (_positive, "a positive integer"),
    "model.vocab_size": (_positive, "a positive integer"),
    "model.dropout": (_fraction, "in [0, 1)"),
    "model.init_std": (_positive, "positive"),
    "data.val_fraction": (lambda x: 0 < x < 1, "in (0, 1)"),
    "data.shard_tokens": (_positive, "a positive integer"),
    "data.workers": (_non_negative, "0 (automatic) or a positive integer"),
    "train.micro_batch_size": (_auto_or_positive, "auto or a positive integer"),
    "train.global_batch_tokens": (_non_negative, "0 (no accumulation) or a positive integer"),
    "train.batch_warmup_tokens": (_non_negative, "0 (off) or a positive integer"),
    "train.batch_warmup_steps": (_non_negative, "non-negative"),
    "train.seq_warmup_length": (_non_negative, "0 (off) or a positive integer"),
    "train.seq_warmup_steps": (_non_negative, "non-negative"),
    "train.max_steps": (_positive, "a positive integer"),
    "train.lr": (_positive, "positive"),
    "train.min_lr": (_non_negative, "non-negative"),
    "train.warmup_steps": (_non_negative, "non-negative"),
    "train.decay_fraction": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "train.weight_decay": (_non_negative, "non-negative"),
    "train.muon_lr": (_positive, "positive"),
    "train.muon_weight_decay": (_non_negative, "non-negative"),
    "train.muon_momentum": (_fraction, "in [0, 1)"),
    "train.muon_neuron_beta2": (_fraction, "in [0, 1) (0: off; NorMuon uses 0.95)"),
    "train.beta1": (_fraction, "in [0, 1)"),
    "train.beta2": (_fraction, "in [0, 1)"),
    "train.eps": (_positive, "positive"),
    "train.grad_clip": (_non_negative, "non-negative (0 turns clipping off)"),
    "train.eval_every": (_non_negative, "non-negative (0 turns evaluation off)"),
    "train.eval_tokens": (_non_negative, "0 (the whole val split) or a positive integer"),
    "train.eval_batches": (_positive, "a positive integer (deprecated: use train.eval_tokens)"),
    "train.checkpoint_every": (_non_negative, "non-negative (0: only at the end)"),
    "train.keep_last": (_positive, "a positive integer"),
    "train.log_every": (_positive, "a positive integer"),
    "train.spike_z": (_positive, "positive (a z-score, e.g. 6)"),
    "train.spike_window": (lambda x: x >= 2, "an integer of at least 2"),
    "train.spike_patience": (_positive, "a positive integer"),
    "train.spike_lr_factor": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "train.spike_lr_steps": (_non_negative, "non-negative"),
}


@dataclass
class ModelConfig:
    n_layer: int = 6
    n_head: int = 12
    head_dim: int = 32
    # Derived: n_head * head_dim. May be given, but then it must agree.
    d_model: int | None = None
    block_size: int = 256
    vocab_size: int = 4096
    dropout: float = 0.0
    bias: bool = False
    # "gelu" is the exact erf form; "gelu_tanh" the tanh approximation GPT-2 used.
    activation: str = "gelu"
    attention: str = "auto"
    init_std: float = 0.02


@dataclass
class DataConfig:
    # "shakespeare" is the embedded default corpus; anything else is a file, directory or glob.
    source: str = "shakespeare"
    tokenizer: str = "bpe"
    # Where shards go; empty means data/<source>-<tokenizer>[-<vocab>] under the working directory
    # (data/<source>-bpe-tok<hash> with tokenizer_file).
    dir: str = ""
    # For tokenizer bpe: an existing HF tokenizer.json (byte-level BPE, <|endoftext|> last) to use
    # as is instead of training one, e.g. an imported model's; empty means train one.
    tokenizer_file: str = ""
    val_fraction: float = 0.1
    shard_tokens: int = 50_000_000
    workers: int = 0
    # strict: invalid UTF-8, or a record without a string text field, stops the prepare;
    # replace: invalid bytes become U+FFFD and such records are skipped (and counted).
    errors: str = "strict"
    # The JSON field / Parquet or Arrow column that holds a record's text.
    text_field: str = "text"
    # A mixture: a list of {path, weight}; each path is prepared on its own and the loader draws
    # each training window from source i with probability weight_i / sum(weights). Empty means
    # data.source alone.
    sources: list = field(default_factory=list)


@dataclass
class TrainConfig:
    # Run name (runs/<name>); empty means the config file's stem.
    name: str = ""
    runs_dir: str = "runs"
    seed: int = 1337
    device: str = "auto"
    precision: str = "auto"
    compile: bool = False
    # Sequences per forward/backward; "auto": the largest that divides the per-process batch and
    # fits the device's memory (andrea/train/memory.py), resolved once per run and kept on resume.
    micro_batch_size: int | str = 8
    # "blocks": recompute each block's activations in backward instead of keeping them.
    activation_checkpointing: str = "none"
    # Under torchrun: "ddp" keeps a whole copy of the model, gradients and AdamW state on every
    # process; "fsdp" shards all three over the processes (FSDP2 fully_shard).
    parallel: str = "ddp"
    # Tokens per optimizer step over all processes; 0 means one micro-batch per process.
    global_batch_tokens: int = 0
    # A batch-size warm-up: the first batch_warmup_steps optimizer steps take batch_warmup_tokens
    # tokens each (fewer micro-batches), the rest global_batch_tokens; 0 and 0: off, and so is a
    # warm-up batch not below global_batch_tokens (e.g. a preset's, after --set lowers the batch).
    batch_warmup_tokens: int = 0
    batch_warmup_steps: int = 0
    # A sequence-length warm-up: the first seq_warmup_steps optimizer steps train on windows of
    # seq_warmup_length tokens (block_size / seq_warmup_length times as many a micro-batch, so
    # the tokens a step stay), the rest on block_size; 0 and 0: off, and so is a length not
    # below model.block_size. The learned positions stay (the short windows use the first ones).
    seq_warmup_length: int = 0
    seq_warmup_steps: int = 0
    max_steps: int = 1000
    lr: float = 6e-4
    min_lr: float = 6e-5
    schedule: str = "cosine"
    warmup_steps: int = 100
    # warmup-stable-decay: the fraction of max_steps spent decaying at the end.
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    eval_every: int = 100
    # The val set: this many target tokens in windows spread over the whole val split (of every
    # mixture source), the same whatever the micro-batch or process count; 0: the whole split.
    eval_tokens: int = 32768
    # Deprecated (it counted micro-batches, so the val set moved with the micro-batch size): an
    # old config's eval_batches N becomes eval_tokens = N x micro_batch_size x block_size (8 for
    # micro_batch_size auto), the tokens it named, unless eval_tokens is given too.
    eval_batches: int | None = None
    checkpoint_every: int = 200
    keep_last: int = 3
    log_every: int = 10
    skip_nonfinite: bool = False
    tensorboard: bool = False
    # adamw: AdamW for every parameter. muon: Muon for the 2-D matrices inside the blocks (its own
    # lr, weight decay and momentum below), AdamW (lr, weight_decay, betas above) for the rest.
    optimizer: str = "adamw"
    # Muon's peak learning rate; the schedule scales it as it scales train.lr.
    muon_lr: float = 0.02
    muon_weight_decay: float = 0.01
    muon_momentum: float = 0.95
    # The dtype of Muon's Newton-Schulz iterations; auto: bf16 where the device has fast bf16
    # matmuls (as for train.precision), else fp32.
    muon_ns_precision: str = "auto"
    # quintic: torch's fixed (3.4445, -4.775, 2.0315) for 5 iterations; polar_express: the
    # Polar Express paper's per-iteration minimax quintics (arXiv:2505.16932), 5 iterations.
    muon_ns_coefficients: str = "quintic"
    # NorMuon: > 0 divides each output neuron's orthogonalised update by the root of a running
    # mean (this decay) of its squares, keeping the update's norm; 0: plain Muon. Not under fsdp.
    muon_neuron_beta2: float = 0.0
    # Decay only the matrix entries whose update has the same sign (moves them towards zero too).
    muon_cautious_weight_decay: bool = False
    # Start every residual branch at zero (attention W_O and the MLP down projection), so each
    # block begins as the identity; false: GPT-2's N(0, 0.02 / sqrt(2 n_layer)).
    zero_init_output: bool = False
    # The loss-spike guard (andrea/train/spike.py, docs/training.md): off; skip (a step whose
    # loss or gradient norm is a z-score outlier against the last spike_window steps is not
    # applied); rollback (as skip, and after spike_patience outliers in a row: back to the last
    # checkpoint, lr x spike_lr_factor for spike_lr_steps steps, past the offending data).
    spike_guard: str = "skip"
    spike_z: float = 6.0
    spike_window: int = 50
    spike_patience: int = 3
    spike_lr_factor: float = 0.5
    spike_lr_steps: int = 100


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # Where the config came from (a path, or "<defaults>"); not a YAML key.
    source: str = field(default="<defaults>", compare=False)
    # The dotted keys the file or --set gave (not YAML keys): to tell a default from a choice.
    given: set[str] = field(default_factory=set, compare=False, repr=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


# A suggestion must be a likely typo (max_step -> max_steps: 0.94); at 0.5, 'nope' became
# 'compile' (0.55) and 'steps' 'eps' (0.75), which mislead more than they help.
SUGGEST_CUTOFF = 0.8


def _suggest(
    word: str, options: typing.Iterable[str], prefix: str = "", listing: str = ""
) -> str:
    """'; did you mean X?' for a close match; else, with `listing` (what the options are),
    all of them; else nothing."""
    options = list(options)
    close = difflib.get_close_matches(word, options, n=1, cutoff=SUGGEST_CUTOFF)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    return f"; {listing}: {', '.join(options)}" if listing else ""


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    args = typing.get_args(tp)
    if args:
        return " or ".join("null" if a is type(None) else names[a] for a in args)
    return names[tp]


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the field type `tp`; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) > 1:
            for option in options:
                try:
                    return _coerce(value, option, where)
                except UserError:
                    pass
            raise UserError(f"{where}: expected {_type_name(tp)}, got {value!r}")
        (tp,) = options
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads 3e-4 (no dot) as a string; accept anything Python reads as a number.
        try:
            value = float(value)
        except ValueError:
            pass
    ok = (
        (tp is bool and isinstance(value, bool))
        or (tp is int and isinstance(value, int) and not isinstance(value, bool))
        or (tp is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (tp is str and isinstance(value, str))
    )
    if not ok:
        raise UserError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    return float(value) if tp is float else value


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _sources(value: Any, where: str) -> list[dict[str, Any]]:
    """data.sources: a list of {path: str, weight: number > 0}."""
    if not isinstance(value, list):
        raise UserError(f"{where}: expected a list of {{path, weight}}, got {value!r}")
    out = []
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"path", "weight"} or "path" not in entry:
            raise UserError(
                f"{at}: expected {{path: FILE|DIR|GLOB, weight: NUMBER}}, got {entry!r}"
            )
        path = _coerce(entry["path"], str, f"{at}.path")
        weight = _coerce(entry.get("weight", 1.0), float, f"{at}.weight")
        if not weight > 0 or weight == float("inf"):
            raise UserError(f"{at}.weight: must be a number > 0, got {entry.get('weight')!r}")
        out.append({"path": path, "weight": weight})
    return out


def _apply(cfg: Config, section: str, key: str, value: Any, origin: str) -> None:
    types_ = _field_types(SECTIONS[section])
    if key not in types_:
        raise UserError(
            f"{origin}: unknown key '{section}.{key}'"
            f"{_suggest(key, types_, section + '.', f'the {section} keys are')}"
        )
    cfg.given.add(f"{section}.{key}")
    if (section, key) == ("data", "sources"):
        cfg.data.sources = _sources(value, f"{origin}: data.sources")
        return
    if value is False and "off" in CHOICES.get(f"{section}.{key}", ()):
        value = "off"  # YAML 1.1 reads a bare `off` as false
    setattr(getattr(cfg, section), key, _coerce(value, types_[key], f"{origin}: {section}.{key}"))


def validate(cfg: Config, origin: str) -> Config:
    """Check values beyond their types and fill in derived fields. Returns cfg."""
    for dotted, choices in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise UserError(
                f"{origin}: {dotted}: '{value}' is not one of {', '.join(choices)}"
                f"{_suggest(str(value), choices)}"
            )
    for dotted, (predicate, must_be) in CONSTRAINTS.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value is not None and not predicate(value):
            raise UserError(f"{origin}: {dotted}: must be {must_be}, got {value!r}")
    m = cfg.model
    derived = m.n_head * m.head_dim
    if m.d_model is not None and m.d_model != derived:
        raise UserError(
            f"{origin}: model.d_model: {m.d_model} is not n_head * head_dim = "
            f"{m.n_head} * {m.head_dim} = {derived}; drop d_model or make them agree"
        )
    m.d_model = derived
    d = cfg.data
    if d.tokenizer_file and d.tokenizer != "bpe":
        raise UserError(
            f"{origin}: data.tokenizer_file applies to data.tokenizer bpe only, not "
            f"{d.tokenizer}; set data.tokenizer=bpe or data.tokenizer_file=''"
        )
    t = cfg.train
    if t.name and (t.name in (".", "..") or "/" in t.name or "\\" in t.name):
        raise UserError(
            f"{origin}: train.name: {t.name!r} is not a folder name; a run lives in "
            f"train.runs_dir/train.name, so set train.runs_dir for the place and train.name "
            f"without '/' for the run"
        )
    if t.eval_batches is not None:
        if "train.eval_tokens" not in cfg.given:
            micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else 8
            t.eval_tokens = t.eval_batches * micro * m.block_size
        t.eval_batches = None
    if t.min_lr > t.lr:
        raise UserError(f"{origin}: train.min_lr: {t.min_lr} is above train.lr = {t.lr}")
    if bool(t.batch_warmup_tokens) != bool(t.batch_warmup_steps):
        raise UserError(
            f"{origin}: train.batch_warmup_tokens ({t.batch_warmup_tokens}) and "
            f"train.batch_warmup_steps ({t.batch_warmup_steps}) go together: set both for a "
            f"batch-size warm-up, or both to 0"
        )
    if t.batch_warmup_tokens and not t.global_batch_tokens:
        raise UserError(
            f"{origin}: train.batch_warmup_tokens: {t.batch_warmup_tokens} needs "
            f"train.global_batch_tokens, the batch it warms up to (0 is one micro-batch per "
            f"process); set it, or set both batch_warmup keys to 0"
        )
    if bool(t.seq_warmup_length) != bool(t.seq_warmup_steps):
        raise UserError(
            f"{origin}: train.seq_warmup_length ({t.seq_warmup_length}) and "
            f"train.seq_warmup_steps ({t.seq_warmup_steps}) go together: set both for a "
            f"sequence-length warm-up, or both to 0"
        )
    if 0 < t.seq_warmup_length < m.block_size and m.block_size % t.seq_warmup_length:
        raise UserError(
            f"{origin}: train.seq_warmup_length: {t.seq_warmup_length} does not divide "
            f"model.block_size {m.block_size} (a micro-batch's windows are cut into shorter "
            f"ones of the same tokens); pick a divisor, e.g. {m.block_size // 2}"
        )
    return cfg


def resolve_path(name: str | Path) -> Path:
    """A path that exists, else a bundled preset by bare name (with or without .yaml)."""
    path = Path(name)
    if path.exists():
        return path
    if path.name == str(name):  # a bare name, no directory part
        for candidate in (configs_dir() / path.name, configs_dir() / f"{path.name}.yaml"):
            if candidate.is_file():
                return candidate
    presets = ", ".join(sorted(p.name for p in configs_dir().glob("*.yaml")))
    raise UserError(f"{name}: no such config file, and no bundled preset by that name ({presets})")


def parse_override(text: str) -> tuple[str, str, Any]:
    """'train.lr=3e-4' -> ('train', 'lr', 0.0003). Values are parsed as YAML scalars."""
    origin = f"--set {text}"
    if "=" not in text:
        raise UserError(f"{origin}: expected SECTION.KEY=VALUE, e.g. train.lr=3e-4")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or parts[0] not in SECTIONS:
        raise UserError(
            f"{origin}: '{dotted}' is not SECTION.KEY with SECTION one of {', '.join(SECTIONS)}"
            f"{_suggest(parts[0], SECTIONS)}"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise UserError(f"{origin}: value is not valid YAML: {exc}") from None
    return parts[0], parts[1], value


def from_dict(data: Any, origin: str) -> Config:
    """Build a Config from parsed YAML (no validation of values yet)."""
    cfg = Config(source=origin)
    if data is None:
        return cfg
    if not isinstance(data, dict):
        raise UserError(f"{origin}: expected a mapping with sections {', '.join(SECTIONS)}")
    for section, body in data.items():
        if section not in SECTIONS:
            raise UserError(
                f"{origin}: unknown section '{section}'{_suggest(str(section), SECTIONS)}"
            )
        if body is None:
            continue
        if not isinstance(body, dict):
            raise UserError(f"{origin}: section '{section}' must be a mapping of keys to values")
        for key, value in body.items():
            _apply(cfg, section, str(key), value, origin)
    return cfg


def load_config(name: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load a YAML config (path or bundled preset name), apply `--set` overrides, validate."""
    if name is None:
        cfg = Config()
        origin = "<defaults>"
    else:
        path = resolve_path(name)
        origin = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"{path}: cannot read config: {exc}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise UserError(f"{path}: YAML syntax error{line}: {problem}") from None
        cfg = from_dict(data, origin)
        if not cfg.train.name:
            cfg.train.name = path.stem
    for text in overrides:
        section, key, value = parse_override(text)
        _apply(cfg, section, key, value, f"--set {text}")
    return validate(cfg, origin if not overrides else f"{origin} (with --set overrides)")


def config_from_dict(data: dict[str, Any], origin: str = "<dict>") -> Config:
    """A validated Config from a plain dict, e.g. the metadata stored in a checkpoint."""
    return validate(from_dict(data, origin), origin)
