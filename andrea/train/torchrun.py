"""Which process this is among how many, as torchrun's environment says it (read once).

`torchrun_env`: what torchrun tells each process through the environment; `DistInfo`: the
ranks as training holds them.

One machine: `torchrun --nproc_per_node=K -m andrea train ...`. Several machines: the same command
on each with `--nnodes=N --node_rank=i --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT`; nothing in
the trainer changes, since ranks, the global batch and the data streams derive from WORLD_SIZE and
RANK.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from andrea.errors import UserError


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells each process it starts, through the environment; a process started
    otherwise is rank 0 of 1."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # the processes on this machine
    restart_count: int = 0  # how often the launcher has restarted the processes
    max_restarts: int = 0  # how often it may (torchrun --max-restarts)
    run_id: str = ""  # the launcher's id of the job (--rdzv_id)
    master_addr: str = ""
    master_port: int = 0
    agent_store: bool = False  # whether the launcher's key-value store is open to the processes


@functools.cache
def torchrun_env() -> TorchrunEnv:
    """The torchrun environment, read once per process: every user takes it from here."""
    env = os.environ
    return TorchrunEnv(
        rank=int(env.get("RANK", "0")), local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
        run_id=env.get("TORCHELASTIC_RUN_ID", ""), master_addr=env.get("MASTER_ADDR", ""),
        master_port=int(env.get("MASTER_PORT", "0")),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def refuse_several_processes(verb: str) -> None:
    """Only `andrea train` shares its work among torchrun's processes: any other verb started
    by torchrun with several would run once in each, each printing, and writing the same
    files (an export's folder, an imported run, prepared shards) at the same time."""
    env = torchrun_env()
    if env.world_size > 1:
        raise UserError(
            f"andrea {verb} runs as one process, and this is rank {env.rank} of "
            f"{env.world_size} (WORLD_SIZE={env.world_size} in the environment, as torchrun "
            f"sets it): run it without torchrun; torchrun is for andrea train")


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # the processes on this machine, which share its memory
    # A process group of one process (ANDREA_PROCESS_GROUP_OF_ONE=1 under torchrun): the
    # several-process path (NCCL, DDP, FSDP2) run on one GPU, to check it where only one is.
    group_of_one: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or self.group_of_one

    @property
    def is_main(self) -> bool:
        return self.rank == 0
