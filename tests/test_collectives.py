"""What the ranks send each other goes where the backend takes it: NCCL reduces and gathers GPU
tensors only (a host tensor fails there, at the first checkpoint of the GPU's first NCCL run), so
every collective of andrea.train.collectives hands the backend tensors on `_comm_device`, and
the caller gets its result where its own tensor lives. A CPU machine has no second device to run
NCCL's rule on: here the backend's device is `meta`, and the fake collective records what it was
handed, then stops the call (a meta tensor holds no values to copy back)."""

from __future__ import annotations

import pytest
import torch

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
