"""Encoding jobs to token ids: in the main process, or in `spawn`ed worker processes with a
bounded number of jobs in flight, results in job order (so the output does not depend on the
worker count and memory stays flat)."""

from __future__ import annotations

import collections
import multiprocessing
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from andrea.data.documents import SPLITS, Input, Settings, Tally, all_jobs, job_documents
from andrea.data.readers import Job
from andrea.data.tokenizer import load_tokenizer

BPE_TRAIN_MAX_BYTES = 256 << 20  # BPE learns from at most this much of the train split
PARALLEL_MIN_BYTES = 2 << 20  # below this, automatic `workers` encodes in-process


def auto_workers(total_bytes: int) -> int:
    if total_bytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(os.cpu_count() or 1, 8))


_worker_tokenizer: Any = None


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

