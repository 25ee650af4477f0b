"""Loader: batches are a pure function of (seed, step, rank, micro_step, sizes); ranks are
disjoint; 1 process x 2 accumulation steps equals 2 processes x 1; the val windows are a fixed
set spread over the split."""

import json

import numpy as np
import pytest
import torch

from andrea.config import load_config
from andrea.data import shards
from andrea.data.loader import (
    Mixture,
    TokenSplit,
    mixture_report,
    read_batch,
    realised_share,
    sample_distinct,
    train_batch,
    val_windows,
    window_groups,
)
from andrea.data.shards import MANIFEST, MANIFEST_VERSION
from andrea.errors import UserError

BASE = 1_000_000  # shard k holds BASE*k, BASE*k + 1, ...: a token names its shard and position
T = 16


def write_prepared(out, sizes, first, vocab_size, ident="test:v1"):
    """A prepared dir whose shard k of a split holds BASE*(first[split] + k) + position tokens,
    uint32, with its manifest."""
    entries = {split: [] for split in sizes}
    for split, split_sizes in sizes.items():
        for k, n in enumerate(split_sizes):
            file = f"{split}_{k:06d}.bin"
            w = shards.ShardWriter(out / file, np.dtype("<u4"), ident)
            w.write(np.arange(n) + BASE * (first[split] + k))
            entries[split].append({"file": file, "tokens": w.close().count})
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "tokenizer": {"kind": "byte", "identity": ident, "vocab_size": vocab_size, "eot_id": 0},
        "shards": entries,
    }
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


@pytest.fixture
def data_dir(tmp_path):
    """Three train shards of different lengths and one val shard, uint32 position tokens."""
    return write_prepared(tmp_path, {"train": [1000, 37, 2500], "val": [300]},
                          {"train": 1, "val": 1}, 10 * BASE)


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


def test_too_small_split_says_how_much_is_needed(data_dir, tmp_path):
    """The number is the least a shard must hold, (windows + 1) x block_size: before, `needs
    about 544` (windows + 2 blocks) here, and `windows of 17 tokens` beside block_size 16."""
    split = TokenSplit(data_dir, "val")
    with pytest.raises(UserError, match=r"the val split has 300 tokens, too few for one global "
                                        r"batch of 32 windows of 16 tokens \(block_size; .*\), "
                                        r"which needs at least 528 tokens in one shard"):
        batch(split, micro_batch_size=32)
    for tokens, enough in ((528, True), (527, False)):
        folder = tmp_path / str(tokens)
        folder.mkdir()
        write_prepared(folder, {"train": [100], "val": [tokens]}, {"train": 1, "val": 1},
                       10 * BASE)
        if enough:
            batch(TokenSplit(folder, "val"), micro_batch_size=32)
        else:
            with pytest.raises(UserError, match="needs at least 528 tokens"):
                batch(TokenSplit(folder, "val"), micro_batch_size=32)


def test_val_windows_cover_the_split_or_spread_a_budget_over_it(tmp_path):
    split = TokenSplit(write_prepared(tmp_path, {"train": [100], "val": [300, 150]},
                                      {"train": 1, "val": 1}, 10 * BASE), "val")
    whole = val_windows(split, T)
    # Every token but a shard's first is a target once: 299 + 149, windows of 16 and the rest.
    assert sum(n for _, _, n in whole) == 299 + 149
    assert whole[:2] == [(0, 0, T), (0, T, T)] and whole[18] == (0, 288, 11)
    assert whole[-1] == (1, 144, 5) and val_windows(split, T, 10**9) == whole
    full = [w for w in whole if w[2] == T]  # 18 + 9 of them
    got = val_windows(split, T, 100)  # 7 windows: 6 whole, the last cut to 4 targets
    assert sum(n for _, _, n in got) == 100 and len(got) == 7
    assert got[:6] == [full[j * 27 // 7] for j in range(6)] and got[6] == (*full[23][:2], 4)
    assert {shard for shard, _, _ in got} == {0, 1}  # spread over the whole split
    # Batched at any size: the same windows, in the same order, the same tokens.
    for size in (1, 3, 8):
        batches = [read_batch(split, group) for group in window_groups(got, size)]
        assert all(len(x) <= size for x, _ in batches)
        xs = [row for x, _ in batches for row in x.tolist()]
        ys = [row for _, y in batches for row in y.tolist()]
        assert [(r[0] // BASE - 1, r[0] % BASE, len(r)) for r in xs] == got
        assert all(y[:-1] == x[1:] for x, y in zip(xs, ys, strict=True))


def test_a_budgets_val_windows_are_found_without_listing_the_split():
    """The windows a budget spreads over the split are the same as picked from the list of
    every window, found without that list (0.6 GB for a 1 GB corpus's train split at T = 64)."""
    import tracemalloc
    from types import SimpleNamespace

    def listed(sizes, block, budget):  # the rule as docs/data.md states it, from the full list
        every = [(s, a, min(block, n - 1 - a)) for s, n in enumerate(sizes)
                 for a in range(0, n - 1, block)]
        k = -(-budget // block)
        full = [w for w in every if w[2] == block]
        out, left = [], budget
        for shard, start, n in [full[j * len(full) // k] for j in range(k)] if len(full) >= k \
                else every:
            if left > 0:
                out.append((shard, start, min(n, left)))
                left -= out[-1][2]
        return out

    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(0, 80, size=rng.integers(1, 5)).tolist()
        block = int(rng.integers(1, 20))
        budget = int(rng.integers(1, max(2, sum(sizes))))
        split = SimpleNamespace(shard_sizes=np.array(sizes, dtype=np.int64))
        if budget < sum(max(0, n - 1) for n in sizes):
            assert val_windows(split, block, budget) == listed(sizes, block, budget), sizes
    big = SimpleNamespace(shard_sizes=np.array([2_000_000, 3, 1_000_001], dtype=np.int64))
    tracemalloc.start()
    try:
        got = val_windows(big, T, 100)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got[0] == (0, 0, T) and got[-1][0] == 2 and sum(n for _, _, n in got) == 100
    assert peak < 100_000  # a list of the 187,500 windows: some 20 MB


def test_the_val_loss_reads_one_batch_at_a_time(tmp_path, monkeypatch):
    """score_val reads a batch just before its forward pass, not the whole val set first: a
    1 GB corpus's whole val split took 0.9 GB as tensors before the first forward."""
    from andrea.train.validation import ValSource, score_val

    split = TokenSplit(write_prepared(tmp_path, {"train": [100], "val": [2000]},
                                      {"train": 1, "val": 0}, 10 * BASE), "val")
    windows = val_windows(split, T)  # 124 of 16 targets, the last of 15
    events = []
    read = split.tokens
    monkeypatch.setattr(split, "tokens", lambda *a: events.append("read") or read(*a))

    class Model(torch.nn.Module):
        def forward(self, x, y):
            events.append(f"forward {len(x)}")
            return None, torch.zeros(())

    source = ValSource("val", 1.0, split, windows, np.ones(2000, dtype=np.int64))
    score = score_val(Model(), [source], batch_size=4, device=torch.device("cpu"),
                      dtype=torch.float32)
    assert events == (["read"] * 4 + ["forward 4"]) * 31 + ["read", "forward 1"]
    assert score.sources[0].tokens == 1999


def test_sample_distinct():
    rng = np.random.default_rng(0)
    for n, k in ((10**12, 1000), (100, 60), (5, 5)):
        got = sample_distinct(rng, n, k)
        assert len(got) == k == len(set(got.tolist())) and got.min() >= 0 and got.max() < n


def test_missing_manifest_and_damaged_shard(data_dir, tmp_path_factory):
    with pytest.raises(UserError, match=r"\(manifest.json missing\); prepare text into it: "
                                        r"andrea prepare --input PATH --out "):
        TokenSplit(tmp_path_factory.mktemp("empty"), "train")
    shard = data_dir / "train_000001.bin"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(UserError, match="train_000001.bin: token shard truncated"):
        TokenSplit(data_dir, "train")


# ----------------------------------------------------------------------------- mixtures


def make_source(root, name, sizes, first_shard, ident="test:v1"):
    """A prepared dir whose shard k holds BASE*(first_shard + k) + position tokens."""
    out = root / name
    out.mkdir()
    return write_prepared(out, {"train": sizes, "val": [200]},
                          {"train": first_shard, "val": first_shard + 50}, 100 * BASE, ident)


@pytest.fixture
def mixture(tmp_path):
    a = make_source(tmp_path, "a", [3000, 900], 1)
    b = make_source(tmp_path, "b", [1500], 10)
    return Mixture([("a", a, 3.0), ("b", b, 1.0)], "train")


def source_of(x):
    return np.where(x[:, 0].numpy() // BASE >= 10, 1, 0)


def test_mixture_draws_by_weight_and_is_a_function_of_seed_and_step(mixture):
    counts = np.zeros(2)
    for step in range(200):
        x, y = batch(mixture, step=step, micro_batch_size=8)
        assert torch.equal(x[:, 1:], y[:, :-1])
        window = torch.cat([x, y[:, -1:]], dim=1)
        assert torch.all(window[:, 1:] - window[:, :-1] == 1)  # inside one shard of a source
        assert len(set(x[:, 0].tolist())) == 8
        counts += np.bincount(source_of(x), minlength=2)
        if step < 5:  # the same batch again (resume), from a freshly opened mixture too
            assert torch.equal(x, batch(mixture, step=step, micro_batch_size=8)[0])
    share = counts / counts.sum()
    # 1,600 windows at p = 0.75: the standard deviation of the share is about 0.011.
    assert abs(share[0] - 0.75) < 0.05, share
    expected = realised_share(mixture, seed=7, steps=range(200), per_step=8, block_size=T)
    np.testing.assert_allclose(share, expected)


@pytest.mark.parametrize("layout", [([3000], [1500], [800]), ([3000, 900], [1500], [700, 700])])
def test_each_window_comes_from_the_source_drawn_for_it(tmp_path, layout):
    """Whatever the sources' shard counts (a small source is one shard): the tokens of each
    source's windows are that source's, so the share read from the batches' tokens is the share
    of the sources drawn (realised_share, what train reports)."""
    dirs = [make_source(tmp_path, name, sizes, first)
            for name, sizes, first in zip("abc", layout, (1, 10, 20), strict=True)]
    mix = Mixture([(name, d, w) for name, d, w in zip("abc", dirs, (3.0, 1.0, 2.0),
                                                       strict=True)], "train")
    counts = np.zeros(3)
    for step in range(100):
        x = batch(mix, step=step, micro_batch_size=8)[0]
        shard = x[:, 0].numpy() // BASE  # 1-2: a, 10: b, 20-21: c
        counts += np.bincount(np.searchsorted([10, 20], shard, side="right"), minlength=3)
    expected = realised_share(mix, seed=7, steps=range(100), per_step=8, block_size=T)
    np.testing.assert_allclose(counts / counts.sum(), expected)
    assert abs(expected[0] - 0.5) < 0.1 and abs(expected[2] - 1 / 3) < 0.1


def test_mixture_share_with_a_batch_warmup_counts_each_steps_own_size(mixture):
    # Steps 0-9 take one micro-batch of 4 windows (a batch warm-up), the rest two.
    counts = np.zeros(2, dtype=np.int64)
    for step in range(25):
        accum = 1 if step < 10 else 2
        for micro in range(accum):
            x = batch(mixture, step=step, micro_step=micro, accum_steps=accum)[0]
            counts += np.bincount(source_of(x), minlength=2)
    expected = realised_share(mixture, seed=7, steps=range(25),
                              per_step=lambda step: 4 if step < 10 else 8, block_size=T)
    np.testing.assert_allclose(counts / counts.sum(), expected)
    fixed = realised_share(mixture, seed=7, steps=range(25), per_step=8, block_size=T)
    assert not np.array_equal(fixed, expected)  # the warm-up steps drew fewer windows


def test_mixture_share_with_a_sequence_warmup_counts_tokens(mixture):
    # Steps 0-9 take 16 windows of T // 4 tokens (a sequence-length warm-up), the rest 4 of T:
    # the same tokens a step, and the share is of tokens, not of windows.
    counts = np.zeros(2, dtype=np.int64)
    for step in range(25):
        windows, length = (16, T // 4) if step < 10 else (4, T)
        x = batch(mixture, step=step, micro_batch_size=windows, block_size=length)[0]
        assert x.shape == (windows, length)
        counts += length * np.bincount(source_of(x), minlength=2)
    expected = realised_share(
        mixture, seed=7, steps=range(25), per_step=lambda step: 16 if step < 10 else 4,
        block_size=lambda step: T // 4 if step < 10 else T)
    np.testing.assert_allclose(counts / counts.sum(), expected)


def test_mixture_accumulation_equals_processes(mixture):
    for step in range(5):
        one = [batch(mixture, step=step, micro_step=m, accum_steps=2)[0] for m in range(2)]
        two = [batch(mixture, step=step, rank=r, world_size=2)[0] for r in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
        assert not set(one[0][:, 0].tolist()) & set(one[1][:, 0].tolist())


def test_mixture_val_reads_every_source_and_report(mixture, tmp_path):
    val = Mixture([("a", tmp_path / "a", 3.0), ("b", tmp_path / "b", 1.0)], "val")
    for part, first in zip(val.parts, (51, 60), strict=True):  # each source its own windows
        groups = window_groups(val_windows(part, T), 4)
        firsts = torch.cat([read_batch(part, group)[0][:, 0] for group in groups])
        assert {int(v) // BASE for v in firsts} == {first}
    line, record = mixture_report(mixture, seed=7, start_step=10, max_steps=110, per_step=8,
                                  block_size=T)
    assert line.startswith("data mixture, realised share of tokens over steps 11-110: a ")
    assert set(record["share"]) == {"a", "b"} and record["weight"] == {"a": 0.75, "b": 0.25}
    assert abs(sum(record["share"].values()) - 1) < 1e-9
    assert mixture_report(TokenSplit(tmp_path / "a", "train"), seed=7, start_step=0,
                          max_steps=10, per_step=8, block_size=T) is None
    # data.sources listing one source still reports its share, as it always has.
    line, _ = mixture_report(Mixture([("x/a", tmp_path / "a", 2.0)], "train"), seed=7,
                             start_step=0, max_steps=10, per_step=8, block_size=T)
    assert line.endswith("steps 1-10: x/a 100.0% (weight 100.0%)")


def test_mixture_weights_near_the_float_maximum_keep_their_ratio(tmp_path):
    # 1e308 + 1e308 is inf: the normalised weights were nan, and the first batch a traceback
    # (numpy's "Probabilities do not sum to 1").
    a = make_source(tmp_path, "a", [3000], 1)
    b = make_source(tmp_path, "b", [1500], 10)
    huge = Mixture([("a", a, 1.5e308), ("b", b, 0.5e308)], "train")
    np.testing.assert_allclose(huge.weights, [0.75, 0.25])
    x = batch(huge, micro_batch_size=8)[0]
    assert len(set(x[:, 0].tolist())) == 8


def test_mixture_refuses_different_tokenizers_and_small_sources(tmp_path):
    a = make_source(tmp_path, "a", [3000], 1)
    c = make_source(tmp_path, "c", [3000], 20, ident="other:v1")
    with pytest.raises(UserError, match=r"data.sources: .*a was prepared with tokenizer test:v1 "
                                        r"but .*c with other:v1"):
        Mixture([("a", a, 1.0), ("c", c, 1.0)], "train")
    small = make_source(tmp_path, "small", [40], 30)
    mix = Mixture([("a", a, 1.0), ("small", small, 1.0)], "train")
    with pytest.raises(UserError, match=r"small: the train split \(mixture source small\) has 40"):
        batch(mix, micro_batch_size=4)
    with pytest.raises(UserError, match=r"\(mixture source small\) has 40"):  # one of one
        batch(Mixture([("small", small, 1.0)], "train"), micro_batch_size=4)


# ----------------------------------------------------------------------------- unchanged draws


def draws_digest(split):
    """sha256 of every micro-batch of a grid of (seed, step, accumulation x processes, rank,
    micro-step, block size): the windows a run draws."""
    import hashlib

    digest = hashlib.sha256()
    for seed in (7, 1234):
        for step in (0, 1, 5, 99):
            for accum, world in ((1, 1), (2, 1), (2, 2)):
                for rank in range(world):
                    for micro in range(accum):
                        for block in (T, 7):
                            x, y = batch(split, seed=seed, step=step, accum_steps=accum,
                                         world_size=world, rank=rank, micro_step=micro,
                                         block_size=block)
                            digest.update(x.numpy().tobytes() + y[:, -1].numpy().tobytes())
    return digest.hexdigest()


def val_digest(split):
    """sha256 of the val set train and eval score: each source's name, weight and windows."""
    import hashlib
    from unittest import mock

    from andrea.train import validation

    digest = hashlib.sha256()
    with mock.patch.object(validation, "token_byte_lengths", lambda part: None):
        for budget in (None, 100):
            for s in validation.val_sources(split, T, budget):
                digest.update(repr((s.name, s.weight, s.split.data_dir.name, s.windows)).encode())
    return digest.hexdigest()


def unchanged_splits(root):
    """A data dir, a two-source mixture and a one-source data.sources, in `root`."""
    a = make_source(root, "a", [3000, 900], 1)
    b = make_source(root, "b", [1500], 10)
    return {
        "data dir": (TokenSplit(a, "train"), TokenSplit(a, "val")),
        "mixture": tuple(Mixture([("a", a, 3.0), ("b", b, 1.0)], s) for s in ("train", "val")),
        "one-source mixture": tuple(Mixture([("x/a", a, 2.0)], s) for s in ("train", "val")),
    }


# Recorded with the loader as it was before a data dir became a mixture of one (run
# record_unchanged_draws with that andrea first on the path); a change here means runs draw
# other batches or val windows than they always have.
UNCHANGED = {
    "data dir": ("9931f89dfeb36d52add06b3c3c90a7fc5300766d82f14cd79b219482d655966e",
                 "7825b61b6bbce722ffd8e2a4a748f01676a954fa65c33c56b1fb7ea1554b8bbb"),
    "mixture": ("33654166d47ea5e7d3f22df4f1842f2f27ca610fd64577892cea3581334c5c8c",
                "8551308b3e4818380faa08bdb412a291c5f16f483bea4e5a5b9bf9def3004824"),
    "one-source mixture": ("e2bb38f7b1a5e79f642b5012429d158557af0d9a7d341f24a19b8b65c8255540",
                           "afe42227540e8ee1368c9c369f81d68d300b89d600749cd9cd9e6f56a1631c02"),
}


def record_unchanged_draws(root):
    """What UNCHANGED holds, computed by whichever andrea is imported."""
    return {name: (draws_digest(train), val_digest(val))
            for name, (train, val) in unchanged_splits(root).items()}


def test_draws_and_val_windows_are_those_recorded(tmp_path):
    assert record_unchanged_draws(tmp_path) == UNCHANGED


def starts_at(sizes: list[int], offset: int, block: int) -> list[tuple[int, int]]:
    """(shard, start) of every candidate window at `offset`, numbered in shard order."""
    return [(k, start) for k, n in enumerate(sizes)
            for start in range(offset, n - block, block)]


def epoch_batch(split, tokens_before, **kw):
    return batch(split, order="epochs", tokens_before=tokens_before, **kw)


def test_epochs_take_every_window_of_a_pass_once_in_a_new_order_each_pass(data_dir):
    split = TokenSplit(data_dir, "train")  # shards of 1000, 37 and 2500 tokens
    per_pass = len(starts_at([1000, 37, 2500], T - 1, T))  # the fewest windows of any offset
    assert per_pass == 217
    read = []  # (shard, start) of every window, steps of 2 micro-batches of 4 in order
    for step in range(82):  # 656 windows: three passes and 5 of a fourth
        for micro in range(2):
            x, _ = epoch_batch(split, step * 8 * T, step=step, micro_step=micro, accum_steps=2)
            read += [(row[0] // BASE - 1, row[0] % BASE) for row in x.tolist()]
    orders = []
    for k in range(3):
        seen = read[k * per_pass:(k + 1) * per_pass]
        offsets = {start % T for _, start in seen}
        assert len(offsets) == 1  # one offset a pass
        # Every candidate window of the pass's offset once (the first 217 in shard order).
        assert sorted(seen) == starts_at([1000, 37, 2500], offsets.pop(), T)[:per_pass]
        orders.append(seen)
    assert orders[0] != orders[1] != orders[2]  # a new order each pass
    assert len({o[0][1] % T for o in orders}) > 1  # and new offsets
    # Random order reads some windows twice and others not at all over as many windows.
    drawn = [tuple(row[:1]) for step in range(27)
             for row in batch(split, step=step, micro_batch_size=8)[0].tolist()]
    assert len(set(drawn)) < len(drawn)


def test_epochs_batches_are_a_function_of_the_position_and_equal_across_processes(data_dir):
    split, again = TokenSplit(data_dir, "train"), TokenSplit(data_dir, "train")
    for before in (0, 200 * T, 213 * T):  # 213: this step's 8 windows straddle two passes
        one = [epoch_batch(split, before, accum_steps=2, micro_step=m)[0] for m in range(2)]
        two = [epoch_batch(again, before, world_size=2, rank=r)[0] for r in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
        firsts = torch.cat(one)[:, 0].tolist()
        assert len(set(firsts)) == 8  # the micro-batches share no window
    assert not torch.equal(epoch_batch(split, 0)[0], epoch_batch(split, 0, seed=8)[0])
    # The step number does not place the windows; the tokens before it do.
    assert torch.equal(epoch_batch(split, 4 * T, step=1)[0], epoch_batch(split, 4 * T, step=9)[0])


def test_epochs_and_a_mixture_are_refused_in_one_line(tmp_path):
    cfg = tmp_path / "mix.yaml"
    cfg.write_text("data:\n  order: epochs\n  sources:\n    - {path: a, weight: 1}\n")
    with pytest.raises(UserError, match=r"mix\.yaml: data\.order: epochs passes over one data "
                                        r"dir, and data\.sources is a mixture"):
        load_config(cfg)
    # Its one source was told to "use one source": the line names the keys that do.
    with pytest.raises(UserError, match=r"set data\.order=random, or read its one source as "
                                        r"data\.source: --set data\.source=a --set "
                                        r"'data\.sources=\[\]'$"):
        load_config(cfg)
    assert load_config(cfg, ["data.source=a", "data.sources=[]"]).data.order == "epochs"
    two = tmp_path / "two.yaml"
    two.write_text("data:\n  order: epochs\n  sources: [{path: a}, {path: b}]\n")
    with pytest.raises(UserError, match=r"set data\.order=random, or use one source as "
                                        r"data\.source$"):
        load_config(two)


def test_a_data_order_is_one_entry_in_its_registry(data_dir, monkeypatch):
    """A throwaway order added to data.loader.ORDERS alone: data.order allows it (validation,
    the key's listing), validation asks it what it refuses, and train_batch takes its windows;
    the mixture refusal is epochs' own."""
    from andrea.config import key_spec
    from andrea.data import loader

    class FirstWindows(loader.WindowOrder):
        name = "first"

        def windows(self, split, seed, step, tokens_before, per_step, block_size):
            cum = np.cumsum(split.window_counts(block_size, 0))
            return [(i, cum, 0) for i in range(per_step)]

        def check_config(self, cfg, origin):
            if cfg.train.seed != 7:
                raise UserError(f"{origin}: data.order: first wants train.seed 7")

    monkeypatch.setitem(loader.ORDERS, "first", FirstWindows())
    assert key_spec("data.order").allowed == "random, epochs, first"
    assert load_config("andrea-tiny", ["data.order=first", "train.seed=7"]).data.order == "first"
    with pytest.raises(UserError, match=r"\(with --set overrides\): data\.order: first wants"):
        load_config("andrea-tiny", ["data.order=first"])
    x, _ = batch(TokenSplit(data_dir, "train"), order="first")
    assert x[:, 0].tolist() == [BASE + i * T for i in range(4)]
    sources = "data.sources=[{path: a}, {path: b}]"
    with pytest.raises(UserError, match=r"data\.order: epochs passes over one data dir"):
        loader.ORDERS["epochs"].check_config(load_config("andrea-tiny", [sources]), "here")
