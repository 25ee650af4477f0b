"""Token shard files: a fixed 256-byte header, then the tokens. Layout (little-endian):

    offset  size  field
    0       8     magic b"ANDRTOK\\0"
    8       4     format version, uint32 (= 1)
    12      4     bytes per token, uint32: 2 (uint16 tokens) or 4 (uint32 tokens)
    16      8     token count, uint64
    24      4     length of the tokenizer identity in bytes, uint32 (<= 224)
    28      4     reserved, zero
    32      224   tokenizer identity, UTF-8, NUL-padded
    256     ...   the tokens; the file is exactly 256 + count * bytes-per-token long

Written to a temporary name and renamed when complete; read with np.memmap, never loaded whole.
The manifest records each shard's CHECKSUM of its token bytes (everything after the header),
computed as they are written (andrea/data/verify.py checks them).
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from andrea.errors import UserError

# A prepared folder's manifest: what was read, how it was split and tokenized, and the token
# counts. Writers live in prepare; every reader of a prepared folder goes through here.
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
SPLITS = ("train", "val")
# A shard file's name, <split>_<6-digit number>.bin (shard_name), and the temporary name
# ShardWriter writes it under, <name>.<pid>.tmp.
SHARD_NAME = re.compile(r"(train|val)_\d{6}\.bin")
SHARD_TEMP_NAME = re.compile(r"(train|val)_\d{6}\.bin\.\d+\.tmp")

MAGIC = b"ANDRTOK\0"
VERSION = 1
HEADER_BYTES = 256
IDENTITY_BYTES = 224
_FIXED = struct.Struct("<8sIIQII")  # magic, version, itemsize, count, identity length, reserved
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
# The manifest's `shard_checksum`: zlib's CRC-32 of a shard's token bytes, 8 hex digits in each
# shard entry's "checksum". The fastest candidate without a new dependency, 3.3 GB/s on one
# core, sha256 1.5, blake2b 0.7 (docs/log.md, 2026-12-03); it is for damage, not for attacks.
CHECKSUM = "crc32"


def shard_name(split: str, index: int) -> str:
    """The file name of shard number `index` (from 0) of `split`."""
    return f"{split}_{index:06d}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return DTYPES[2] if vocab_size <= 2**16 else DTYPES[4]


def pack_header(count: int, itemsize: int, identity: str) -> bytes:
    ident = identity.encode("utf-8")
    if len(ident) > IDENTITY_BYTES:
        raise ValueError(f"tokenizer identity longer than {IDENTITY_BYTES} bytes: {identity!r}")
    fixed = _FIXED.pack(MAGIC, VERSION, itemsize, count, len(ident), 0)
    return fixed + ident.ljust(HEADER_BYTES - len(fixed), b"\0")


class DamagedFolder(UserError):
    """A prepared folder that is not as prepare left it: `what` is wrong with `path` (the
    folder's manifest, or one of its shards). Its message ends with how to prepare the folder
    again, built from what the folder records (data.request.prepare_again)."""

    def __init__(self, path: Path, what: str, folder: Path | None = None) -> None:
        super().__init__(path, what)
        self.path, self.what = Path(path), what
        self.folder = Path(folder) if folder is not None else self.path.parent

    def __str__(self) -> str:
        from andrea.data.request import prepare_again  # it reads manifests through here

        return f"{self.path}: {self.what}; {prepare_again(self.folder)}"


class DamagedShard(DamagedFolder):
    """A shard file that is not what prepare wrote: `what` is wrong with `path`."""


def crc32_text(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    count: int
    dtype: np.dtype
    identity: str


def read_header(path: Path) -> ShardInfo:
    """Parse and check a shard's header and its length; every error (a DamagedShard) names the
    file and says what is wrong."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        size = path.stat().st_size
    except FileNotFoundError:
        raise DamagedShard(path, "token shard missing") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read token shard: {exc.strerror}") from None
    if len(head) < HEADER_BYTES:
        raise DamagedShard(path, f"not a token shard (shorter than its {HEADER_BYTES}-byte "
                                 "header)")
    magic, version, itemsize, count, ident_len, _ = _FIXED.unpack_from(head)
    if magic != MAGIC:
        raise DamagedShard(path, f"not a token shard (bad magic {magic!r})")
    if version != VERSION:
        raise DamagedShard(path, f"token shard format version {version}, this andrea reads "
                                 f"{VERSION}")
    if itemsize not in DTYPES:
        raise DamagedShard(path, f"token shard has {itemsize} bytes per token (must be 2 or 4)")
    if ident_len > IDENTITY_BYTES:
        raise DamagedShard(path, f"token shard header is corrupt (identity length {ident_len})")
    expected = HEADER_BYTES + count * itemsize
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise DamagedShard(path, f"token shard {what}: {size} bytes, header says {count} "
                                 f"tokens = {expected} bytes")
    start = _FIXED.size
    identity = head[start : start + ident_len].decode("utf-8", errors="replace")
    return ShardInfo(path, count, DTYPES[itemsize], identity)


def open_shard(path: Path, identity: str | None = None) -> np.memmap | np.ndarray:
    """The shard's tokens as a read-only memmap, after checking the header (and identity)."""
    info = read_header(path)
    if identity is not None and info.identity != identity:
        raise DamagedShard(path, f"made with tokenizer {info.identity}, {MANIFEST} says "
                                 f"{identity}")
    if info.count == 0:  # np.memmap refuses empty maps
        return np.zeros(0, dtype=info.dtype)
    return np.memmap(path, dtype=info.dtype, mode="r", offset=HEADER_BYTES, shape=(info.count,))


class ShardWriter:
    """Streams tokens into one shard under a temporary name; `close()` fixes the count, renames."""

    def __init__(self, path: Path, dtype: np.dtype, identity: str) -> None:
        self.path, self.dtype, self.identity = path, np.dtype(dtype), identity
        self.tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # unique per process
        self.count = 0
        self.crc32 = 0  # of the token bytes written so far: the manifest's CHECKSUM
        self._f = open(self.tmp, "wb")
        self._f.write(pack_header(0, self.dtype.itemsize, identity))

    def write(self, tokens: np.ndarray) -> None:
        blob = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._f.write(blob)
        self.crc32 = zlib.crc32(blob, self.crc32)
        self.count += len(tokens)

    @property
    def checksum(self) -> str:
        return crc32_text(self.crc32)

    def close(self) -> ShardInfo:
        self._f.seek(0)
        self._f.write(pack_header(self.count, self.dtype.itemsize, self.identity))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self.tmp.replace(self.path)
        return ShardInfo(self.path, self.count, self.dtype, self.identity)

    def abort(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass  # its buffer did not fit on a full disk: the partial file goes all the same
        finally:
            self.tmp.unlink(missing_ok=True)


def read_manifest(data_dir: Path) -> dict[str, Any]:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DamagedFolder(data_dir, f"no prepared data here ({MANIFEST} missing)", data_dir)
    try:
        manifest = json.loads(path.read_text("utf-8"))
        if not isinstance(manifest, dict):
            raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
    except (OSError, ValueError) as exc:
        raise DamagedFolder(path, f"unreadable manifest ({exc})") from None
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        raise DamagedFolder(path, f"manifest version {manifest.get('manifest_version')}, this "
                                  f"andrea reads {MANIFEST_VERSION}")
    return manifest
