"""Tokenizers: one small interface, rebuilt from a JSON-serialisable spec.

    tok = get_tokenizer({"kind": "gpt2"})          # tiktoken's GPT-2 BPE (50257 ids)
    tok = CharTokenizer.from_text(corpus)          # a character vocabulary
    tok = get_tokenizer(tok.spec)                  # the same tokenizer again, e.g. from meta.json

    tok = SpecialsTokenizer(base, ["<|user|>", "<|end|>"])   # base's ids, then one id per special token

Every tokenizer has `encode(text) -> list[int]`, `decode(ids) -> str`, `decode_bytes(ids)`,
`vocab_size`, `eot_token` and `spec`. Datasets and checkpoints store the spec, so sampling always
uses the tokenizer that made the data.

Policies
- Decoding never raises: bytes cut in the middle of a UTF-8 character decode to U+FFFD; for
  streaming, `StreamDecoder` holds incomplete bytes back until the character is complete.
- `char`: text containing a character outside the vocabulary is an error (ValueError naming the
  characters), never a silent substitution.
- `specials` (a chat template's role markers and end-of-turn token, gpt/data/chat.py): the special
  tokens get the ids after the base's whole vocabulary, so every base id keeps its meaning and a base
  checkpoint only grows rows. `encode` never produces them: text that spells `<|end|>` is encoded as
  ordinary text (a user cannot forge a turn); only `special(name)` gives their ids.
- Any text encodes. tiktoken's pre-tokenizer (fancy-regex) panics on a run of more than
  `MAX_WHITESPACE_RUN` whitespace characters (its backtracking stack holds a million entries; a
  PanicException, not an Exception). Such a run is cut into pieces of at most that many, each encoded
  on its own (`safe_pieces`); a text without one is encoded whole, so its ids are exactly tiktoken's.
- `gpt2` offline: set GPT2_TIKTOKEN_FILE (or pass `ranks_file`) to a `.tiktoken` ranks file;
  otherwise tiktoken downloads and caches its files the normal way. A file that is not a ranks file
  is a TokenizerError naming it and where it came from (the variable, or the caller's flag).
- A `bpe` spec's pattern is one of `KNOWN_PATTERNS` (GPT-2's pre-tokenizer in the three spellings files
  carry), else a one-line TokenizerError (`check_pattern`). tiktoken runs the pattern on a backtracking
  engine: any other pattern a file could hold might make one encode take seconds (`((a+)+)\\1b|.` on
  20,000 characters) or panic (one that matches empty text, e.g. a lone lookbehind). Every reader of a
  file that holds a spec (checkpoint meta, dataset meta.json, a Hugging Face directory) calls
  `check_spec` with the file's name; `bpe_tokenizer` checks again, so no other way in reaches tiktoken.
"""

from __future__ import annotations

import base64
import codecs
import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from gpt.errors import UserError

EOT_TEXT = "<|endoftext|>"
# GPT-2's pre-tokenizer: contractions, letters, digits, other symbols, whitespace.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same splits as GPT-2's release (encoder.py) and Hugging Face's ByteLevel pre-tokenizer (use_regex) spell them,
GPT2_RELEASE_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# and as tiktoken 0.14 spells them for its gpt2 (possessive quantifiers: less backtracking, the same splits).
TIKTOKEN_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# The patterns a spec may name (module docs). GPT2_PATTERN is the one gpt writes: its own BPE trains with it and
# every spec and tokenizer.json it has written carries it (a spec without a pattern means it too).
KNOWN_PATTERNS = (GPT2_PATTERN, GPT2_RELEASE_PATTERN, TIKTOKEN_GPT2_PATTERN)
GPT2_RANKS_ENV = "GPT2_TIKTOKEN_FILE"
# The longest run of whitespace tiktoken 0.14 encodes (measured: 999,999 of ' ', '\n', '\u3000' or a mix
# panic with "StackOverflow", at the start, middle or end of a text); tests/test_tokenizer.py checks it.
MAX_WHITESPACE_RUN = 999_998
# Unicode's White_Space, what `\s` means to tiktoken's (Rust) regex; Python's `\s` adds U+001C..U+001F.
WHITESPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_WHITESPACE_CHAR = re.compile(f"[{WHITESPACE}]")
_WHITESPACE_RUN = re.compile(f"[{WHITESPACE}]+")


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be built here (e.g. GPT-2's BPE offline without its file)."""


class Tokenizer(Protocol):
    vocab_size: int
    eot_token: int

    @property
    def spec(self) -> dict: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode_bytes(self, ids: Iterable[int]) -> bytes: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def safe_pieces(text: str, limit: int = MAX_WHITESPACE_RUN) -> list[str]:
    """`text` cut so that no piece holds a run of more than `limit` whitespace characters: `[text]` when none
    does (nearly always: a few probes, one every `limit` characters, find no whitespace), else each such run
    cut every `limit` characters, the text before it staying with its first piece and the text after it
    with its last. A cut falls only inside such a run, where the pre-tokenizer makes one piece of whitespace."""
    if len(text) <= limit or not any(_WHITESPACE_CHAR.match(text, i) for i in range(limit, len(text), limit)):
        return [text]  # a run of limit + 1 characters would cover one of the probes
    pieces, start = [], 0
    for run in _WHITESPACE_RUN.finditer(text):  # each run matched once: linear (`{limit,}` would retry each start)
        for cut in range(run.start() + limit, run.end(), limit):
            pieces.append(text[start:cut])
            start = cut
    pieces.append(text[start:])
    return pieces


class TiktokenTokenizer:
    """Byte-level BPE run by tiktoken: GPT-2's, or one trained on a corpus (`bpe`)."""

    def __init__(self, encoding, spec: dict):
        self.enc = encoding
        self._spec = spec
        self.eot_token = encoding.eot_token
        self.vocab_size = encoding.n_vocab

    @property
    def spec(self) -> dict:
        return dict(self._spec)

    def encode(self, text: str) -> list[int]:
        pieces = safe_pieces(text)
        if len(pieces) == 1:
            return self.enc.encode_ordinary(text)
        return [i for piece in pieces for i in self.enc.encode_ordinary(piece)]

    def encode_to_numpy(self, text: str):
        """`encode` as a numpy array of uint32 (tiktoken's fastest path; special tokens' text is plain text)."""
        pieces = safe_pieces(text)
        arrays = [self.enc.encode_to_numpy(piece, disallowed_special=()) for piece in pieces]
        if len(arrays) == 1:
            return arrays[0]
        import numpy as np  # only for a text with a huge whitespace run; tokenizers do not need numpy otherwise

        return np.concatenate(arrays)

    def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        """Encode many texts on all cores (tiktoken releases the GIL). Each thread takes a run of texts:
        tiktoken's own batch call makes a task per text, which costs more than encoding a short one
        (a sentence, a chat message: several times slower on 120,000 chat messages, 2 cores)."""
        threads = min(num_threads or os.cpu_count() or 1, -(-len(texts) // 64))
        if threads <= 1:
            return [self.encode(t) for t in texts]
        size = -(-len(texts) // (4 * threads))  # 4 runs per thread, so uneven runs still balance
        runs = [texts[i : i + size] for i in range(0, len(texts), size)]
        with ThreadPoolExecutor(threads) as pool:
            return [ids for run in pool.map(lambda run: [self.encode(t) for t in run], runs) for ids in run]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.enc.decode_bytes([int(i) for i in ids])

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class CharTokenizer:
    """One id per character of a fixed vocabulary, plus an end-of-text id after them."""

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise TokenizerError("char vocabulary has repeated characters")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.eot_token = len(chars)
        self.vocab_size = len(chars) + 1

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def spec(self) -> dict:
        return {"kind": "char", "chars": self.chars}

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            unknown = sorted(set(text) - set(self.stoi))
            shown = ", ".join(repr(c) for c in unknown[:10])
            raise TokenizerError(
                f"{len(unknown)} character(s) not in the char vocabulary: {shown}{' ...' if len(unknown) > 10 else ''}"
            ) from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.decode(ids).encode("utf-8")

    def decode(self, ids: Iterable[int]) -> str:
        n = len(self.chars)
        return "".join(self.chars[i] if 0 <= i < n else (EOT_TEXT if i == n else "\ufffd") for i in map(int, ids))


class SpecialsTokenizer:
    """A base tokenizer plus special tokens with the ids after its vocabulary (`vocab_size`, ...)."""

    def __init__(self, base: Tokenizer, specials: list[str]):
        if not specials or len(set(specials)) != len(specials) or not all(isinstance(t, str) and t for t in specials):
            raise TokenizerError(f"special tokens must be distinct non-empty strings, got {specials!r}")
        if isinstance(base, SpecialsTokenizer):
            raise TokenizerError("special tokens are added to a base tokenizer once, not nested")
        self.base = base
        self.specials = list(specials)
        self.ids = {t: base.vocab_size + i for i, t in enumerate(self.specials)}
        self.eot_token = base.eot_token
        self.vocab_size = base.vocab_size + len(self.specials)

    @property
    def spec(self) -> dict:
        return {"kind": "specials", "base": self.base.spec, "specials": list(self.specials)}

    def special(self, name: str) -> int:
        """The id of special token `name` (KeyError if it is not one)."""
        return self.ids[name]

    def encode(self, text: str) -> list[int]:
        return self.base.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.base.encode_batch(texts)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        out, run, n = [], [], self.base.vocab_size
        for i in map(int, ids):
            if n <= i < self.vocab_size:
                out.append(self.base.decode_bytes(run))
                out.append(self.specials[i - n].encode("utf-8"))
                run = []
            else:
                run.append(i)
        out.append(self.base.decode_bytes(run))
        return b"".join(out)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns ids into text as they arrive, holding back the bytes of an incomplete character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Iterable[int]) -> str:
        return self._utf8.decode(self.tokenizer.decode_bytes(ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# ---- building tokenizers from specs ----------------------------------------------------------------


def load_ranks(path: str) -> dict[bytes, int]:
    """Read a `.tiktoken` ranks file (one `base64(token) rank` per line); ValueError if it is not one."""
    with open(path, "rb") as f:
        return parse_ranks(f)


def parse_ranks(lines: Iterable[bytes]) -> dict[bytes, int]:
    """Ranks from the lines of a `.tiktoken` file; ValueError naming the first line that is not
    `base64(token) rank`, or if the 256 single bytes a byte-level BPE starts from are not all there."""
    ranks = {}
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:  # also binascii.Error
                raise ValueError(f"line {number} is not `base64-token rank`") from None
    if not all(bytes([b]) in ranks for b in range(256)):
        raise ValueError("it lacks some of the 256 single bytes every byte-level BPE ranks first")
    return ranks


def dump_ranks(ranks: dict[bytes, int]) -> str:
    return "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))


def check_pattern(pattern, source, error: type[Exception] = TokenizerError) -> str:
    """`pattern` if it is one of KNOWN_PATTERNS, else `error`, one line naming `source` (the file it came from)."""
    if isinstance(pattern, str) and pattern in KNOWN_PATTERNS:
        return pattern
    shown = repr(pattern) if len(repr(pattern)) <= 60 else repr(pattern)[:57] + "..."
    raise error(
        f"{source}: pre-tokenizer pattern {shown} is not one gpt knows (it splits text only with GPT-2's "
        f"pattern, which its own BPE uses too)"
    )


def check_spec(spec, source, error: type[Exception] = TokenizerError) -> None:
    """A tokenizer spec read from `source` (a file): a bpe's pattern, a chat base's included, checked
    (`check_pattern`). Other problems with the spec are left to its reader and to `get_tokenizer`."""
    if not isinstance(spec, dict):
        return
    if spec.get("kind") == "specials":
        check_spec(spec.get("base"), source, error)
    elif spec.get("kind") == "bpe":
        check_pattern(spec.get("pattern", GPT2_PATTERN), source, error)


def _encoding(name: str, pattern: str, ranks: dict[bytes, int]):
    import tiktoken  # lazy: BPE only

    return tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={EOT_TEXT: len(ranks)})


def gpt2_tokenizer(ranks_file: str | None = None, file_flag: str | None = None) -> TiktokenTokenizer:
    """GPT-2's BPE from `ranks_file`, $GPT2_TIKTOKEN_FILE, or tiktoken's own download and cache.

    `file_flag` is the caller's command-line flag that gave `ranks_file` (data/prepare.py's
    `--tokenizer-file`), if it has one: errors name it, and the offline hint offers it. Scripts
    without such a flag leave it None, and the hint offers only the variable.
    """
    spec = {"kind": "gpt2"}
    path, given_by = ranks_file, file_flag or "ranks_file"
    if not path:
        path, given_by = os.environ.get(GPT2_RANKS_ENV), GPT2_RANKS_ENV
    if path:
        fix = f"point {given_by} at GPT-2's ranks file, gpt2.tiktoken"
        if not os.path.isfile(path):
            raise TokenizerError(f"GPT-2 ranks file not found: {path} (from {given_by}): {fix}")
        try:
            ranks = load_ranks(path)
        except OSError as e:
            raise TokenizerError(f"cannot read {path} (from {given_by}): {e.strerror or e}") from None
        except ValueError as e:
            raise TokenizerError(f"{path} (from {given_by}) is not a tiktoken ranks file: {e}; {fix}") from None
        return TiktokenTokenizer(_encoding("gpt2", GPT2_PATTERN, ranks), spec)
    import tiktoken  # lazy: BPE only

    try:
        return TiktokenTokenizer(tiktoken.get_encoding("gpt2"), spec)
    except Exception as e:  # no network and nothing cached
        raise TokenizerError(
            f"cannot load GPT-2's BPE: tiktoken could not download it ({type(e).__name__}). Either connect "
            f"to the internet once (tiktoken caches it), or set {GPT2_RANKS_ENV}=/path/to/gpt2.tiktoken "
            + (f"or pass {file_flag} /path/to/gpt2.tiktoken " if file_flag else "")
            + "(a local ranks file)"
        ) from None


def bpe_tokenizer(ranks: dict[bytes, int] | str, pattern: str = GPT2_PATTERN) -> TiktokenTokenizer:
    """A byte-level BPE trained on a corpus; `ranks` as a dict or in `.tiktoken` text form; `pattern` one of
    KNOWN_PATTERNS (TokenizerError otherwise: callers that read a spec from a file check it first, naming it)."""
    check_pattern(pattern, "the bpe tokenizer spec")
    if isinstance(ranks, str):
        text = ranks
        try:
            ranks = parse_ranks(text.encode("ascii", errors="replace").splitlines())
        except ValueError as e:
            raise TokenizerError(f"the bpe tokenizer's ranks are not in tiktoken's format: {e}") from None
    else:
        text = dump_ranks(ranks)
    return TiktokenTokenizer(_encoding("bpe", pattern, ranks), {"kind": "bpe", "pattern": pattern, "ranks": text})


def get_tokenizer(spec: dict | str, ranks_file: str | None = None) -> Tokenizer:
    """Build the tokenizer a spec describes ("gpt2" is short for {"kind": "gpt2"})."""
    if isinstance(spec, str):
        spec = {"kind": spec}
    kind = spec.get("kind")
    if kind == "gpt2":
        return gpt2_tokenizer(ranks_file)
    if kind == "char":
        return CharTokenizer(spec["chars"])
    if kind == "bpe":
        return bpe_tokenizer(spec["ranks"], spec.get("pattern", GPT2_PATTERN))
    if kind == "specials":
        return SpecialsTokenizer(get_tokenizer(spec["base"], ranks_file), spec["specials"])
    raise TokenizerError(f"unknown tokenizer kind {kind!r}; expected 'gpt2', 'char', 'bpe' or 'specials'")
