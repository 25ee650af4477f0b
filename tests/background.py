"""Builds that tests wait for, started when the test session starts.

The suite leaves one of the two cores of the test machines idle much of the time: a test drives
one process at a time, and most of what that process does is serial. The compiler runs some tests
check or use (the kernel emulator's g++ builds, NVRTC and nvcc on the kernel file, builds of a
kernel copy with a planted bug, inductor's code for a compiled model) take 10-40 s of CPU each on
a cold cache, as on CI, and depend on nothing a test does first. So the modules that need them
declare them here; they start on two threads of the lowest priority (nice 19: a test's own
processes always come first) when the session does, and the test that needs one finds it done or
waits for it.

A build starts only if a selected test wants it, in the order the builds were declared (the order
the tests run). A test that gets to a build no thread has taken yet runs it itself, at its own
priority. What a build returns or raises is what `result` returns or raises in the test. A build
declared `late` is one the session's first minutes cannot finish (they keep both cores busy): it
starts after the others, and the tests that want it run after all others (tests/conftest.py).

Under pytest-xdist every worker collects every test, so each would start every build. The workers
of one run share them instead (`share_between_workers`): a build is run by whichever worker gets
to it first, under a lock in a folder the run's controller makes; the others skip it, and a test
that needs it waits for that worker and reads what it returned from the folder. Before, the two
workers of the README's command each compiled the NVRTC, nvcc and emulator builds.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# The test machines' cores, shared by the run's workers: at nice 19 the threads take only what
# the tests leave.
CORES = 2
SHARED_VARIABLE = "ANDREA_TEST_SHARED_BUILDS"  # the folder the workers of one run share builds in


@dataclass
class Build:
    name: str
    run: Callable[[], Any]
    wanted_by: tuple[str, ...]  # "test_file.py" or "test_file.py::test_function"
    late: bool = False
    future: Future = field(default_factory=Future)
    taken: bool = False

    def wanted(self, item: pytest.Item) -> bool:
        file = item.path.name
        function = getattr(item, "originalname", item.name)
        return any(spec in (file, f"{file}::{function}") for spec in self.wanted_by)

    def run_here(self) -> None:
        try:
            self.future.set_result(self.run())
        except BaseException as exc:  # noqa: BLE001 - a skip or a failure, raised in the test
            self.future.set_exception(exc)


class Builds:
    def __init__(self, workers: int = CORES, shared: Path | None = None) -> None:
        self.workers = workers
        self.shared = shared  # the folder the workers of the run share builds in, if any
        self._made_shared = False
        self._stopping = False
        self._builds: dict[str, Build] = {}
        self._queue: list[Build] = []
        self._lock = threading.Lock()
        self._processes: set[subprocess.Popen] = set()

    def share_between_workers(self, config: pytest.Config) -> None:
        """pytest_configure: the controller of an xdist run (or a run without -n) makes the
        folder before the workers start, and they find it in their environment; each worker
        then runs a thread per core it has (CORES over the workers)."""
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        self.workers = max(1, CORES // workers)
        if hasattr(config, "workerinput"):
            folder = os.environ.get(SHARED_VARIABLE)
            self.shared = Path(folder) if folder else None
            return
        self.shared = Path(tempfile.mkdtemp(prefix="andrea-test-builds-"))
        self._made_shared = True
        os.environ[SHARED_VARIABLE] = str(self.shared)

    def unshare(self) -> None:
        """pytest_unconfigure: the process that made the folder removes it."""
        if self._made_shared and self.shared is not None:
            shutil.rmtree(self.shared, ignore_errors=True)

    def declare(self, name: str, run: Callable[[], Any], *, wanted_by: Iterable[str],
                late: bool = False) -> None:
        """Build NAME is RUN(), wanted by the tests WANTED_BY names ("test_file.py" for every
        test of a file, "test_file.py::test_function" for one test and all its parameters);
        LATE: it starts after the others, and those tests run last."""
        assert name not in self._builds, f"two builds named {name}"
        self._builds[name] = Build(name, run, tuple(wanted_by), late)

    def runs_late(self, item: pytest.Item) -> bool:
        return any(b.late and b.wanted(item) for b in self._builds.values())

    def start(self, items: Iterable[pytest.Item]) -> None:
        """Queues every build a selected test wants, and starts the threads that run them."""
        items = list(items)
        with self._lock:
            wanted = [b for b in self._builds.values() if any(b.wanted(i) for i in items)]
            self._queue.extend(sorted(wanted, key=lambda b: b.late))  # stable
            threads = min(self.workers, len(self._queue))
        for n in range(threads):
            threading.Thread(target=self._work, name=f"background-build-{n}", daemon=True).start()

    def _take(self, build: Build) -> bool:
        """True for the one caller (a thread, or the test) that gets to run BUILD."""
        with self._lock:
            taken, build.taken = build.taken, True
        return not taken

    def _work(self) -> None:
        if sys.platform == "linux":  # nice applies to this thread alone, and what it starts
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._lock:
                if not self._queue:
                    return
                build = self._queue.pop(0)
            if self._take(build) and not self._run(build, wait=False):
                with self._lock:  # another worker runs it: a test here waits for that one
                    build.taken = False

    def _run(self, build: Build, wait: bool) -> bool:
        """Runs BUILD here and settles its future, or takes what another worker of the run
        returned for it; False (only where not WAIT) while another worker is running it."""
        if self.shared is None:
            build.run_here()
            return True
        with open(self.shared / f"{build.name}.lock", "ab") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                return False
            done = self.shared / f"{build.name}.pickle"
            if done.exists():
                build.future.set_result(pickle.loads(done.read_bytes()))
                return True
            build.run_here()
            # Only a success is shared, and never one cut short by the session's end: a worker
            # that finds no result runs the build itself (the lock goes with a dead process).
            if build.future.exception() is None and not self._stopping:
                try:
                    data = pickle.dumps(build.future.result())
                except (pickle.PicklingError, TypeError, AttributeError):
                    return True
                partial = done.with_suffix(".partial")
                partial.write_bytes(data)
                os.replace(partial, done)
        return True

    def result(self, name: str) -> Any:
        """What build NAME returned: waits for the thread running it (in this worker or another
        one of the run), or runs it here if none has taken it yet (or the session started none:
        a test run outside this suite's conftest)."""
        build = self._builds[name]
        while not build.future.done():
            if self._take(build):
                self._run(build, wait=True)
            else:  # a thread here has it; it gives it back if another worker is running it
                concurrent.futures.wait([build.future], timeout=0.2)
        return build.future.result()

    def run_process(self, argv: list[str], **popen: Any) -> subprocess.CompletedProcess:
        """subprocess.run(ARGV) with stdout and stderr captured together as text, killed by stop
        if it is still running then (its test never came, or failed first)."""
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, **popen)
        with self._lock:
            self._processes.add(proc)
        try:
            out, _ = proc.communicate()
        finally:
            with self._lock:
                self._processes.discard(proc)
        return subprocess.CompletedProcess(argv, proc.returncode, out, None)

    def stop(self) -> None:
        """The session's end: builds not started are dropped, processes still running killed
        (the threads are daemons; an emulator build half written is under a temporary name)."""
        with self._lock:
            self._stopping = True
            self._queue.clear()
            running = list(self._processes)
        for proc in running:
            proc.kill()


_session = Builds()
declare, start, result, run_process, stop, runs_late = (
    _session.declare, _session.start, _session.result, _session.run_process, _session.stop,
    _session.runs_late)
share_between_workers, unshare = _session.share_between_workers, _session.unshare
