"""The data folder a prepare writes: who owns it, the lock, and what clean-up may remove.

A folder is andrea's when it holds a manifest, a progress record or andrea's shards (or is empty
but for the lock file). Anything else there is the user's: a prepare into a non-empty folder that
is not andrea's is refused, and clean-up removes only what andrea can tell it wrote: the files the
folder's manifest and progress record list (shards, the BPE's tokenizer.json), shard files with
andrea's header, and andrea's own temporary names. One prepare at a time holds the folder's lock
(`DataLock`, a folder_lock.FolderLock on LOCK); a second waits for it and then finds the result.
A training holds the same lock shared while it reads the folder (`DataLock.share`, any number at
once): a prepare that would rewrite the folder is refused meanwhile, in one line naming the
training.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from andrea.data import shards
from andrea.data.shards import MANIFEST, SHARD_NAME, SHARD_TEMP_NAME, SPLITS
from andrea.data.tokenizer import BPE_FILE, KINDS
from andrea.errors import UserError, listed
from andrea.folder_lock import FolderLock, pid_alive, same_file, who

PROGRESS = "progress.json"  # an unfinished prepare's complete shards and where to go on
LOCK = ".andrea-prepare.lock"  # flock'ed by the prepare writing the folder, which writes its
#                                pid first; shared by the trainings reading it, each adding a
#                                JSON line that names it
WAIT_S = 0.1  # how often a prepare waiting for another looks again (a training may come first)
# Temporary names, unique per process: a shard being written, a decompressed text file, and
# fileio's atomic writes of the manifest, progress record and tokenizer.
TEMP_NAME = re.compile(
    rf"{SHARD_TEMP_NAME.pattern}|decompressed\.\d+\.tmp"
    rf"|\.({re.escape(MANIFEST)}|{re.escape(PROGRESS)}|{re.escape(BPE_FILE)})\.tmp\d+"
)


def scratch_name() -> str:
    return f"decompressed.{os.getpid()}.tmp"


# ----------------------------------------------------------------------------- ownership


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def records(folder: Path) -> list[dict[str, Any]]:
    """The folder's andrea records: its manifest and progress record, those that parse."""
    found = []
    manifest = _read_json(folder / MANIFEST)
    if manifest is not None and "manifest_version" in manifest:
        found.append(manifest)
    progress = _read_json(folder / PROGRESS)
    if progress is not None and isinstance(progress.get("settings"), dict):
        found.append({**progress["settings"], "shards": progress.get("shards")})
    return found


def _is_shard(path: Path) -> bool:
    """A file named like a shard whose first bytes are andrea's shard magic."""
    if not SHARD_NAME.fullmatch(path.name):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(shards.MAGIC)) == shards.MAGIC
    except OSError:
        return False


def is_andrea_folder(folder: Path) -> bool:
    """True when `folder` holds an andrea manifest, progress record or shard (prepared data,
    complete or not): never an input to read, and a folder a prepare may write."""
    if records(folder):
        return True
    try:
        return any(_is_shard(p) for p in folder.iterdir())
    except OSError:
        return False


def check_owned(out: Path) -> None:
    """Refuse a folder andrea may not write: a file, or a non-empty folder that is not andrea's."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: not a folder; the data folder (--out / data.dir) must be one")
    shown = foreign_files(out)
    if shown:
        raise UserError(
            f"{out}: the folder holds files andrea did not write ({shown}) and no {MANIFEST}; "
            "andrea prepares only into an empty folder or one it prepared: choose another data "
            "folder (--out / data.dir)"
        )


def foreign_files(folder: Path) -> str | None:
    """The files of a folder that is not andrea's, in words ('a.txt, b.txt, c.txt and 2
    more'); None for a folder that is andrea's, empty, or missing."""
    if not folder.is_dir() or is_andrea_folder(folder):
        return None
    foreign = sorted(p.name for p in folder.iterdir() if p.name != LOCK)
    if not foreign:
        return None
    return listed(foreign)


def owned_files(out: Path) -> set[str]:
    """The names andrea wrote in `out`, by its manifest and progress record: the listed shards,
    the BPE's tokenizer.json, the records themselves; plus andrea's shards and temporary files."""
    owned: set[str] = set()
    for record in records(out):
        for split in SPLITS:
            for entry in (record.get("shards") or {}).get(split) or []:
                if isinstance(entry, dict) and isinstance(entry.get("file"), str):
                    owned.add(Path(entry["file"]).name)  # a name, never a path elsewhere
        name = (record.get("tokenizer_request") or {}).get("kind")  # a record is untrusted
        kind = KINDS.get(name) if isinstance(name, str) else None
        if kind is not None and kind.file:
            owned.add(kind.file)
    if records(out):
        owned |= {MANIFEST, PROGRESS}
    for p in out.iterdir():
        if TEMP_NAME.fullmatch(p.name) or _is_shard(p):
            owned.add(p.name)
    return owned


def clear(out: Path, owned: set[str] | None = None) -> None:
    """Remove what andrea wrote in `out` (`owned`, by default what the folder's records list):
    the manifest first (it is the 'complete' mark), the progress record last (it marks the
    folder as andrea's until the end)."""
    owned = owned_files(out) if owned is None else owned
    order = [MANIFEST, *sorted(owned - {MANIFEST, PROGRESS}), PROGRESS]
    for name in order:
        if name in owned:
            (out / name).unlink(missing_ok=True)


def remove_unlisted(out: Path, keep: set[str]) -> None:
    """Before resuming: drop temporary files, and andrea shards the progress record does not
    list (complete, but written after the last record)."""
    for p in out.iterdir():
        if p.name not in keep and (TEMP_NAME.fullmatch(p.name) or _is_shard(p)):
            p.unlink()


def keep_complete(out: Path) -> tuple[int, int, int]:
    """After a prepare stopped short (a signal, a full disk, a failure): keep the complete
    shards its records list, remove partial and unlisted files; with nothing complete, clear
    the folder. Returns (shards kept, their tokens, their bytes)."""
    kept = [e for r in records(out) for s in SPLITS for e in (r.get("shards") or {}).get(s) or []
            if isinstance(e, dict) and isinstance(e.get("file"), str)]
    remove_unlisted(out, {Path(e["file"]).name for e in kept})
    if not kept:
        clear(out)
        return 0, 0, 0
    size = sum(p.stat().st_size for p in (out / Path(e["file"]).name for e in kept)
               if p.is_file())
    return len(kept), sum(int(e.get("tokens", 0)) for e in kept), size


# ----------------------------------------------------------------------------- lock


def _readers(fd: int) -> list[dict[str, Any]]:
    """The trainings a lock file names as reading the folder, newest first, those that may
    still: of another host, or of this one and alive. The lines of readers since gone stay
    until the next prepare empties the file."""
    here = socket.gethostname()
    found = []
    for line in os.pread(fd, 1 << 16, 0).decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
            pid, host = int(record["pid"]), str(record["host"])
        except (ValueError, TypeError, KeyError):
            continue  # the pid line of the last prepare
        if host != here or pid_alive(pid):
            found.append(record)
    return found[::-1]


def _readers_refusal(out: Path, readers: list[dict[str, Any]]) -> str:
    """The one line of a prepare that would rewrite a folder trainings read."""
    if not readers:  # its reader is between taking the lock and naming itself
        return (f"{out}: an andrea train is starting to read this data folder; rewriting it "
                "would change the shards under it: wait for it to end, or prepare into another "
                "folder (--out / data.dir)")
    first = readers[0]
    more = f" and {len(readers) - 1} more" if len(readers) > 1 else ""
    return (
        f"{out}: {first.get('reader', 'an andrea train')} reads this data folder "
        f"({who(first['pid'], first['host'], float(first.get('since', 0)))}){more}; rewriting "
        f"it would change the shards under it: wait for it to end or stop it (kill "
        f"{first['pid']}), or prepare into another folder (--out / data.dir)"
    )


class FolderInUse(UserError):
    """A prepare would take the folder's lock while trainings read the folder. `waited`:
    whether it first waited for another prepare (which may have made what it asks for)."""

    def __init__(self, message: str, waited: bool) -> None:
        super().__init__(message)
        self.waited = waited


class DataLock(FolderLock):
    """The exclusive right to write the data folder `out` (a prepare's): a second prepare
    waits for the first, after saying so once (`say`), then finds its result. Or, taken by
    `share`, the right to read it, which any number of processes hold at once."""

    what = "data folder"

    def __init__(
        self, out: Path, say: Callable[[str], None] = partial(print, flush=True)
    ) -> None:
        super().__init__(out, LOCK)
        self.say = say
        self.waited = False

    def take(self, fd: int) -> bool:
        """At once, or after the prepare that holds it (said once); FolderInUse when trainings
        hold it shared (they read the folder). A waiting prepare looks again every WAIT_S,
        since a training may take the folder before it does."""
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pass
            if _shared_only(self.path):
                try:  # unless the holder let go just now
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    raise FolderInUse(_readers_refusal(self.folder, _readers(fd)),
                                      self.waited) from None
            if not self.waited:
                # Empty while the holder is between its lock and its pid's write.
                pid = os.pread(fd, 32, 0).decode("ascii", "replace").split("\n")[0].strip()
                holder = (f"another andrea process (pid {pid})" if pid.isdigit()
                          else "another andrea process")
                self.say(f"{self.folder}: {holder} is preparing this folder; waiting for it to "
                         f"finish")
            self.waited = True
            time.sleep(WAIT_S)

    def claim(self, fd: int, flocked: bool) -> None:
        pid = f"{os.getpid()}\n".encode()
        os.pwrite(fd, pid, 0)  # then cut to it: the file is never empty in between
        os.ftruncate(fd, len(pid))

    def share(self, reader: str) -> DataLock | None:
        """Hold the prepared folder for reading (`reader`: who, for a prepare's refusal), with
        any other readers, until `release`; waits for a prepare under way. None where the lock
        cannot be taken (a read-only folder, no flock on its filesystem): then nobody can
        prepare over it either, or nothing can tell."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError:
                os.close(fd)
                return None
            if same_file(fd, self.path):
                break
            os.close(fd)  # a failed prepare removed the folder's lock file meanwhile
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                  "reader": reader}
        os.write(fd, (json.dumps(record) + "\n").encode())  # one O_APPEND write: never split
        self._fd = fd
        return self

    def release(self, remove_created: bool = False) -> None:
        """Let the next process in; with `remove_created`, first remove the lock file and the
        folders this prepare created, when empty (a failed prepare leaves nothing behind; the
        lock file of a folder it did not create stays)."""
        super().release(remove=remove_created and bool(self.created))


def _shared_only(path: Path) -> bool:
    """Whether the lock at `path`, which an exclusive flock just failed to take, is held
    shared (by readers) rather than exclusively (by a prepare): a shared flock can be had."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the probe's flock
