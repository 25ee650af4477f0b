"""torchrun's restarts: which launch of the workers this is, and what is said of a lost rank.

`attempt`: the launch, the same on every rank, and its part of torchrun's store. After a
collective failed: which ranks were lost, and the surviving ranks' line (`lost_peer_line`:
torchrun restarts the job, or the command that continues it).
"""

from __future__ import annotations

import functools
import shlex
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from andrea.errors import Restarting, UserError
from andrea.train.torchrun import DistInfo, torchrun_env


@dataclass(frozen=True)
class Attempt:
    """Which launch of the workers this is, the same on every rank, and its key-value store."""

    number: int  # 0: the first launch; n: torchrun's n-th restart of the workers
    store: Any  # this attempt's part of torchrun's store (None without a shared one)


@functools.cache
def attempt() -> Attempt:
    """torchrun keeps its store across a restart: without keys of its own, a restarted worker
    reads the addresses the dead attempt published there, and gloo fails to connect
    (`connectFullMesh ... Connection refused`) or waits on them. TORCHELASTIC_RESTART_COUNT
    alone cannot name the attempt: under --rdzv-backend c10d across machines, a node whose
    workers did not fail restarts them without counting. Every restart starts every rank once,
    so each rank takes the first number, from the restart count on, it has not started under."""
    env = torchrun_env()
    if env.world_size <= 1 or not env.agent_store:
        return Attempt(env.restart_count, None)
    client = dist.TCPStore(env.master_addr, env.master_port, world_size=env.world_size,
                           is_master=False, timeout=timedelta(minutes=5))
    number = env.restart_count
    while client.add(f"andrea/rank-{env.rank}/started-{number}", 1) > 1:
        number += 1
    return Attempt(number, dist.PrefixStore(f"andrea/attempt-{number}", client))


def lost_ranks(info: DistInfo, wait: float = 5.0) -> list[int] | None:
    """After a collective failed on this rank: the ranks that do not answer a roll call in this
    attempt's store within `wait` seconds. Every rank a collective failed on answers, so []
    means that no process was lost (the failure is another); None: no store to ask (it is gone
    with node 0's launcher, or torchrun shares none)."""
    store = attempt().store
    if store is None:
        return None
    try:
        store.set(f"andrea/alive/{info.rank}", "1")
        deadline = time.monotonic() + wait
        while True:
            missing = [r for r in range(info.world_size)
                       if not store.check([f"andrea/alive/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except (RuntimeError, OSError):  # the store's own failure: nobody left to ask
        return None


def lost_peer_line(info: DistInfo, exc: BaseException, step: int, checkpoint: Path | None,
                   run_dir: Path) -> UserError | Restarting | None:
    """What the surviving ranks say when a collective failed because another rank's process
    ended (gloo's or nccl's own message names an address, not a rank, nor how to go on), as
    the exception that ends this process; None for any other failure."""
    if not (info.world_size > 1 and isinstance(exc, RuntimeError)):  # alone: no peer to lose
        return None
    lost = lost_ranks(info)
    if lost == []:
        return None
    line, restarting = lost_peer_words(lost, step, checkpoint, run_dir,
                                       attempt_number=attempt().number,
                                       max_restarts=torchrun_env().max_restarts)
    return Restarting(line) if restarting else UserError(line)


def lost_peer_words(lost: list[int] | None, step: int, checkpoint: Path | None, run_dir: Path,
                    *, attempt_number: int, max_restarts: int) -> tuple[str, bool]:
    """(the line, whether torchrun restarts the job) for `lost` ranks (None: unknown, the store
    is gone with node 0's launcher, which takes the job with it) in attempt `attempt_number`.
    The attempt counts every restart, and each node's launcher at most as many, so restarts
    left by it are left on every node: the line never promises one that does not come."""
    who = (f"ranks {', '.join(map(str, lost))} were lost (their processes ended, or their "
           f"nodes went down)" if lost and len(lost) > 1 else
           f"{f'rank {lost[0]}' if lost else 'a process on another node'} was lost (its "
           f"process ended, or its node went down)")
    where = (f"the newest intact checkpoint is {checkpoint}" if checkpoint is not None
             else "no checkpoint was written yet")
    head = f"{who} after step {step}; {where}"
    if lost and attempt_number < max_restarts:
        return (f"{head}; torchrun restarts the job (restart {attempt_number + 1} of "
                f"{max_restarts})"), True
    if checkpoint is None:
        return (f"{head}; start it again with the same launch (there is nothing to resume; "
                f"torchrun --max-restarts N restarts it by itself)"), False
    return (f"{head}; continue with the same launch and "
            f"{shlex.join(['--resume', str(run_dir)])} (torchrun --max-restarts N continues by "
            f"itself)"), False
