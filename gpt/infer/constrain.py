"""Constrained decoding: a grammar (a JSON schema, any JSON object, a regular expression, a Lark or GBNF
grammar) turned into a mask of the tokens allowed at each step, by llguidance's matcher.

    grammar = Grammar.json_schema(schema)            # or json_object(), regex(text), lark(text), gbnf(text)
    grammar.check(tokenizer)                         # GrammarError: what the engine cannot do with it, up front
    rows = Matchers(grammar, tokenizer, ends, n)     # one matcher per sample
    allowed = rows.allowed(vocab, samples)           # (len(samples), vocab) bool: what each may sample next
    rows.advance(ids, samples)                       # their sampled ids consumed

The end of a sample is a token too: once the text is complete the mask allows `ends` (end-of-text, a chat's end
of turn) and, where the grammar allows nothing more, only them, so a sample that ends by itself always parses.
A sample cut by max_new_tokens is cut (finish_reason "length"), as OpenAI's is.

Why llguidance (Microsoft's, the engine OpenAI's structured outputs, llama.cpp and vLLM use): it computes a
mask from the tokenizer's byte strings without a per-vocabulary precompile, takes JSON schemas, regular
expressions and Lark grammars (GBNF through its converter), and a byte-level tokenizer of any kind works
through `TokenizerWrapper` (bench/bench_grammar.py measures its per-token mask cost against xgrammar's on
GPT-2's BPE and on a char vocabulary).

Footguns
- The bridge tokenizer is built from `decode_bytes` of every id (a 50k vocabulary: about a second), kept per
  tokenizer object (`bridge`): build the grammar's matchers with the same tokenizer object every time.
- A sample's matcher must consume exactly the tokens the sample draws, in order: callers name the samples
  they ask about (`rows`), as a batch's rows come and go.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from gpt.data.tokenizer import SpecialsTokenizer, Tokenizer
from gpt.errors import UserError

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
COMPACT = {"whitespace_flexible": False}
NO_TOKEN = "the model's vocabulary has no token for what the grammar needs next"


class GrammarError(UserError, ValueError):
    """A grammar the engine cannot compile, or cannot follow with this tokenizer (the message says why)."""


@dataclass(frozen=True)
class Grammar:
    """What samples must match: `kind` (one of KINDS) and its text (a schema as JSON, a pattern, a grammar)."""

    kind: str
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Grammar:
        return cls("json_object", json.dumps({"type": "object"}))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        return cls("lark", grammar)

    @classmethod
    def gbnf(cls, grammar: str) -> Grammar:
        return cls("gbnf", grammar)

    def compiled(self) -> str:
        """The grammar in llguidance's own form (GrammarError when it cannot be converted)."""
        llguidance = _llguidance()
        try:
            if self.kind in ("json_schema", "json_object"):
                # compact JSON (no free whitespace between tokens): a sample of bounded values ends in bounded
                # length, where free whitespace lets a weak model ramble in it until max_new_tokens
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=COMPACT)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            if self.kind == "gbnf":
                from llguidance.gbnf_to_lark import gbnf_to_lark  # (a converter module of its own)

                return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(self.source))
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        except Exception as e:  # its parsers raise ValueError / RuntimeError / their own kinds with the reason
            raise GrammarError(f"{self.kind}: {_first_line(e)}") from None

    def check(self, tokenizer: Tokenizer) -> None:
        """GrammarError unless llguidance compiles this grammar for `tokenizer` without a word of warning (an
        unsupported schema feature, a bad pattern, a grammar that does not parse): a warning is a part of the
        grammar it would not enforce, and an answer must match all of it."""
        llguidance = _llguidance()
        _, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.compiled(), bridge(tokenizer))
        if messages:
            raise GrammarError(f"{self.kind}: {_first_line(messages[0])}")


def _llguidance():
    """The llguidance module (the serve extra's), or a GrammarError that says how to install it."""
    try:
        import llguidance  # the serve extra's: only constrained decoding needs it
    except ImportError:
        raise GrammarError("constrained decoding needs llguidance: pip install 'gpt[serve]' (or llguidance)") from None
    return llguidance


def _first_line(e) -> str:
    """llguidance's message on one line: its first, and the reason a first line ending in ":" announces (the
    "error: ..." line under a drawing of where the text went wrong)."""
    lines = (str(e).strip() or type(e).__name__).splitlines()
    reason = [line.strip()[6:].strip() for line in lines[1:] if line.strip().startswith("error:")]
    return f"{lines[0]} {reason[0]}" if lines[0].endswith(":") and reason else lines[0]


_BRIDGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bridge(tokenizer: Tokenizer):
    """llguidance's view of `tokenizer` (an `LLTokenizer`): every id's bytes, end-of-text and the special tokens
    (a chat's), which a grammar never produces. Built once per tokenizer object."""
    if tokenizer in _BRIDGES:
        return _BRIDGES[tokenizer]
    llguidance = _llguidance()

    specials = {tokenizer.eot_token}
    if isinstance(tokenizer, SpecialsTokenizer):
        specials.update(range(tokenizer.base.vocab_size, tokenizer.vocab_size))

    class View:  # what llguidance.TokenizerWrapper reads
        eos_token_id = tokenizer.eot_token
        bos_token_id = None
        tokens = [b"" if i in specials else tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size)]
        special_token_ids = sorted(specials)

        def __call__(self, text) -> list[int]:
            if not isinstance(text, str):
                raise TypeError("text, not bytes")  # (llguidance asks once, then sends text)
            try:
                return tokenizer.encode(text)
            except UserError:  # a character the vocabulary lacks: the rest, which the mask then shows unspellable
                return [i for c in text for i in _encodable(tokenizer, c)]

    made = llguidance.LLTokenizer(llguidance.TokenizerWrapper(View()))
    _BRIDGES[tokenizer] = made
    return made


def _encodable(tokenizer: Tokenizer, text: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except UserError:
        return []


class Matchers:
    """One llguidance matcher per sampled row, all on one grammar, ending at any of `ends`."""

    def __init__(self, grammar: Grammar, tokenizer: Tokenizer, ends, n: int):
        llguidance = _llguidance()
        if not ends:
            raise GrammarError("a grammar needs a token that ends the sample (end-of-text is switched off)")
        compiled = grammar.compiled()
        tok = bridge(tokenizer)
        self.ends = sorted(ends)
        self.rows = [llguidance.LLMatcher(tok, compiled, log_level=0) for _ in range(n)]
        self.words = (tokenizer.vocab_size + 31) // 32

    def allowed(self, vocab: int, rows: list[int], device=None) -> torch.Tensor:
        """(len(rows), vocab) bool: the tokens each of `rows` (indices of this object's rows: the samples) may
        sample next; `ends` where its text may end."""
        matchers = [self.rows[i] for i in rows]
        bits = np.empty((len(matchers), self.words), dtype=np.int32)
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bits[i].ctypes.data, self.words * 4)
        errors = [m.get_error() for m in matchers if m.is_error()]
        if errors and "NoExtensionBias" in errors[0]:  # llguidance's word for an empty mask
            raise GrammarError(NO_TOKEN)
        if errors:
            raise GrammarError(f"the grammar cannot go on: {_first_line(errors[0])}")
        # bit j of word w is id 32 w + j (little-endian words); numpy's unpackbits: tens of microseconds for
        # 50k ids, where torch's shifts took milliseconds on a busy machine
        allowed = torch.from_numpy(np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little").astype(bool))
        allowed = allowed[:, :vocab]
        allowed[:, self.ends] = torch.tensor([m.is_accepting() for m in matchers])[:, None]
        if not allowed.any(-1).all():
            raise GrammarError(NO_TOKEN)
        return allowed.to(device) if device is not None else allowed

    def advance(self, ids: list[int], rows: list[int]) -> None:
        """Row rows[k]'s sampled id ids[k] consumed (an end token ends the row: nothing is consumed)."""
        for i, token in zip(rows, ids):
            if token not in self.ends:
                self.rows[i].consume_token(token)
