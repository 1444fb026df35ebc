"""Any of our tokenizers as the vocabulary other tools' tokenizers take: every id's token, byte-level BPE
merges, the pre-tokenizer regex and the special tokens. The one conversion behind both ways out: Hugging
Face's tokenizer.json (gpt/checkpoints/hf_tokenizer.py) and llama.cpp's GGUF (gpt/checkpoints/gguf.py).

    v = vocabulary(get_tokenizer(spec))   # gpt2, bpe, char, and either with chat specials
    v.tokens[i]        # id i's token: byte-level BPE spelled in GPT-2's byte-to-unicode alphabet ("Ġthe"),
                       # char the character itself, a special token as it is written
    v.merges           # ("Ġ", "t"), ... in priority order, the first merged first ([] for char)
    v.pattern          # the pre-tokenizer regex (None for char: each character is a token)
    v.specials         # {"<|endoftext|>": 50256, "<|system|>": ...}: the ids `encode` never produces
    b = byte_level(v)  # a char vocabulary as byte-level BPE too (GGUF has no word-level model)

How each kind becomes merges that tokenize exactly as we do
- `gpt2` / `bpe` (tiktoken): tiktoken's ids are its ranks, so token i is the bytes of rank i. Each
  multi-byte token's merge is recovered from the ranks (`bpe_merges`): tiktoken's BPE over the token's own
  bytes, allowing only lower ranks, ends in exactly two parts. One merge per token in rank order is GPT-2's
  own merges.txt, and the merge rule Hugging Face's and llama.cpp's BPE apply (the adjacent pair highest in
  the list first) then replays tiktoken's choices.
- `char`: one token per character. For byte-level BPE (`byte_level`) a character of several UTF-8 bytes is
  built from its bytes by merging its prefixes, left to right; merges never join two characters (a merge's
  left side always starts with a UTF-8 lead byte, its right side is a continuation byte), so every
  character in the vocabulary becomes its own token. A character outside the vocabulary has no token: we
  refuse the text, llama.cpp drops those bytes, Hugging Face's WordLevel model raises.
- specials: end-of-text right after the base's tokens, then a chat template's markers; the other side must
  treat them as special (control) tokens that plain text never produces. A special token that is also an
  ordinary token is refused (TokenizerExportError): the other side could not tell them apart.
"""

from __future__ import annotations

from typing import NamedTuple

from gpt.data.bpe import byte_level_alphabet
from gpt.data.tokenizer import EOT_TEXT, GPT2_PATTERN, CharTokenizer, SpecialsTokenizer, TiktokenTokenizer
from gpt.errors import UserError


class TokenizerExportError(UserError, ValueError):
    """A tokenizer or chat template the other side cannot reproduce; the message says why."""


class Vocabulary(NamedTuple):
    """A tokenizer's vocabulary as the Hugging Face and GGUF formats want it (module docs)."""

    model: str  # "bpe" (byte-level) or "char"
    tokens: list[str]  # every id's token, specials included
    merges: list[tuple[str, str]]  # byte-level BPE merges in priority order; [] for char
    pattern: str | None  # the pre-tokenizer's regex; None: any split gives the same ids (char)
    eot_token: int
    specials: dict[str, int]  # every special token (end of text, chat markers) -> its id


_BYTE_CHAR = {b: c for c, b in byte_level_alphabet().items()}  # GPT-2's printable spelling of each byte


def to_byte_level(raw: bytes) -> str:
    """`raw` spelled in GPT-2's byte-to-unicode alphabet (b" the" -> "Ġthe")."""
    return "".join(_BYTE_CHAR[b] for b in raw)


def bpe_merges(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The merge that made each multi-byte token, tokens given in rank order (rank = index): byte-level BPE
    on the token's bytes allowing only merges ranked below it, which ends in exactly two parts."""
    ranks = {t: r for r, t in enumerate(tokens)}
    merges = []
    for rank, token in enumerate(tokens):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while True:
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise TokenizerExportError(
                f"token {token!r} (rank {rank}) is not one merge of two lower-ranked tokens: not a BPE's ranks"
            )
        merges.append((parts[0], parts[1]))
    return merges


def char_merges(chars: str) -> list[tuple[str, str]]:
    """The byte-level merges that build each multi-byte character of `chars` from its UTF-8 bytes."""
    merges: dict[tuple[str, str], None] = {}  # (an ordered set: characters may share their first bytes)
    for c in chars:
        raw = c.encode("utf-8")
        for i in range(1, len(raw)):
            merges[(to_byte_level(raw[:i]), to_byte_level(raw[i : i + 1]))] = None
    return list(merges)


def special_tokens(tok) -> dict[str, int]:
    """Every special token of `tok` (end of text, then a chat template's markers) -> its id."""
    base, extra = (tok.base, tok.specials) if isinstance(tok, SpecialsTokenizer) else (tok, [])
    return {EOT_TEXT: base.eot_token, **{t: base.vocab_size + i for i, t in enumerate(extra)}}


def vocabulary(tok) -> Vocabulary:
    """The vocabulary of any of our tokenizers (gpt2, bpe, char, and either with chat specials), ids unchanged."""
    base = tok.base if isinstance(tok, SpecialsTokenizer) else tok
    if isinstance(base, TiktokenTokenizer):
        raw = [base.enc.decode_single_token_bytes(i) for i in range(base.eot_token)]
        assert len(raw) == base.vocab_size - 1, "tiktoken ids are dense, end-of-text last"
        merges = [(to_byte_level(a), to_byte_level(b)) for a, b in bpe_merges(raw)]
        tokens = [to_byte_level(t) for t in raw]
        model, pattern = "bpe", base.spec.get("pattern", GPT2_PATTERN)  # (GPT-2's spec has none: tiktoken's is this)
    elif isinstance(base, CharTokenizer):
        model, tokens, merges, pattern = "char", list(base.chars), [], None
    else:
        raise TokenizerExportError(f"cannot export a {base.spec.get('kind')!r} tokenizer: no byte-level BPE form")
    specials = special_tokens(tok)
    _check_distinct(tokens, specials)
    return Vocabulary(model, tokens + list(specials), merges, pattern, base.eot_token, specials)


def byte_level(v: Vocabulary) -> Vocabulary:
    """`v` as byte-level BPE: a char vocabulary's characters spelled as bytes, with the merges that build
    them (module docs); a BPE vocabulary as it is."""
    if v.model != "char":
        return v
    chars = v.tokens[: len(v.tokens) - len(v.specials)]
    tokens = [to_byte_level(c.encode("utf-8")) for c in chars]
    _check_distinct(tokens, v.specials, " once spelled as byte-level BPE (each byte a character: é is Ã©)")
    return Vocabulary("bpe", tokens + list(v.specials), char_merges("".join(chars)), None, v.eot_token, v.specials)


def _check_distinct(tokens: list[str], specials: dict[str, int], how: str = "") -> None:
    clash = [t for t in specials if t in set(tokens)]
    if clash:
        raise TokenizerExportError(f"the special token {clash[0]!r} is also an ordinary token of the vocabulary{how}")
