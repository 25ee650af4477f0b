"""A trained run's data when its data folder is not here, prepared with the run's own tokenizer.

A run folder copied to another machine, or its data folder deleted. Shared by `andrea train
--resume` (train/setup.py) and the verbs that open a checkpoint (andrea/trained.py).

The data is prepared again only with the run's own tokenizer: the tokenizer.json its checkpoint
carries for a BPE (`own_tokenizer_config`; a new BPE trained on the same text could differ), or
byte and gpt2 by name; and only from the run's own text, said in one line (`prepare_line`).
When that text is not here either, a one-line error names the data, the text and the command
that prepares it (`stop_without_text`).
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from pathlib import Path

from andrea.config import Config
from andrea.data.documents import SHAKESPEARE
from andrea.data.inputs import names_anything
from andrea.data.prepare import run_sources, source_words
from andrea.data.shards import MANIFEST
from andrea.data.tokenizer import KINDS
from andrea.errors import UserError
from andrea.train.rundir import CONFIG, verify_file


def own_tokenizer_config(cfg: Config, ckpt: Path) -> Config:
    """cfg with data.tokenizer_file set to the tokenizer.json checkpoint `ckpt` carries (a BPE
    run's, checked against the checkpoint's checksum): its data folders are then the ones
    `andrea prepare -c RUN/config.yaml --tokenizer-file CKPT/tokenizer.json` writes
    (data/<source>-bpe-tok<hash of the file>). cfg itself when the checkpoint carries none
    (byte, gpt2, or a checkpoint written before checkpoints carried their tokenizer)."""
    path = KINDS[cfg.data.tokenizer].in_checkpoint(ckpt)
    if path is None:
        return cfg
    verify_file(path)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer_file=str(path)))


def carried(cfg: Config, ckpt: Path) -> bool:
    """Whether cfg's data.tokenizer_file is the tokenizer file checkpoint `ckpt` carries."""
    own = KINDS[cfg.data.tokenizer].in_checkpoint(ckpt)
    return own is not None and bool(cfg.data.tokenizer_file) and \
        Path(cfg.data.tokenizer_file) == own


def is_prepared(cfg: Config) -> bool:
    """Whether every data folder of cfg holds a finished prepare (its manifest)."""
    return all((d / MANIFEST).is_file() for _, d, _ in run_sources(cfg))


def missing_text(cfg: Config) -> list[str]:
    """The sources of cfg's data whose text is not here (moved, deleted, or a path relative to
    another working directory)."""
    return [s for s, _, _ in run_sources(cfg) if s != SHAKESPEARE and not names_anything(s)]


def prepare_command(cfg: Config, ckpt: Path, out: Path | None = None) -> str:
    """The command that prepares the run's data with its own tokenizer (from its config.yaml),
    into `out` when given (else where the run's config says)."""
    argv = ["andrea", "prepare", "-c", str(ckpt.parent / CONFIG)]
    if carried(cfg, ckpt):
        argv += ["--tokenizer-file", cfg.data.tokenizer_file]
    if out is not None:
        argv += ["--out", str(out)]
    return shlex.join(argv)


def stop_without_text(
    own: Config, ckpt: Path, *, needs: str, data: Path, command: str, otherwise: str = ""
) -> None:
    """A UserError when the text the run's data is prepared from is not here: what `needs` it
    (e.g. "the val loss"), the data folder, the text, and `command` to run once the text is
    back (`otherwise`: what else the user can do)."""
    missing = missing_text(own)
    if missing:
        raise UserError(
            f"{ckpt}: {needs} needs the run's data, {data}, which is not here, nor is "
            f"{missing[0]}, the text it is prepared from; put that text there and prepare the "
            f"data with the run's own tokenizer: `{command}`{otherwise}"
        )


def prepare_line(own: Config, ckpt: Path, data: Path, target: Path, note: str = "") -> str:
    """The one line that says the run's data is prepared again: into `target`, from what, with
    which tokenizer, and why (`data`, the run's folder, is not here; `note`: more on that)."""
    d = own.data
    if carried(own, ckpt):
        tokenizer = f"the run's own tokenizer ({d.tokenizer_file})"
    elif d.tokenizer_file:
        tokenizer = f"the tokenizer {d.tokenizer_file} its config names"
    elif KINDS[d.tokenizer].trained:
        tokenizer = (f"a BPE trained again, as the run's config says ({ckpt} holds no "
                     f"{KINDS[d.tokenizer].file}: written before checkpoints carried their "
                     f"tokenizer)")
    else:
        tokenizer = f"the {d.tokenizer} tokenizer"
    return (f"preparing {target} from {source_words(own)} with {tokenizer}: the run's data, "
            f"{data}, is not here{note}")


def check_same_data(
    ckpt: Path, recorded: list[dict[str, str]] | None, found: list[dict[str, str]], *,
    needs: str, named: bool, take: Callable[[str], str],
) -> str:
    """The data found (loader.data_record) against the data checkpoint `ckpt` records, for
    what `needs` it ("resuming", "the val loss"). Other shards in another folder stop, in one
    line that names both and `take(folder)`, the option that reads the data found: a relative
    data.dir (the derived one is) names another folder from another working directory, where
    data prepared from another text of the same name would be read without a word. Other
    shards in the folder the run read are its data kept current (its text changed and was
    prepared again): a note line, returned; else ''. `named`: the command names its data
    itself (train's --set data.dir, eval's --data), and reads it unchecked."""
    if recorded is None or named:
        return ""
    changed = []
    for old, new in zip(recorded, found, strict=False):  # data.sources is the run's own
        if all(old[split] == digest for split, digest in new.items() if split != "dir"):
            continue
        if old["dir"] != new["dir"]:
            raise UserError(
                f"{ckpt}: {needs} would read other data: the run trained on {old['dir']}, and "
                f"the data here is {new['dir']}, which holds other shards (a relative data.dir "
                f"names a folder under the working directory); run it from the directory the "
                f"run trained in, or read this data by naming it: {take(new['dir'])}")
        changed.append(new["dir"])
    if not changed:
        return ""
    return (f"note: {', '.join(changed)} holds other shards than {ckpt} was trained on "
            f"(prepared again since, from its text as it is now)")
