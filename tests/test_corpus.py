"""The embedded Shakespeare corpus: found by import, converted from Markdown, split by line."""

import io
import random
import re

from andrea.data.corpus import play_files, play_text, plays_dir, shakespeare
from andrea.data.documents import val_start

# "<br>" stands for Markdown's two-space line break (kept out of the source as trailing spaces).
MARKDOWN = """# Macbeth

## ACT I

### SCENE II. A camp near Forres.

_Alarum within. Enter DUNCAN, with Attendants,
meeting a bleeding Sergeant_

**DUNCAN**<br>
What bloody man is that? He can report,<br>
As seemeth by his plight\\--of the revolt<br>

**First Witch**<br>
Where the place? __\\[Aside]_<br>
*[He draws his sword.]*

_Exeunt_
""".replace("<br>", "  ")

EXPECTED = """Macbeth

ACT I

SCENE II. A camp near Forres.

Alarum within. Enter DUNCAN, with Attendants,
meeting a bleeding Sergeant

DUNCAN:
What bloody man is that? He can report,
As seemeth by his plight--of the revolt

First Witch:
Where the place? [Aside]
[He draws his sword.]

Exeunt
"""


def test_conversion_rules():
    assert play_text(MARKDOWN) == EXPECTED


def rules_line_by_line(markdown: str) -> str:
    """docs/data.md's conversion rules, each applied to every line as written there: what
    play_text, which skips a rule on a line it cannot change, must give."""
    out = []
    for line in markdown.splitlines():
        line = line.rstrip()
        speaker = re.match(r"^\*\*(?P<name>[^*]+?)\*\*\s*$", line)
        if speaker:
            out.append(speaker.group("name").strip() + ":")
            continue
        line = re.sub(r"^#+\s*", "", line).replace("*", "").replace("_", "")
        out.append(re.sub(r"\\(.)", r"\1", line).strip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out).strip("\n")) + "\n"


def test_conversion_is_the_rules_on_every_line():
    for path in play_files():
        markdown = path.read_text("utf-8")
        assert play_text(markdown) == rules_line_by_line(markdown), path
    # Markup in every place a guard could skip: a line that only ends in it, or holds it late.
    pieces = ["*", "**", "_", "\\", "\\*", "#", "## ", " ", "\t", "\n", "\r\n", "\u2028",
              "\u00a0", "A", ":", "**A**", "\\\n", "x#"]
    rng = random.Random(0)
    for _ in range(20_000):
        markdown = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert play_text(markdown) == rules_line_by_line(markdown), repr(markdown)


def test_plays_found_sorted_and_clean():
    files = play_files()
    assert len(files) == 38
    rel = [p.relative_to(plays_dir()).as_posix() for p in files]
    assert rel == sorted(rel) and "tragedies/macbeth.md" in rel
    plays = shakespeare()
    assert [name for name, _ in plays] == [r[:-3] for r in rel]
    text = "".join(t for _, t in plays)
    assert 4_500_000 < len(text) < 5_500_000
    for markup in ("*", "_", "\\", "#", "  \n", " \n", "\n\n\n"):
        assert markup not in text, markup
    macbeth = dict(plays)["tragedies/macbeth"]
    assert macbeth.startswith("Macbeth\n\nACT I\n")
    assert "\nFirst Witch:\nWhen shall we three meet again\nIn thunder" in macbeth


def test_split_is_the_tail_after_a_line_break():
    blob = b"line one\nline two\nline three\nline four\n"
    start = val_start(io.BytesIO(blob), len(blob), 0.25)
    # 75% of 39 bytes is byte 29, where "line four" starts; the first line break at or after it
    # is the document's last byte, so this document gives val nothing.
    assert start == len(blob)
    start = val_start(io.BytesIO(blob), len(blob), 0.5)
    assert blob[start:] == b"line four\n"
    # No line break at all: cut at the first character boundary at or after the target.
    blob = "ééééé".encode()
    start = val_start(io.BytesIO(blob), len(blob), 0.5)
    assert start == 6 and blob[start:].decode() == "éé"
