"""A text corpus on disk: which files are documents, how they split into train/val, and reading them
as bounded text chunks cut where a BPE pre-tokenizer would cut anyway; record files (JSONL, Parquet)
read row by row, each row a document.

    docs = find_documents(["books/", "notes.txt"])
    segments, split_by = plan_split(docs, val_fraction=0.1)
    for chunk, nbytes in read_chunks(segment, chunk_bytes=1 << 20, stats=stats): ...

Policies
- A document is one file. A directory stands for every file below it, in sorted path order,
  skipping hidden names (".git", ".DS_Store") and files that look binary (a NUL byte in the first
  8 KiB). A file named explicitly is always read. Empty files are not documents.
- Validation split: by document when that gives at least one validation document (every
  1/val_fraction-th document, spread evenly through the sorted list), else the tail of the
  concatenated corpus (nanoGPT's way for one file), cut at the start of a line.
- Bytes that are not UTF-8 are replaced by U+FFFD and counted (`ReadStats.replaced_bytes`), or are
  an error with `strict=True`. The file is never rejected silently and never decoded as Latin-1.
- Chunks end just after a newline that sits between two non-space characters ("x\\ny"), where
  GPT-2's pre-tokenizer always cuts, so encoding chunk by chunk gives the same ids as encoding the
  whole text. A chunk with no such newline is cut before a space that follows a non-space, and a
  single huge "word" at a character boundary (the only case where ids can differ, never the text).
- Record files, as pretraining corpora ship (FineWeb, The Pile, SlimPajama): `.jsonl` / `.jsonl.gz`
  (one JSON object per line) and `.parquet`, a named field / column (default `text`) holding one
  document per row. Parquet is read a batch at a time within row groups (pyarrow), so memory stays
  bounded for shards larger than RAM. Their rows are split like documents: every 1/val_fraction-th
  row of each file goes to val. A row that is not JSON, not an object, lacks the field or holds no
  string is one BadRowError naming file, row and field, or is skipped and counted (`skip_bad`).
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpt.errors import UserError

SNIFF_BYTES = 8192
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


def is_record_file(path: str | Path) -> bool:
    return str(path).endswith(RECORD_SUFFIXES)


class CorpusError(UserError, ValueError):
    """A corpus that cannot be read as text (gpt.data.prepare turns it into a DataError)."""


class BadRowError(CorpusError):
    """One row of a record file (JSONL, Parquet) that is not what the reader needs."""

    def __init__(self, path: str | Path, row: int, problem: str):
        self.path, self.row, self.problem = path, row, problem
        super().__init__(f"{path}, row {row}: {problem}")


@dataclass(frozen=True)
class Document:
    path: Path
    size: int  # bytes
    records: bool = False  # a JSONL / Parquet file: each row a document (`read_records`)


@dataclass(frozen=True)
class Segment:
    """Bytes [start, end) of one document, going to one split; `last` when it ends the document."""

    doc: Document
    start: int
    end: int
    split: str
    last: bool

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class ReadStats:
    replaced_bytes: int = 0
    files_with_replacements: list = field(default_factory=list)
    bad_rows: list = field(default_factory=list)  # BadRowErrors skipped (with skip_bad)
    rows: int = 0  # rows of record files read (documents)


# ---- finding and splitting documents -----------------------------------------------------------------


def _open(path: Path):
    """open(path, "rb"), with a file that cannot be read (permissions, a vanished file) as one CorpusError."""
    try:
        return open(path, "rb")
    except OSError as e:
        raise CorpusError(f"cannot read {path}: {e.strerror or e}") from None


def _looks_binary(path: Path) -> bool:
    with _open(path) as f:
        return b"\0" in f.read(SNIFF_BYTES)


def find_documents(inputs: list[str | Path], exclude: Path | None = None) -> list[Document]:
    """The documents named by `inputs` (files and directories), in order, without duplicates."""
    if not inputs:
        raise CorpusError("no input given: name one or more text files or directories")
    exclude = exclude.resolve() if exclude else None
    seen, docs = set(), []
    for item in map(Path, inputs):
        if not item.exists():
            raise CorpusError(f"no such file or directory: {item}")
        if item.is_dir():
            files = []
            for root, dirs, names in os.walk(item):
                dirs[:] = sorted(
                    d for d in dirs if not d.startswith(".") and (exclude is None or Path(root, d).resolve() != exclude)
                )
                files += [Path(root, n) for n in names if not n.startswith(".")]
            files = [f for f in sorted(files) if f.is_file() and (is_record_file(f) or not _looks_binary(f))]
        else:
            files = [item]
        for f in files:
            key = f.resolve()
            if key not in seen and f.stat().st_size > 0:
                seen.add(key)
                docs.append(Document(f, f.stat().st_size, is_record_file(f)))
    return docs


def _cut_point(path: Path, offset: int, size: int, limit: int = 1 << 20) -> int:
    """Where to cut a document near byte `offset`: the next line start if there is one before the
    end (within `limit` bytes), else the next UTF-8 character start."""
    with _open(path) as f:
        f.seek(offset)
        window = f.read(limit)
    nl = window.find(b"\n")
    if nl >= 0 and offset + nl + 1 < size:
        return offset + nl + 1
    i = 0
    while i < len(window) and 0x80 <= window[i] < 0xC0:  # skip UTF-8 continuation bytes
        i += 1
    return offset + i


def plan_split(docs: list[Document], val_fraction: float) -> tuple[list[Segment], str]:
    """Assign every byte of the corpus to train or val: (segments, "document" or "tail"). Record files
    are one segment each whose split is "rows": their rows are assigned as they are read (`val_row`)."""
    if not 0 < val_fraction < 1:
        raise CorpusError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    records = [Segment(d, 0, d.size, "rows", True) for d in docs if d.records]
    docs = [d for d in docs if not d.records]
    if not docs:
        return records, "row"
    segments, split_by = _plan_text(docs, val_fraction)
    return segments + records, split_by + (" (record files: by row)" if records else "")


def val_row(i: int, val_fraction: float) -> bool:
    """Whether row i (from 0) of a record file goes to val: floor(n f) of n rows, evenly spread."""
    return int((i + 1) * val_fraction) > int(i * val_fraction)


def _plan_text(docs: list[Document], val_fraction: float) -> tuple[list[Segment], str]:
    n = len(docs)
    if int(n * val_fraction) >= 1:
        # Document i goes to val when floor((i+1)f) > floor(if): floor(n f) documents, evenly spread.
        return [
            Segment(d, 0, d.size, "val" if int((i + 1) * val_fraction) > int(i * val_fraction) else "train", True)
            for i, d in enumerate(docs)
        ], "document"
    total = sum(d.size for d in docs)
    cut = int(total * (1 - val_fraction))
    segments, offset = [], 0
    for d in docs:
        if offset + d.size <= cut:
            segments.append(Segment(d, 0, d.size, "train", True))
        elif offset >= cut:
            segments.append(Segment(d, 0, d.size, "val", True))
        else:
            at = min(_cut_point(d.path, cut - offset, d.size), d.size)
            if at > 0:
                segments.append(Segment(d, 0, at, "train", at == d.size))
            if at < d.size:
                segments.append(Segment(d, at, d.size, "val", True))
        offset += d.size
    return segments, "tail"


# ---- reading text in chunks ----------------------------------------------------------------------------


def decode_utf8(data: bytes, final: bool, strict: bool = False) -> tuple[str, int, int]:
    """Decode as much of `data` as possible: (text, bytes consumed, bytes replaced by U+FFFD).

    An incomplete character at the end is left unconsumed unless `final`. Invalid bytes are replaced
    (one U+FFFD per maximal invalid sequence, as Python's "replace") and counted, or raise with `strict`.
    """
    view, pos, parts, replaced = memoryview(data), 0, [], 0
    while True:
        try:
            text, n = codecs.utf_8_decode(view[pos:], "strict", final)
            parts.append(text)
            return "".join(parts), pos + n, replaced
        except UnicodeDecodeError as e:
            if strict:
                raise UnicodeDecodeError("utf-8", data, pos + e.start, pos + e.end, e.reason) from None
            parts.append(codecs.utf_8_decode(view[pos : pos + e.start], "strict", True)[0])
            parts.append("\ufffd")
            replaced += e.end - e.start
            pos += e.end


def _safe_cut(text: str) -> int:
    """Index just past the last place in `text` where GPT-2's pre-tokenizer is sure to cut, or 0."""
    lo = len(text) // 2  # only look at the second half: chunks stay at least half the target size
    i = text.rfind("\n", lo, len(text) - 1)
    while i > lo:
        if not text[i - 1].isspace() and not text[i + 1].isspace():
            return i + 1
        i = text.rfind("\n", lo, i)
    i = text.rfind(" ", lo, len(text) - 1)
    while i > lo:
        if not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
        i = text.rfind(" ", lo, i)
    return 0


def read_chunks(
    segment: Segment, chunk_bytes: int, stats: ReadStats, strict: bool = False
) -> Iterator[tuple[str, int]]:
    """Yield (text, nbytes) pieces of the segment, each about `chunk_bytes` of UTF-8 or less, where
    `nbytes` counts the file bytes consumed since the previous piece (for progress)."""
    replaced_here = 0
    with _open(segment.doc.path) as f:
        f.seek(segment.start)
        remaining, carry, pending, consumed = segment.size, b"", "", 0
        offset = segment.start  # file offset of carry[0]
        while remaining > 0:
            block = f.read(min(chunk_bytes, remaining))
            if not block:  # the file shrank while we read it
                break
            remaining -= len(block)
            consumed += len(block)
            data = carry + block
            try:
                text, used, replaced = decode_utf8(data, final=remaining == 0, strict=strict)
            except UnicodeDecodeError as e:
                raise CorpusError(
                    f"{segment.doc.path}: bytes at offset {offset + e.start} are not UTF-8 ({e.reason}); "
                    f"convert the file to UTF-8, or leave out --strict-utf8 to replace them with U+FFFD"
                ) from None
            replaced_here += replaced
            carry, offset = data[used:], offset + used
            text = pending + text
            cut = _safe_cut(text) if remaining > 0 else len(text)
            if cut == 0:
                cut = len(text)  # one huge "word": cut at a character boundary
            yield text[:cut], consumed
            pending, consumed = text[cut:], 0
        if pending or consumed:
            yield pending, consumed
    if replaced_here:
        stats.replaced_bytes += replaced_here
        stats.files_with_replacements.append((segment.doc.path, replaced_here))


# ---- record files: one JSON value per line -----------------------------------------------------------


def jsonl_rows(path: str | Path, progress=None) -> Iterator[tuple[int, object, str | None]]:
    """(row, value, problem) for each non-blank line of a `.jsonl` (or gzip-compressed `.jsonl.gz`) file:
    `row` counts lines from 1, `value` is the parsed JSON (None when `problem` says why it could not be).
    The caller decides whether a bad row stops it (`BadRowError(path, row, problem)`) or is skipped.
    `progress(n)`, if given, is told the file bytes read since it was last told (compressed ones for .gz)."""
    path = Path(path)
    try:
        raw = open(path, "rb")
        with raw, gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw as f:
            told = 0
            for row, line in enumerate(f, 1):
                if progress:
                    at = raw.tell()
                    progress(at - told)
                    told = at
                if not line.strip():
                    continue
                try:
                    yield row, json.loads(line), None
                except UnicodeDecodeError:
                    yield row, None, "not UTF-8"
                except ValueError as e:
                    yield row, None, f"not JSON ({e.msg} at column {e.colno})"
    except (OSError, EOFError) as e:  # unreadable, or a damaged / truncated gzip stream
        raise CorpusError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def record_texts(doc: Document, field: str, stats: ReadStats, skip_bad: bool = False, progress=None):
    """(row index from 0, text) of each good row of a record file; a bad row raises BadRowError, or with
    `skip_bad` is added to `stats.bad_rows` and left out (rows are numbered from 1 in messages, as lines
    are). `progress(n)` is told the file bytes read."""
    rows = (
        _parquet_rows(doc, field, progress)
        if doc.path.name.endswith(".parquet")
        else _jsonl_texts(doc, field, progress)
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


def _jsonl_texts(doc: Document, field: str, progress):
    for row, value, problem in jsonl_rows(doc.path, progress):
        if problem is None:
            if not isinstance(value, dict):
                problem = f"a JSON {type(value).__name__}, not an object with a {field!r} field"
            elif field not in value:
                keys = ", ".join(sorted(map(str, value))[:8]) or "none"
                problem = f"no field {field!r} (its fields: {keys}); name the field with --text-field"
            elif not isinstance(value[field], str):
                problem = f"field {field!r} is {type(value[field]).__name__}, not a string"
        yield row, value[field] if problem is None else None, problem


def _parquet_rows(doc: Document, field: str, progress):
    pa, pf = _open_parquet(doc.path)
    names = pf.schema_arrow.names
    if field not in names:
        raise CorpusError(
            f"{doc.path}: no column {field!r} (its columns: {', '.join(names[:8])}); name the column with --text-field"
        )
    kind = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise CorpusError(f"{doc.path}: column {field!r} holds {kind}, not strings")
    for row, value, _ in _batched_rows(doc.path, pa, pf, progress, [field]):
        text = value[field]
        yield row, text, None if text is not None else f"column {field!r} is null"


def _open_parquet(path: Path):
    """(the pyarrow module, the open ParquetFile); a CorpusError when pyarrow or the file is missing."""
    try:
        import pyarrow as pa  # optional: parquet
        import pyarrow.parquet as pq  # optional: parquet
    except ImportError:
        raise CorpusError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        return pa, pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise CorpusError(f"cannot read {path} as Parquet: {e}") from None


def parquet_rows(path: str | Path, progress=None, columns: list[str] | None = None):
    """(row, value, None) for each row of a Parquet file, `value` a dict of its columns (all, or `columns`),
    read a batch of rows at a time within the row groups (bounded memory for a shard larger than RAM).
    Rows count from 1, as jsonl_rows' lines; `progress(n)` is told the file bytes read (in proportion to
    the rows)."""
    path = Path(path)
    yield from _batched_rows(path, *_open_parquet(path), progress, columns)


def _batched_rows(path: Path, pa, pf, progress, columns, batch_rows: int = 1024):
    """parquet_rows of an open file (the text reader opens it first to check its column)."""
    size, n, row, told = path.stat().st_size, max(1, pf.metadata.num_rows), 0, 0
    try:
        for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
            for value in batch.to_pylist():
                row += 1
                yield row, value, None
            if progress:
                at = size * row // n
                progress(at - told)
                told = at
    except (OSError, pa.ArrowException) as e:
        raise CorpusError(f"cannot read {path} (row {row + 1}): {e}") from None
