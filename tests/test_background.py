"""tests/background.py: builds start for the selected tests only, in order, once each, at the
lowest priority; a test gets what its build returned or raised; the session's end kills what
still runs; the workers of one pytest-xdist run build each once between them."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from background import SHARED_VARIABLE, Builds
from conftest import wait_until


def item(spec: str) -> SimpleNamespace:
    """A selected test as pytest gives it: "file.py::function[param]"."""
    file, name = spec.split("::")
    return SimpleNamespace(path=Path("/somewhere/tests", file), name=name,
                           originalname=name.split("[")[0])


def test_only_builds_a_selected_test_wants_start_and_in_the_order_declared():
    builds, ran, gate = Builds(workers=1), [], threading.Event()
    for name in ("a", "b", "c", "d"):
        builds.declare(name, lambda n=name: ran.append(n) or gate.wait(5) and n,
                       wanted_by={"a": ["test_x.py::test_one"], "b": ["test_y.py"],
                                  "c": ["test_x.py::test_two"], "d": ["test_x.py::test_one"]}[name])
    builds.start([item("test_x.py::test_one[p0]"), item("test_y.py::test_other")])
    gate.set()
    assert [builds.result(n) for n in ("a", "b", "d")] == ["a", "b", "d"]
    assert ran == ["a", "b", "d"]  # c's only test was not selected: nothing started it
    assert builds.result("c") == "c" and ran[-1] == "c"  # asked for, it runs in the caller
    builds.stop()


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
def test_threads_run_at_nice_19_and_a_test_takes_over_a_build_no_thread_has_taken():
    def priority() -> tuple[int, int]:
        return threading.get_native_id(), os.getpriority(os.PRIO_PROCESS,
                                                         threading.get_native_id())

    builds, taken, gate = Builds(workers=1), threading.Event(), threading.Event()
    builds.declare("slow", lambda: taken.set() or gate.wait(5) and priority(), wanted_by=["t.py"])
    builds.declare("queued", priority, wanted_by=["t.py"])
    builds.start([item("t.py::test")])
    # the thread may start late on a loaded machine: had the test asked first, it would have
    # taken "slow" too, which is right but not what this test is about
    assert taken.wait(5)
    here = priority()
    assert builds.result("queued") == here  # the one thread is busy: the test ran it itself
    gate.set()
    worker, nice = builds.result("slow")
    assert worker != here[0] and nice == 19
    builds.stop()


def test_each_build_runs_once_however_many_ask():
    builds, calls, gate = Builds(workers=2), [], threading.Event()
    builds.declare("once", lambda: calls.append(1) or gate.wait(30) and len(calls),
                   wanted_by=["t.py"])
    builds.start([item("t.py::test")])
    wait_until(lambda: calls, what="the build to start")  # held at the gate until all ask
    asking, results = [], []

    def ask() -> None:
        asking.append(1)
        results.append(builds.result("once"))

    askers = [threading.Thread(target=ask) for _ in range(4)]
    for thread in askers:
        thread.start()
    wait_until(lambda: len(asking) == 4, what="four askers")
    gate.set()
    for thread in askers:
        thread.join()
    assert calls == [1] and results == [1] * 4


def test_what_a_build_raises_is_raised_in_the_test_a_skip_included():
    builds = Builds()
    builds.declare("fails", lambda: 1 / 0, wanted_by=["t.py"])
    builds.declare("skips", lambda: pytest.skip("no compiler here"), wanted_by=["t.py"])
    builds.start([item("t.py::test")])
    with pytest.raises(ZeroDivisionError):
        builds.result("fails")
    with pytest.raises(pytest.skip.Exception, match="no compiler here"):
        builds.result("skips")


def test_stop_kills_a_process_still_running():
    builds = Builds()
    code = "import time; print('started', flush=True); time.sleep(60)"  # a build that hangs
    builds.declare("hangs", lambda: builds.run_process([sys.executable, "-c", code]),
                   wanted_by=["t.py"])
    builds.start([item("t.py::test")])
    wait_until(lambda: builds._processes, what="the build's process")
    began = time.monotonic()
    builds.stop()
    proc = builds.result("hangs")
    assert proc.returncode == -9 and time.monotonic() - began < 10


def test_a_late_build_starts_after_the_others_and_its_tests_sort_last():
    builds, ran = Builds(workers=1), []
    builds.declare("long", lambda: ran.append("long"), wanted_by=["a.py::test_two"], late=True)
    builds.declare("quick", lambda: ran.append("quick"), wanted_by=["a.py"])
    items = [item(spec) for spec in ("a.py::test_one", "a.py::test_two[x]", "a.py::test_two[y]",
                                     "b.py::test_three")]
    assert [i.name for i in sorted(items, key=builds.runs_late)] == [
        "test_one", "test_three", "test_two[x]", "test_two[y]"]
    builds.start(items)
    wait_until(lambda: len(ran) == 2, what="both builds")  # the thread runs both, asked or not
    assert ran == ["quick", "long"]


def test_two_workers_of_a_run_build_each_once_and_share_what_it_returned(tmp_path):
    calls, gate = [], threading.Event()

    def build() -> dict:
        calls.append(1)
        gate.wait(30)
        return {"cubin": "/cache/kernels.cubin", "registers": [90, 188]}

    first, second = (Builds(workers=1, shared=tmp_path) for _ in range(2))
    for worker in (first, second):
        worker.declare("nvrtc", build, wanted_by=["t.py"])
    first.start([item("t.py::test")])
    wait_until(lambda: calls, what="the first worker's build to start")
    second.start([item("t.py::test")])  # its thread finds the build taken and gives it back
    results = []
    asker = threading.Thread(target=lambda: results.append(second.result("nvrtc")))
    asker.start()
    gate.set()
    asker.join(30)
    assert calls == [1]
    assert results == [first.result("nvrtc")] and results[0] is not first.result("nvrtc")


@pytest.mark.parametrize("outcome", ["raises", "cut short by the session's end"])
def test_a_worker_shares_no_failure_and_no_build_cut_short(tmp_path, outcome):
    first, second = Builds(workers=1, shared=tmp_path), Builds(workers=1, shared=tmp_path)
    code = "import time; time.sleep(60)"
    first.declare("emulator", (lambda: 1 / 0) if outcome == "raises" else
                  lambda: first.run_process([sys.executable, "-c", code]), wanted_by=["t.py"])
    second.declare("emulator", lambda: "built again", wanted_by=["t.py"])
    first.start([item("t.py::test")])
    if outcome == "raises":
        with pytest.raises(ZeroDivisionError):
            first.result("emulator")
    else:
        wait_until(lambda: first._processes, what="the build's process")
        first.stop()
        assert first.result("emulator").returncode == -9
    assert second.result("emulator") == "built again"


def test_the_controller_makes_the_folder_its_workers_find_and_removes_it(monkeypatch):
    monkeypatch.delenv(SHARED_VARIABLE, raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    controller, worker = Builds(), Builds()
    controller.share_between_workers(SimpleNamespace())
    assert controller.shared.is_dir() and os.environ[SHARED_VARIABLE] == str(controller.shared)
    worker.share_between_workers(SimpleNamespace(workerinput={}))
    assert worker.shared == controller.shared and worker.workers == 1  # 2 cores, 2 workers
    worker.unshare()
    assert controller.shared.is_dir()  # a worker leaves it to the controller
    controller.unshare()
    assert not controller.shared.exists()
