"""Our tokenizers and chat templates as Hugging Face files: `tokenizer.json` (the `tokenizers` library's
format), `tokenizer_config.json` with a Jinja `chat_template`, `special_tokens_map.json`.

    v = vocabulary(tok)              # tokens in id order, merges, pre-tokenizer pattern, special ids (GGUF reuses it)
    data = tokenizer_json(tok)       # a dict: json.dump it as tokenizer.json
    text = chat_template_jinja(ChatTemplate())   # renders exactly ChatTemplate.render / prompt

Design notes
- Byte-level BPE (`gpt2`, an own `bpe`): tiktoken's ids are its ranks, so token i is the bytes of rank i,
  spelled with GPT-2's byte-to-unicode table (gpt.data.bpe.byte_level_alphabet, inverted). Each token's
  merge is recovered from the ranks (`bpe_merges`). The pre-tokenizer is the tokenizer's own regex
  (`Split`, isolated) then `ByteLevel` without its own regex: the pipeline `gpt.data.bpe.train_hf_bpe`
  trains with. `ignore_merges` stays off (tiktoken takes a pre-token that is a whole token as is, but the
  recovered merges reach every token from its own bytes anyway, and tokenizers 0.19 gives tokens found
  that way empty offsets, which breaks transformers' assistant mask).
- `char`: a `WordLevel` model over the characters, a pre-tokenizer that splits every character, a `Fuse`
  decoder (no spaces between tokens). Our encoder refuses a character outside the vocabulary; the
  `unk_token` names a token that is not in the vocabulary, so `tokenizers` raises too ("Missing [UNK]
  token") instead of substituting anything.
- End-of-text and a chat template's markers are added tokens (special, one id each).
- Text that spells a special token. Our `encode` never produces special ids. `tokenizer(text)` on the
  Hugging Face side matches them, as every HF tokenizer does by default; `split_special_tokens=True`
  gives ours. Inside `apply_chat_template` the exported template does better: it escapes any special
  token spelled in a message's content by inserting U+FDD0 (a Unicode noncharacter, reserved for
  internal use) after its first character, and the tokenizer's normalizer takes that character out
  again before the model sees the text. So a message cannot forge a turn and its text encodes as ours.
  The one exception: content that itself holds such an escaped spelling ("<" U+FDD0 "|end|>") encodes as
  the unescaped text.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from gpt.data.bpe import byte_level_alphabet
from gpt.data.chat import ChatTemplate
from gpt.data.tokenizer import EOT_TEXT, GPT2_PATTERN, CharTokenizer, SpecialsTokenizer, TiktokenTokenizer
from gpt.errors import UserError

ESCAPE = "\ufdd0"  # a noncharacter: inserted into special tokens spelled in chat content, removed by the normalizer
UNKNOWN_CHAR = "<unknown character: not in this char vocabulary>"  # a WordLevel unk_token absent from the vocabulary
CHAR_SPLIT = r"[\s\S]"  # every single character (Oniguruma: `.` skips newlines)


class TokenizerExportError(UserError, ValueError):
    """A tokenizer or chat template the Hugging Face side cannot reproduce; the message says why."""


class Vocabulary(NamedTuple):
    """A tokenizer's vocabulary as the Hugging Face and GGUF formats want it."""

    model: str  # "bpe" (byte-level) or "char"
    tokens: list[str]  # every id's token (byte-level BPE: in GPT-2's printable spelling), specials included
    merges: list[tuple[str, str]]  # byte-level BPE merges in priority order; [] for char
    pattern: str | None  # the pre-tokenizer's regex (BPE); None for char (each character is a token)
    eot_token: int
    specials: dict[str, int]  # every special token (end of text, chat markers) -> its id


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table spelling each byte as a printable character (the inverse of bpe.byte_level_alphabet)."""
    return {b: c for c, b in byte_level_alphabet().items()}


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
            raise ValueError(f"token {token!r} (rank {rank}) is not one merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def vocabulary(tok) -> Vocabulary:
    """The vocabulary of any of our tokenizers (gpt2, bpe, char, and either with chat specials)."""
    base, extra = (tok.base, tok.specials) if isinstance(tok, SpecialsTokenizer) else (tok, [])
    if isinstance(base, TiktokenTokenizer):
        raw = [base.enc.decode_single_token_bytes(i) for i in range(base.eot_token)]
        spell = bytes_to_unicode()

        def text(b: bytes) -> str:
            return "".join(spell[x] for x in b)

        merges = [(text(a), text(b)) for a, b in bpe_merges(raw)]
        model, tokens, pattern = "bpe", [text(t) for t in raw], base.spec.get("pattern", GPT2_PATTERN)
    elif isinstance(base, CharTokenizer):
        model, tokens, merges, pattern = "char", list(base.chars), [], None
    else:
        raise TokenizerExportError(f"cannot export a {base.spec.get('kind')!r} tokenizer to Hugging Face")
    specials = special_tokens(tok)
    clash = [t for t in specials if t in tokens]
    if clash:
        raise TokenizerExportError(f"the special token {clash[0]!r} is also an ordinary token of the vocabulary")
    return Vocabulary(model, tokens + list(specials), merges, pattern, base.eot_token, specials)


def special_tokens(tok) -> dict[str, int]:
    """Every special token of `tok` (end of text, then a chat template's markers) -> its id."""
    base, extra = (tok.base, tok.specials) if isinstance(tok, SpecialsTokenizer) else (tok, [])
    return {EOT_TEXT: base.eot_token, **{t: base.vocab_size + i for i, t in enumerate(extra)}}


def _added_token(content: str, i: int) -> dict:
    flags = dict(single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
    return {"id": i, "content": content, **flags}


def tokenizer_json(tok, chat_template: ChatTemplate | None = None) -> dict:
    """The `tokenizers` library's JSON for `tok` (json.dumps it as tokenizer.json). With a chat template,
    the normalizer undoes the template's escaping of special tokens in message content (module docs)."""
    v = vocabulary(tok)
    n_plain = len(v.tokens) - len(v.specials)
    if v.model == "bpe":
        pre = [
            {"type": "Split", "pattern": {"Regex": v.pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]
        pre_tokenizer = {"type": "Sequence", "pretokenizers": pre}
        decoder = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(v.tokens[:n_plain])},
            "merges": [f"{a} {b}" for a, b in v.merges],  # the string form every tokenizers version reads
        }
    else:
        pre_tokenizer = {"type": "Split", "pattern": {"Regex": CHAR_SPLIT}, "behavior": "Isolated", "invert": False}
        decoder = {"type": "Fuse"}
        model = {
            "type": "WordLevel",
            "vocab": {t: i for i, t in enumerate(v.tokens[:n_plain])},
            "unk_token": UNKNOWN_CHAR,
        }
    normalizer = None
    if chat_template is not None:
        check_escapable(list(v.specials))
        replace = [{"type": "Replace", "pattern": {"String": escaped(t)}, "content": t} for t in sorted(v.specials)]
        normalizer = {"type": "Sequence", "normalizers": replace}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_token(t, i) for t, i in v.specials.items()],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": decoder,
        "model": model,
    }


def escaped(token: str) -> str:
    """How the chat template writes special token `token` when a message's content spells it."""
    return token[0] + ESCAPE + token[1:]


def check_escapable(tokens: list[str]) -> None:
    """The escaping works when no special token holds the escape, each has two characters or more, none
    contains another and no token's end is another's (or its own) beginning: then no match can straddle
    an escape or the edge of a message. TokenizerExportError otherwise."""
    for t in tokens:
        if len(t) < 2 or ESCAPE in t:
            raise TokenizerExportError(
                f"cannot export the chat template: its special token {t!r} must have two characters or more "
                f"and no U+FDD0, so that content spelling it can be told apart; use markers like <|user|>"
            )
    for a in tokens:
        for b in tokens:
            overlap = any(a[-k:] == b[:k] for k in range(1, min(len(a), len(b))))
            if (a != b and a in b) or overlap:
                raise TokenizerExportError(
                    f"cannot export the chat template: its special tokens {a!r} and {b!r} overlap, so content "
                    f"next to a marker could spell one; use markers like <|user|> that do not"
                )


def _jinja_str(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def chat_template_jinja(template: ChatTemplate, specials: list[str]) -> str:
    """A Jinja chat template (transformers' dialect) rendering exactly `template.render` (and, with
    `add_generation_prompt`, `template.prompt`): each message as marker, content, end; the assistant's
    content and end inside `{% generation %}`, which is our loss mask. Content spelling any of `specials`
    is escaped (module docs)."""
    check_escapable(specials)
    content = "message['content']" + "".join(
        f" | replace({_jinja_str(t)}, {_jinja_str(escaped(t))})" for t in sorted(specials)
    )
    markers = "{" + ", ".join(f"{_jinja_str(r)}: {_jinja_str(template.marker(r))}" for r in ("system", "user")) + "}"
    end, assistant = _jinja_str(template.end), _jinja_str(template.assistant)
    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' and not loop.first -%}"
        "{{ raise_exception('only the first message may be a system message') }}"
        "{%- endif -%}"
        f"{{%- set content = {content} -%}}"
        "{%- if message['role'] == 'assistant' -%}"
        f"{{{{ {assistant} }}}}{{% generation %}}{{{{ content }}}}{{{{ {end} }}}}{{% endgeneration %}}"
        f"{{%- elif message['role'] in {markers} -%}}"
        f"{{{{ {markers}[message['role']] }}}}{{{{ content }}}}{{{{ {end} }}}}"
        "{%- else -%}"
        "{{ raise_exception('unknown role ' + message['role'] + ': expected system, user or assistant') }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{{{{ {assistant} }}}}{{%- endif -%}}"
    )


def tokenizer_config(tok, model_max_length: int, chat_template: ChatTemplate | None = None) -> dict:
    """tokenizer_config.json: the fast tokenizer class, the special tokens, the chat template."""
    eos = chat_template.end if chat_template is not None else EOT_TEXT
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": EOT_TEXT,
        "eos_token": eos,
        "pad_token": EOT_TEXT,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template_jinja(chat_template, list(special_tokens(tok)))
    return config


def special_tokens_map(chat_template: ChatTemplate | None = None) -> dict:
    eos = chat_template.end if chat_template is not None else EOT_TEXT
    out = {"bos_token": EOT_TEXT, "eos_token": eos, "pad_token": EOT_TEXT}
    if chat_template is not None:
        out["additional_special_tokens"] = [t for t in chat_template.specials if t != eos]
    return out


def dumps(data: dict) -> str:
    """The JSON text written for these files (stable: export -> import -> export gives the same bytes)."""
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


# ---- back: our tokenizer spec from a tokenizer.json ------------------------------------------------


def spec_from_tokenizer_json(data: dict, source) -> tuple[dict, dict | None]:
    """(our tokenizer spec, chat template spec or None) from a tokenizer.json of the shapes `tokenizer_json`
    writes, e.g. after transformers saved the tokenizer again without our own files: a byte-level BPE whose
    ids are its ranks, or a char WordLevel; end-of-text right after the vocabulary, then the chat markers
    (four of them: system, user, assistant, end). TokenizerExportError for any other tokenizer."""

    def refuse(why: str):
        return TokenizerExportError(f"{source}: cannot read this tokenizer back ({why}); only the shapes gpt exports")

    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(vocab, dict) or sorted(vocab.values()) != list(range(len(vocab))):
        raise refuse("no vocabulary with ids 0 .. n-1")
    n = len(vocab)
    tokens = sorted(vocab, key=vocab.get)
    added = sorted((t["id"], t["content"]) for t in data.get("added_tokens", []) if isinstance(t, dict))
    if not added or added[0] != (n, EOT_TEXT) or [i for i, _ in added] != list(range(n, n + len(added))):
        raise refuse(f"end-of-text {EOT_TEXT} is not id {n}, right after the vocabulary, with the specials after it")
    if model.get("type") == "WordLevel" and all(len(t) == 1 for t in tokens):
        base = {"kind": "char", "chars": "".join(tokens)}
    elif model.get("type") == "BPE":
        base = _bpe_spec(tokens, data.get("pre_tokenizer"), refuse)
    else:
        raise refuse(f"a {model.get('type')} model")
    specials = [t for _, t in added[1:]]
    if not specials:
        return base, None
    spec = {"kind": "specials", "base": base, "specials": specials}
    return spec, dict(zip(("system", "user", "assistant", "end"), specials)) if len(specials) == 4 else None


def _bpe_spec(tokens: list[str], pre_tokenizer, refuse) -> dict:
    from gpt.data.tokenizer import TokenizerError, dump_ranks, get_tokenizer  # (gpt2's ranks: only to compare)

    alphabet = byte_level_alphabet()
    if not all(c in alphabet for t in tokens for c in t):
        raise refuse("not a byte-level BPE")
    raw = [bytes(alphabet[c] for c in t) for t in tokens]
    if not {bytes([b]) for b in range(256)} <= set(raw):
        raise refuse("it lacks some of the 256 single bytes")
    pieces = pre_tokenizer.get("pretokenizers", []) if isinstance(pre_tokenizer, dict) else []
    split = [p for p in pieces if p.get("type") == "Split" and "Regex" in p.get("pattern", {})]
    pattern = split[0]["pattern"]["Regex"] if split else None
    if isinstance(pre_tokenizer, dict) and pre_tokenizer.get("type") == "ByteLevel" and pre_tokenizer.get("use_regex"):
        pattern = GPT2_PATTERN  # GPT-2's own tokenizer.json: ByteLevel with its built-in regex, which is GPT-2's
    if pattern is None:
        raise refuse("its pre-tokenizer is not a Split on a regex, then ByteLevel")
    if pattern == GPT2_PATTERN and len(raw) == 50256:
        try:
            gpt2 = get_tokenizer("gpt2")
            if all(gpt2.enc.decode_single_token_bytes(i) == t for i, t in enumerate(raw)):
                return {"kind": "gpt2"}
        except TokenizerError:  # GPT-2's ranks not at hand: the same BPE, as an own one
            pass
    return {"kind": "bpe", "pattern": pattern, "ranks": dump_ranks({t: i for i, t in enumerate(raw)})}
