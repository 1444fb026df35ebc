"""Reusable vocabularies: encode a new corpus with the tokenizer of an existing run or dataset, so any
checkpoint can be fine-tuned on new text.

    gpt prepare new.txt --out data/new --tokenizer-from out/shakespeare-char      # a run's vocabulary
    gpt prepare new.txt --out data/new --tokenizer-from data/shakespeare_char --unknown replace

Where the tokenizer comes from (`dataset_spec` here, `gpt.checkpoints.loader.tokenizer_source` for the rest): a prepared dataset (its meta.json, a bpe's ranks read
in from tokenizer.tiktoken), a run directory or checkpoint file (its meta; reading a .pt file imports
torch, the dataset path does not), or a Hugging Face GPT-2 directory (gpt_tokenizer.json, else
GPT-2's BPE). The new dataset's meta.json then holds the very same spec, which is what
`train.py --init-from` checks.

Characters the vocabulary lacks: only a `char` vocabulary can lack any (gpt2 and bpe are byte-level
and encode every text). They are counted, per character, in a pass before anything is encoded;
- `--unknown refuse` (the default) stops with one line: how many, which (the most frequent first,
  with counts) and the two ways on;
- `--unknown replace` writes each as `--replacement` (default `?`, else a space, whichever the
  vocabulary has), and the summary line and meta.json's `corpus.unknown_chars` say how many were
  replaced and which.
Nothing is ever dropped or replaced silently.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from gpt.data.format import DataError, dataset_kind, inline_ranks, is_dataset, read_meta

UNKNOWN_POLICIES = ("refuse", "replace")
REPLACEMENT_CANDIDATES = ("?", " ")


class Reused(NamedTuple):
    """A vocabulary to reuse: the tokenizer spec and where it came from (for messages and meta.json)."""

    spec: dict
    source: str


def dataset_spec(path: str | os.PathLike) -> Reused | None:
    """The self-contained tokenizer spec of a prepared dataset (None when `path` is not one). Runs,
    checkpoints and Hugging Face directories are read by `gpt.checkpoints.loader.tokenizer_source`."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"--tokenizer-from {path}: no such run, checkpoint or dataset")
    if not (path.is_dir() and is_dataset(path)):
        return None
    return Reused(inline_ranks(path, read_meta(path, dataset_kind(path))["tokenizer"]), str(path))


def unknown_chars(counts: Counter, chars: str) -> Counter:
    """The characters of `counts` (a corpus's character counts) that the vocabulary `chars` lacks."""
    vocab = set(chars)
    return Counter({c: n for c, n in counts.items() if c not in vocab})


def describe(unknown: Counter, limit: int = 8) -> str:
    """`1,234 characters (3 distinct): 'é' x1,000, '—' x200, '\\u00a0' x34`."""
    shown = ", ".join(f"{c!r} x{n:,}" for c, n in unknown.most_common(limit))
    more = f", and {len(unknown) - limit} more" if len(unknown) > limit else ""
    return f"{sum(unknown.values()):,} characters ({len(unknown)} distinct): {shown}{more}"


def replacement_char(chars: str, requested: str | None) -> str:
    """The character unknown ones become: `requested`, else the first candidate the vocabulary has."""
    if requested is not None:
        if len(requested) != 1 or requested not in chars:
            raise DataError(f"--replacement {requested!r}: must be one character of the vocabulary")
        return requested
    for c in REPLACEMENT_CANDIDATES:
        if c in chars:
            return c
    raise DataError(
        "--unknown replace: the vocabulary has neither '?' nor a space; pass --replacement CHAR, one of its characters"
    )


def unknown_policy(unknown: Counter, chars: str, policy: str, replacement: str | None, source) -> str | None:
    """What to do with `unknown` characters: None (none, or nothing to replace), the replacement
    character, or a DataError (`refuse`)."""
    if policy not in UNKNOWN_POLICIES:
        raise DataError(f"--unknown {policy!r}: choose one of {', '.join(UNKNOWN_POLICIES)}")
    if not unknown:
        return None
    if policy == "refuse":
        raise DataError(
            f"the corpus has {describe(unknown)} that the vocabulary of {source} lacks; pass --unknown "
            f"replace to write them as {replacement_char(chars, replacement)!r}, or prepare with "
            f"--tokenizer char for a new vocabulary (and a new model)"
        )
    return replacement_char(chars, replacement)
