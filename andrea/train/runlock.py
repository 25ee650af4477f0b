"""The run folder's lock: one `andrea train` writes a run folder at a time.

Rank 0 takes it (`TrainingLocks.take_run`, from setup.open_run) before it decides anything
about the run (new, resumed, replaced), and holds it until the training's `TrainingLocks` ends;
the other ranks of its torchrun job share the run through rank 0's decision. It is a
folder_lock.FolderLock on runs/NAME/.andrea-train.lock (rundir.RUN_LOCK) that refuses a second
process at once. Its record of the holder (pid, host, since, last alive: refreshed every
HEARTBEAT_S seconds, and its torchrun job and attempt) is for a holder on another host: where
flock is not shared between hosts (some network filesystems) or the host is lost, the record
names it, and the line says how to take the run over (delete the lock file). A record of this
host whose process is gone is stale; one of an earlier attempt of the same torchrun job is a
restart's.

Every verb that replaces a run folder takes the same lock first (`andrea import --force`,
andrea/hf.py), so a live run is never replaced under its training. The holder checks at every
step that its lock file is still the run's (`RunLock.check`: two stats): one removed or
replaced (by hand, to take the run over) stops the training in one line before it writes
anything more there. A training also holds each data folder it reads
(`TrainingLocks.read_data`: a shared data.folder.DataLock), so that a prepare which would
rewrite one is refused meanwhile.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from andrea.data.folder import DataLock
from andrea.errors import UserError
from andrea.folder_lock import FolderLock, pid_alive, same_file, who
from andrea.train.metrics import open_segment
from andrea.train.restarts import attempt
from andrea.train.rundir import METRICS, RUN_LOCK
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
        return who(self.pid, self.host, self.since)


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


def unlocked_writer(run_dir: Path, me: Holder) -> Holder | None:
    """A training of this host that writes `run_dir` without its lock: one started by an andrea
    from before the run lock, which keeps no lock file, so that the free flock and the missing
    record read as a run no one writes (upgrading andrea while a run trains). Its metrics.jsonl
    names it: the last segment's start record with no end after it, whose process still runs
    and ran by then (not a later one given the same pid)."""
    start = open_segment(run_dir / METRICS)
    if start is None or start.get("host") != me.host:
        return None
    pid, since = start.get("pid"), start.get("time")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid == me.pid \
            or not isinstance(since, int | float) or not pid_alive(pid, since):
        return None
    return Holder(pid, me.host, float(since), float(since))


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


class RunLock(FolderLock):
    """The exclusive right to write `run_dir`, refused at once while another process holds
    it (`instead`: what the refusal suggests instead of this verb). Its lock file and the
    folders made to hold it are removed on release: a run refused during set-up leaves
    nothing behind."""

    what = "run folder"

    def __init__(self, run_dir: Path, instead: str = TRAIN_ANOTHER) -> None:
        super().__init__(run_dir, RUN_LOCK)
        self.instead = instead
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def take(self, fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            holder = read_holder(fd, wait=0.5)
            raise refusal(self.folder, self.path, holder, this_process(), self.instead) from None
        except OSError:  # no flock on this filesystem: the record alone decides
            return False

    def claim(self, fd: int, flocked: bool) -> None:
        """Refused while the record names a holder that may still write the run; else this
        process's record, kept alive until `release`."""
        me, holder = this_process(), read_holder(fd)
        if not is_stale(holder, me, flocked):
            raise refusal(self.folder, self.path, holder, me, self.instead)
        unlocked = unlocked_writer(self.folder, me) if holder is None else None
        if unlocked is not None:
            raise refusal(self.folder, self.path, unlocked, me, self.instead)
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, args=(fd, me),
                                      name="andrea-run-lock", daemon=True)
        self._beat.start()

    def replaced(self, tries: int) -> None:
        if tries == 10:
            raise UserError(f"{self.path}: the lock file keeps being replaced; is another "
                            f"andrea train starting on this run? Run this again")

    def _heartbeat(self, fd: int, record: Holder) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not same_file(fd, self.path):
                return  # a lock file removed or replaced: the record is no one's to refresh
            record = replace(record, alive=time.time())
            with contextlib.suppress(OSError):
                os.pwrite(fd, record.encode(), 0)

    def check(self, step: int) -> None:
        """Raise RunLost when this lock no longer holds the run folder's lock file (deleted by
        hand to take the run over, or the folder replaced): another process may write the run
        now, so this one must write nothing more there, not even its end record or a
        checkpoint."""
        if not self.held():
            raise RunLost(
                f"{self.folder}: its lock file {self.path} was removed or replaced while this "
                f"training held it, so another process may write the run now; stopped at step "
                f"{step}, writing nothing more there; once no other training writes the run, "
                f"continue it with: {shlex.join(['andrea', 'train', '--resume', str(self.folder)])}"
            )

    def release(self, remove: bool = True) -> None:
        if self._beat is not None:
            self._stop.set()
            self._beat.join()
            self._beat = None
        super().release(remove)


def read_holder(fd: int, wait: float = 0.0) -> Holder | None:
    """The record in the open lock file; a holder that has just taken the lock may not have
    written it yet: up to `wait` seconds for it."""
    deadline = time.monotonic() + wait
    while True:
        holder = Holder.decode(os.pread(fd, 4 * RECORD_BYTES, 0))
        if holder is not None or time.monotonic() >= deadline:
            return holder
        time.sleep(0.02)


class TrainingLocks(contextlib.ExitStack):
    """What one training holds until its `with` ends, however it ends: its run folder's lock
    (rank 0's: `run`) and each data folder it reads. Two trainings one after the other in one
    process (andrea.cli.main twice) each take the run in turn."""

    run: RunLock | None = None

    def take_run(self, run_dir: Path) -> None:
        self.run = self.enter_context(RunLock(run_dir))

    def read_data(self, folders: list[Path], run_dir: Path) -> None:
        """Hold each data folder `folders` (those the training in `run_dir` reads): a prepare
        that would rewrite one (`--force`, changed inputs) is refused meanwhile, naming this
        training (data.folder.DataLock.share)."""
        for folder in dict.fromkeys(folders):
            lock = DataLock(folder).share(f"andrea train of {run_dir}")
            if lock is not None:
                self.callback(lock.release)

    def check(self, step: int) -> None:
        """RunLock.check, where this process holds the run (rank 0). Called by the training at
        every step, and before a checkpoint moves `latest`."""
        if self.run is not None:
            self.run.check(step)
