"""Record files, as pretraining corpora ship (FineWeb, The Pile, SlimPajama): `.jsonl` / `.jsonl.gz` (one JSON
value per line) and `.parquet`, read row by row in bounded memory.

    for row, text in record_texts(doc, "text", stats, skip_bad=True): ...     # a text corpus's rows
    for row, value, problem in jsonl_rows(path): ...                          # any rows (chat files)
    value = parse_json_line(line)                                             # one line, or a BadJSONError

Policies
- A text corpus's record file holds one document per row in a named field / column (default `text`). Parquet is read a batch at a time within row groups (pyarrow), so memory stays
  bounded for shards larger than RAM. Their rows are split like documents: every 1/val_fraction-th
  row of each file goes to val. A row that is not JSON, not an object, lacks the field or holds no
  string is one BadRowError naming file, row and field, or is skipped and counted (`skip_bad`).
- Record-file bombs (a few KB of gzip or of a dictionary-encoded Parquet column that decode to GBs):
  memory stays bounded whatever a row's size. A row longer than `max_row_bytes` (default 64 MiB; JSONL:
  the line's bytes, read in bounded pieces and never whole; Parquet: its decoded strings, measured before
  they are decoded) is a bad row. Parquet strings are read dictionary-encoded (as stored) and decoded
  a slice of rows at a time, slices cut by decoded bytes (`BATCH_BYTES`), not by row counts. A long row
  is handed on in pieces (`text_pieces`) cut where the pre-tokenizer cuts, as text files are.
- A gzip stream damaged in the middle is one CorpusError naming the file and how far it was read.
- JSON lines are parsed by `parse_json_line`, the one place that turns every way a line can fail (bytes
  that are not UTF-8, bad JSON, nesting deeper than Python's recursion, a number of more digits than
  Python converts) into one BadJSONError (a ValueError); `sample.py --chat`'s pipe mode uses it too.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gpt.data.corpus import BadRowError, CorpusError, Document, ReadStats

DEFAULT_MAX_ROW_BYTES = 64 << 20  # --max-row-bytes: a longer row is a bad row
BATCH_BYTES = 16 << 20  # Parquet: decoded bytes of strings turned into Python values at once
_LINE_PIECE = 1 << 20  # bytes of an over-long line read at a time while it is skipped


class BadJSONError(CorpusError):
    """A line that is not one JSON value; its message says why, without the file and line (callers add them)."""


def parse_json_line(line: bytes | str) -> object:
    """The JSON value of one line (bytes or text), or a BadJSONError saying why not: bytes that are not UTF-8,
    JSON that does not parse (where), nesting too deep for Python's parser (a RecursionError otherwise), a
    number with more digits than Python converts. Never any other exception, whatever the line holds."""
    try:
        return json.loads(line)
    except UnicodeDecodeError:
        raise BadJSONError("not UTF-8") from None
    except json.JSONDecodeError as e:
        raise BadJSONError(f"not JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None
    except RecursionError:
        raise BadJSONError("not JSON this reader takes (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits (sys.set_int_max_str_digits)
        raise BadJSONError(f"not JSON this reader takes ({e})") from None


def _too_long(nbytes: int, limit: int) -> str:
    return f"{nbytes:,} bytes, more than --max-row-bytes {limit:,} (raise it to read the row)"


def jsonl_rows(
    path: str | Path, progress=None, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
) -> Iterator[tuple[int, object, str | None]]:
    """(row, value, problem) for each non-blank line of a `.jsonl` (or gzip-compressed `.jsonl.gz`) file:
    `row` counts lines from 1, `value` is the parsed JSON (None when `problem` says why it could not be).
    The caller decides whether a bad row stops it (`BadRowError(path, row, problem)`) or is skipped.
    A line longer than `max_row_bytes` is a problem, read in pieces and never held whole.
    `progress(n)`, if given, is told the file bytes read since it was last told (compressed ones for .gz)."""
    path, row, at = Path(path), 0, 0
    try:
        raw = open(path, "rb")
        with raw, gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw as f:
            told = 0
            while line := f.readline(max_row_bytes + 1):
                row += 1
                if len(line) > max_row_bytes and not line.endswith(b"\n"):  # too long: skip to its end
                    nbytes = len(line)
                    del line
                    while (piece := f.readline(_LINE_PIECE)) and not piece.endswith(b"\n"):
                        nbytes += len(piece)
                    line, problem = b"", _too_long(nbytes + len(piece) - piece.endswith(b"\n"), max_row_bytes)
                else:
                    problem = None
                at = raw.tell()
                if progress:
                    progress(at - told)
                    told = at
                if problem:
                    yield row, None, problem
                    continue
                if not line.strip():
                    continue
                try:
                    value = parse_json_line(line)
                except BadJSONError as e:
                    yield row, None, str(e)
                else:
                    yield row, value, None
    except (OSError, EOFError, zlib.error) as e:  # unreadable, or a damaged / truncated gzip stream
        where = f" (damaged after line {row:,}, {at:,} bytes of the file read)" if row else ""
        raise CorpusError(f"cannot read {path}{where}: {getattr(e, 'strerror', None) or e}") from None


def record_texts(
    doc: Document,
    field: str,
    stats: ReadStats,
    skip_bad: bool = False,
    progress=None,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
):
    """(row index from 0, text) of each good row of a record file; a bad row (a row longer than
    `max_row_bytes` included) raises BadRowError, or with `skip_bad` is added to `stats.bad_rows` and left
    out (rows are numbered from 1 in messages, as lines are). `progress(n)` is told the file bytes read."""
    rows = (
        _parquet_rows(doc, field, progress, max_row_bytes)
        if doc.path.name.endswith(".parquet")
        else _jsonl_texts(doc, field, progress, max_row_bytes)
    )
    index = 0
    for row, text, problem in rows:
        if problem is not None:
            error = BadRowError(doc.path, row, problem)
            if not skip_bad:
                raise error
            stats.bad_rows.append(error)
            continue
        yield index, text
        index += 1


def _jsonl_texts(doc: Document, field: str, progress, max_row_bytes: int):
    for row, value, problem in jsonl_rows(doc.path, progress, max_row_bytes):
        if problem is None:
            if not isinstance(value, dict):
                problem = f"a JSON {type(value).__name__}, not an object with a {field!r} field"
            elif field not in value:
                keys = ", ".join(sorted(map(str, value))[:8]) or "none"
                problem = f"no field {field!r} (its fields: {keys}); name the field with --text-field"
            elif not isinstance(value[field], str):
                problem = f"field {field!r} is {type(value[field]).__name__}, not a string"
        yield row, value[field] if problem is None else None, problem


def _parquet_rows(doc: Document, field: str, progress, max_row_bytes: int):
    pa, pf = _open_parquet(doc.path)
    names = pf.schema_arrow.names
    if field not in names:
        raise CorpusError(
            f"{doc.path}: no column {field!r} (its columns: {', '.join(names[:8])}); name the column with --text-field"
        )
    kind = pf.schema_arrow.field(field).type
    kind = kind.value_type if pa.types.is_dictionary(kind) else kind
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise CorpusError(f"{doc.path}: column {field!r} holds {kind}, not strings")
    for row, value, problem in _batched_rows(doc.path, pa, pf, progress, [field], max_row_bytes):
        text = None if problem else value[field]
        yield row, text, problem or (None if text is not None else f"column {field!r} is null")


def _open_parquet(path: Path):
    """(the pyarrow module, the open ParquetFile), its string columns read dictionary-encoded as they are
    stored (decoded only row by row: a few KB can hold one long string repeated in every row); a
    CorpusError when pyarrow or the file is missing."""
    try:
        import pyarrow as pa  # optional: parquet
        import pyarrow.parquet as pq  # optional: parquet
    except ImportError:
        raise CorpusError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
        strings = [c.path for c in pf.schema if c.physical_type == "BYTE_ARRAY"]
        if not strings:
            return pa, pf
        pf.close()  # opened again, the footer read once: its string columns as dictionaries
        return pa, pq.ParquetFile(path, metadata=pf.metadata, read_dictionary=strings)
    except (OSError, pa.ArrowException) as e:
        raise CorpusError(f"cannot read {path} as Parquet: {e}") from None


def parquet_rows(
    path: str | Path, progress=None, columns: list[str] | None = None, max_row_bytes=DEFAULT_MAX_ROW_BYTES
):
    """(row, value, problem) for each row of a Parquet file, `value` a dict of its columns (all, or `columns`),
    `problem` a row longer than `max_row_bytes` (decoded) and then `value` None. Read a batch of rows at a
    time within the row groups, decoded a slice of about BATCH_BYTES at a time (bounded memory for a shard
    larger than RAM, or a small file whose strings decode to much more). Rows count from 1, as jsonl_rows'
    lines; `progress(n)` is told the file bytes read (in proportion to the rows)."""
    path = Path(path)
    yield from _batched_rows(path, *_open_parquet(path), progress, columns, max_row_bytes)


def _batch_rows(pf, group: int, columns) -> int:
    """Rows per batch of row group `group`: about BATCH_BYTES of its stored (uncompressed) columns."""
    meta = pf.metadata.row_group(group)
    chunks = (meta.column(i) for i in range(meta.num_columns))
    stored = sum(
        c.total_uncompressed_size for c in chunks if columns is None or c.path_in_schema.split(".")[0] in columns
    )
    return max(1, min(1024, BATCH_BYTES * meta.num_rows // max(1, stored)))


def _row_bytes(pa, column) -> np.ndarray:
    """The decoded bytes of each row of one column: its strings and binaries (a dictionary's values counted in
    every row that uses them), fixed-size values by their width; measured in Arrow, nothing decoded."""
    import pyarrow.compute as pc  # optional: parquet

    kind, t = column.type, pa.types
    if t.is_dictionary(kind):
        values = _row_bytes(pa, column.dictionary) if len(column.dictionary) else np.zeros(1, dtype=np.int64)
        return values[column.indices.fill_null(0).to_numpy(zero_copy_only=False)]
    strings = (t.is_string, t.is_large_string, t.is_string_view, t.is_binary, t.is_large_binary, t.is_binary_view)
    if any(is_kind(kind) for is_kind in strings):
        return pc.binary_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if t.is_nested(kind):  # a list / struct / map: row by row, through its children
        return np.array([_nested_bytes(pa, column.slice(i, 1)) for i in range(len(column))], dtype=np.int64)
    try:
        width = max(1, kind.bit_width // 8)
    except ValueError:  # the null type: no values at all
        width = 0
    return np.full(len(column), width, dtype=np.int64)


def _nested_bytes(pa, column) -> int:
    kind = column.type
    if pa.types.is_struct(kind):
        return sum(_nested_bytes(pa, child) for child in column.flatten())
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _nested_bytes(pa, column.flatten())
    if pa.types.is_nested(kind):  # a map, a union: what Arrow holds for it
        return column.nbytes
    return int(_row_bytes(pa, column).sum())


def _batched_rows(path: Path, pa, pf, progress, columns, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES):
    """parquet_rows of an open file (the text reader opens it first to check its column)."""
    size, n, row, told = path.stat().st_size, max(1, pf.metadata.num_rows), 0, 0
    try:
        for group in range(pf.num_row_groups):
            for batch in pf.iter_batches(_batch_rows(pf, group, columns), row_groups=[group], columns=columns):
                sizes = sum((_row_bytes(pa, c) for c in batch.columns), np.zeros(batch.num_rows, dtype=np.int64))
                start = 0
                while start < batch.num_rows:
                    if sizes[start] > max_row_bytes:
                        row += 1
                        yield row, None, _too_long(int(sizes[start]), max_row_bytes)
                        start += 1
                        continue
                    end, decoded = start + 1, sizes[start]
                    while end < batch.num_rows and sizes[end] <= max_row_bytes and decoded + sizes[end] <= BATCH_BYTES:
                        decoded += sizes[end]
                        end += 1
                    for value in batch.slice(start, end - start).to_pylist():
                        row += 1
                        yield row, value, None
                    start = end
                if progress:
                    at = size * row // n
                    progress(at - told)
                    told = at
    except (OSError, pa.ArrowException) as e:
        raise CorpusError(f"cannot read {path} (row {row + 1}): {e}") from None
