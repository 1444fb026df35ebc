"""Turn any text corpus into a memory-mapped token dataset (the logic behind `data/prepare.py`).

    python data/prepare.py corpus/ more.txt --out data/mine --tokenizer bpe --vocab-size 8192

    from gpt.prepare import prepare
    summary = prepare(["corpus/"], "data/mine", tokenizer="gpt2")
    print(summary.line())

Passes over the corpus, each streaming it in chunks (memory does not grow with the corpus):
1. only for `char`: collect the character set; only for `bpe`: train the BPE on the train split;
2. encode every chunk on all cores (tiktoken releases the GIL) and append the ids to train.bin or
   val.bin, hashing them on the way; each document ends with the end-of-text token.

Policies (the corpus policies, UTF-8 included, are in gpt/corpus.py)
- Everything is written to a hidden temporary directory beside `--out` and moved into place at the
  end, meta.json last: an interrupted prepare never leaves a dataset that looks complete, and a
  failed `--force` leaves the previous dataset as it was.
- An `--out` that already holds a dataset (any of train.bin, val.bin, meta.json, tokenizer.tiktoken)
  is refused unless `force`; other files in that directory are never touched, so a recipe directory
  (`data/shakespeare_char/`) can hold its own prepare.py next to the data.
- Ids are stored as uint16 when the vocabulary fits (<= 65536 ids), uint32 otherwise; every chunk
  is checked against the vocabulary before it is narrowed, so nothing ever wraps around.
- Each split must hold at least one training window (block_size + 1 tokens).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

from gpt.corpus import CorpusError, ReadStats, Segment, find_documents, plan_split, read_chunks
from gpt.data import FORMAT_VERSION, META_FILE, SPLITS, DataError, dtype_for_vocab
from gpt.progress import Progress
from gpt.tokenizer import CharTokenizer, TiktokenTokenizer, TokenizerError, gpt2_tokenizer

TOKENIZERS = ("gpt2", "char", "bpe")
RANKS_FILE = "tokenizer.tiktoken"
DATASET_FILES = (*(f"{s}.bin" for s in SPLITS), RANKS_FILE, META_FILE)
TMP_MARK = ".prepare-"
DEFAULT_BPE_VOCAB = 8192


@dataclass
class PrepareSummary:
    path: Path
    documents: int
    tokens: dict  # split -> count
    corpus_bytes: int
    replaced_bytes: int
    seconds: float
    meta: dict

    def line(self) -> str:
        total = sum(self.tokens.values())
        mb = self.corpus_bytes / 1e6
        text = (
            f"prepared {self.path}: {self.documents:,} document{'s' if self.documents != 1 else ''}, {total:,} tokens "
            f"(train {self.tokens['train']:,}, val {self.tokens['val']:,}), {self.meta['tokenizer']['kind']} "
            f"vocab {self.meta['vocab_size']:,} as {self.meta['dtype']}, {mb:,.1f} MB in {self.seconds:.1f} s "
            f"({mb / max(self.seconds, 1e-9):,.1f} MB/s)"
        )
        if self.replaced_bytes:
            text += f"; {self.replaced_bytes:,} bytes that were not UTF-8 replaced by U+FFFD"
        return text


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def prepare(
    inputs: list[str | os.PathLike],
    out: str | os.PathLike,
    tokenizer: str = "gpt2",
    *,
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    block_size: int = 1024,
    tokenizer_file: str | None = None,
    force: bool = False,
    strict_utf8: bool = False,
    workers: int | None = None,
    chunk_bytes: int = 1 << 20,
    progress: bool | None = None,
    log: Callable[[str], None] = _stderr,
) -> PrepareSummary:
    """Tokenize the text files and directories in `inputs` into the dataset directory `out`.

    Raises DataError for every user mistake (the CLI prints it as one line); nothing is left behind.
    """
    t0 = time.perf_counter()
    out = Path(out)
    if tokenizer not in TOKENIZERS:
        raise DataError(f"unknown --tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    if block_size < 1:
        raise DataError(f"--block-size must be >= 1, got {block_size}")
    if vocab_size is not None and tokenizer != "bpe":
        raise DataError(f"--vocab-size is for --tokenizer bpe (the {tokenizer} vocabulary is fixed by the tokenizer)")
    if tokenizer_file is not None and tokenizer != "gpt2":
        raise DataError(f"--tokenizer-file is GPT-2's ranks file, for --tokenizer gpt2 only (got --tokenizer {tokenizer})")
    _check_out(out, force)
    try:
        docs = find_documents(inputs, exclude=out)
        if not docs:
            raise DataError(
                f"empty corpus: no text in {', '.join(map(str, inputs))} (only empty, hidden or binary files)"
            )
        segments, split_by = plan_split(docs, val_fraction)
    except CorpusError as e:
        raise DataError(str(e)) from None
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _remove_stale_tmp(out, log)

    tok = _build_tokenizer(tokenizer, segments, vocab_size, tokenizer_file, strict_utf8, chunk_bytes, progress)
    dtype = dtype_for_vocab(tok.vocab_size)
    made = _mkdirs(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{TMP_MARK}{os.getpid()}-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the dataset gets the usual permissions
    try:
        stats = ReadStats()
        writers = {s: _SplitWriter(tmp / f"{s}.bin", dtype, tok.vocab_size) for s in SPLITS}
        try:
            _encode(segments, tok, writers, stats, workers, chunk_bytes, strict_utf8, progress)
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
        spec = tok.spec
        if spec["kind"] == "bpe":  # the ranks go in their own file, in tiktoken's format
            (tmp / RANKS_FILE).write_text(spec.pop("ranks"), encoding="ascii")
            spec.update(ranks_file=RANKS_FILE, ranks_sha256=_sha256_file(tmp / RANKS_FILE))
        corpus = {
            "inputs": [str(i) for i in inputs],
            "bytes": sum(d.size for d in docs),
            "replaced_bytes": stats.replaced_bytes,
            "val_fraction": val_fraction,
            "split_by": split_by,
        }
        meta = _meta(tok, dtype, spec, writers, len(docs), corpus)
        _write_durably(tmp / META_FILE, json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in made:  # parents this call created, innermost first
            try:
                d.rmdir()
            except OSError:
                break
        raise
    return PrepareSummary(
        out, len(docs), {s: w.tokens for s, w in writers.items()}, corpus["bytes"], stats.replaced_bytes,
        time.perf_counter() - t0, meta,
    )


def _meta(tok, dtype: str, spec: dict, writers: dict, documents: int, corpus: dict) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "eot_token": tok.eot_token,
        "tokenizer": spec,
        "tokens": sum(w.tokens for w in writers.values()),
        "documents": documents,
        "splits": {
            s: {"file": f"{s}.bin", "tokens": w.tokens, "documents": w.documents, "sha256": w.sha256.hexdigest()}
            for s, w in writers.items()
        },
        "corpus": corpus,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _mkdirs(path: Path) -> list[Path]:
    """mkdir -p; returns the directories it created, innermost first (to undo it on failure)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    return missing


# ---- tokenizers -------------------------------------------------------------------------------------


def _texts(segments: list[Segment], chunk_bytes: int, strict: bool, bar: Progress | None = None):
    stats = ReadStats()
    for seg in segments:
        for text, nbytes in read_chunks(seg, chunk_bytes, stats, strict):
            yield text
            if bar:
                bar.update(nbytes)


def _build_tokenizer(kind, segments, vocab_size, tokenizer_file, strict, chunk_bytes, progress):
    try:
        if kind == "gpt2":
            try:
                return gpt2_tokenizer(tokenizer_file)
            except (FileNotFoundError, TokenizerError) as e:
                raise DataError(str(e)) from None
        if kind == "char":
            bar = Progress("scan chars", sum(s.size for s in segments), enabled=progress)
            chars = set()
            for text in _texts(segments, chunk_bytes, strict, bar):
                chars.update(text)
            bar.close()
            return CharTokenizer("".join(sorted(chars)))
        from gpt.bpe import train_bpe

        train = [s for s in segments if s.split == "train"]
        bar = Progress("train BPE", sum(s.size for s in train), enabled=progress)
        try:
            tok = train_bpe(_texts(train, chunk_bytes, strict, bar), vocab_size or DEFAULT_BPE_VOCAB)
        except ValueError as e:
            raise DataError(str(e)) from None
        bar.close()
        return tok
    except CorpusError as e:
        raise DataError(str(e)) from None


def _encoder(tok) -> Callable[[str], np.ndarray]:
    """text -> ids as a numpy array, fast paths first (both release the GIL for most of the work)."""
    if isinstance(tok, TiktokenTokenizer):
        return lambda text: tok.enc.encode_to_numpy(text, disallowed_special=())
    if isinstance(tok, CharTokenizer):
        codepoints = np.array([ord(c) for c in tok.chars], dtype=np.uint32)  # sorted, as the vocabulary

        def encode_chars(text: str) -> np.ndarray:
            cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            ids = np.searchsorted(codepoints, cps).astype(np.uint32)
            if len(cps) and not np.array_equal(codepoints[np.minimum(ids, len(codepoints) - 1)], cps):
                raise DataError("a file changed while it was being prepared (a character is new): run it again")
            return ids

        assert np.all(codepoints[1:] > codepoints[:-1]), "char vocabulary must be sorted"
        return encode_chars
    return lambda text: np.asarray(tok.encode(text), dtype=np.int64)


# ---- writing ----------------------------------------------------------------------------------------


class _SplitWriter:
    def __init__(self, path: Path, dtype: str, vocab_size: int):
        self.f = open(path, "wb")
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.vocab_size = vocab_size
        self.sha256 = hashlib.sha256()
        self.tokens = 0
        self.documents = 0

    def write(self, ids: np.ndarray) -> None:
        if len(ids) and int(ids.max()) >= self.vocab_size:
            raise RuntimeError(f"tokenizer produced id {int(ids.max())} outside its vocabulary of {self.vocab_size}")
        data = ids.astype(self.dtype, copy=False).tobytes()
        self.sha256.update(data)
        self.f.write(data)
        self.tokens += len(ids)

    def close(self) -> None:
        if not self.f.closed:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()


def _encode(segments, tok, writers, stats, workers, chunk_bytes, strict, progress) -> None:
    """Encode the segments in order on `workers` threads, keeping a bounded number of chunks in flight."""
    encode = _encoder(tok)
    eot = np.array([tok.eot_token], dtype=np.int64)
    bar = Progress("encode", sum(s.size for s in segments), enabled=progress)
    in_flight: deque = deque()

    def drain(limit: int) -> None:
        while len(in_flight) > limit:
            future, split, nbytes = in_flight.popleft()
            writers[split].write(future.result() if future is not None else eot)
            bar.update(nbytes)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            for seg in segments:
                for text, nbytes in read_chunks(seg, chunk_bytes, stats, strict):
                    in_flight.append((pool.submit(encode, text), seg.split, nbytes))
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
    bar.close()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the output directory ---------------------------------------------------------------------------


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a directory: choose another --out")
    existing = [name for name in DATASET_FILES if (out / name).exists()]
    if existing and not force:
        raise DataError(
            f"{out} already holds a dataset ({', '.join(existing)}): pass --force to replace it, or choose another --out"
        )


def _remove_stale_tmp(out: Path, log: Callable[[str], None]) -> None:
    """Remove temporary directories left by a prepare of `out` that was killed (its process is gone)."""
    if not out.parent.is_dir():
        return
    for tmp in out.parent.glob(f".{out.name}{TMP_MARK}*"):
        pid = tmp.name[len(f".{out.name}{TMP_MARK}") :].split("-")[0]
        if tmp.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"removed {tmp}, left by an interrupted prepare")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished dataset from `tmp` to `out`; meta.json arrives last (the commit point)."""
    if not out.exists():
        os.rename(tmp, out)  # atomic: `out` appears complete or not at all
        _fsync_dir(out.parent)
        return
    # `out` is a directory without a dataset (a recipe's directory) or one being replaced (--force).
    (out / META_FILE).unlink(missing_ok=True)  # from here on the old dataset no longer looks complete
    _fsync_dir(out)
    new = {p.name for p in tmp.iterdir()}
    for name in DATASET_FILES:
        if name != META_FILE:
            if name in new:
                os.replace(tmp / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)  # e.g. the old BPE ranks when replaced by char
    _fsync_dir(out)
    os.replace(tmp / META_FILE, out / META_FILE)
    _fsync_dir(out)
    tmp.rmdir()


# ---- recipes ----------------------------------------------------------------------------------------


def fetch(url: str, dest: Path, timeout: float = 30) -> Path:
    """Download `url` to `dest` once (atomically); a DataError says how to work offline."""
    import urllib.request

    dest = Path(dest)
    if dest.is_file():
        return dest
    tmp = dest.with_name(f".{dest.name}.download-{os.getpid()}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f)
        os.replace(tmp, dest)
    except OSError as e:
        raise DataError(f"cannot download {url} ({e}): if offline, pass --input FILE with a local copy") from None
    finally:
        tmp.unlink(missing_ok=True)
    return dest
