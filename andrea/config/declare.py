"""How a config key is declared: `key(default, description, ...)` as a dataclass field.

A section dataclass (andrea/config/sections.py) declares each of its keys once, with everything
andrea knows about it; loading, validation, the resume rules and the key reference read it back
through `key_specs`.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The field-metadata entry that holds a key's `Rule`.
_RULE = "andrea"


@dataclass(frozen=True)
class Check:
    """A constraint beyond the key's type: `holds(value)`, else the value must be `must_be`."""

    holds: Callable[[Any], bool]
    must_be: str


# The registries above config whose names a key's value picks (train.optimizer: OPTIMIZERS in
# andrea/train/optim.py), by the key's dotted name. Config may not import them
# (tests/test_layout.py), so each registers itself here as it is imported.
_REGISTRIES: dict[str, Mapping[str, Any]] = {}


def register_choices(dotted: str, registry: Mapping[str, Any]) -> None:
    """The values of key `dotted` are the names of `registry` (read whenever they are needed,
    so an entry added to it is the whole change)."""
    _REGISTRIES[dotted] = registry


def registry(dotted: str) -> Mapping[str, Any] | None:
    """Key `dotted`'s registry; None before its module is imported."""
    return _REGISTRIES.get(dotted)


def registered(dotted: str, name: Any) -> Any:
    """The entry `name` of key `dotted`'s registry; None before its module is imported."""
    return _REGISTRIES.get(dotted, {}).get(name)


@dataclass(frozen=True)
class Registered:
    """`choices=` of a key whose allowed values are a registry's names, e.g. the optimizers."""

    dotted: str


@dataclass(frozen=True)
class ResumeChange:
    """A key a resume may change in part: the change from `old` to `new` when `allows(old,
    new)`, as `says` puts it in the config reference (docs/config.md's "on resume")."""

    allows: Callable[[Any, Any], bool]
    says: str


# A key's `before` when andrea did what its default does before the key existed (most keys).
AS_DEFAULT = object()


@dataclass(frozen=True)
class Rule:
    """What a key's declaration says besides its type and default."""

    description: str
    options: tuple[str, ...] | Registered = ()
    check: Check | None = None
    # May `--resume` change it? Such keys decide how a run proceeds (how far, how often it
    # logs, evaluates and checkpoints, how fast it computes), not what it trains; a
    # ResumeChange, a part of it.
    resumable: bool | ResumeChange = False
    # Where the run lives rather than what it is: never compared on resume (--resume names it).
    location: bool = False
    # A file or folder: a leading ~ is the home folder (config.load.validate expands it).
    path: bool = False
    # The trainer_state.json key that records what the key's `auto` resolved to in the run: a
    # resume may pin the key to that value, which changes nothing the run computes.
    recorded_auto: str | None = None
    # What a run's config.yaml written before the key existed (so without it) reads it as:
    # what andrea did then, where that is not the default (config.load.load_run_config).
    before: Any = AS_DEFAULT

    def may_change(self, old: Any, new: Any) -> bool:
        """Whether a resume may change the key's value from `old` to `new`."""
        if isinstance(self.resumable, ResumeChange):
            return self.resumable.allows(old, new)
        return self.resumable

    @property
    def choices(self) -> tuple[str, ...]:
        """The allowed values; for a registry's names, those registered now (none until its
        module is imported: andrea.train imports it before it reads the key, and the CLI before
        it loads a config)."""
        if isinstance(self.options, Registered):
            return tuple(_REGISTRIES.get(self.options.dotted, ()))
        return self.options


def key(
    default: Any,
    description: str,
    *,
    choices: tuple[str, ...] | Registered = (),
    check: Check | None = None,
    resumable: bool | ResumeChange = False,
    location: bool = False,
    path: bool = False,
    recorded_auto: str | None = None,
    before: Any = AS_DEFAULT,
) -> Any:
    """A section field: its default and its rule (a list default gets a fresh list per config)."""
    rule = Rule(description, choices, check, resumable, location, path, recorded_auto, before)
    if isinstance(default, list):
        return dataclasses.field(default_factory=list, metadata={_RULE: rule})
    return dataclasses.field(default=default, metadata={_RULE: rule})


@dataclass(frozen=True)
class KeySpec:
    """One config key as declared: `section.name`, its type, default and rule."""

    section: str
    name: str
    type: Any
    default: Any
    rule: Rule

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def allowed(self) -> str:
        """The values it takes, in words: its choices, its constraint, else its type."""
        if self.rule.choices:
            return ", ".join(self.rule.choices)
        if self.rule.check is not None:
            return self.rule.check.must_be
        return type_name(self.type)


@functools.cache
def section_keys(section: str, cls: type) -> tuple[KeySpec, ...]:
    """The keys a section dataclass declares, in the order of its fields. A field declared
    without `key` gets an empty description (tests/test_config.py refuses it)."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        default = [] if f.default is dataclasses.MISSING else f.default
        rule = f.metadata.get(_RULE, Rule(""))
        specs.append(KeySpec(section, f.name, hints[f.name], default, rule))
    return tuple(specs)


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               list: "a list", dict: "a JSON object"}


def type_name(tp: Any) -> str:
    """'an integer', 'an integer or a string', 'an integer or null': a type in words."""
    args = typing.get_args(tp)
    if args:
        return " or ".join("null" if a is type(None) else _TYPE_NAMES[a] for a in args)
    return _TYPE_NAMES[tp]


def positive(must_be: str = "positive") -> Check:
    return Check(lambda x: x > 0, must_be)


def non_negative(must_be: str = "non-negative") -> Check:
    return Check(lambda x: x >= 0, must_be)


def not_blank(must_be: str) -> Check:
    """Text with something in it: an empty path would mean the working directory."""
    return Check(lambda x: bool(x.strip()), must_be)


def fraction(must_be: str = "in [0, 1)") -> Check:
    """A value in [0, 1): a dropout, a momentum, a decay."""
    return Check(lambda x: 0 <= x < 1, must_be)


POSITIVE_INT = positive("a positive integer")
