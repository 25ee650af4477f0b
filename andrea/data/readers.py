"""Input formats for `andrea prepare`: a file's content as jobs (andrea/data/inputs.py finds the
files).

Formats, chosen by extension and checked by content (docs/data.md); READERS at the end of this
file is the one list of them (a new format is one entry there and its jobs function):
  text     .txt .md .text .rst (optionally .gz / .zst): the whole file is one document
  records  .jsonl .json (optionally .gz / .zst): one JSON object per line, one document each
  parquet  .parquet: the text column, read row group by row group
  csv      .csv (optionally .gz / .zst): a header row, then one document per row (the text column)
  arrow    the Arrow stream files of a Hugging Face `datasets` save_to_disk folder

Every file is cut into jobs of about CHUNK_BYTES of text, in a fixed order, so a job number
names the same piece of input in every run (what a resumed prepare skips to). A job carries its
data to a worker process; the main process only reads (and decompresses) bytes.
"""

from __future__ import annotations

import codecs
import io
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from andrea.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
RECORD_SUFFIXES = (".jsonl", ".json")
COMPRESSIONS = (".gz", ".zst")
READ_BYTES = 1 << 20
# Compressed input is fed to its decompressor this much at a time: what one call gives back is
# held whole, and highly repetitive text compresses 10,000 to 1 (500 MB of repeated JSON Lines
# is 44 KB of zstd; read a block at a time it all came back at once, 6.7 GB at the peak).
FEED_BYTES = 1 << 12
_MAGIC = {".gz": b"\x1f\x8b", ".zst": b"\x28\xb5\x2f\xfd"}
_STRING_TYPES = ("string", "large_string", "string_view", "binary", "large_binary")


@dataclass(frozen=True)
class InputFile:
    """One input file (andrea/data/inputs.py lists them) and the format that reads it."""

    path: Path
    kind: str  # a Reader's kind: "text" | "records" | "parquet" | "csv" | "arrow"
    compression: str  # "" | ".gz" | ".zst"
    size: int  # bytes on disk
    mtime_ns: int

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def reader(self) -> Reader:
        return BY_KIND[self.kind]


# ----------------------------------------------------------------------------- raw bytes


def _decompressor(compression: str) -> Any:
    if compression == ".gz":
        return zlib.decompressobj(wbits=31)
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj()


def iter_blocks(f: InputFile) -> Iterator[tuple[bytes, int]]:
    """(decompressed bytes, file bytes consumed) blocks of the whole file, at most READ_BYTES
    each. A truncated or corrupt .gz / .zst is a UserError naming the file; concatenated
    members are read on."""
    try:
        fh = open(f.path, "rb")
    except OSError as exc:
        raise UserError(f"{f.path}: cannot read input: {exc.strerror}") from None
    with fh:
        if not f.compression:
            while block := fh.read(READ_BYTES):
                yield block, len(block)
            return
        head = fh.read(4)
        fh.seek(0)
        if not head.startswith(_MAGIC[f.compression]):
            raise UserError(
                f"{f.path}: not {f.compression} data (the file does not start with its magic "
                "bytes); rename it to match its format"
            )
        decomp, pending = _decompressor(f.compression), b""
        while True:
            raw = pending or fh.read(FEED_BYTES)
            pending = b""
            if not raw:
                break
            try:
                out = decomp.decompress(raw)
            except Exception as exc:  # zlib.error, zstd.ZstdError
                raise UserError(f"{f.path}: corrupt {f.compression} data ({exc})") from None
            consumed = len(raw) - len(decomp.unused_data)
            for start in range(0, max(1, len(out)), READ_BYTES):
                yield out[start : start + READ_BYTES], consumed if start == 0 else 0
            if decomp.eof:
                pending = decomp.unused_data
                decomp = _decompressor(f.compression)
                if not pending:
                    pending = fh.read(FEED_BYTES)
                    if not pending:
                        return
                    decomp = _decompressor(f.compression)
        if not decomp.eof:
            raise UserError(
                f"{f.path}: truncated {f.compression} file (the stream ends before its end "
                "marker); download or copy it again"
            )


def refuse_binary(name: str, head: bytes) -> None:
    """A UserError for input whose first 8 KiB hold a NUL byte: no UTF-8 text has one (UTF-16
    text, an image or an archive does)."""
    if b"\0" in head[:8192]:
        raise UserError(
            f"{name}: looks binary (NUL bytes), not text; give text, JSON Lines, CSV, Parquet or "
            "Arrow files (docs/data.md, \"Input formats\")"
        )


# ----------------------------------------------------------------------------- jobs


@dataclass
class Job:
    """One piece of input for a worker. `data` is None for a job a resumed run skips."""

    kind: str  # "text" | "records" | "column"
    name: str  # the file, for messages
    nbytes: int  # input (file) bytes it stands for, for the progress bar
    data: Any = None
    start: int = 0  # first line (records) or first row (column), 1-based line / 0-based row
    where: str = ""  # "row group N" for a column job


RowEnd = Callable[[bytearray, int], int]


def _pieces(f: InputFile, row_end: Callable[[], RowEnd]) -> Iterator[tuple[bytes, int]]:
    """(bytes, file bytes consumed) of the whole file in pieces of about READ_BYTES, each cut
    just past its last row. `row_end()` makes a piece's finder: `last(buf, start)`, where its
    last row ends in buf, 0 when none does yet (read on); buf[:start] was searched before and
    holds none. A row of many blocks is so read in time linear in its length: searched
    whole at every block, a 100 MB JSON Lines record took 9 s and a 50 MB CSV field 30 s."""
    buf, consumed, searched, last = bytearray(), 0, 0, row_end()
    for block, n in iter_blocks(f):
        buf += block
        consumed += n
        if len(buf) < READ_BYTES:
            continue
        cut = last(buf, searched)
        if cut == 0:
            searched = len(buf)
            continue  # a row longer than a block: read on
        yield bytes(buf[:cut]), consumed
        del buf[:cut]
        consumed, searched, last = 0, 0, row_end()
    if buf or consumed:
        yield bytes(buf), consumed


def _last_line_end(buf: bytearray, start: int) -> int:
    return buf.rfind(b"\n", start) + 1


def record_jobs(f: InputFile, field: str, skip: int) -> Iterator[Job]:
    """JSON Lines cut at line breaks into jobs of about READ_BYTES (the field is read by the
    worker)."""
    line = 1
    for index, (data, consumed) in enumerate(_pieces(f, lambda: _last_line_end)):
        if index == 0:  # a BOM that some editors write: json refuses it, as pyarrow.csv skips it
            data = data.removeprefix(codecs.BOM_UTF8)
        yield Job("records", f.name, consumed, data if index >= skip else None, line)
        line += data.count(b"\n")


def _csv_line_ends(raw: np.ndarray) -> np.ndarray:
    """Offsets just past each line break: "\n", "\r\n" or a lone "\r" (old Mac files), the three
    pyarrow.csv ends a row at. A "\r" that ends the buffer is not one yet: its "\n" may follow
    in the next block, and a piece cut between the two would start with an empty line."""
    ends = raw == ord("\n")
    ends[:-1] |= (raw[:-1] == ord("\r")) & ~ends[1:]
    return np.flatnonzero(ends) + 1


def _csv_lines(data: bytes) -> int:
    """How many line breaks a piece holds (pieces are never cut inside a "\r\n")."""
    return data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n")


def _csv_row_ends(buf: bytes) -> np.ndarray:
    """Offsets just past each line break outside quotes (an even number of '"' before it:
    RFC 4180 quoting, a quote inside a quoted field doubled)."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    ends = _csv_line_ends(raw)
    return ends[np.cumsum(raw == ord('"'))[ends - 1] % 2 == 0]


_CSV_FIX = ("fix the file (a header row, then rows of as many fields, \" around a field with "
            ", \" or a line break, \"\" for a \" inside one)")
_FIELD_EDGES = np.frombuffer(b',\n\r"', dtype=np.uint8)


def _csv_stray_quote(data: bytes) -> int:
    """Offset of the first '"' that neither opens nor closes a quoted field (one inside a field
    not quoted, or text after a closing one), -1 if none. `data` starts at a row's start. Row
    ends are found by quote parity, which such a quote flips, so a cut after it can fall inside
    a quoted field; RFC 4180 has no such quote. By parity, an opening quote follows a field's
    edge (or the closing quote of a doubled \"\"), a closing one comes before one."""
    raw = np.frombuffer(data, dtype=np.uint8)
    quotes = np.flatnonzero(raw == ord('"'))
    if not len(quotes):
        return -1
    # The piece's ends are fields' edges; a uint8 comma, as a Python int made it 8 bytes a byte.
    comma = np.array([ord(",")], dtype=np.uint8)
    edged = np.concatenate((comma, raw, comma))
    opening, closing = quotes[0::2], quotes[1::2]
    stray = np.concatenate((opening[~np.isin(edged[opening], _FIELD_EDGES)],
                            closing[~np.isin(edged[closing + 2], _FIELD_EDGES)]))
    return int(stray.min()) if len(stray) else -1


class _CsvRowEnd:
    """A CSV piece's row-end finder for `_pieces`: the quotes in what it searched are counted,
    so each search looks at the new bytes alone."""

    def __init__(self) -> None:
        self.quotes = 0  # in buf[:start]

    def __call__(self, buf: bytearray, start: int) -> int:
        # From one byte back: a "\r" that ended the searched part was no line break yet.
        lo = max(0, start - 1)
        raw = np.frombuffer(buf[lo:], dtype=np.uint8)  # a copy: buf grows on
        quotes = np.cumsum(raw == ord('"'))
        before = self.quotes - int(lo < start and raw[0] == ord('"'))
        self.quotes = before + (int(quotes[-1]) if len(quotes) else 0)
        ends = _csv_line_ends(raw)
        ends = ends[(before + quotes[ends - 1]) % 2 == 0]
        return lo + int(ends[-1]) if len(ends) else 0


def _read_csv(f: InputFile, data: bytes, names: list[str] | None, field: str, line: int) -> Any:
    """A piece of CSV (whole rows, from file line `line`) as a table: with `names`, its rows
    are data and only the text column is read, as bytes (decoded by the worker, under
    --errors); without, the header."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    read = pcsv.ReadOptions(column_names=names, block_size=len(data) + 1, use_threads=False)
    convert = pcsv.ConvertOptions(include_columns=[field], column_types={field: pa.binary()}
                                  ) if names else None
    try:
        return pcsv.read_csv(io.BytesIO(data), read_options=read, convert_options=convert,
                             parse_options=pcsv.ParseOptions(newlines_in_values=True))
    except Exception as exc:  # pyarrow.ArrowInvalid: a row with too few or too many fields
        problem = " ".join(str(exc).split())
        raise UserError(
            f"{f.path}: not readable CSV in the rows from line {line} on ({problem}); {_CSV_FIX}"
        ) from None


def csv_jobs(f: InputFile, field: str, skip: int) -> Iterator[Job]:
    """A header row naming the columns, then rows cut into jobs of about READ_BYTES at row
    ends (line breaks in quoted fields stay inside their row); each job the text column."""
    names: list[str] | None = None
    row, line, offset = 1, 1, 0
    for index, (data, consumed) in enumerate(_pieces(f, _CsvRowEnd)):
        if index == 0:
            refuse_binary(f.name, data)
        # The parity that cut this piece is right up to its first stray quote: the first one
        # in the file is in the piece it made wrong, or in a later one cut right.
        if (stray := _csv_stray_quote(data)) >= 0:
            decompressed = " once decompressed" if f.compression else ""
            raise UserError(
                f"{f.path}: a \" at line {line + _csv_lines(data[:stray])} (byte offset "
                f"{offset + stray}{decompressed}) that neither opens nor closes a quoted field; "
                f"{_CSV_FIX}"
            )
        offset += len(data)
        if names is None:
            ends = _csv_row_ends(data)
            head = int(ends[0]) if len(ends) else len(data)
            try:  # pyarrow's column names would raise it as they are made str
                data[:head].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(
                    f"{f.path}: invalid UTF-8 at byte offset {exc.start}, in its header row; fix "
                    "the file (CSV is read as UTF-8 text)"
                ) from None
            names = _read_csv(f, data[:head], None, field, line).column_names
            if field not in names:
                raise UserError(
                    f"{f.path}: no column '{field}'; its header has: {', '.join(names)}; "
                    "choose one with --text-field (data.text_field)"
                )
            line += _csv_lines(data[:head])
            data = data[head:]
        column = _read_csv(f, data, names, field, line).column(0) if data.strip() else None
        rows = len(column) if column is not None else 0
        yield Job("column", f.name, consumed, column if index >= skip and rows else None, row,
                  "after the header")
        row += rows
        line += _csv_lines(data)


def _open_parquet(f: InputFile) -> Any:
    import pyarrow.parquet as pq

    try:
        # Streamed through a buffer: pyarrow's default reads a row group's whole column chunk
        # first, so memory grew with the largest row group (120 MB more at 200 MB than at 50).
        return pq.ParquetFile(f.path, buffer_size=READ_BYTES, pre_buffer=False)
    except Exception as exc:  # pyarrow.ArrowInvalid and friends
        raise UserError(f"{f.path}: not a readable Parquet file ({exc})") from None


def _field_path(f: InputFile, schema: Any, field: str) -> list[str]:
    """The column holding the text: [field], or for a dotted `doc.body` (no column of that
    name) the struct column and fields down to it; checked to hold strings."""
    import pyarrow as pa

    names = list(schema.names)
    path = [field] if field in names else field.split(".")
    if path[0] not in names:
        raise UserError(
            f"{f.path}: no column '{field}'; it has: {', '.join(names)}; "
            "choose one with --text-field (data.text_field; doc.body for a struct's field)"
        )
    kind = schema.field(path[0]).type
    for depth, part in enumerate(path[1:], 1):
        if not pa.types.is_struct(kind) or kind.get_field_index(part) < 0:
            raise UserError(
                f"{f.path}: column '{'.'.join(path[:depth])}' has no field '{part}' "
                f"(it holds {kind}); choose the text with --text-field (data.text_field)"
            )
        kind = kind.field(part).type
    # A dictionary-encoded column (what a pandas category column is written as) reads as its
    # values.
    values = kind.value_type if pa.types.is_dictionary(kind) else kind
    if str(values) not in _STRING_TYPES:
        raise UserError(
            f"{f.path}: column '{field}' holds {kind}, not strings; choose a text column with "
            "--text-field (data.text_field)"
        )
    return path


def _text_column(array: Any, path: list[str]) -> Any:
    """The text out of a read column: down the struct fields of a dotted path (a null struct
    gives null text)."""
    for part in path[1:]:
        array = array.flatten()[array.type.get_field_index(part)]
    return array


def parquet_jobs(f: InputFile, field: str, skip: int) -> Iterator[Job]:
    """The text column, row group by row group, in batches of about READ_BYTES of text.
    Skipped row groups are not read at all (their job count comes from the metadata)."""
    pf = _open_parquet(f)
    path = _field_path(f, pf.schema_arrow, field)
    meta = pf.metadata
    leaves = [pf.schema.column(i).path for i in range(meta.num_columns)]
    column = leaves.index(".".join(path))  # the Parquet leaf column, for its size
    total_rows = max(1, meta.num_rows)
    index, rows_done, bytes_done = 0, 0, 0
    for rg in range(meta.num_row_groups):
        group = meta.row_group(rg)
        rows = group.num_rows
        text_bytes = group.column(column).total_uncompressed_size
        per_batch = max(1, min(rows, READ_BYTES * rows // max(1, text_bytes)))
        n_jobs = -(-rows // per_batch) if rows else 0
        if index + n_jobs <= skip:  # all skipped: no need to read the row group
            for j in range(n_jobs):
                end_rows = rows_done + min(rows, (j + 1) * per_batch)
                end_bytes = f.size * end_rows // total_rows
                yield Job("column", f.name, end_bytes - bytes_done)
                bytes_done = end_bytes
            index += n_jobs
            rows_done += rows
            continue
        try:
            batches = pf.iter_batches(batch_size=per_batch, row_groups=[rg],
                                      columns=[".".join(path)])
            first = 0
            for batch in batches:
                end_rows = rows_done + first + batch.num_rows
                end_bytes = f.size * end_rows // total_rows
                yield Job("column", f.name, end_bytes - bytes_done,
                          _text_column(batch.column(0), path) if index >= skip else None,
                          first, f"row group {rg}")
                bytes_done = end_bytes
                first += batch.num_rows
                index += 1
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"{f.path}: row group {rg} unreadable ({exc})") from None
        rows_done += rows


def arrow_jobs(f: InputFile, field: str, skip: int) -> Iterator[Job]:
    """A `datasets` Arrow stream file, batch by batch (memory-mapped)."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(f.path))
        reader = pa.ipc.open_stream(source)
    except Exception as exc:
        raise UserError(f"{f.path}: not a readable Arrow stream file ({exc})") from None
    path = _field_path(f, reader.schema, field)
    column = reader.schema.names.index(path[0])
    index, row, pos = 0, 0, 0
    for n, batch in enumerate(reader):
        array = _text_column(batch.column(column), path)
        batch_bytes, pos = source.tell() - pos, source.tell()
        per_job = max(1, READ_BYTES * len(array) // max(1, array.nbytes))
        starts = range(0, len(array), per_job)
        for k, start in enumerate(starts):
            share = batch_bytes // len(starts) + (batch_bytes % len(starts) if k == 0 else 0)
            # A slice pickles with its whole batch's buffers: copy it out to send just it.
            part = pa.concat_arrays([array.slice(start, per_job)]) if index >= skip else None
            yield Job("column", f.name, share, part, row + start, f"batch {n}")
            index += 1
        row += len(array)


# ----------------------------------------------------------------------------- the formats


@dataclass(frozen=True)
class Reader:
    """One input format: the suffixes that name its files and how a file becomes jobs."""

    kind: str
    suffixes: tuple[str, ...]
    # (file, text field, jobs to skip) -> its jobs in order; None for a whole text, which
    # andrea/data/documents.py cuts itself (its val tail needs the whole document).
    jobs: Callable[[InputFile, str, int], Iterator[Job]] | None
    compressible: bool = True  # also as .gz / .zst, read through iter_blocks
    in_folders: bool = True  # collected from a directory (Arrow files: from their state.json)
    title: str = ""  # its name in `andrea prepare --help`; the kind's when empty

    @property
    def has_records(self) -> bool:
        """Many documents a file, each whole in one split, the text in data.text_field."""
        return self.jobs is not None


READERS = (
    Reader("text", TEXT_SUFFIXES, None),
    Reader("records", RECORD_SUFFIXES, record_jobs, title="JSON Lines"),
    Reader("parquet", (".parquet",), parquet_jobs, compressible=False, title="Parquet"),
    Reader("csv", (".csv",), csv_jobs, title="CSV"),
    Reader("arrow", (".arrow",), arrow_jobs, compressible=False, in_folders=False, title="Arrow"),
)
BY_SUFFIX = {suffix: r for r in READERS for suffix in r.suffixes}
BY_KIND = {r.kind: r for r in READERS}
