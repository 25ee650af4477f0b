"""Shard format: round trip in both token widths, and every header corruption names the file."""

import struct

import numpy as np
import pytest

from andrea.data import shards
from andrea.errors import UserError


def write(path, tokens, vocab_size, identity="byte:v1"):
    w = shards.ShardWriter(path, shards.token_dtype(vocab_size), identity)
    w.write(tokens[: len(tokens) // 2])
    w.write(tokens[len(tokens) // 2 :])
    return w.close()


@pytest.mark.parametrize("vocab_size,itemsize", [(257, 2), (65536, 2), (65537, 4), (100_000, 4)])
def test_round_trip(tmp_path, vocab_size, itemsize):
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=1001)
    path = tmp_path / "s.bin"
    write(path, tokens, vocab_size, identity="gpt2:abc")
    assert path.stat().st_size == 256 + 1001 * itemsize
    assert not (tmp_path / "s.bin.tmp").exists()
    info = shards.read_header(path)
    assert (info.count, info.dtype.itemsize, info.identity) == (1001, itemsize, "gpt2:abc")
    got = shards.open_shard(path, "gpt2:abc")
    assert isinstance(got, shards.ShardFile) and len(got) == 1001
    np.testing.assert_array_equal(got, tokens)
    np.testing.assert_array_equal(got[10:20], tokens[10:20])
    assert got[-1] == tokens[-1] and got.read(995, 100).tolist() == tokens[995:].tolist()


def corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: corrupt(p, 0, b"NOTATOK\0"), "bad magic"),
        (lambda p: corrupt(p, 8, struct.pack("<I", 99)), "format version 99"),
        (lambda p: corrupt(p, 12, struct.pack("<I", 3)), "3 bytes per token"),
        (lambda p: corrupt(p, 24, struct.pack("<I", 999)), "header is corrupt"),
        (lambda p: p.write_bytes(p.read_bytes()[:-2]), "truncated"),
        (lambda p: p.write_bytes(p.read_bytes()[:100]), "shorter than its 256-byte header"),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0\0"), "trailing bytes"),
        (lambda p: corrupt(p, 16, struct.pack("<Q", 11)), "truncated"),
    ],
)
def test_corruption_is_a_one_line_error_naming_the_file(tmp_path, damage, message):
    path = tmp_path / "train_000000.bin"
    write(path, np.arange(10), 257)
    damage(path)
    with pytest.raises(UserError, match=message) as err:
        shards.open_shard(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_wrong_tokenizer_identity(tmp_path):
    path = tmp_path / "s.bin"
    write(path, np.arange(10), 257, identity="byte:v1")
    with pytest.raises(UserError, match="made with tokenizer byte:v1, manifest.json says gpt2"):
        shards.open_shard(path, "gpt2:196139668be63f3b")


def test_abort_leaves_nothing(tmp_path):
    w = shards.ShardWriter(tmp_path / "s.bin", np.uint16, "byte:v1")
    w.write(np.arange(5))
    w.abort()
    assert list(tmp_path.iterdir()) == []
