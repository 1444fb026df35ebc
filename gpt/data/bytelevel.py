"""Any of our tokenizers as byte-level BPE tokens and merges: the form other tools' tokenizers take
(llama.cpp's GGUF `gpt2` tokenizer; Hugging Face's tokenizer.json is the same model).

    vocab = byte_level_vocab(get_tokenizer(spec))
    vocab.tokens[i]        # id i's text, its bytes spelled in GPT-2's byte-to-unicode alphabet
    vocab.merges           # ("Ġ", "t"), ... in priority order
    vocab.specials         # {id: text} of the ids `encode` never produces (end-of-text, chat markers)

How each kind becomes merges that tokenize exactly as we do
- `gpt2` / `bpe` (tiktoken): tiktoken merges the adjacent pair whose concatenation has the lowest rank,
  whichever pair of tokens spells it. So every split of a token into two tokens is a merge, and the
  merges are ordered by the rank of what they make (then by the ranks of the two halves): a merge list
  replays tiktoken's choices step for step.
- `char`: one token per character. A character of several UTF-8 bytes is built from its bytes by merging
  its prefixes, left to right; merges never join two characters (a merge's left side always starts with a
  UTF-8 lead byte, its right side is a continuation byte), so every character in the vocabulary becomes
  its own token. A character outside the vocabulary has no token: we refuse the text, the other side drops
  those bytes (llama.cpp) or maps them to its unknown token.
- `specials`: the base's tokens, then the special tokens as they are written (the other side must treat
  them as special/control tokens that plain text never produces).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpt.data.bpe import byte_level_alphabet
from gpt.data.tokenizer import EOT_TEXT, GPT2_PATTERN, CharTokenizer, SpecialsTokenizer, TiktokenTokenizer


@dataclass
class ByteLevelVocab:
    tokens: list[str]  # id -> text in the byte-level alphabet (specials: their own text)
    merges: list[tuple[str, str]]  # in priority order, the first merged first
    specials: dict[int, str] = field(default_factory=dict)  # id -> text of the ids plain text never produces
    pattern: str | None = GPT2_PATTERN  # the pre-tokenizer regex; None: any split gives the same ids (char)


def to_byte_level(raw: bytes) -> str:
    """`raw` spelled in GPT-2's byte-to-unicode alphabet (b" the" -> "Ġthe")."""
    return "".join(_BYTE_CHAR[b] for b in raw)


_BYTE_CHAR = {b: c for c, b in byte_level_alphabet().items()}


def ranks_merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """The merges that replay tiktoken's BPE over `ranks` (see the module's notes), byte-level spelled."""
    ordered = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = ranks.get(token[:i]), ranks.get(token[i:])
            if left is not None and right is not None:
                ordered.append((rank, left, right, i, token))
    ordered.sort()
    return [(to_byte_level(t[:i]), to_byte_level(t[i:])) for _, _, _, i, t in ordered]


def char_merges(chars: str) -> list[tuple[str, str]]:
    """The merges that build each multi-byte character of `chars` from its UTF-8 bytes."""
    merges: dict[tuple[str, str], None] = {}  # (an ordered set: characters may share their first bytes)
    for c in chars:
        raw = c.encode("utf-8")
        for i in range(1, len(raw)):
            merges[(to_byte_level(raw[:i]), to_byte_level(raw[i : i + 1]))] = None
    return list(merges)


def byte_level_vocab(tok) -> ByteLevelVocab:
    """`tok` (any of gpt.data.tokenizer's kinds) as byte-level BPE tokens and merges, ids unchanged."""
    if isinstance(tok, SpecialsTokenizer):
        base = byte_level_vocab(tok.base)
        specials = {**base.specials, **{tok.special(t): t for t in tok.specials}}
        return ByteLevelVocab(base.tokens + list(tok.specials), base.merges, specials, base.pattern)
    if isinstance(tok, CharTokenizer):
        tokens = [to_byte_level(c.encode("utf-8")) for c in tok.chars]
        return ByteLevelVocab([*tokens, EOT_TEXT], char_merges(tok.chars), {tok.eot_token: EOT_TEXT}, None)
    if isinstance(tok, TiktokenTokenizer):
        ranks = {tok.enc.decode_single_token_bytes(i): i for i in range(tok.eot_token)}
        assert len(ranks) == tok.eot_token == tok.vocab_size - 1, "tiktoken ids are dense, end-of-text last"
        tokens = [to_byte_level(t) for t in sorted(ranks, key=ranks.get)]
        pattern = tok.spec.get("pattern", GPT2_PATTERN)  # (GPT-2's spec has none: tiktoken's gpt2 uses this one)
        return ByteLevelVocab([*tokens, EOT_TEXT], ranks_merges(ranks), {tok.eot_token: EOT_TEXT}, pattern)
    raise TypeError(f"no byte-level form for {type(tok).__name__}")
