"""The one exception type for bad input: the CLI prints it as one line and exits with 2; and
the end of a process its launcher restarts, said as what it is. With them, the words a message
spells values in (quoted, listed, counted)."""

import json
from typing import Any


class UserError(Exception):
    """Bad input from the user (a file, a key, a value). The message says what to do."""

    exit_code = 2


class Restarting(Exception):
    """No error to act on: this process ends so that its launcher (torchrun --max-restarts, with
    restarts left) starts the job again. The CLI prints the message as it is, exit code 1."""

    exit_code = 1


def quoted(value: Any) -> str:
    """A value read from a file, in an error line as JSON spells it (so "16" reads as the
    string it is), cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def counted(count: int, noun: str, nouns: str | None = None) -> str:
    """`count` of `noun` for a message: '1 step', '40 steps', '1,024 tokens' (`nouns`: a plural
    that is not noun + 's', 'processes'). A count a message cannot know to be above 1 (steps
    left, --stop-after, a folder's shards) said '1 steps' as often as not."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def listed(names: "list[str]", shown: int = 3) -> str:
    """The first `shown` names of a list for an error line, and how many more: 'a, b, c and 4
    more'."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
