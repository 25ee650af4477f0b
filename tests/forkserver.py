"""`python ARGV` in a process forked from one that has already imported torch and andrea.

Why: a fresh `python -m andrea` spends about 3 s of CPU importing torch and andrea on the 2-core
test machines before it reads its first argument, and the suite starts the command hundreds of
times (torchrun and each of its workers too). A child forked from a warm process is still a
process of its own: its own argv, working folder, environment, stdin/stdout/stderr, signals and
exit status, running the module or script as `python` runs it (runpy, `__main__`). What it
skips is the interpreter's start and the imports. The journeys that are about those
(tests/test_journey.py, tests/test_packaging.py) start the command fresh, and
ANDREA_TEST_FRESH=1 makes every call fresh (`ANDREA_TEST_FRESH=1 python -m pytest`), for a
change that touches start-up itself.

The warm process (the zygote) is started once per pytest process, on first use. It imports and
builds nothing with data: no thread pool exists when it forks, and no andrea function has run,
so no per-process cache (distributed.torchrun_env, ...) is filled before a child reads its own
environment. A child whose caller goes away (a killed torchrun, a test that timed out) is
killed with its process group, as a killpg of a fresh command's group would end it.

A process started with `command("-m", "andrea", ARGS)` (subprocess.Popen, or the worker torchrun
starts with --no-python) is a stdlib-only stand-in, up in tens of milliseconds, that hands its
own stdio, folder and environment (RANK, MASTER_PORT, ...) to a forked child, passes the signals
it gets on to it and ends as the child ended: its exit code, or killed by the same signal.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

# what a stand-in passes on to its child; a child starts with them at a fresh interpreter's
# dispositions
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGQUIT)


def _send(conn: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(conn, [data], fds)
    else:
        conn.sendall(data)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while data and not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            break
        data += more
    if not data.endswith(b"\n"):
        raise EOFError("the other side closed the connection")
    return json.loads(data), fds


# ----------------------------------------------------------------------------- the zygote


def _preload() -> None:
    import importlib
    import pkgutil

    import torch
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import andrea

    for module in pkgutil.walk_packages(andrea.__path__, "andrea."):
        if not module.name.endswith(".__main__"):  # what runs as __main__ is never imported
            importlib.import_module(module.name)
    # Building on the meta device imports torch's meta kernels lazily (about 1 s): do it here
    # with torch's modules only (no tensor holds data, so no thread pool starts).
    with torch.device("meta"):
        layer = torch.nn.Linear(8, 8)
        torch.nn.functional.layer_norm(layer(torch.empty(2, 8)), (8,))
        torch.nn.Embedding(4, 8)


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python ARGV` (ARGV: -m MODULE ARGS, SCRIPT ARGS, -c CODE
    ARGS or - ARGS) in REQUEST's folder, environment and stdio, and exit as Python would."""
    import importlib.util
    import runpy

    code = 1
    try:
        _own_exit_handlers()
        # its own process group (torchrun's workers join it), so that a caller that goes away
        # takes the lot, as a killpg of a fresh command's group would
        os.setpgid(0, 0)
        # dispositions as a fresh interpreter has them, whatever the zygote inherited
        for sig in (*PASSED_ON, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_stdio()
        if "OMP_NUM_THREADS" in os.environ:  # OpenMP reads it when it loads, in a fresh process
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if request["argv"][0] == "-m":
            _, module, *args = request["argv"]
            sys.argv = ["-m", *args]
            sys.path[0] = request["cwd"]  # what `python -m` puts first
            # runpy runs the module's code afresh, as `python -m` does; a copy already imported
            # here would make it warn
            package = importlib.util.find_spec(module).submodule_search_locations is not None
            sys.modules.pop(f"{module}.__main__" if package else module, None)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        elif request["argv"][0] in ("-c", "-"):  # python -c CODE ARGS, python - ARGS (stdin)
            flag, *rest = request["argv"]
            source, name = (rest.pop(0), "<string>") if flag == "-c" else (sys.stdin.read(),
                                                                           "<stdin>")
            sys.argv = [flag, *rest]
            sys.path[0] = ""
            main = type(sys)("__main__")
            sys.modules["__main__"] = main
            exec(compile(source, name, "exec"), main.__dict__)
        else:
            script = os.path.abspath(request["argv"][0])
            sys.argv = [request["argv"][0], *request["argv"][1:]]
            sys.path[0] = os.path.dirname(script)  # what `python SCRIPT` puts first
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:  # as Python's own top level: the traceback, then die by SIGINT
        import traceback

        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            threading._shutdown()  # join non-daemon threads, as interpreter exit does
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            _end_as(code, os._exit)


def _end_as(code: int, exit_with) -> None:
    """End this process as one that ended with CODE: killed by the signal -CODE, else
    exit_with(CODE)."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    exit_with(code)


def _own_exit_handlers() -> None:
    """Exit handlers as the command registers them, with those the zygote's imports registered
    dropped but the ones a command's own objects rely on kept: multiprocessing's (it ends a
    pool's workers), logging's (it flushes) and weakref.finalize's (registered again by the
    first finalizer the child makes). What goes is torch's clean-up of its operator libraries
    and the like, 70 ms of every exit that nothing observes in a process that is ending."""
    import logging
    import multiprocessing.util
    import weakref

    atexit._clear()
    weakref.finalize._registered_with_atexit = False
    atexit.register(multiprocessing.util._exit_function)
    atexit.register(logging.shutdown)


def _fresh_stdio() -> None:
    """sys.stdout and sys.stderr over the new fds, buffered as a fresh interpreter buffers them
    under this environment: stdout by blocks, by lines at a terminal, not at all under
    PYTHONUNBUFFERED; stderr by lines."""
    import io

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding
    for fd, name in ((1, "stdout"), (2, "stderr")):
        binary = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        stream = io.TextIOWrapper(
            binary, encoding=encoding, errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=fd == 2 or os.isatty(fd), write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def serve(path: str) -> None:
    _preload()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    # a child's exit wakes the loop at once (its caller is waiting for the status)
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector.register(woken, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> its caller's connection
    print("ready", flush=True)
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=1):
            if key.fileobj == woken:
                os.read(woken, 4096)
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                conn.setblocking(True)
                try:
                    request, fds = _receive(conn)
                except (OSError, EOFError, ValueError):  # a caller gone before it asked
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    for fd in (woken, wake):
                        os.close(fd)
                    selector.close()
                    listener.close()
                    for other in [conn, *children.values()]:
                        other.close()
                    _child(request, fds)
                try:  # the child does it too: whichever runs first, killpg finds the group
                    os.setpgid(pid, pid)
                except OSError:
                    pass
                for fd in fds:
                    os.close(fd)
                _send(conn, {"pid": pid})
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            elif not key.fileobj.recv(1):  # the caller went away: so does its child's group
                try:
                    os.killpg(key.data, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                selector.unregister(key.fileobj)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    selector.unregister(conn)
                except KeyError:
                    pass
                try:
                    _send(conn, {"status": status})
                except OSError:
                    pass
                conn.close()


# ----------------------------------------------------------------------------- the callers

_zygote: dict = {}
_lock = threading.Lock()


def enabled() -> bool:
    """Whether calls go through the warm process: on Linux (fork, fd passing, /proc), unless
    ANDREA_TEST_FRESH=1 asks for a fresh interpreter every time."""
    return sys.platform == "linux" and os.environ.get("ANDREA_TEST_FRESH") != "1"


def socket_path() -> str:
    """The warm process's socket, starting it on first use."""
    with _lock:
        if not _zygote:
            folder = tempfile.mkdtemp(prefix="andrea-forkserver-")
            path = os.path.join(folder, "socket")
            proc = subprocess.Popen(
                [sys.executable, "-u", __file__, "--serve", path],
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
            )
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the fork server did not start (exit {proc.wait()})")
            _zygote.update(proc=proc, path=path)
            atexit.register(_stop)
        return _zygote["path"]


def _stop() -> None:
    proc = _zygote.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    if "path" in _zygote:
        shutil.rmtree(os.path.dirname(_zygote["path"]), ignore_errors=True)


def _start(conn: socket.socket, path: str, argv: list[str], cwd: str, env: dict[str, str],
           fds: list[int]) -> tuple[int, object]:
    """Ask the warm process at PATH for `python ARGV` over FDS (its stdin, stdout, stderr): the
    child's pid, and the reader its exit status will come on."""
    conn.connect(path)
    _send(conn, {"argv": argv, "cwd": cwd, "env": env}, fds)
    reader = conn.makefile("rb")
    return json.loads(reader.readline())["pid"], reader


def run(argv: list[str], cwd: str, env: dict[str, str],
        timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run([python, *ARGV], capture_output=True, text=True) in a forked child, with no
    stand-in process between: the same CompletedProcess, or TimeoutExpired after TIMEOUT."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        pid, reader = _start(conn, socket_path(), argv, cwd, env,
                             [0, out.fileno(), err.fileno()])
        conn.settimeout(timeout)
        try:
            status = json.loads(reader.readline())["status"]
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout) from None
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            [sys.executable, *argv], os.waitstatus_to_exitcode(status),
            _text(out.read()), _text(err.read()),
        )


def _text(data: bytes) -> str:
    """What text=True makes of captured output: decoded, with universal newlines."""
    return data.decode().replace("\r\n", "\n").replace("\r", "\n")


def stand_in(path: str, argv: list[str]) -> None:
    """`python ARGV` as this process: a child forked with this process's stdio, folder and
    environment; signals sent here are passed on; this process ends as the child
    ended (its exit code, or killed by the same signal). Killed itself (SIGKILL, a killpg), it
    closes its connection and the child's process group is killed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        pid, reader = _start(conn, path, argv, os.getcwd(), dict(os.environ), [0, 1, 2])
        for sig in PASSED_ON:
            signal.signal(sig, lambda number, _frame: os.kill(pid, number))
        code = os.waitstatus_to_exitcode(json.loads(reader.readline())["status"])
    _end_as(code, sys.exit)


def command(*argv: str) -> list[str]:
    """The command line that runs `python ARGV` (-m MODULE ARGS, SCRIPT ARGS, -c CODE ARGS or
    - ARGS) through the warm process: for subprocess.run/Popen, and for torchrun --no-python
    (whose workers it then starts). A fresh `python ARGV` where the warm process is not used
    (enabled())."""
    if not enabled():
        return [sys.executable, *argv]
    return [sys.executable, __file__, "--socket", socket_path(), *argv]


def python_script(folder: str) -> str:
    """An executable file in FOLDER that runs as `python` does, through the warm process: for a
    script that takes its interpreter from a variable (PYTHON=...). sys.executable itself where
    the warm process is not used (enabled())."""
    if not enabled():
        return sys.executable
    path = os.path.join(folder, "python")
    with open(path, "w") as f:
        f.write("#!/bin/sh\nexec " + " ".join(f"'{part}'" for part in command()) + ' "$@"\n')
    os.chmod(path, 0o755)
    return path


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "--socket":
        stand_in(sys.argv[2], sys.argv[3:])
