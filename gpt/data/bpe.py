"""Train a byte-level BPE on a corpus and hand it to tiktoken.

    from gpt.data.bpe import train_bpe
    tok = train_bpe(text_chunks, vocab_size=8192)   # a gpt.data.tokenizer.TiktokenTokenizer
    tok.spec                                        # {"kind": "bpe", "pattern": ..., "ranks": ...}

The training is done by Hugging Face `tokenizers` (Rust, multi-threaded; a hand-written trainer in
Python would be orders of magnitude slower on a real corpus). Encoding and decoding are done by
tiktoken, so a trained vocabulary runs at the same speed as GPT-2's.

Conversion to tiktoken's ranks
- HF's byte-level BPE spells bytes as printable characters (GPT-2's byte-to-unicode table); we undo
  that table to get each token's raw bytes.
- Ranks are the 256 single bytes first (rank = byte value), then each merge's concatenated bytes in
  merge order. tiktoken merges the adjacent pair whose concatenation has the lowest rank, which
  replays the merges in the order they were learned. A merge whose bytes are already a token (the
  same string reached by another pair) is skipped so the ranks stay dense: 0 .. len(ranks)-1.
- The end-of-text token is `len(ranks)`, so `vocab_size = len(ranks) + 1`.
- A long whitespace run is cut into runs of MAX_TRAINING_RUN characters for training only (HF's trainer
  is quadratic in a word's length). A long word that is not whitespace still costs that.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from gpt.data.tokenizer import GPT2_PATTERN, TiktokenTokenizer, bpe_tokenizer, safe_pieces

MIN_VOCAB_SIZE = 257  # the 256 single bytes and the end-of-text token
# HF's trainer takes time quadratic in a word's length (80,000 spaces: 5 s; a million: ~13 min): a whitespace
# run is cut into words of at most this many characters for training (what it learns of whitespace is the same).
MAX_TRAINING_RUN = 1024


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's table from the printable character HF uses for a byte back to the byte's value.

    Bytes that are printable Latin-1 characters stand for themselves; the other 68 bytes (controls,
    space, NBSP, soft hyphen) are given the characters U+0100, U+0101, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    for i, b in enumerate(shifted):
        table[chr(256 + i)] = b
    assert len(table) == 256
    return table


def merges_to_ranks(merges: Iterable[tuple[str, str]]) -> dict[bytes, int]:
    """tiktoken ranks from HF byte-level merges (pairs of byte-level strings, in merge order)."""
    alphabet = byte_level_alphabet()

    def raw(token: str) -> bytes:
        return bytes(alphabet[c] for c in token)

    ranks = {bytes([b]): b for b in range(256)}
    for left, right in merges:
        a, b = raw(left), raw(right)
        assert a in ranks and b in ranks, f"merge of unknown tokens {left!r} + {right!r}"
        ranks.setdefault(a + b, len(ranks))
    return ranks


def hf_merges(hf_tokenizer) -> list[tuple[str, str]]:
    merges = json.loads(hf_tokenizer.to_str())["model"]["merges"]
    # tokenizers >= 0.20 stores [left, right] pairs; older versions "left right" strings.
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


def train_bpe(texts: Iterable[str], vocab_size: int, pattern: str = GPT2_PATTERN) -> TiktokenTokenizer:
    """Learn a byte-level BPE of at most `vocab_size` ids (end-of-text included) from `texts`.

    `texts` may be any iterable of strings (e.g. a corpus streamed in chunks): HF keeps only the
    counts of distinct pre-tokenized words in memory. Chunks should be cut where `pattern` would cut
    anyway (gpt.data.corpus does so), otherwise a word split across two chunks is counted as two words.
    The result can be smaller than `vocab_size` when the corpus has fewer distinct pairs to merge.
    """
    return bpe_tokenizer(merges_to_ranks(hf_merges(train_hf_bpe(texts, vocab_size, pattern))), pattern)


def train_hf_bpe(texts: Iterable[str], vocab_size: int, pattern: str = GPT2_PATTERN):
    """The trained Hugging Face `tokenizers.Tokenizer` (byte-level BPE, `pattern` as pre-tokenizer)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least {MIN_VOCAB_SIZE}")
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers  # optional: BPE

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the end-of-text id comes on top, from tiktoken
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    hf.train_from_iterator(_nonempty(texts), trainer=trainer)
    return hf


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    return (piece for t in texts if t for piece in safe_pieces(t, MAX_TRAINING_RUN))
