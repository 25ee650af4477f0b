"""A folder's lock: one process writes a run folder (train/runlock.py) or a data folder
(data/folder.py) at a time.

The lock is one file in the folder: an `fcntl.flock` on it, which the kernel drops when its
holder dies (a holder killed on this host never blocks), and the holder's record, which names
it in a second writer's line. A record of this host whose process is gone (`pid_alive`) is
stale; one of another host cannot be checked from here. Each kind of lock gives its policy
while another process holds it (`FolderLock.take`): a run folder's refuses at once, a data
folder's waits for the prepare that holds it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Self

from andrea.errors import UserError
from andrea.fileio import file_in_the_way


class FolderLock:
    """The exclusive right to write `folder`, through its lock file `folder/name`: taken by
    `acquire`, given up by `release`, or both by a `with`. `created`: the folders made to hold
    it. Each kind of lock says how the flock is taken (`take`) and what its holder records
    (`claim`)."""

    what = "folder"  # the folder, as a line names it: "run folder", "data folder"

    def __init__(self, folder: Path, name: str) -> None:
        self.folder, self.path = folder, folder / name
        self.created: list[Path] = []
        self._fd: int | None = None

    def take(self, fd: int) -> bool:
        """flock the open lock file `fd` exclusively, refusing (raising) or waiting while
        another process holds it: True, or False where this filesystem has no flock."""
        raise NotImplementedError

    def claim(self, fd: int, flocked: bool) -> None:
        """Write this process's record into the lock file just taken, or raise to refuse."""
        raise NotImplementedError

    def replaced(self, tries: int) -> None:
        """The lock file taken had been removed or replaced (its holder released it just now),
        `tries` times so far: open it anew, or raise."""

    def acquire(self) -> Self:
        """Take the lock, or raise: the kind's refusal, or a folder that cannot be written."""
        tries = 0
        while True:
            self.created += [d for d in missing_dirs(self.folder) if d not in self.created]
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                # O_NOFOLLOW: a link in its place must not get this lock's record written
                # into whatever it points to.
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                why = file_in_the_way(self.folder) or exc.strerror
                raise UserError(f"{self.folder}: cannot write the {self.what}: {why}") from None
            try:
                flocked = self.take(fd)
                if same_file(fd, self.path):
                    self.claim(fd, flocked)
                    self._fd = fd
                    return self
            except BaseException:
                os.close(fd)
                self.release()
                raise
            os.close(fd)
            tries += 1
            self.replaced(tries)

    def held(self) -> bool:
        """Whether the lock file is still the one this lock holds (not removed or replaced
        since): two stats, cheap enough for every step."""
        return self._fd is not None and same_file(self._fd, self.path)

    def release(self, remove: bool = True) -> None:
        """Let the next writer in; with `remove`, the lock file first (if it is still this
        lock's: a take-over may have replaced it), then the folders made for it, if nothing
        else was written there."""
        if self._fd is not None:
            if remove and same_file(self._fd, self.path):
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None
        if remove:
            remove_empty(self.created)
            self.created = []

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def who(pid: int, host: str, since: float) -> str:
    """A holder as the lines name it."""
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(since))
    return f"pid {pid} on host {host}, since {when}"


def pid_alive(pid: int, started_by: float | None = None) -> bool:
    """Whether process `pid` of this host runs; with `started_by` (a time.time()), only one
    that started by then: a pid the system gave again to a later process (container restarts
    hand out the same low pids) is not the process recorded."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's process
        pass
    except (OSError, OverflowError, ValueError):  # no such pid can run
        return False
    if started_by is None:
        return True
    started = process_start_time(pid)
    # /proc's boot time is whole seconds, a process's start in clock ticks: 2 s of slack.
    return started is None or started <= started_by + 2.0


def process_start_time(pid: int) -> float | None:
    """When process `pid` of this host started (a time.time()), as Linux's /proc says; None
    where it cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # the stat line's 22nd field, starttime, in clock ticks
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        held, now = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def missing_dirs(out: Path) -> list[Path]:
    """`out` and those of its parents that do not exist yet, deepest first."""
    missing = []
    for p in (out, *out.absolute().parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def remove_empty(dirs: list[Path]) -> None:
    """Remove the folders a lock created, deepest first, if they are empty."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return
