"""Turn chat files into a chat dataset: the conversations rendered by a chat template, with a loss mask.

    gpt prepare --chat train.jsonl --val-chat val.jsonl --out data/chat --tokenizer-from out/base

    from gpt.data.sft import prepare_chat
    print(prepare_chat(["train.jsonl"], "data/chat", tokenizer_from=reused).line())

Each row of a `.jsonl` / `.jsonl.gz` / `.parquet` file (or of a `.json` file holding one list of rows) is one
conversation in one of the shapes gpt/data/chat.py recognises. The dataset (format in gpt/data/format.py)
stores per split the ids of every conversation one after the other (`{split}.bin`), one mask byte per
token (`{split}.mask.bin`, 1 on the assistant's tokens) and where each conversation starts (`{split}.idx`,
int64, one more entry than conversations). Training packs them into windows (gpt/data/packing.py).

Policies
- The tokenizer is the base model's (`tokenizer_from`), or GPT-2's, plus the template's special tokens:
  ids after the base vocabulary, so the base model's ids keep their meaning.
- A bad row (not JSON, not a conversation, longer than `max_row_bytes`, a character a char vocabulary
  lacks) is one error naming file and row, or skipped and counted with `skip_bad_rows`.
- A conversation longer than a window (`block_size + 1` tokens) is cut to the window (`long="truncate"`)
  or left out (`long="skip"`); both are counted. One whose cut leaves no assistant token is left out.
- Without `val_inputs`, `val_fraction` of the conversations (at least one) is held out, chosen by `seed`.
- The dataset's files may take at most `max_output_bytes` (default: staging.OutputBudget's rule, a multiple of
  the chat files' bytes on disk): a Parquet or gzip chat file of a million copies of one conversation stops
  at it with one error. (The conversations are read into memory first: RAM bounds them, not this.)
- Written to a hidden directory and moved into place at the end, as every dataset (staging.staged).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpt.data import vocab
from gpt.data.chat import ChatError, ChatTemplate, conversation
from gpt.data.corpus import BadRowError, CorpusError
from gpt.data.format import SPLITS, DataError, dtype_for_vocab, new_meta, store_ranks, write_meta
from gpt.data.prepare import reused_spec, reused_tokenizer
from gpt.data.records import DEFAULT_MAX_ROW_BYTES, BadJSONError, jsonl_rows, parquet_rows, parse_json_line
from gpt.data.staging import OutputBudget, staged
from gpt.data.tokenizer import CharTokenizer, TokenizerError, gpt2_tokenizer
from gpt.fsutil import open_new
from gpt.progress import Progress

LONG_POLICIES = ("truncate", "skip")
DEFAULT_VAL_FRACTION = 0.05
ENCODE_BATCH = 4096  # messages encoded per call (tiktoken spreads a batch over its threads)


@dataclass
class ChatSummary:
    path: Path
    conversations: dict  # split -> kept
    tokens: dict  # split -> count
    targets: dict  # split -> tokens under the mask
    truncated: int
    skipped_long: int
    bad_rows: int
    seconds: float
    meta: dict = field(repr=False)

    def line(self) -> str:
        n = sum(self.conversations.values())
        text = (
            f"prepared {self.path}: {n:,} conversations (train {self.conversations['train']:,}, val "
            f"{self.conversations['val']:,}), {sum(self.tokens.values()):,} tokens of which "
            f"{sum(self.targets.values()):,} are the assistant's (the loss's targets), vocab "
            f"{self.meta['vocab_size']:,} as {self.meta['dtype']}, in {self.seconds:.1f} s"
        )
        notes = []
        if self.truncated:
            notes.append(f"{self.truncated:,} longer than the block truncated")
        if self.skipped_long:
            notes.append(f"{self.skipped_long:,} longer than the block skipped")
        if self.bad_rows:
            notes.append(f"{self.bad_rows:,} bad rows skipped")
        return text + ("; " + ", ".join(notes) if notes else "")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def read_conversations(
    paths: list[str | os.PathLike],
    fmt: str | None = None,
    skip_bad_rows: bool = False,
    on_skip=None,
    progress: Callable[[int], None] | None = None,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    check: Callable[[list[dict]], None] | None = None,
) -> Iterator[list[dict]]:
    """The conversations of the chat files in order; a bad row (one longer than `max_row_bytes`, or one that
    `check(messages)` refuses with a ChatError, included) raises BadRowError (file and row), or is passed to
    `on_skip(error)` and left out with `skip_bad_rows`. `progress(n)` is told the bytes read."""
    for path in paths:
        for row, value, problem in file_rows(Path(path), progress, max_row_bytes):
            try:
                if problem is not None:
                    raise ChatError(problem)
                messages = conversation(value, fmt)
                if check:
                    check(messages)
                yield messages
            except ChatError as e:
                error = BadRowError(path, row, str(e))
                if not skip_bad_rows:
                    raise error from None
                if on_skip:
                    on_skip(error)


def file_rows(
    path: Path, progress=None, max_row_bytes=DEFAULT_MAX_ROW_BYTES
) -> Iterator[tuple[int, object, str | None]]:
    """(row, value, problem) of each row of a `.jsonl` / `.jsonl.gz`, `.parquet` or `.json` (a list) file (chat and
    preference files); a missing or unreadable file is a CorpusError."""
    if not path.is_file():
        raise CorpusError(f"chat file not found: {path}" if not path.exists() else f"{path} is not a file")
    if path.suffix == ".parquet":
        yield from parquet_rows(path, progress, max_row_bytes=max_row_bytes)
        return
    if path.suffix != ".json":
        yield from jsonl_rows(path, progress, max_row_bytes)
        return
    try:
        data = path.read_bytes()
        if progress:
            progress(len(data))
        rows = parse_json_line(data)
    except OSError as e:
        raise CorpusError(f"cannot read {path}: {e.strerror or e}") from None
    except BadJSONError as e:
        raise CorpusError(f"{path} is {e}; a JSON Lines file ends in .jsonl") from None
    if not isinstance(rows, list):
        raise CorpusError(f"{path} holds a JSON {type(rows).__name__}; a .json chat file holds a list of rows")
    for row, value in enumerate(rows, 1):
        yield row, value, None


def hold_out(n: int, fraction: float, seed: int) -> np.ndarray:
    """A boolean mask of the conversations held out for val: `fraction` of `n` (at least one), by `seed`."""
    if not 0 < fraction < 1:
        raise DataError(f"--val-fraction must be between 0 and 1, got {fraction}")
    if n < 2:
        raise DataError(f"{n} conversation{'s' if n != 1 else ''}: too few to hold one out for val; give --val-chat")
    held = np.zeros(n, dtype=bool)
    held[np.random.default_rng(seed).permutation(n)[: max(1, round(n * fraction))]] = True
    return held


class MaskedSplit:
    """The .bin, .mask.bin and .idx of one split, filled one sequence (a conversation) at a time."""

    def __init__(self, tmp: Path, name: str, dtype: str, budget: OutputBudget):
        self.name, self.dtype, self.budget = name, np.dtype(dtype).newbyteorder("<"), budget
        self.ids = open_new(tmp / f"{name}.bin")  # (in the fresh directory staging.staged made)
        self.mask = open_new(tmp / f"{name}.mask.bin")
        self.starts = [0]
        self.targets = 0
        self.max_id = 0
        self.sha256 = hashlib.sha256()

    def add(self, ids: list[int], mask: list[int]) -> None:
        data = np.asarray(ids, dtype=self.dtype).tobytes()
        self.budget.spend(len(data) + len(mask) + 8)  # its ids, mask bytes and entry in the index
        self.sha256.update(data)
        self.ids.write(data)
        self.mask.write(np.asarray(mask, dtype=np.uint8).tobytes())
        self.starts.append(self.starts[-1] + len(ids))
        self.targets += sum(mask)
        self.max_id = max(self.max_id, max(ids))

    def close(self, tmp: Path) -> dict:
        self.ids.close()
        self.mask.close()
        with open_new(tmp / f"{self.name}.idx") as f:
            np.asarray(self.starts, dtype="<i8").tofile(f)
        return {
            "file": f"{self.name}.bin",
            "mask": f"{self.name}.mask.bin",
            "index": f"{self.name}.idx",
            "tokens": self.starts[-1],
            "conversations": len(self.starts) - 1,
            "targets": self.targets,
            "sha256": self.sha256.hexdigest(),
            "max_id": self.max_id,
        }


def prepare_chat(
    inputs: list[str | os.PathLike],
    out: str | os.PathLike,
    *,
    val_inputs: list[str | os.PathLike] | None = None,
    tokenizer_from: vocab.Reused | str | os.PathLike | None = None,
    tokenizer: str | None = None,
    tokenizer_file: str | None = None,
    template: ChatTemplate | None = None,
    fmt: str | None = None,
    block_size: int = 1024,
    long: str = "truncate",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = 0,
    skip_bad_rows: bool = False,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    max_output_bytes: int | None = None,
    force: bool = False,
    progress: bool | None = None,
    log: Callable[[str], None] = _stderr,
) -> ChatSummary:
    """Render the conversations of `inputs` (and `val_inputs`, else a held-out share) into the chat dataset
    `out`, with progress bars on a terminal (`progress` None) or not (False). Raises DataError for a user
    mistake (one line), StorageError for a disk that fails."""
    t0 = time.perf_counter()
    if long not in LONG_POLICIES:
        raise DataError(f"--long must be one of {', '.join(LONG_POLICIES)}, got {long!r}")
    if block_size < 2:
        raise DataError(f"--block-size must be >= 2, got {block_size}")
    if tokenizer not in (None, "gpt2"):
        raise DataError(
            f"--tokenizer {tokenizer}: a chat dataset is encoded with the base model's tokenizer: give "
            f"--tokenizer-from BASE_RUN_OR_DATASET (or --tokenizer gpt2 for GPT-2's)"
        )
    template = template or ChatTemplate()
    tok = template.tokenizer(base_tokenizer(tokenizer_from, tokenizer, tokenizer_file))
    check = _encodable(tok)
    with staged(out, force, log) as tmp:
        bad, bad_val = [], []
        files = [Path(p) for p in [*inputs, *(val_inputs or [])]]
        input_bytes = sum(p.stat().st_size for p in files if p.is_file())  # (a missing file: read_conversations says)
        try:
            with Progress("read", input_bytes, enabled=progress) as bar:
                read = (fmt, skip_bad_rows)
                train = list(read_conversations(inputs, *read, bad.append, bar.update, max_row_bytes, check))
                val = (
                    list(read_conversations(val_inputs, *read, bad_val.append, bar.update, max_row_bytes, check))
                    if val_inputs
                    else None
                )
        except CorpusError as e:
            raise DataError(str(e)) from None
        for name, conversations, its_bad in (("--chat", train, bad), ("--val-chat", val, bad_val)):
            if conversations is not None and not conversations:
                files = ", ".join(map(str, inputs if name == "--chat" else val_inputs))
                raise DataError(
                    f"{name} {files}: no conversation"
                    + (f" (all {len(its_bad)} rows were bad)" if its_bad else " (empty)")
                )
        bad += bad_val
        for error in bad[:3]:
            log(f"skipped {error}")
        if len(bad) > 3:
            log(f"skipped {len(bad) - 3:,} more bad rows")
        if val is None:
            held = hold_out(len(train), val_fraction, seed)
            train, val = [c for c, h in zip(train, held) if not h], [c for c, h in zip(train, held) if h]
        budget = OutputBudget(out, input_bytes, max_output_bytes)
        with Progress("render", len(train) + len(val), unit="conversations", scale=1, enabled=progress) as bar:
            splits, counts = _write_splits(tmp, (train, val), template, tok, block_size, long, bar, budget)
        meta = new_meta(
            "chat",
            tok.vocab_size,
            store_ranks(tmp, tok.spec),
            eot_token=tok.eot_token,
            chat_template=template.spec,
            block_size=block_size,
            splits=splits,
            corpus={
                "inputs": [str(i) for i in inputs],
                "val_inputs": [str(i) for i in val_inputs or []],
                "format": fmt or "auto",
                "tokenizer_from": None
                if tokenizer_from is None
                else str(getattr(tokenizer_from, "source", tokenizer_from)),
                "long": long,
                "bad_rows_skipped": len(bad),
                **counts,
            },
        )
        write_meta(tmp, meta)
    return ChatSummary(
        Path(out),
        {s: splits[s]["conversations"] for s in SPLITS},
        {s: splits[s]["tokens"] for s in SPLITS},
        {s: splits[s]["targets"] for s in SPLITS},
        counts["truncated"],
        counts["skipped_long"],
        len(bad),
        time.perf_counter() - t0,
        meta,
    )


def _write_splits(tmp: Path, conversations, template, tok, block_size: int, long: str, bar: Progress, budget):
    """Render (train, val) into `tmp`: (the splits' meta, counts of conversations truncated / skipped)."""
    counts = {"truncated": 0, "skipped_long": 0}
    splits = {}
    for name, split_conversations in zip(SPLITS, conversations):
        split = MaskedSplit(tmp, name, dtype_for_vocab(tok.vocab_size), budget)
        try:
            for ids, mask in render_all(split_conversations, template, tok):
                bar.update()
                if len(ids) > block_size + 1:
                    if long == "skip" or not any(mask[: block_size + 1]):
                        counts["skipped_long"] += 1
                        continue
                    ids, mask = ids[: block_size + 1], mask[: block_size + 1]
                    counts["truncated"] += 1
                split.add(ids, mask)
        finally:
            splits[name] = split.close(tmp)
        if not splits[name]["conversations"]:
            raise DataError(f"no {name} conversation left to write (all were skipped): see --long, --block-size")
    return splits, counts


def _encodable(tok) -> Callable[[list[dict]], None] | None:
    """For a char vocabulary, a check that a conversation's messages hold only its characters (a ChatError
    naming the first it lacks, which read_conversations turns into a bad row naming file and row); None
    for a byte-level BPE, which encodes any text."""
    base = getattr(tok, "base", tok)
    if not isinstance(base, CharTokenizer):
        return None
    chars = frozenset(base.chars)

    def check(messages: list[dict]) -> None:
        for n, m in enumerate(messages):
            missing = set(m["content"]) - chars
            if missing:
                shown = ", ".join(repr(c) for c in sorted(missing)[:5]) + (" ..." if len(missing) > 5 else "")
                raise ChatError(f"message {n} holds {shown}, not in the char vocabulary")

    return check


def base_tokenizer(tokenizer_from, tokenizer, tokenizer_file):
    """The tokenizer of --tokenizer-from, else GPT-2's (chat and preference datasets)."""
    spec = reused_spec(tokenizer_from, tokenizer, None, tokenizer_file)
    if spec is not None:
        return reused_tokenizer(spec, tokenizer_file)
    try:
        return gpt2_tokenizer(tokenizer_file, file_flag="--tokenizer-file")
    except TokenizerError as e:
        raise DataError(str(e)) from None


def render_all(conversations: list[list[dict]], template: ChatTemplate, tok) -> Iterator[tuple[list[int], list[int]]]:
    """(ids, mask) of each conversation, the messages' contents encoded in batches."""
    for start in range(0, len(conversations), ENCODE_BATCH):
        chunk = conversations[start : start + ENCODE_BATCH]
        contents = tok.encode_batch([m["content"] for c in chunk for m in c])
        at = 0
        for c in chunk:
            yield template.assemble(c, contents[at : at + len(c)], tok)
            at += len(c)
