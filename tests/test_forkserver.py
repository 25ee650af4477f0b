"""tests/forkserver.py, which starts the suite's commands from a warm process, must give what a
fresh `python -m andrea` gives: the same output, exit status, signals and process life."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import forkserver
import pytest
from conftest import python_command, run_andrea

pytestmark = pytest.mark.skipif(not forkserver.enabled(),
                                reason="every command starts fresh here (ANDREA_TEST_FRESH=1, "
                                       "or not Linux): nothing is forked")

def test_a_forked_command_prints_and_ends_as_a_fresh_one(tmp_path: Path) -> None:
    args = ("count-params", "--config", "andrea-tiny", "--json")
    forked = run_andrea(*args, cwd=tmp_path)
    fresh = run_andrea(*args, cwd=tmp_path, fresh=True)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode, fresh.stdout, fresh.stderr)


SCRIPT = """
import os, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd() == sys.argv[1], "env", os.environ.get("PROBE"))
print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
sys.stdout.write("buffered, never flushed: lost to os._exit in a fresh process too\\n")
sys.stderr.write("stderr is line-buffered\\n")
if sys.argv[2] == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
os._exit(int(sys.argv[2]))
"""


def test_a_script_gets_argv_folder_environment_buffering_and_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    results = []
    for fresh in (False, True):
        command = python_command(str(script), str(tmp_path), "3", fresh=fresh)
        proc = subprocess.run(command, cwd=tmp_path, env={**env, "PROBE": "yes"},
                              capture_output=True, text=True, timeout=60)
        results.append((proc.returncode, proc.stdout, proc.stderr))
    assert results[0] == results[1]
    assert results[0] == (3, "", "stderr is line-buffered\n")  # block-buffered stdout, as fresh


def test_signals_reach_the_child_and_a_killed_stand_in_takes_the_child_along(
        tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    command = python_command(str(script), str(tmp_path), "sleep")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    interrupted = subprocess.Popen(command, cwd=tmp_path, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert interrupted.stdout.readline().startswith("argv")
    assert interrupted.stdout.readline() == "path0 True\n"
    interrupted.stdout.readline()
    assert interrupted.stdout.readline() == "sleeping\n"
    interrupted.send_signal(signal.SIGINT)  # KeyboardInterrupt in the child, as at a terminal
    _, err = interrupted.communicate(timeout=30)
    assert interrupted.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err

    killed = subprocess.Popen(command, cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    for _ in range(4):
        killed.stdout.readline()
    child = sleeping_child(script)
    killed.kill()
    killed.wait(timeout=30)
    deadline = time.monotonic() + 10
    while process_exists(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_exists(child), "the forked child outlived its killed stand-in"


def sleeping_child(script: Path) -> int:
    """The pid of the one running child of the warm process (the suite runs one test at a
    time): the one running SCRIPT."""
    zygote = forkserver._zygote["proc"].pid
    children = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == zygote and stat[0] != "Z":
            children.append(int(pid))
    assert len(children) == 1, (script, children)
    return children[0]


def process_exists(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_warm_process_and_its_folder_end_with_the_session(tmp_path: Path) -> None:
    code = ("import forkserver, os; r = forkserver.run(['-c', 'print(7)'], os.getcwd(), "
            "dict(os.environ), 60); print(forkserver._zygote['proc'].pid, "
            "forkserver.socket_path(), r.stdout.strip())")
    proc = subprocess.run(python_command("-c", code, fresh=True), cwd=Path(forkserver.__file__)
                          .parent, capture_output=True, text=True, timeout=120)
    pid, socket, printed = proc.stdout.split()
    assert (proc.returncode, printed) == (0, "7"), proc.stderr
    assert not os.path.exists(os.path.dirname(socket))
    assert not Path(f"/proc/{pid}").exists()  # killed and waited for
