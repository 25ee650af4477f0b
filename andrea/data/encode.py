"""Encoding jobs to token ids: in the main process, or in `spawn`ed worker processes with a
bounded number of jobs in flight, results in job order (so the output does not depend on the
worker count and memory stays flat)."""

from __future__ import annotations

import ast
import collections
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from andrea.data.documents import SPLITS, Input, Settings, Tally, all_jobs, job_documents
from andrea.data.readers import InputFile, Job, iter_blocks
from andrea.data.tokenizer import load_tokenizer
from andrea.errors import UserError

BPE_TRAIN_MAX_BYTES = 256 << 20  # BPE learns from at most this much of the train split
PARALLEL_MIN_BYTES = 2 << 20  # below this, automatic `workers` encodes in-process


def auto_workers(inputs: list[Input]) -> int:
    """data.workers 0: one process for inputs of less than PARALLEL_MIN_BYTES, else a worker a
    core (8 at most)."""
    if held_bytes(inputs, PARALLEL_MIN_BYTES) < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(os.cpu_count() or 1, 8))


def held_bytes(inputs: list[Input], enough: int) -> int:
    """The bytes `inputs` hold, counted until `enough`: a compressed file's decompressed, read
    through its decompressor (its size on disk says nothing: 8.6 MB of JSON Lines was 1.2 KB
    as .zst, and was encoded by one process). Decompressing 2 MiB takes 6 to 20 ms; a zstd
    frame's recorded size would be cheaper, but a stream compressed from a pipe records none,
    and gzip records only its last member's size, modulo 4 GiB."""
    held = 0
    for item in inputs:
        if held >= enough:
            break
        if not (isinstance(item, InputFile) and item.compression):
            held += item.size
            continue
        for block, _ in iter_blocks(item):
            held += len(block)
            if held >= enough:
                break
    return held


_worker_tokenizer: Any = None


def refuse_an_unguarded_script() -> None:
    """A UserError, before any worker starts, when this process is a Python script that calls
    andrea from a top-level statement that no `if` on `__name__` encloses. `spawn` starts each
    worker by importing that script, which would then call andrea again, fail, and be replaced
    by the pool, forever. Not for the andrea command, `python -m PKG` (a `__main__` module,
    which spawn never imports again), a notebook or an interpreter's prompt (no file)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if path is None or spec_name == "__main__" or spec_name.endswith(".__main__"):
        return
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:  # not called while the main script runs its top level
        return
    try:
        tree = ast.parse(Path(path).read_bytes())  # bytes: a coding cookie is honoured
    except (OSError, SyntaxError, ValueError):
        return
    line = frame.f_lineno
    for statement in tree.body:
        if statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            if not _under_a_name_test(statement, line):
                raise UserError(
                    f"{path}:{line}: calls andrea outside `if __name__ == \"__main__\":`; "
                    f"the workers that tokenize (data.workers) start by importing the script, "
                    f"which would call it again in each: put the call under that guard, or set "
                    f"data.workers=1"
                )
            return


def _under_a_name_test(statement: ast.stmt, line: int) -> bool:
    """Whether an `if` whose test reads `__name__` encloses `line` within `statement` (the
    guard, however written: `and` more, `!=` with an else, inside a try)."""
    return any(
        isinstance(node, ast.If) and node.lineno <= line <= (node.end_lineno or node.lineno)
        and any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test))
        for node in ast.walk(statement))


def refuse_in_a_starting_worker(call: str) -> None:
    """A RuntimeError when a worker process andrea started is importing the user's script (as
    `spawn` starts every process: it runs the script as __mp_main__) and the script calls
    andrea at its top level, unguarded: each such worker would train or prepare again, fail
    (the run is locked by its parent) and be replaced, forever. Called at the Python entry
    points (train, prepare_inputs), so the worker says why before it ends."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            f"{call} was called while a worker process that andrea started imported your script: "
            f"call andrea under `if __name__ == \"__main__\":` in a script (the workers that "
            f"tokenize import it, as every process multiprocessing starts does), or set "
            f"data.workers=1"
        )


def init_worker(kind: str, data_dir: str | None, in_pool: bool = True) -> None:
    global _worker_tokenizer
    if in_pool:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
        # Ctrl-C at a terminal reaches the whole process group: the main process alone stops
        # the prepare, and ends the pool (SIGTERM, which kills a worker without a word).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_tokenizer = load_tokenizer(kind, Path(data_dir) if data_dir else None)


JobResult = tuple[dict[str, np.ndarray], Tally]


def encode_job(args: tuple[Job, Settings, str]) -> JobResult:
    """One job's tokens per split (each document followed by end-of-text), and its skip count."""
    job, settings, dtype = args
    docs, tally = job_documents(job, settings)
    tok = _worker_tokenizer
    encode = getattr(tok, "encode_array", None) or tok.encode
    eot = np.array([tok.eot_id], dtype=dtype)
    parts: dict[str, list[Any]] = {s: [] for s in SPLITS}
    for split, text, end in docs:
        parts[split].append(np.asarray(encode(text), dtype=dtype))
        if end:
            parts[split].append(eot)
    tokens = {
        s: np.concatenate(p) if p else np.zeros(0, dtype=dtype) for s, p in parts.items()
    }
    return tokens, tally


def encode_all(
    jobs: Iterator[Job], settings: Settings, tok: Any, data_dir: Path, dtype: str, workers: int
) -> Iterator[tuple[Job, JobResult | None]]:
    """Encode jobs in order with `tok` (workers load their own copy); at most 2 * workers
    in flight, so memory is bounded. A job without data comes back with None."""
    global _worker_tokenizer
    kind = tok.name
    if workers <= 1:
        _worker_tokenizer = tok
        for job in jobs:
            yield job, None if job.data is None else encode_job((job, settings, dtype))
        return
    refuse_an_unguarded_script()
    ctx = multiprocessing.get_context("spawn")  # no fork: HF tokenizers' threads dislike it
    with ctx.Pool(workers, init_worker, (kind, str(data_dir))) as pool:
        pending: collections.deque = collections.deque()
        for job in jobs:
            result = None
            if job.data is not None:
                result = pool.apply_async(encode_job, ((job, settings, dtype),))
            pending.append((job, result))
            while len(pending) > 2 * workers:
                j, r = pending.popleft()
                yield j, None if r is None else r.get()
        while pending:
            j, r = pending.popleft()
            yield j, None if r is None else r.get()


def train_texts(
    inputs: list[Input], settings: Settings, scratch: Path
) -> Iterator[str]:
    """The train split's texts, in order, up to BPE_TRAIN_MAX_BYTES: what a BPE learns from."""
    seen = 0
    for job in all_jobs(inputs, settings.val_fraction, settings.text_field, 0, scratch):
        for split, text, _ in job_documents(job, settings)[0]:
            if split == "train":
                yield text
                seen += len(text)
                if seen >= BPE_TRAIN_MAX_BYTES:
                    return

