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

Written to a temporary name and renamed when complete; read window by window with os.pread
(`ShardFile`), never loaded whole and never mapped: a mapped file cut short under a reader kills
it with SIGBUS, where a read just comes back short and is named (`ShardChanged`). The manifest
records each shard's CHECKSUM of its token bytes (everything after the header), computed as they
are written (andrea/data/verify.py checks them).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

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
        super().__init__(path, what, folder)  # all three: it pickles (a worker's error)
        self.path, self.what = Path(path), what
        self.folder = Path(folder) if folder is not None else self.path.parent

    def __str__(self) -> str:
        return f"{self.path}: {self.what}; {prepare_again(self.folder)}"


def _prepare_again_unknown(folder: Path) -> str:
    return f"prepare {folder} again with the command that made it, adding --force"


# How to prepare a folder again, the end of DamagedFolder's message: data.request's
# prepare_again, which sets itself here when imported (it reads manifests through this module,
# so this module may not import it; data.loader imports it for every reader of shards).
prepare_again: Callable[[Path], str] = _prepare_again_unknown


class DamagedShard(DamagedFolder):
    """A shard file that is not what prepare wrote: `what` is wrong with `path`."""


class ShardChanged(UserError):
    """A shard that changed on disk while this process read it (cut short, replaced, deleted or
    rewritten in place): `what` changed, in words; `split`, the split it belongs to."""

    def __init__(self, path: Path, what: str, split: str) -> None:
        super().__init__(path, what, split)  # all three: it pickles
        self.path, self.what, self.split = Path(path), what, split

    def __str__(self) -> str:
        return (f"{self.path}: token shard changed while andrea read it ({self.what}); once "
                f"nothing writes {self.path.parent}, run the command again")

    def training_line(self, step: int, checkpoint: Path | None, run_dir: Path) -> str:
        """The one line of a training this stopped, its last completed step `step` saved as
        `checkpoint` (None: no step completed): what changed and the command that goes on."""
        head = f"{self.path}: token shard changed while the training read it ({self.what})"
        wait = f"once nothing writes {self.path.parent}"
        if checkpoint is None:
            start = shlex.join(["andrea", "train", "--config", str(run_dir / "config.yaml")])
            return (f"{head}; stopped before a step completed, no checkpoint written; {wait}, "
                    f"start again: {start}")
        resume = shlex.join(["andrea", "train", "--resume", str(run_dir)])
        return (f"{head}; stopped after step {step}, checkpoint {checkpoint}; {wait}, continue: "
                f"{resume} (it names a damaged shard, or prepares the folder again, first)")


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
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise DamagedShard(path, "token shard missing") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read token shard: {exc.strerror}") from None
    return parse_header(path, head, size)


def parse_header(path: Path, head: bytes, size: int) -> ShardInfo:
    """The header `head` of the shard `path`, `size` bytes long, checked (read_header)."""
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


def open_shard(path: Path, identity: str | None = None, split: str = "") -> ShardFile:
    """The shard's tokens (a ShardFile), after checking the header (and identity)."""
    shard = ShardFile(path, split)
    if identity is not None and shard.identity != identity:
        shard.close()
        raise DamagedShard(path, f"made with tokenizer {shard.identity}, {MANIFEST} says "
                                 f"{identity}")
    return shard


# What says a file is still the one a reader opened: its inode, size and modification time.
FileState = tuple[int, int, int]


def file_state(st: os.stat_result) -> FileState:
    return st.st_ino, st.st_size, st.st_mtime_ns


class ShardFile:
    """One shard's tokens, read with os.pread on the descriptor opened with it (as np.memmap
    held one), checked (`check_unchanged`) against what the file was when opened. A read that
    comes back short (the file cut short meanwhile) is a ShardChanged, never a SIGBUS; so is a
    file replaced, deleted, or rewritten in place (its size or modification time moved). A
    rewrite that keeps the modification time is not seen (by this check: the training's
    checksums may still find it). `len()`, an index or a slice (`shard[a:b]`, read at once) and
    np.asarray (the whole shard) read it as an array would."""

    def __init__(self, path: Path, split: str = "") -> None:
        self.path, self.split = Path(path), split
        self._fd: int | None = None
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise DamagedShard(self.path, "token shard missing") from None
        except OSError as exc:
            raise UserError(f"{path}: cannot read token shard: {exc.strerror}") from None
        try:
            st = os.fstat(self._fd)
            info = parse_header(self.path, os.pread(self._fd, HEADER_BYTES, 0), st.st_size)
        except BaseException:
            self.close()
            raise
        self.opened: FileState = file_state(st)
        self.count, self.dtype, self.identity = info.count, info.dtype, info.identity

    def __len__(self) -> int:
        return self.count

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the shard (fewer past its end), in its dtype."""
        start, stop = min(max(start, 0), self.count), min(max(start + length, 0), self.count)
        want = (stop - start) * self.dtype.itemsize
        offset = HEADER_BYTES + start * self.dtype.itemsize
        blob = b""
        while len(blob) < want:  # a regular file reads whole unless it ends first
            chunk = os.pread(self._fd, want - len(blob), offset + len(blob))  # type: ignore[arg-type]
            if not chunk:
                self.changed(f"cut short: a read at byte {offset + len(blob):,} found its end")
            blob += chunk
        return np.frombuffer(blob, dtype=self.dtype)

    def check_unchanged(self) -> None:
        """Raise ShardChanged when the file at the shard's path is no longer the one opened."""
        try:
            now = file_state(os.stat(self.path))
        except FileNotFoundError:
            self.changed("deleted")
        if now == self.opened:
            return
        ino, size, mtime = self.opened
        if now[0] != ino:
            self.changed("replaced by another file")
        if now[1] != size:
            self.changed(f"{'cut short' if now[1] < size else 'grown'} to {now[1]:,} bytes from "
                         f"{size:,}")
        self.changed("rewritten in place: its modification time moved")

    def changed(self, what: str) -> NoReturn:
        raise ShardChanged(self.path, what, self.split)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.count)
            return self.read(start, max(0, stop - start))[::step]
        if not -self.count <= index < self.count:
            raise IndexError(f"token {index} of a shard of {self.count}")
        return self.read(index % self.count, 1)[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        tokens = self.read(0, self.count)
        return tokens if dtype is None else tokens.astype(dtype)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


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
