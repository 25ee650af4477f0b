"""The run folder's lock: one `andrea train` writes a run folder at a time.

Rank 0 takes it (`lock_run`, from setup.open_run) before it decides anything about the run (new,
resumed, replaced), and `held_during` releases it when `train()` returns or raises; the other
ranks of its torchrun job share the run through rank 0's decision. The lock is two things in
one file, runs/NAME/.andrea-train.lock (rundir.RUN_LOCK):

- an `fcntl.flock`, which the kernel drops when its process dies: a holder killed on this host
  (kill -9) never blocks, and a second process is refused at once;
- a record of the holder (pid, host, since, last alive: refreshed every HEARTBEAT_S seconds,
  and its torchrun job and attempt), for a holder on another host: where flock is not shared
  between hosts (some network filesystems) or the host is lost, the record names it, and the
  line says how to take the run over (delete the lock file). A record of this host whose
  process is gone is stale; one of an earlier attempt of the same torchrun job is a restart's.

Every verb that replaces a run folder takes the same lock first (`andrea import --force`,
andrea/hf.py), so a live run is never replaced under its training. The holder checks at every
step that its lock file is still the run's (`check_held`: two stats): one removed or replaced
(by hand, to take the run over) stops the training in one line before it writes anything more
there. A training also holds each data folder it reads (`read_data`: a shared
data.folder.FolderLock), so that a prepare which would rewrite one is refused meanwhile.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from andrea.data.folder import FolderLock, missing_dirs, pid_alive, remove_empty, same_file
from andrea.errors import UserError
from andrea.train.restarts import attempt
from andrea.train.rundir import RUN_LOCK
from andrea.train.torchrun import torchrun_env

HEARTBEAT_S = 30.0  # how often a holder refreshes `alive` in its record
RECORD_BYTES = 512  # the record is rewritten in place at this size, so a reader never sees it
#                     truncated; JSON ignores the padding


@dataclass(frozen=True)
class Holder:
    """Who holds a run folder, as its lock file records it."""

    pid: int
    host: str
    since: float  # time.time() when it took the lock
    alive: float  # time.time() at its last heartbeat
    job: str = ""  # the torchrun job ("" outside torchrun): its id and rendezvous address
    attempt: int = 0  # which launch of that job's workers (andrea.train.restarts.attempt)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode().ljust(RECORD_BYTES)

    @classmethod
    def decode(cls, raw: bytes) -> Holder | None:
        try:
            record = json.loads(raw.decode("utf-8"))
            return cls(int(record["pid"]), str(record["host"]), float(record["since"]),
                       float(record["alive"]), str(record.get("job", "")),
                       int(record.get("attempt", 0)))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    def who(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host}, since {since}"


def this_process() -> Holder:
    env, now = torchrun_env(), time.time()
    job = f"{env.run_id}@{env.master_addr}:{env.master_port}" if env.master_port else ""
    return Holder(os.getpid(), socket.gethostname(), now, now, job, attempt().number)


def is_stale(holder: Holder | None, me: Holder, flocked: bool) -> bool:
    """Whether the recorded holder no longer writes the run, so that `me` may take it: no
    record; a record of this host where the flock was free (the kernel drops it with the
    process) or, where flock does not work, whose pid is gone; an earlier attempt of the same
    torchrun job (torchrun stops a job's workers before it restarts them)."""
    if holder is None:
        return True
    if holder.host == me.host:
        return flocked or not pid_alive(holder.pid)
    return bool(holder.job) and holder.job == me.job and holder.attempt < me.attempt


def age_text(seconds: float) -> str:
    """'12 s', '10 min', '3 h', '2 days': how long ago, as coarsely as a person needs it."""
    seconds = max(0.0, seconds)
    for unit, size, up_to in (("s", 1, 120), ("min", 60, 7200), ("h", 3600, 172800)):
        if seconds < up_to:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds / 86400:.0f} days"


TRAIN_ANOTHER = "train another run with --set train.name=..."


def refusal(
    run_dir: Path, lock: Path, holder: Holder | None, me: Holder, instead: str = TRAIN_ANOTHER
) -> UserError:
    """The one line of a second `andrea train` (or another verb that would write the run:
    `instead` says what it may do instead) on a run folder in use."""
    if holder is None:  # its holder is between taking the lock and writing its record
        return UserError(
            f"{run_dir}: another andrea train is starting on this run (it holds {lock}); wait "
            f"for it to end, or {instead}"
        )
    if holder.host == me.host:
        return UserError(
            f"{run_dir}: another andrea train is writing this run ({holder.who()}); wait for it "
            f"to end or stop it (kill {holder.pid}), or {instead}"
        )
    silent = age_text(time.time() - holder.alive)
    return UserError(
        f"{run_dir}: another andrea train is writing this run ({holder.who()}, last alive "
        f"{silent} ago by that host's clock); wait for it to end, or {instead}; if that "
        f"training is gone (its node lost), take the run over: rm {lock}, then run this again"
    )


class RunLost(UserError):
    """The run's lock file is no longer the one this training holds: another process may own
    the run now, and this one writes nothing more there."""


class RunLock:
    """The exclusive right to write `run_dir`, taken by `acquire`, given up by `release`.
    `created`: the folders made to hold it, removed again on release when nothing else was
    written there (a run refused during set-up leaves nothing behind)."""

    def __init__(self, run_dir: Path, instead: str = TRAIN_ANOTHER) -> None:
        self.run_dir, self.path = run_dir, run_dir / RUN_LOCK
        self.instead = instead  # what the refusal suggests instead of this verb
        self.created: list[Path] = []
        self.holder: Holder | None = None
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> RunLock:
        """Take the lock now, or raise the one-line refusal naming its holder."""
        me = this_process()
        self.created = missing_dirs(self.run_dir)
        for _ in range(10):  # the file replaced under us: its holder released it just now
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise UserError(f"{self.run_dir}: cannot write the run folder: "
                                f"{exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                flocked = True
            except BlockingIOError:
                holder = read_holder(fd, wait=0.5)
                os.close(fd)
                self.release()
                raise refusal(self.run_dir, self.path, holder, me, self.instead) from None
            except OSError:  # no flock on this filesystem: the record alone decides
                flocked = False
            if same_file(fd, self.path):
                break
            os.close(fd)
        else:
            raise UserError(f"{self.path}: the lock file keeps being replaced; is another "
                            f"andrea train starting on this run? Run this again")
        holder = read_holder(fd)
        if not is_stale(holder, me, flocked):
            os.close(fd)
            self.release()
            raise refusal(self.run_dir, self.path, holder, me, self.instead)
        self._fd, self.holder = fd, me
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="andrea-run-lock",
                                      daemon=True)
        self._beat.start()
        return self

    def held(self) -> bool:
        """Whether the run's lock file is still the one this lock holds (not removed or
        replaced since): two stats, cheap enough for every step."""
        return self._fd is not None and same_file(self._fd, self.path)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            fd, holder = self._fd, self.holder
            if fd is None or holder is None or not self.held():
                return  # a lock file removed or replaced: the record is no one's to refresh
            self.holder = replace(holder, alive=time.time())
            with contextlib.suppress(OSError):
                os.pwrite(fd, self.holder.encode(), 0)

    def release(self) -> None:
        """Let the next writer in: the lock file removed (if it is still ours: a take-over may
        have replaced it), then the folders made for it, if nothing else was written there."""
        if self._beat is not None:
            self._stop.set()
            self._beat.join()
            self._beat = None
        if self._fd is not None:
            if same_file(self._fd, self.path):
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None
        remove_empty(self.created)
        self.created = []


def read_holder(fd: int, wait: float = 0.0) -> Holder | None:
    """The record in the open lock file; a holder that has just taken the lock may not have
    written it yet: up to `wait` seconds for it."""
    deadline = time.monotonic() + wait
    while True:
        holder = Holder.decode(os.pread(fd, 4 * RECORD_BYTES, 0))
        if holder is not None or time.monotonic() >= deadline:
            return holder
        time.sleep(0.02)


# The locks taken inside the innermost `held_during`: run locks, and data folders read.
_held: list[RunLock | FolderLock] = []


def lock_run(run_dir: Path) -> RunLock:
    """Take `run_dir`'s lock for this process until the enclosing `held_during` ends (the
    process's end, outside one)."""
    lock = RunLock(run_dir).acquire()
    _held.append(lock)
    return lock


def check_held(step: int) -> None:
    """Raise RunLost when a run lock this process holds no longer names its run folder's lock
    file (deleted by hand to take the run over, or the folder replaced): another process may
    write the run now, so this one must write nothing more there, not even its end record or a
    checkpoint. Called by the training at every step, and before a checkpoint moves `latest`."""
    for lock in _held:
        if isinstance(lock, RunLock) and not lock.held():
            raise RunLost(
                f"{lock.run_dir}: its lock file {lock.path} was removed or replaced while this "
                f"training held it, so another process may write the run now; stopped at step "
                f"{step}, writing nothing more there; once no other training writes the run, "
                f"continue it with: andrea train --resume {lock.run_dir}"
            )


def read_data(folders: list[Path], run_dir: Path) -> None:
    """Hold each data folder `folders` (those the training in `run_dir` reads) until the
    enclosing `held_during` ends: a prepare that would rewrite one (`--force`, changed inputs)
    is refused meanwhile, naming this training (data.folder.FolderLock.share)."""
    for folder in dict.fromkeys(folders):
        lock = FolderLock(folder).share(f"andrea train of {run_dir}")
        if lock is not None:
            _held.append(lock)


@contextlib.contextmanager
def held_during() -> Iterator[None]:
    """The run locks taken inside are released when it ends, however it ends: two trainings
    one after the other in one process (andrea.cli.main twice) each take the run in turn."""
    outer = len(_held)
    try:
        yield
    finally:
        while len(_held) > outer:
            _held.pop().release()
