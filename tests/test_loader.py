"""Loader: batches are a pure function of (seed, step, rank, micro_step, sizes); ranks are
disjoint; 1 process x 2 accumulation steps equals 2 processes x 1; val is a fixed pass."""

import json

import numpy as np
import pytest
import torch

from andrea import shards
from andrea.errors import UserError
from andrea.loader import TokenSplit, sample_distinct, train_batch, val_batches
from andrea.prepare import MANIFEST, MANIFEST_VERSION

BASE = 1_000_000  # shard k holds BASE*k, BASE*k + 1, ...: a token names its shard and position
T = 16


@pytest.fixture
def data_dir(tmp_path):
    """Three train shards of different lengths and one val shard, uint32 position tokens."""
    ident = "test:v1"
    entries = {"train": [], "val": []}
    for split, sizes in (("train", [1000, 37, 2500]), ("val", [300])):
        for k, n in enumerate(sizes):
            name = f"{split}_{k:06d}.bin"
            w = shards.ShardWriter(tmp_path / name, np.dtype("<u4"), ident)
            w.write(np.arange(n) + BASE * (k + 1))
            entries[split].append({"file": name, "tokens": w.close().count})
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "tokenizer": {"kind": "byte", "identity": ident, "vocab_size": 10 * BASE, "eot_id": 0},
        "shards": entries,
    }
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    return tmp_path


def batch(split, **kw):
    args = dict(seed=7, step=3, micro_step=0, rank=0, accum_steps=1, world_size=1,
                micro_batch_size=4, block_size=T)
    return train_batch(split, **{**args, **kw})


def test_windows_are_aligned_contiguous_and_inside_one_shard(data_dir):
    split = TokenSplit(data_dir, "train")
    assert split.n_tokens == 3537
    for step in range(20):
        x, y = batch(split, step=step, micro_batch_size=8)
        assert x.dtype == torch.int64 and x.shape == (8, T) == y.shape
        assert torch.equal(x[:, 1:], y[:, :-1])
        window = torch.cat([x, y[:, -1:]], dim=1)
        assert torch.all(window[:, 1:] - window[:, :-1] == 1)  # never crosses a shard
        starts = (x[:, 0] % BASE).numpy()
        assert len(set(starts % T)) == 1  # one offset per step
        assert len(set(x[:, 0].tolist())) == 8  # distinct windows
        ends = (y[:, -1] % BASE).numpy()
        sizes = {1: 1000, 2: 37, 3: 2500}
        assert all(e < sizes[int(s)] for e, s in zip(ends, (x[:, 0] // BASE).tolist(), strict=True))


def test_batch_is_a_function_of_its_arguments(data_dir):
    split = TokenSplit(data_dir, "train")
    first = batch(split, step=5)
    batch(split, step=6)  # no hidden state: other calls in between change nothing
    again = TokenSplit(data_dir, "train")  # a resumed process
    assert torch.equal(batch(again, step=5)[0], first[0])
    assert not torch.equal(batch(split, step=6)[0], first[0])
    assert not torch.equal(batch(split, step=5, seed=8)[0], first[0])


def test_accumulation_equals_processes_and_ranks_are_disjoint(data_dir):
    split = TokenSplit(data_dir, "train")
    for step in range(5):
        one = [batch(split, step=step, accum_steps=2, micro_step=m)[0] for m in range(2)]
        two = [batch(split, step=step, world_size=2, rank=r)[0] for r in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
        # 2 ranks x 2 micro-steps: the four micro-batches share no window.
        grid = [
            batch(split, step=step, world_size=2, accum_steps=2, rank=r, micro_step=m)[0]
            for r in range(2) for m in range(2)
        ]
        firsts = torch.cat([g[:, 0] for g in grid]).tolist()
        assert len(set(firsts)) == len(firsts) == 16


def test_too_small_split_says_how_much_is_needed(data_dir):
    split = TokenSplit(data_dir, "val")
    with pytest.raises(UserError, match=r"the val split has 300 tokens, too few .*needs about 544"):
        batch(split, micro_batch_size=32)


def test_val_batches_are_a_fixed_sequential_pass(data_dir):
    split = TokenSplit(data_dir, "val")
    got = list(val_batches(split, micro_batch_size=4, block_size=T, max_batches=None))
    assert len(got) == (300 - 1) // T // 4  # 18 windows -> 4 full batches
    xs = torch.cat([x for x, _ in got])
    assert torch.equal(xs[:, 0] - BASE, torch.arange(len(xs)) * T)
    again = list(val_batches(split, micro_batch_size=4, block_size=T, max_batches=2))
    assert len(again) == 2
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, got[:2], strict=True))
    only = list(val_batches(split, micro_batch_size=64, block_size=T, max_batches=None))
    assert len(only) == 1 and only[0][0].shape == (18, T)  # the partial batch, when alone
    with pytest.raises(UserError, match="fewer than one window of 301"):
        next(val_batches(split, micro_batch_size=1, block_size=300, max_batches=None))


def test_sample_distinct():
    rng = np.random.default_rng(0)
    for n, k in ((10**12, 1000), (100, 60), (5, 5)):
        got = sample_distinct(rng, n, k)
        assert len(got) == k == len(set(got.tolist())) and got.min() >= 0 and got.max() < n


def test_missing_manifest_and_damaged_shard(data_dir, tmp_path_factory):
    with pytest.raises(UserError, match="run `andrea prepare`"):
        TokenSplit(tmp_path_factory.mktemp("empty"), "train")
    shard = data_dir / "train_000001.bin"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(UserError, match="train_000001.bin: token shard truncated"):
        TokenSplit(data_dir, "train")
