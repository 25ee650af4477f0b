"""Loading and validating configs: YAML or a dict, `--set` overrides, the checks of values.

Every error names the file (or the `--set` override) and the dotted key, in one line, and raises
`UserError`, which the CLI turns into exit code 2. What each key allows is declared once, in
andrea/config/sections.py; this module applies the declarations.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from andrea.config.declare import (
    AS_DEFAULT,
    Check,
    KeySpec,
    Registered,
    registered,
    section_keys,
    type_name,
)
from andrea.config.sections import SECTIONS, Config, key_specs
from andrea.errors import UserError
from andrea.resources import configs_dir

# A suggestion must be a likely typo (max_step -> max_steps: 0.94); at 0.5, 'nope' became
# 'compile' (0.55) and 'steps' 'eps' (0.75), which mislead more than they help.
SUGGEST_CUTOFF = 0.8
# The longest name of one folder (NAME_MAX) on Linux's file systems (ext4, xfs, btrfs, tmpfs),
# in bytes of the file system's encoding. The run folder is runs_dir/train.name itself: the
# trainer puts what it adds (step-N.partial-PID, .andrea-overwritten, ...) inside that folder,
# never beside it under a longer name, so the whole limit is train.name's.
RUN_NAME_MAX_BYTES = 255
INT64 = 2**63  # an integer key's values lie in [-INT64, INT64)


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


def _suggest_key(parts: list[str]) -> str:
    """'; did you mean X?' for a dotted name that is no SECTION.KEY: a key its last part names
    in its section (`train.optimzer.lr`: train.lr), else the closest key, else the closest
    section."""
    keys = [spec.dotted for spec in key_specs()]
    if parts[0] in SECTIONS and len(parts) > 2 and f"{parts[0]}.{parts[-1]}" in keys:
        return f"; did you mean '{parts[0]}.{parts[-1]}'?"
    if parts == [parts[0]] and parts[0] in SECTIONS:  # a section alone: name one of its keys
        first = next(k for k in keys if k.startswith(f"{parts[0]}."))
        return f"; name one of its keys, e.g. '{first}' (andrea config keys lists them)"
    return _suggest(".".join(parts), keys) or _suggest(parts[0], SECTIONS)


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
            raise UserError(f"{where}: expected {type_name(tp)}, got {value!r}")
        (tp,) = options
    given = value
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
        raise UserError(f"{where}: expected {type_name(tp)}, got {value!r}")
    if tp is float and not math.isfinite(value):
        # inf passes `x > 0`, and no run trains on an infinite or nan lr, eps or weight decay.
        raise UserError(f"{where}: must be a finite number, got {given}")
    if tp is int and not -INT64 <= value < INT64:
        # Beyond 64 bits numpy and torch overflow (a seed, a step count, a token count).
        raise UserError(f"{where}: {value} is out of range: at most {INT64 - 1:,}")
    return float(value) if tp is float else value


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
        if not path.strip():  # as data.source: never the working directory by accident
            raise UserError(f"{at}.path: must be a file, directory or glob, got ''")
        weight = _coerce(entry.get("weight", 1.0), float, f"{at}.weight")
        if not weight > 0:
            raise UserError(f"{at}.weight: must be a number > 0, got {entry.get('weight')!r}")
        # ~ is the home folder, as for the path keys (validate).
        out.append({"path": os.path.expanduser(path), "weight": weight})
    return out


def _apply(cfg: Config, section: str, key: str, value: Any, origin: str,
           typed: Callable[[], str | None] = lambda: None) -> None:
    """Set section.key to YAML's `value`; `typed()`: the value as the user typed it (YAML reads
    `yes` as true, `1.50` as 1.5), for the hint that quotes it, when known."""
    specs = {spec.name: spec for spec in section_keys(section, SECTIONS[section])}
    if key not in specs:
        raise UserError(
            f"{origin}: unknown key '{section}.{key}'"
            f"{_suggest(key, specs, section + '.', f'the {section} keys are')}"
        )
    cfg.given.add(f"{section}.{key}")
    if (section, key) == ("data", "sources"):
        cfg.data.sources = _sources(value, f"{origin}: data.sources")
        return
    rule = specs[key].rule
    if value is False and "off" in rule.choices:
        value = "off"  # YAML 1.1 reads a bare `off` as false
    where = f"{origin}: {section}.{key}"
    if specs[key].type is str and isinstance(value, bool | int | float):
        # YAML read a bare 123, 1e3 or yes as a number or a boolean, not as the text meant.
        text = typed() or (str(value).lower() if isinstance(value, bool) else str(value))
        if rule.choices:
            raise UserError(f"{where}: '{text}' is not one of {', '.join(rule.choices)}")
        raise UserError(f"{where}: expected a string, got {value!r}, which YAML reads as a "
                        f"{'boolean' if isinstance(value, bool) else 'number'}; quote it for "
                        f"text: --set '{section}.{key}=\"{text}\"' ({key}: \"{text}\" in a file)")
    try:
        value = _coerce(value, specs[key].type, where)
    except UserError:
        if rule.check is None or typing.get_origin(specs[key].type) is None:
            raise
        # "expected an integer or a string" would invite text that the key then refuses.
        raise UserError(f"{where}: must be {rule.check.must_be}, got {value!r}") from None
    setattr(getattr(cfg, section), key, value)


def _value(cfg: Config, spec: KeySpec) -> Any:
    return getattr(getattr(cfg, spec.section), spec.name)


def _check_declared(cfg: Config, origin: str) -> None:
    """Every key's declared choices, then every key's declared constraint."""
    specs = key_specs()
    for spec in specs:
        choices, value = spec.rule.choices, _value(cfg, spec)
        if choices and value not in choices:
            raise UserError(
                f"{origin}: {spec.dotted}: '{value}' is not one of {', '.join(choices)}"
                f"{_suggest(str(value), choices)}"
            )
    for spec in specs:
        check, value = spec.rule.check, _value(cfg, spec)
        if check is not None and value is not None and not check.holds(value):
            raise UserError(f"{origin}: {spec.dotted}: must be {check.must_be}, got {value!r}"
                            f"{_quoted_hint(spec, check, value)}")


def _quoted_hint(spec: KeySpec, check: Check, value: Any) -> str:
    """For text that the key takes unquoted ('true', '8' quoted in YAML): how to give it."""
    if not isinstance(value, str):
        return ""
    try:
        unquoted = yaml.safe_load(value)
    except yaml.YAMLError:
        return ""
    try:  # a number or a boolean only, which a check written for text may not take
        fits = isinstance(unquoted, bool | int | float) and check.holds(unquoted)
    except (AttributeError, TypeError):
        return ""
    return (f" in quotes, which makes it text; give it without them: --set {spec.dotted}={value}"
            f" ({spec.name}: {value} in a file)" if fits else "")


def _check_chosen(cfg: Config, origin: str) -> None:
    """What each registered value chosen asks of the rest of the config, key by key: its
    `check_config(cfg, origin)` where it has one (data.tokenizer gpt2 refuses
    data.tokenizer_file, data.order epochs data.sources)."""
    for spec in key_specs():
        if isinstance(spec.rule.options, Registered):
            chosen = registered(spec.rule.options.dotted, _value(cfg, spec))
            check = getattr(chosen, "check_config", None)
            if check is not None:
                check(cfg, origin)


def _check_name_length(name: str, origin: str) -> None:
    """train.name as a folder name the file system takes: a longer one failed only when the
    run folder was made, with a traceback (OSError: File name too long)."""
    shown = repr(name if len(name) <= 24 else f"{name[:20]}...")
    try:
        size = len(os.fsencode(name))
    except UnicodeEncodeError:  # a lone surrogate, e.g. from a YAML "\ud800" escape
        raise UserError(
            f"{origin}: train.name: {shown} cannot be written as a folder name in this file "
            f"system's encoding ({sys.getfilesystemencoding()}); use other characters"
        ) from None
    if size > RUN_NAME_MAX_BYTES:
        raise UserError(
            f"{origin}: train.name: {shown} is {size} bytes long; a folder name takes at most "
            f"{RUN_NAME_MAX_BYTES} bytes, so shorten train.name"
        )


def validate(cfg: Config, origin: str) -> Config:
    """Check values beyond their types and fill in derived fields. Returns cfg."""
    _check_declared(cfg, origin)
    # A shell expands ~ only where a word starts (not in --set KEY=~/x), YAML never: a path
    # left as ~/runs was a folder named ~ in the working directory.
    for spec in key_specs():
        if spec.rule.path:
            section = getattr(cfg, spec.section)
            setattr(section, spec.name, os.path.expanduser(getattr(section, spec.name)))
    m = cfg.model
    derived = m.n_head * m.head_dim
    if m.d_model is not None and m.d_model != derived:
        raise UserError(
            f"{origin}: model.d_model: {m.d_model} is not n_head * head_dim = "
            f"{m.n_head} * {m.head_dim} = {derived}; drop d_model or make them agree"
        )
    m.d_model = derived
    _check_chosen(cfg, origin)
    t = cfg.train
    if t.name and (t.name in (".", "..") or "/" in t.name or "\\" in t.name):
        raise UserError(
            f"{origin}: train.name: {t.name!r} is not a folder name; a run lives in "
            f"train.runs_dir/train.name, so set train.runs_dir for the place and train.name "
            f"without '/' for the run"
        )
    if t.name:
        _check_name_length(t.name, origin)
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


def override_value(value: object) -> str:
    """value as --set reads it back (a YAML scalar or flow list): parse_override's inverse, for
    the --set of a command we print. Text YAML would read as something else (a folder named
    `2024` or `true`) is in double quotes, as the refusal of such a --set spells it: inside a
    shell's single quotes they need no escape."""
    if value == "":
        return ""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, allow_unicode=True)
    text = text.removesuffix("\n...\n").strip()
    if isinstance(value, str) and text.startswith("'"):
        return json.dumps(value, ensure_ascii=False)
    return text


def value_text(value: object) -> str:
    """value as a YAML config spells it, for a line that shows it (docs/config.md's defaults,
    a resume's `KEY OLD -> NEW`): `false`, `null`, `''` where Python's str would print False,
    None or nothing, a list in YAML's flow style. Text stays bare: only a command's --set needs
    override_value's quotes, and `off` quoted would read as another value than the key's."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if value == "":
        return "''"
    if isinstance(value, list | dict):
        return override_value(value)
    return str(value)


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
            f"{_suggest_key(parts)}"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise UserError(f"{origin}: value is not valid YAML: {exc}") from None
    if raw.strip():
        check_unique_keys(raw, origin)
    return parts[0], parts[1], value


def from_dict(data: Any, origin: str, text: str | None = None) -> Config:
    """Build a Config from parsed YAML (no validation of values yet); `text`: the YAML it was
    parsed from, when there is one."""
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
            _apply(cfg, section, str(key), value, origin,
                   lambda s=section, k=key: _scalar_text(text, s, k) if text else None)
    return cfg


def _scalar_text(text: str, section: str, key: Any) -> str | None:
    """The value of `section: {key: ...}` as written in YAML `text`, if it is a plain scalar
    there (not merged in from an anchor)."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    for node in (section, key):
        if not isinstance(root, yaml.MappingNode):
            return None
        root = next((v for k, v in root.value if k.value == str(node)), None)
    return root.value if isinstance(root, yaml.ScalarNode) else None


MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *anchor`, which merges rather than repeats


def check_unique_keys(text: str, origin: str) -> None:
    """A key given twice in one mapping of YAML `text` is an error naming both lines: PyYAML
    keeps the last silently, so a second `train:` section dropped every key of the first.
    Checked on the composed nodes (before any merge key is expanded); call it on text that
    parses."""
    nodes, visited = [yaml.compose(text, Loader=yaml.SafeLoader)], set()
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            nodes += node.value
        elif isinstance(node, yaml.MappingNode):
            lines: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                nodes += [key, value]
                if not isinstance(key, yaml.ScalarNode) or key.tag == MERGE_TAG:
                    continue
                line = key.start_mark.line + 1
                if (key.tag, key.value) in lines:
                    raise UserError(f"{origin}: line {line}: '{key.value}' is given twice "
                                    f"(also at line {lines[key.tag, key.value]}); keep one")
                lines[key.tag, key.value] = line


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
        if data is None:
            raise UserError(_empty_config(path))
        check_unique_keys(text, origin)
        cfg = from_dict(data, origin, text)
    file_keys, set_keys = set(cfg.given), {}
    for text in overrides:
        section, key, value = parse_override(text)
        _apply(cfg, section, key, value, f"--set {text}",
               lambda t=text: t.split("=", 1)[1].strip())
        set_keys[f"{section}.{key}"] = text
    old_budget = set_keys.get("train.eval_batches")
    if (old_budget is not None and cfg.train.eval_batches is not None
            and "train.eval_tokens" in file_keys and "train.eval_tokens" not in set_keys):
        # The file's eval_tokens outranks eval_batches (validate): the --set would do nothing.
        raise UserError(
            f"--set {old_budget}: {origin} gives train.eval_tokens "
            f"({cfg.train.eval_tokens:,}), which outranks the deprecated train.eval_batches; "
            f"--set train.eval_tokens=N instead (the val set's target tokens)")
    if not cfg.train.name and name is not None:  # `--set train.name=` too: never runs_dir itself
        cfg.train.name = path.stem
    return validate(cfg, origin if not overrides else f"{origin} (with --set overrides)")


def load_run_config(path: Path, overrides: typing.Sequence[str] = ()) -> Config:
    """A run's own config.yaml, which andrea wrote with every key of its version: a key it
    lacks came after the run, and reads as what andrea did before it (the key's declared
    `before`) where today's default differs, so that a run of an older andrea resumes as it
    trained instead of taking up a newer default (the spike guard) without a word."""
    cfg = load_config(path, overrides)
    for spec in key_specs():
        if spec.rule.before is not AS_DEFAULT and spec.dotted not in cfg.given:
            setattr(getattr(cfg, spec.section), spec.name, spec.rule.before)
    return cfg


def _empty_config(path: Path) -> str:
    """The error for a config file with no keys (an empty file, or comments only): training
    every default under the file's name is rarely what was meant; `{}` still asks for it."""
    presets = sorted(p.stem for p in configs_dir().glob("*.yaml"))
    close = difflib.get_close_matches(path.stem, presets, n=1, cutoff=SUGGEST_CUTOFF)
    meant = (f"for the bundled preset give --config {close[0]}," if close
             else f"give a bundled preset ({', '.join(presets)}),")
    return (f"{path}: the config file is empty; {meant} or write the keys you change "
            "(docs/config.md), or {} for every default")


def config_from_dict(data: dict[str, Any], origin: str = "<dict>") -> Config:
    """A validated Config from a plain dict, e.g. the metadata stored in a checkpoint."""
    return validate(from_dict(data, origin), origin)
