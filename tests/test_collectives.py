"""What the ranks send each other goes where the backend takes it: NCCL reduces and gathers GPU
tensors only (a host tensor fails there, at the first checkpoint of the GPU's first NCCL run), so
every collective of andrea.train.collectives hands the backend tensors on `_comm_device`, and
the caller gets its result where its own tensor lives. A CPU machine has no second device to run
NCCL's rule on: here the backend's device is `meta`, and the fake collective records what it was
handed, then stops the call (a meta tensor holds no values to copy back)."""

from __future__ import annotations

import pytest
import torch

from andrea.errors import UserError
from andrea.train import collectives
from andrea.train.torchrun import DistInfo


class Handed(Exception):
    pass


@pytest.fixture
def backend_on_meta(monkeypatch) -> list[torch.device]:
    handed: list[torch.device] = []

    def collective(*tensors, **_kwargs):
        for t in tensors:
            for one in (t if isinstance(t, list) else [t]):
                handed.append(one.device)
        raise Handed

    monkeypatch.setattr(collectives, "_comm_device", lambda info: torch.device("meta"))
    for name in ("all_reduce", "all_gather", "broadcast"):
        monkeypatch.setattr(collectives.dist, name, collective)
    return handed


ALONE_IN_A_GROUP = DistInfo(group_of_one=True)


def test_a_host_tensor_is_summed_on_the_backends_device(backend_on_meta):
    with pytest.raises(Handed):
        collectives.all_reduce_sum(torch.tensor([1.0]), ALONE_IN_A_GROUP)
    assert backend_on_meta == [torch.device("meta")]


def test_bytes_are_gathered_on_the_backends_device(backend_on_meta):
    with pytest.raises(Handed):
        collectives.all_gather_bytes(torch.zeros(4, dtype=torch.uint8), ALONE_IN_A_GROUP)
    assert set(backend_on_meta) == {torch.device("meta")}


def test_a_sum_lands_where_the_callers_tensor_lives(monkeypatch):
    """With a backend whose device is the host's: the sum in place, on the caller's tensor."""
    monkeypatch.setattr(collectives, "_comm_device", lambda info: torch.device("cpu"))
    monkeypatch.setattr(collectives.dist, "all_reduce", lambda t, op: t.mul_(3))  # three ranks
    values = torch.tensor([1.0, 2.0])
    out = collectives.all_reduce_sum(values, ALONE_IN_A_GROUP)
    assert out is values and values.tolist() == [3.0, 6.0]


SECOND_OF_THREE = DistInfo(rank=1, world_size=3)


def test_a_failure_on_other_ranks_is_raised_here_naming_the_first(monkeypatch):
    """on_every_rank on rank 1, whose own work went well: ranks 0 and 2 refused. The first
    refusal is raised here as the same one line (a UserError, not a traceback), naming its rank."""
    outcomes = [("user", "no room on rank 0's disk"), ("ok", ""), ("user", "rank 2's own")]
    monkeypatch.setattr(collectives, "all_gather_objects", lambda obj, info: outcomes)
    with pytest.raises(UserError, match=r"^rank 0: no room on rank 0's disk$"):
        collectives.on_every_rank(lambda: 7, SECOND_OF_THREE)
    outcomes[0] = ("ok", "")
    outcomes[2] = ("failed", "boom")
    with pytest.raises(RuntimeError, match=r"^rank 2 failed: boom$"):
        collectives.on_every_rank(lambda: 7, SECOND_OF_THREE)
    outcomes[2] = ("ok", "")
    assert collectives.on_every_rank(lambda: 7, SECOND_OF_THREE) == 7


def test_rank_0s_failure_reaches_the_other_ranks_as_a_failure_not_a_value(monkeypatch):
    """from_rank0 on rank 1: what rank 0 broadcast decides, a crash there included (raised
    here too, never returned as if it were rank 0's decision)."""
    sent = {"box": ("failed", "boom")}

    def broadcast(box, src, device):
        box[0] = sent["box"]

    monkeypatch.setattr(collectives, "_comm_device", lambda info: torch.device("cpu"))
    monkeypatch.setattr(collectives.dist, "broadcast_object_list", broadcast)
    with pytest.raises(RuntimeError, match=r"^rank 0 failed: boom$"):
        collectives.from_rank0(lambda: "not run here", SECOND_OF_THREE)
    sent["box"] = ("user", "data/: not prepared")
    with pytest.raises(UserError, match=r"^data/: not prepared$"):
        collectives.from_rank0(lambda: "not run here", SECOND_OF_THREE)
    sent["box"] = ("ok", 42)
    assert collectives.from_rank0(lambda: "not run here", SECOND_OF_THREE) == 42


def test_a_sum_on_another_device_comes_back_into_the_callers_tensor(monkeypatch):
    """Under nccl a host tensor is summed as a copy on the GPU: the sum must be copied back.
    Here `.to` of the backend's device hands out a copy, as a move to a GPU does."""
    monkeypatch.setattr(collectives, "_comm_device", lambda info: "the backend's device")
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device: self.clone())
    monkeypatch.setattr(collectives.dist, "all_reduce", lambda t, op: t.mul_(3))  # three ranks
    values = torch.tensor([1.0, 2.0])
    out = collectives.all_reduce_sum(values, ALONE_IN_A_GROUP)
    assert out is values and values.tolist() == [3.0, 6.0]
