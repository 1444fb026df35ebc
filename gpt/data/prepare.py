"""Turn any text corpus into a memory-mapped token dataset (the logic behind `data/prepare.py`).

    gpt prepare corpus/ more.txt --out data/mine --tokenizer bpe --vocab-size 8192

    from gpt.data.prepare import prepare
    summary = prepare(["corpus/"], "data/mine", tokenizer="gpt2")
    print(summary.line())

Passes over the corpus, each streaming it in chunks (memory does not grow with the corpus):
1. only for `char`: collect the character set; only for `bpe`: train the BPE on the train split;
2. encode every chunk on all cores (tiktoken releases the GIL) and append the ids to train.bin or
   val.bin, hashing them on the way; each document ends with the end-of-text token.

Policies (the corpus policies, UTF-8 included, are in gpt/data/corpus.py; the format and the atomic
writing in gpt/data/format.py)
- Everything is written to a hidden temporary directory beside `--out` and moved into place at the
  end, meta.json last: an interrupted prepare never leaves a dataset that looks complete, and a
  failed `--force` (a full disk, Ctrl-C) leaves the previous dataset as it was.
- An `--out` that already holds a dataset (any of train.bin, val.bin, meta.json, tokenizer.tiktoken)
  is refused unless `force`; other files in that directory are never touched, so a recipe directory
  (`data/shakespeare_char/`) can hold its own prepare.py next to the data.
- Ids are stored as uint16 when the vocabulary fits (<= 65536 ids), uint32 otherwise; every chunk
  is checked against the vocabulary before it is narrowed, so nothing ever wraps around, and each
  split's largest id goes into meta.json (`max_id`) for the loader to check, and the UTF-8 bytes of its
  text (`bytes`), which turn its loss into bits per byte.
- Each split must hold at least one training window (block_size + 1 tokens).
- train.bin and val.bin together may take at most `max_output_bytes` (default: 32 times the inputs' bytes
  on disk, at least 16 MiB; staging.OutputBudget): past it the prepare stops with one error and writes
  nothing, so a record file that decodes to GBs (a Parquet or gzip bomb) never fills the disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpt.data import vocab
from gpt.data.bpe import train_bpe
from gpt.data.corpus import (
    CorpusError,
    ReadStats,
    Segment,
    find_documents,
    plan_split,
    read_chunks,
    text_pieces,
    val_row,
)
from gpt.data.format import SPLITS, TOKENIZERS, DataError, dtype_for_vocab, new_meta, store_ranks, write_meta
from gpt.data.records import DEFAULT_MAX_ROW_BYTES, record_texts
from gpt.data.staging import OutputBudget, staged
from gpt.data.tokenizer import (
    CharTokenizer,
    TiktokenTokenizer,
    TokenizerError,
    get_tokenizer,
    gpt2_tokenizer,
)
from gpt.fsutil import open_new, replacing
from gpt.progress import Progress

DEFAULT_BPE_VOCAB = 8192
TOKENIZER_FILE_FLAG = "--tokenizer-file"  # data/prepare.py's flag for GPT-2's ranks, named in hints


@dataclass
class PrepareSummary:
    path: Path
    documents: int
    tokens: dict  # split -> count
    corpus_bytes: int
    replaced_bytes: int
    seconds: float
    meta: dict
    unknown: Counter | None = None  # characters the reused vocabulary lacks, replaced

    def line(self) -> str:
        total = sum(self.tokens.values())
        mb = self.corpus_bytes / 1e6
        text = (
            f"prepared {self.path}: {self.documents:,} document{'s' if self.documents != 1 else ''}, {total:,} tokens "
            f"(train {self.tokens['train']:,}, val {self.tokens['val']:,}), {self.meta['tokenizer']['kind']} "
            f"vocab {self.meta['vocab_size']:,} as {self.meta['dtype']}, {mb:,.1f} MB in {self.seconds:.1f} s "
            f"({mb / max(self.seconds, 1e-9):,.1f} MB/s)"
        )
        if self.meta["corpus"].get("bad_rows_skipped"):
            text += f"; {self.meta['corpus']['bad_rows_skipped']:,} bad rows skipped"
        if self.replaced_bytes:
            text += f"; {self.replaced_bytes:,} bytes that were not UTF-8 replaced by U+FFFD"
        if self.unknown:
            replaced_by = self.meta["corpus"]["unknown_chars"]["replaced_by"]
            text += f"; {vocab.describe(self.unknown)} not in the vocabulary, written as {replaced_by!r}"
        return text


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def prepare(
    inputs: list[str | os.PathLike],
    out: str | os.PathLike,
    tokenizer: str | None = None,
    *,
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    block_size: int = 1024,
    tokenizer_file: str | None = None,
    tokenizer_from: str | os.PathLike | vocab.Reused | None = None,
    unknown: str = "refuse",
    replacement: str | None = None,
    force: bool = False,
    strict_utf8: bool = False,
    text_field: str = "text",
    skip_bad_rows: bool = False,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    max_output_bytes: int | None = None,
    workers: int | None = None,
    chunk_bytes: int = 1 << 20,
    progress: bool | None = None,
    log: Callable[[str], None] = _stderr,
) -> PrepareSummary:
    """Tokenize the text files, record files (`.jsonl`, `.jsonl.gz`, `.parquet`: `text_field` of each row,
    bad rows (rows longer than `max_row_bytes` too) an error or, with `skip_bad_rows`, skipped and counted)
    and directories in `inputs` into the dataset directory `out` (train.bin and val.bin at most
    `max_output_bytes` together; None: staging.OutputBudget's rule), with a new tokenizer of kind `tokenizer`
    (default gpt2), or the one of `tokenizer_from` (a dataset, or the `vocab.Reused` of a run or checkpoint
    from `gpt.checkpoints.loader.tokenizer_source`: see gpt/data/vocab.py for it and the `unknown` /
    `replacement` policy).

    Raises DataError for every user mistake and a StorageError for an `out` that cannot be written or
    a full disk (the CLI prints either as one line); nothing is left behind.
    """
    t0 = time.perf_counter()
    out = Path(out)
    spec = reused_spec(tokenizer_from, tokenizer, vocab_size, tokenizer_file)
    if isinstance(tokenizer_from, vocab.Reused):
        tokenizer_from = tokenizer_from.source
    if spec is None:
        tokenizer = tokenizer or "gpt2"
        check_tokenizer_options(tokenizer, vocab_size, tokenizer_file)
    if block_size < 1:
        raise DataError(f"--block-size must be >= 1, got {block_size}")
    if workers is not None and workers < 1:
        raise DataError(f"--workers must be >= 1 (encoding threads), got {workers}; leave it out to use every core")
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with staged(out, force, log) as tmp:  # first, so an `out` that cannot be written fails before the work
        try:
            docs = find_documents(inputs, exclude=out)
            if not docs:
                raise DataError(
                    f"empty corpus: no text in {', '.join(map(str, inputs))} (only empty, hidden or binary files)"
                )
            segments, split_by = plan_split(docs, val_fraction)
        except CorpusError as e:
            raise DataError(str(e)) from None
        missing, replace_with = None, None
        reading = Reading(chunk_bytes, strict_utf8, text_field, skip_bad_rows, val_fraction, max_row_bytes)
        if spec is None:
            tok = _build_tokenizer(tokenizer, segments, vocab_size, tokenizer_file, reading, progress)
        else:
            tok = reused_tokenizer(spec, tokenizer_file)
            if isinstance(tok, CharTokenizer):
                missing = vocab.unknown_chars(_char_counts(segments, reading, progress), tok.chars)
                replace_with = vocab.unknown_policy(missing, tok.chars, unknown, replacement, tokenizer_from)
        dtype = dtype_for_vocab(tok.vocab_size)
        stats = ReadStats()
        budget = OutputBudget(out, sum(d.size for d in docs), max_output_bytes)  # train.bin and val.bin together
        writers = {s: _SplitWriter(tmp / f"{s}.bin", dtype, tok.vocab_size, budget) for s in SPLITS}
        try:
            _encode(segments, tok, writers, stats, workers, reading, progress, replace_with)
        finally:
            for w in writers.values():
                w.close()
        for path, n in stats.files_with_replacements[:5]:
            log(f"warning: {path}: {n:,} bytes that are not UTF-8 replaced by U+FFFD")
        if len(stats.files_with_replacements) > 5:
            log(f"warning: ... and {len(stats.files_with_replacements) - 5} more files with bytes that are not UTF-8")
        for s, w in writers.items():
            if w.tokens < block_size + 1:
                raise DataError(
                    f"corpus too small: the {s} split has {w.tokens:,} tokens, fewer than one training window "
                    f"of block_size + 1 = {block_size + 1:,}; use a larger corpus, a smaller --block-size"
                    f"{' or a larger --val-fraction' if s == 'val' else ''}"
                )
        corpus = {
            "inputs": [str(i) for i in inputs],
            "bytes": sum(d.size for d in docs),
            "replaced_bytes": stats.replaced_bytes,
            "val_fraction": val_fraction,
            "split_by": split_by,
        }
        if any(d.records for d in docs):
            corpus.update(text_field=text_field, bad_rows_skipped=len(stats.bad_rows))
        for error in stats.bad_rows[:3]:
            log(f"skipped {error}")
        if len(stats.bad_rows) > 3:
            log(f"skipped {len(stats.bad_rows) - 3:,} more bad rows")
        if spec is not None:
            corpus["tokenizer_from"] = str(tokenizer_from)
            corpus["unknown_chars"] = {
                "count": sum(missing.values()) if missing else 0,
                "replaced_by": replace_with,
                "most_common": (missing or Counter()).most_common(20),
            }
        documents = sum(not d.records for d in docs) + stats.rows
        meta = _meta(tok, store_ranks(tmp, tok.spec), writers, documents, corpus)
        write_meta(tmp, meta)
    return PrepareSummary(
        out,
        documents,
        {s: w.tokens for s, w in writers.items()},
        corpus["bytes"],
        stats.replaced_bytes,
        time.perf_counter() - t0,
        meta,
        missing,
    )


def _meta(tok, spec: dict, writers: dict, documents: int, corpus: dict) -> dict:
    splits = {
        s: {
            "file": f"{s}.bin",
            "tokens": w.tokens,
            "documents": w.documents,
            "sha256": w.sha256.hexdigest(),
            "max_id": w.max_id,
            "bytes": w.text_bytes,
        }
        for s, w in writers.items()
    }
    return new_meta(
        "tokens",
        tok.vocab_size,
        spec,
        eot_token=tok.eot_token,
        tokens=sum(w.tokens for w in writers.values()),
        documents=documents,
        splits=splits,
        corpus=corpus,
    )


def check_tokenizer_options(kind: str, vocab_size: int | None, tokenizer_file: str | None) -> None:
    """The tokenizer options that go together (text and pairs datasets alike)."""
    if kind not in TOKENIZERS:
        raise DataError(f"unknown --tokenizer {kind!r}; choose one of {', '.join(TOKENIZERS)}")
    if vocab_size is not None and kind != "bpe":
        raise DataError(f"--vocab-size is for --tokenizer bpe (the {kind} vocabulary is fixed by the tokenizer)")
    if tokenizer_file is not None and kind != "gpt2":
        raise DataError(f"--tokenizer-file is GPT-2's ranks file, for --tokenizer gpt2 only (got --tokenizer {kind})")


# ---- tokenizers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """How the corpus is read: chunk size and UTF-8 strictness for text files; for record files the
    field of each row, whether bad rows are skipped, the share of rows that goes to val, the longest row."""

    chunk_bytes: int = 1 << 20
    strict: bool = False
    field: str = "text"
    skip_bad: bool = False
    val_fraction: float = 0.1
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES

    def rows(self, doc, stats: ReadStats, progress=None):
        """(row, text) of each good row of the record file `doc` (record_texts with these settings)."""
        return record_texts(doc, self.field, stats, self.skip_bad, progress, self.max_row_bytes)

    def split_of(self, row: int) -> str:
        return "val" if val_row(row, self.val_fraction) else "train"


def _texts(segments: list[Segment], reading: Reading, bar: Progress | None = None, split: str | None = None):
    """The corpus's text in pieces (text-file chunks, record rows cut as chunks are); only `split`'s rows of
    record files."""
    stats = ReadStats()
    for seg in segments:
        if seg.doc.records:
            update = bar.update if bar else None
            for row, text in reading.rows(seg.doc, stats, update):
                if split is None or reading.split_of(row) == split:
                    yield from text_pieces(text, reading.chunk_bytes)
            continue
        for text, nbytes in read_chunks(seg, reading.chunk_bytes, stats, reading.strict):
            yield text
            if bar:
                bar.update(nbytes)


def reused_spec(source, kind: str | None, vocab_size, tokenizer_file) -> dict | None:
    """The spec of `--tokenizer-from` (None without it), checked against the options that go with it."""
    if source is None:
        return None
    reused = source if isinstance(source, vocab.Reused) else None
    where = reused.source if reused else source  # a path, never the spec (a bpe's holds its ranks)
    if kind is not None or vocab_size is not None:
        given = f"--tokenizer {kind}" if kind is not None else f"--vocab-size {vocab_size}"
        has = f" (a {reused.spec.get('kind')!r} tokenizer)" if reused else ""
        raise DataError(f"{given} and --tokenizer-from {where}{has}: give one or the other")
    reused = reused or vocab.dataset_spec(source)
    if reused is None:
        raise DataError(
            f"--tokenizer-from {source}: not a prepared dataset; a run, checkpoint or Hugging Face "
            f"directory is read by gpt.checkpoints.loader.tokenizer_source(path), passed as tokenizer_from"
        )
    spec = reused.spec
    if tokenizer_file is not None and spec.get("kind") != "gpt2":
        raise DataError(f"--tokenizer-file is GPT-2's ranks file; {where} has a {spec.get('kind')!r} tokenizer")
    return spec


def reused_tokenizer(spec: dict, tokenizer_file: str | None):
    try:
        if spec.get("kind") == "gpt2":
            return gpt2_tokenizer(tokenizer_file, file_flag=TOKENIZER_FILE_FLAG)
        return get_tokenizer(spec)
    except (TokenizerError, KeyError) as e:
        raise DataError(f"--tokenizer-from: cannot build its tokenizer ({e})") from None


def _char_counts(segments, reading: Reading, progress) -> Counter:
    """How often each character occurs in the corpus."""
    counts = Counter()
    try:
        with Progress("scan chars", sum(s.size for s in segments), enabled=progress) as bar:
            for text in _texts(segments, reading, bar):
                counts.update(text)
    except CorpusError as e:
        raise DataError(str(e)) from None
    return counts


def _build_tokenizer(kind, segments, vocab_size, tokenizer_file, reading: Reading, progress):
    try:
        if kind == "gpt2":
            try:
                return gpt2_tokenizer(tokenizer_file, file_flag=TOKENIZER_FILE_FLAG)
            except TokenizerError as e:
                raise DataError(str(e)) from None
        if kind == "char":
            return CharTokenizer("".join(sorted(_char_counts(segments, reading, progress))))
        train = [s for s in segments if s.split in ("train", "rows")]
        try:
            with Progress("train BPE", sum(s.size for s in train), enabled=progress) as bar:
                return train_bpe(_texts(train, reading, bar, split="train"), vocab_size or DEFAULT_BPE_VOCAB)
        except ValueError as e:
            raise DataError(str(e)) from None
    except CorpusError as e:
        raise DataError(str(e)) from None


def _encoder(tok, replace_with: str | None = None) -> Callable[[str], np.ndarray]:
    """text -> ids as a numpy array, fast paths first (both release the GIL for most of the work); a char
    vocabulary's unknown characters become `replace_with`'s id (else they are an error)."""
    if isinstance(tok, TiktokenTokenizer):
        return tok.encode_to_numpy
    if isinstance(tok, CharTokenizer):
        # a vocabulary of this project's is sorted; one from elsewhere (an edited meta.json) need not be
        order = np.argsort([ord(c) for c in tok.chars]).astype(np.uint32)  # ids by code point
        codepoints = np.array([ord(c) for c in tok.chars], dtype=np.uint32)[order]

        def encode_chars(text: str) -> np.ndarray:
            cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            at = np.minimum(np.searchsorted(codepoints, cps), len(codepoints) - 1)
            ids, unknown = order[at], codepoints[at] != cps
            if replace_with is not None:
                ids[unknown] = tok.stoi[replace_with]
            elif unknown.any():
                raise DataError("a file changed while it was being prepared (a character is new): run it again")
            return ids

        return encode_chars
    return lambda text: np.asarray(tok.encode(text), dtype=np.int64)


# ---- writing ----------------------------------------------------------------------------------------


class _SplitWriter:
    def __init__(self, path: Path, dtype: str, vocab_size: int, budget: OutputBudget):
        self.f = open_new(path)  # (in the fresh directory staging.staged made)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.vocab_size = vocab_size
        self.budget = budget
        self.sha256 = hashlib.sha256()
        self.tokens = 0
        self.documents = 0
        self.max_id = 0
        self.text_bytes = 0  # UTF-8 bytes of the text encoded (bits-per-byte: gpt.data.tokens.bits_per_byte)

    def write(self, ids: np.ndarray) -> None:
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))
        if self.max_id >= self.vocab_size:  # a bug, never narrowed silently
            raise RuntimeError(f"tokenizer produced id {self.max_id} outside its vocabulary of {self.vocab_size}")
        data = ids.astype(self.dtype, copy=False).tobytes()
        self.budget.spend(len(data))  # before the write: a bomb stops at the limit
        self.sha256.update(data)
        self.f.write(data)
        self.tokens += len(ids)

    def close(self) -> None:
        self.f.close()


def _row_batches(seg: Segment, reading: Reading, stats: ReadStats):
    """(split, texts, ends, file bytes read) of a record file: rows in batches of about `chunk_bytes` of text
    or of file, a longer row alone in pieces of about `chunk_bytes` (`ends[i]`: texts[i] ends its row, an
    end-of-text follows), so no row's ids are ever held whole; split None and no texts: bytes of skipped
    rows only."""
    rows, size, read = {"train": [], "val": []}, 0, [0]

    def progress(n: int) -> None:
        read[0] += n

    def take():
        for split in ("train", "val"):
            if rows[split]:
                yield split, rows[split], [True] * len(rows[split]), read[0]
                rows[split], read[0] = [], 0
        if read[0]:  # only skipped rows since the last batch: their bytes, for the progress bar
            yield None, [], [], read[0]
            read[0] = 0

    for row, text in reading.rows(seg.doc, stats, progress):
        if len(text) > reading.chunk_bytes:
            yield from take()
            size, pieces = 0, text_pieces(text, reading.chunk_bytes)
            piece = next(pieces)
            for after in pieces:
                yield reading.split_of(row), [piece], [False], 0
                piece = after
            yield reading.split_of(row), [piece], [True], read[0]
            read[0] = 0
            continue
        rows[reading.split_of(row)].append(text)
        size += len(text)
        if size >= reading.chunk_bytes or read[0] >= reading.chunk_bytes:
            yield from take()
            size = 0
    yield from take()


def _encode(segments, tok, writers, stats, workers, reading: Reading, progress, replace_with=None) -> None:
    """Encode the segments in order on `workers` threads, keeping a bounded number of chunks in flight."""
    encode = _encoder(tok, replace_with)
    eot = np.array([tok.eot_token], dtype=np.int64)

    def encode_rows(texts: list[str], ends: list[bool]) -> np.ndarray:  # rows' ids, each row's then end-of-text
        parts = [encode(text).astype(np.int64, copy=False) for text in texts]
        return np.concatenate([ids for part, end in zip(parts, ends) for ids in ((part, eot) if end else (part,))])

    in_flight: deque = deque()

    def drain(limit: int) -> None:
        while len(in_flight) > limit:
            future, split, nbytes = in_flight.popleft()
            writers[split].write(future.result() if future is not None else eot)
            bar.update(nbytes)

    bar = Progress("encode", sum(s.size for s in segments), enabled=progress)
    with bar, ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            for seg in segments:
                if seg.doc.records:
                    for split, texts, ends, nbytes in _row_batches(seg, reading, stats):
                        if not texts:
                            bar.update(nbytes)
                            continue
                        in_flight.append((pool.submit(encode_rows, texts, ends), split, nbytes))
                        writers[split].text_bytes += sum(len(t.encode("utf-8")) for t in texts)  # (pieces of rows)
                        writers[split].documents += sum(ends)
                        stats.rows += sum(ends)
                        drain(2 * workers)
                    continue
                for text, nbytes in read_chunks(seg, reading.chunk_bytes, stats, reading.strict):
                    in_flight.append((pool.submit(encode, text), seg.split, nbytes))
                    writers[seg.split].text_bytes += len(text.encode("utf-8"))
                    drain(2 * workers)
                if seg.last:
                    in_flight.append((None, seg.split, 0))  # the document ends: end-of-text
                writers[seg.split].documents += 1
            drain(0)
        except CorpusError as e:
            raise DataError(str(e)) from None
        finally:
            for future, _, _ in in_flight:
                if future is not None:
                    future.cancel()


# ---- recipes ----------------------------------------------------------------------------------------


def fetch(url: str, dest: Path, timeout: float = 30) -> Path:
    """Download `url` to `dest` once (atomically); a DataError says how to work offline."""
    import urllib.request  # lazy: downloads

    dest = Path(dest)
    if dest.is_file():
        return dest
    try:
        with replacing(dest) as tmp, urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f)
    except OSError as e:
        raise DataError(f"cannot download {url} ({e}): if offline, pass --input FILE with a local copy") from None
    return dest
