"""The on-disk format of prepared datasets, token streams and translation pairs alike (no torch).

    from gpt.data.format import read_meta, write_meta
    meta = read_meta("data/shakespeare_char", "tokens")   # meta.json, schema-checked: or one DataError line
    write_meta(tmp, meta)                                   # last, in gpt.data.staging's hidden directory

A dataset directory holds (gpt/data/prepare.py writes token datasets, gpt/data/pairs.py pairs datasets,
gpt/data/sft.py chat datasets):

| file | contents |
| --- | --- |
| `meta.json` | written last, so a directory without it is incomplete; checked field by field on opening |
| `train.bin`, `val.bin` | token ids, flat, little-endian `uint16` (vocabularies up to 65536 ids) or `uint32` |
| `train.idx`, `val.idx` | pairs: int64 offsets into the .bin, source and target of each pair; chat: where each conversation starts (and the end) |
| `train.mask.bin`, `val.mask.bin` | chat only: one uint8 per token, 1 where the token is a target of the loss (the assistant's words and end-of-turn) |
| `tokenizer.tiktoken` | a trained BPE's ranks in tiktoken's format; meta.json names it with its sha256 |

meta.json, every kind: `format_version` (1), `kind` (`tokens`, `pairs`, `chat` or `preferences`), `dtype`, `vocab_size`,
`tokenizer` (the spec gpt.data.tokenizer.get_tokenizer takes; a bpe's pattern is one of its KNOWN_PATTERNS)
and `splits`, where each split records `max_id`, its largest token id, so opening a dataset checks every
id against the vocabulary without a pass over the files; a token dataset's split also records `bytes`, the
UTF-8 bytes of the text it was encoded from (bits per byte). Older datasets still open: pairs datasets
named the version `format`, token datasets had no `kind`, a split without `max_id` has its ids read once
when opened, and one without `bytes` is decoded once when its bits per byte are first asked for
(`TokenDataset.text_bytes`).
A preference dataset (gpt/data/preferences.py) holds the chat dataset's files and fields, with two sequences
per pair (prompt + chosen, prompt + rejected; the mask on the answers), `pairs` instead of `conversations`
and `targets`, and `chat_template` null for pairs rendered as plain text.
A chat dataset also holds `eot_token`, `chat_template` (gpt/data/chat.py), `block_size` (conversations
were cut or left out to fit block_size + 1 tokens) and per split `file`, `mask`, `index`, `tokens`,
`conversations`, `targets` (tokens under the mask), `sha256` of the .bin and `max_id`.

Footguns
- Every mistake in meta.json is one DataError naming the file and the field (`splits.train.file`),
  never a KeyError or TypeError later on: `read_meta` checks the shape of every field the code reads.
- A dataset is written by `gpt.data.staging.staged` (a hidden directory, moved into place complete): its
  files are DATASET_FILES, the only ones publishing replaces.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from gpt.data.tokenizer import GPT2_PATTERN, check_pattern
from gpt.errors import UserError
from gpt.fsutil import write_text

FORMAT_VERSION = 1
VERSION_KEY = "format_version"
OLD_VERSION_KEY = "format"  # what pairs datasets called it before this module
KINDS = {
    "tokens": "a token dataset",
    "pairs": "translation pairs",
    "chat": "chat conversations",
    "preferences": "preference pairs",
}
TOKENIZERS = ("gpt2", "char", "bpe")
DTYPES = ("uint16", "uint32")
SPLITS = ("train", "val")
META_FILE = "meta.json"
RANKS_FILE = "tokenizer.tiktoken"
DATASET_FILES = (*(f"{s}.{ext}" for s in SPLITS for ext in ("bin", "idx", "mask.bin")), RANKS_FILE, META_FILE)
REPREPARE = "prepare the dataset again with --force"


class DataError(UserError, ValueError):
    """A dataset or corpus problem the user can fix (missing files, bad meta.json, too little data)."""


def prepare_hint(kind: str, path: str | os.PathLike) -> str:
    """The command that prepares a dataset of `kind` at `path`."""
    if kind == "pairs":
        return f"run `gpt prepare --pairs SRC TGT --out {path}`"
    if kind == "chat":
        return f"run `gpt prepare --chat FILE.jsonl --out {path} --tokenizer-from BASE_RUN`"
    if kind == "preferences":
        return f"run `gpt prepare --preferences FILE.jsonl --out {path} --tokenizer-from RUN`"
    return f"run `gpt prepare INPUT... --out {path} --tokenizer {{gpt2,char,bpe}}`"


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest stored dtype that holds every id below `vocab_size`."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise DataError(f"vocabulary of {vocab_size} ids does not fit in uint32")


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def check_sha256(file: Path, expected: str) -> None:
    if file_sha256(file) != expected:
        raise DataError(
            f"{file} does not match its checksum in meta.json (the file was changed or damaged): {REPREPARE}"
        )


# ---- the BPE's ranks file ---------------------------------------------------------------------------


def store_ranks(directory: Path, spec: dict) -> dict:
    """The spec as meta.json stores it: a bpe's ranks moved out into `directory`/tokenizer.tiktoken,
    named with its sha256. Other specs are returned as they are."""
    spec = dict(spec)
    if spec["kind"] == "specials":
        spec["base"] = store_ranks(directory, spec["base"])
    elif spec["kind"] == "bpe":
        file = Path(directory) / RANKS_FILE
        write_text(file, spec.pop("ranks"), encoding="ascii")
        spec.update(ranks_file=RANKS_FILE, ranks_sha256=file_sha256(file))
    return spec


def inline_ranks(directory: Path, spec: dict) -> dict:
    """The spec with a bpe's ranks read back in from their file (checked against the sha256): a
    self-contained spec a checkpoint can store to rebuild the tokenizer without the dataset."""
    spec = dict(spec)
    if spec["kind"] == "specials":
        spec["base"] = inline_ranks(directory, spec["base"])
    elif spec["kind"] == "bpe" and "ranks" not in spec:
        file = _ranks_file(Path(directory), spec.pop("ranks_file"))
        check_sha256(file, spec.pop("ranks_sha256"))
        spec["ranks"] = file.read_text(encoding="ascii")
    return spec


def _ranks_file(directory: Path, name: str) -> Path:
    if not (directory / name).is_file():
        raise DataError(f"{directory / name} is missing (the BPE's ranks, named in meta.json): {REPREPARE}")
    return directory / name


# ---- meta.json --------------------------------------------------------------------------------------


def new_meta(kind: str, vocab_size: int, spec: dict, **fields) -> dict:
    """The fields every dataset's meta.json starts with, then `fields`, then the time of writing."""
    assert kind in KINDS, kind
    return {
        VERSION_KEY: FORMAT_VERSION,
        "kind": kind,
        "dtype": dtype_for_vocab(vocab_size),
        "vocab_size": vocab_size,
        "tokenizer": spec,
        **fields,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_meta(directory: Path, meta: dict) -> None:
    write_text(Path(directory) / META_FILE, json.dumps(meta, indent=1, ensure_ascii=False) + "\n")


def _raw_meta(path: str | os.PathLike) -> dict | None:
    """meta.json as it is, unchecked; None where there is none, or it is not a JSON object."""
    try:
        meta = json.loads((Path(path) / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return None
    return meta if isinstance(meta, dict) else None


def is_dataset(path: str | os.PathLike) -> bool:
    """Whether `path` holds a prepared dataset (a meta.json with splits), whatever its state."""
    meta = _raw_meta(path)
    return meta is not None and "splits" in meta


def dataset_kind(path: str | os.PathLike) -> str:
    """The kind a dataset directory's meta.json says (`tokens`, or `pairs` for translation pairs); `tokens`
    where it says none or cannot be read (`read_meta` then reports what is wrong, with its fix)."""
    kind = (_raw_meta(path) or {}).get("kind", "tokens")
    return kind if kind in KINDS else "tokens"


def read_meta(path: str | os.PathLike, kind: str) -> dict:
    """meta.json of the dataset of `kind` at `path`, every field it must have checked (and the BPE's
    ranks file it names): anything else is one DataError naming the file, the field and the fix."""
    path = Path(path)
    hint = prepare_hint(kind, path)
    if not path.is_dir():
        raise DataError(f"no dataset directory {path}: {hint}")
    file = path / META_FILE
    if not file.is_file():
        raise DataError(f"no {META_FILE} in {path} (not prepared, or an interrupted prepare): {hint}")
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{file} is not valid JSON ({e}): {REPREPARE}") from None
    if not isinstance(meta, dict):
        raise DataError(
            f"{file} holds a JSON {type(meta).__name__}, not an object of the dataset's fields: {REPREPARE}"
        )
    found = _check_header(_Fields(file, meta))
    if found != kind:
        raise DataError(f"{path} holds {KINDS[found]}, not {KINDS[kind]}: {hint}")
    _check_fields(_Fields(file, meta), kind)
    spec = meta["tokenizer"]
    spec = spec["base"] if spec["kind"] == "specials" else spec
    if spec["kind"] == "bpe" and "ranks" not in spec:
        _ranks_file(path, spec["ranks_file"])
    return meta


_MISSING = object()


def _show(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


class _Fields:
    """Typed reads of one JSON object's fields; the first wrong one is a DataError naming it."""

    def __init__(self, file: Path, data: dict, prefix: str = ""):
        self.file, self.data, self.prefix = file, data, prefix

    def get(self, key: str, expected: str, ok: Callable[[object], bool], default=_MISSING):
        if key not in self.data:
            if default is not _MISSING:
                return default
            raise DataError(f"{self.file} lacks {self.prefix}{key}: {REPREPARE}")
        if not ok(self.data[key]):
            value = _show(self.data[key])
            raise DataError(f"{self.file}: {self.prefix}{key} is {value}, expected {expected}: {REPREPARE}")
        return self.data[key]

    def int(self, key: str, low: int = 0, below: int | None = None, default=_MISSING) -> int:
        expected = f"a whole number >= {low}" if below is None else f"a whole number from {low} to {below - 1}"
        ok = lambda v: type(v) is int and v >= low and (below is None or v < below)  # noqa: E731 (bool is not a count)
        return self.get(key, expected, ok, default)

    def str(self, key: str, choices=None, default=_MISSING) -> str:
        if choices:
            return self.get(key, f"one of {', '.join(map(repr, choices))}", lambda v: v in choices, default)
        return self.get(key, "a string", lambda v: isinstance(v, str), default)

    def name(self, key: str) -> str:
        """A file name inside the dataset directory (no path: meta.json never points outside it)."""
        return self.get(
            key,
            "a file name in the dataset directory",
            lambda v: isinstance(v, str) and v not in ("", ".", "..") and Path(v).name == v,
        )

    def obj(self, key: str) -> _Fields:
        value = self.get(key, "an object", lambda v: isinstance(v, dict))
        return _Fields(self.file, value, f"{self.prefix}{key}.")


def _check_header(m: _Fields) -> str:
    """The format version and the kind of dataset (old datasets: see the module docstring)."""
    key = OLD_VERSION_KEY if OLD_VERSION_KEY in m.data and VERSION_KEY not in m.data else VERSION_KEY
    m.get(key, f"{FORMAT_VERSION}, the version this gpt reads", lambda v: type(v) is int and v == FORMAT_VERSION)
    return m.str("kind", tuple(KINDS), default="tokens" if key == VERSION_KEY else _MISSING)


def _check_fields(m: _Fields, kind: str) -> None:
    dtype = m.str("dtype", DTYPES)
    vocab = m.int("vocab_size", low=1)
    if vocab - 1 > np.iinfo(dtype).max:
        raise DataError(f"{m.file}: vocab_size {vocab} does not fit dtype {dtype}: {REPREPARE}")
    tok = m.obj("tokenizer")
    if tok.str("kind", (*TOKENIZERS, "specials")) == "specials":  # a chat template's tokens on a base
        tok.get("specials", "a list of strings", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v))
        tok = tok.obj("base")
    tokenizer = tok.str("kind", TOKENIZERS)
    if tokenizer == "char":
        tok.str("chars")
    elif tokenizer == "bpe":
        check_pattern(tok.data.get("pattern", GPT2_PATTERN), m.file, DataError)
        if tok.str("ranks", default=None) is None:
            tok.name("ranks_file")
            tok.str("ranks_sha256")
    splits = m.obj("splits")
    if kind == "tokens":
        m.int("eot_token", below=vocab)
        for name in SPLITS:
            split = splits.obj(name)
            split.name("file")
            split.int("tokens")
            split.str("sha256")
            split.int("max_id", default=None)
            split.int("bytes", default=None)
        return
    if kind == "chat":
        m.int("eot_token", below=vocab)
        m.obj("chat_template")  # checked in full by gpt.data.chat.ChatTemplate.from_spec
        for name in SPLITS:
            split = splits.obj(name)
            for key in ("file", "mask", "index"):
                split.name(key)
            for key in ("tokens", "conversations", "targets", "max_id"):
                split.int(key)
            split.str("sha256")
        return
    if kind == "preferences":
        m.int("eot_token", below=vocab, default=None)
        m.get("chat_template", "an object or null", lambda v: v is None or isinstance(v, dict))
        for name in SPLITS:
            split = splits.obj(name)
            for key in ("file", "mask", "index"):
                split.name(key)
            split.int("pairs", low=1)
            for key in ("tokens", "max_id"):
                split.int(key)
            split.str("sha256")
        return
    for key in ("bos", "eos", "pad"):
        m.int(key, below=vocab)
    m.int("max_len", low=2)
    for name in SPLITS:
        split = splits.obj(name)
        split.int("pairs", low=1)
        for key in ("src_tokens", "tgt_tokens", "max_src_len", "max_tgt_len"):
            split.int(key)
        split.int("max_id", default=None)


# ---- token ids --------------------------------------------------------------------------------------


def memmap_ids(file: Path, dtype: str, tokens: int, hint: str) -> np.ndarray:
    """The ids in `file` as a read-only array backed by it (nothing is read), after checking the file
    against meta.json's count of `tokens`."""
    if not file.is_file():
        raise DataError(f"no {file.name} in {file.parent}: {hint}")
    dt = np.dtype(dtype).newbyteorder("<")
    size = file.stat().st_size
    if size % dt.itemsize:
        raise DataError(
            f"{file} is {size:,} bytes, not a whole number of {dtype} tokens (truncated or damaged): {REPREPARE}"
        )
    if size // dt.itemsize != tokens:
        raise DataError(f"{file} holds {size // dt.itemsize:,} tokens but meta.json says {tokens:,}: {REPREPARE}")
    if tokens == 0:  # np.memmap cannot map an empty file
        empty = np.empty(0, dtype=dt)
        empty.flags.writeable = False
        return empty
    return np.memmap(file, dtype=dt, mode="r")


def check_ids(ids: np.ndarray, vocab_size: int, split: str, file: Path, max_id: int | None) -> None:
    """Every id of a split is below `vocab_size`, or a DataError names the split and the id.

    `max_id` is the largest id, recorded in meta.json when the split was written. Without it (a
    dataset prepared before it was recorded) every id is read once, a fast sequential pass. With it,
    a bounded sample spread over the file (its first and last ids included) also catches damage done
    since; the loaders' `IdGuard` checks every batch as it is read, and `open_dataset(verify=True)`'s
    checksums catch damage that leaves the ids in the vocabulary.
    """
    if max_id is None:
        top = int(ids.max()) if len(ids) else -1
    else:
        top = max(max_id, _sampled_max(ids))
    if top >= vocab_size:
        raise DataError(
            f"the {split} split holds id {top}, outside the vocabulary of {vocab_size} ids ({file} is damaged, or "
            f"meta.json's dtype or vocab_size is wrong): {REPREPARE}"
        )


class IdGuard:
    """Checks every batch read from one split against the vocabulary, before it becomes a tensor.

    The check at open (`check_ids`) samples the file; damage done since prepare elsewhere would reach
    the model: as an IndexError from the embedding (an id past the padded vocabulary), or silently as
    training on rows no text maps to (an id between the tokenizer's vocabulary and the padding). So
    the loaders call `check` on each batch's ids as read: one vectorised max over the batch, a few
    microseconds against steps of milliseconds, less than reading the batch out of the memmap
    (bench/bench_id_guard.py measures both at the main job's and GPT-2's batch shapes). Only when an id
    is out of range are the batch's spans read again, to name the offset of the first bad id.
    """

    def __init__(self, ids: np.ndarray, vocab_size: int, dataset: Path, split: str, file: Path):
        self.ids, self.vocab_size, self.dataset, self.split, self.file = ids, vocab_size, dataset, split, file

    def check(self, batch: np.ndarray, spans: Callable[[], Iterator[tuple[int, int]]]) -> None:
        """`batch`: the ids just read (any shape; negative padding is fine). `spans`: gives the (start,
        end) token offsets in the split they were read from; asked only when an id is out of range."""
        if batch.size and int(batch.max()) >= self.vocab_size:
            raise self._error(spans())

    def _error(self, spans) -> DataError:
        first = None
        for start, end in spans:
            bad = np.flatnonzero(self.ids[start:end] >= self.vocab_size)
            if len(bad) and (first is None or start + int(bad[0]) < first):
                first = start + int(bad[0])
        assert first is not None, "a bad id in the batch must lie in one of its spans"
        return DataError(
            f"dataset {self.dataset}, {self.split} split: id {int(self.ids[first])} at token offset {first:,} of "
            f"{self.file.name} is outside the vocabulary of {self.vocab_size} ids (the file was damaged after it was "
            f"prepared, or meta.json's dtype or vocab_size is wrong): {REPREPARE}"
        )


def _sampled_max(ids: np.ndarray, samples: int = 64, sample_len: int = 4096) -> int:
    n = len(ids)
    if n == 0:
        return -1
    starts = np.linspace(0, max(n - sample_len, 0), num=min(samples, n), dtype=np.int64)
    return max(int(ids[s : s + sample_len].max()) for s in np.unique(starts).tolist())
