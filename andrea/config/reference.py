"""The config keys for people: `andrea config keys` (a table, JSON) and docs/config.md.

All of it is generated from the declarations in andrea/config/sections.py, so it cannot go
stale; tests/test_config.py checks docs/config.md against `keys_markdown()`.
"""

from __future__ import annotations

import json
from typing import Any

from andrea.config.declare import KeySpec, ResumeChange
from andrea.config.load import value_text
from andrea.config.sections import SECTIONS, key_specs

REGENERATE = "andrea config keys --markdown > docs/config.md"


def default_text(spec: KeySpec) -> str:
    """The default as a YAML config spells it."""
    return value_text(spec.default)


def on_resume(spec: KeySpec) -> str:
    """What `--resume` does with a changed value of the key."""
    if spec.rule.location:
        return "names the run"
    if isinstance(spec.rule.resumable, ResumeChange):
        return spec.rule.resumable.says
    if spec.rule.recorded_auto is not None and not spec.rule.resumable:
        return "fixed; auto may be set to what it resolved to"
    return "may change" if spec.rule.resumable else "fixed"


def keys_table() -> str:
    """Every key with its default and description, aligned for a terminal."""
    rows = [(spec.dotted, default_text(spec), spec.rule.description) for spec in key_specs()]
    key_w = max(len(r[0]) for r in rows)
    default_w = max(len(r[1]) for r in rows)
    lines = [f"{'key':<{key_w}}  {'default':<{default_w}}  description"]
    lines += [f"{k:<{key_w}}  {d:<{default_w}}  {text}" for k, d, text in rows]
    return "\n".join(lines)


def keys_json() -> str:
    """Every key's declaration as a JSON list."""
    records: list[dict[str, Any]] = [
        {
            "key": spec.dotted,
            "default": spec.default,
            "allowed": spec.allowed,
            "choices": list(spec.rule.choices),
            "on_resume": on_resume(spec),
            "description": spec.rule.description,
        }
        for spec in key_specs()
    ]
    return json.dumps(records, indent=2)


_HEADER = f"""\
# Config keys

<!-- Generated from andrea/config/sections.py by `{REGENERATE}`;
tests/test_config.py fails when this file differs. Edit the declarations, not this file. -->

A config is a YAML file with three sections, `model`, `data` and `train`, each a mapping of the
keys below; a key left out takes its default. `--set SECTION.KEY=VALUE` overrides one key (the
value read as YAML), `andrea config show --config X` prints a config as resolved, and
`andrea config keys` prints this list (`--json`: a list with one object per key, `key`,
`default`, `allowed`, `choices`, `on_resume` and `description`). An unknown key, a value of the
wrong type, a number that is not finite (`inf`, `nan`) or beyond 64 bits, or a value outside what
the key allows is a one-line error naming the file and the key; so is a key given twice in one
section (or a section twice) and an empty file (`{{}}` asks for every default).

On resume: a resumed run's config may differ from its own config.yaml (by `--set`, or the
`--config` given with `--resume auto`) only in the keys marked *may change* (how the run
proceeds: how far, how often it logs, evaluates and checkpoints, how fast it computes), and
where the column says so in part (`data.sources`: its weights); any other change is refused,
except that a run not yet trained (an import, at step 0) may change every key outside `model`.
The keys marked *names the run* say where the run lives and are not compared.

A path (`data.source`, `data.dir`, `data.tokenizer_file`, `data.sources`' paths,
`train.runs_dir`) that starts with `~` starts at the home folder, in a file and in `--set` alike
(a shell expands `~` only where a word starts, so not in `--set KEY=~/x`); a relative one is
relative to the working directory.

Each description is one line; how the keys work together, at length: [model.md](model.md)
(`model`), [data.md](data.md) (`data`), [training.md](training.md) (`train`).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "\\<")


def keys_markdown() -> str:
    """docs/config.md: one table per section, every key with its declaration."""
    parts = [_HEADER]
    specs = key_specs()
    for section in SECTIONS:
        parts.append(f"\n## {section}\n\n| key | default | allowed | on resume | description |\n"
                     "|---|---|---|---|---|\n")
        parts += [
            f"| `{spec.dotted}` | `{default_text(spec)}` | {_cell(spec.allowed)} | "
            f"{on_resume(spec)} | {_cell(spec.rule.description)} |\n"
            for spec in specs if spec.section == section
        ]
    return "".join(parts)
