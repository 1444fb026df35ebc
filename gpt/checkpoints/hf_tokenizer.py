"""Our tokenizers and chat templates as Hugging Face files: `tokenizer.json` (the `tokenizers` library's
format), `tokenizer_config.json` with a Jinja `chat_template`, `special_tokens_map.json`.

    data = tokenizer_json(tok, template)             # a dict: json.dump it as tokenizer.json
    config = tokenizer_config(tok, 1024, template)   # its chat_template renders exactly ChatTemplate.render / prompt

The vocabulary (tokens in id order, merges, pre-tokenizer regex, specials) comes from
gpt/data/bytelevel.py and the Jinja template from gpt/data/chat_jinja.py, the homes the GGUF writer uses too.

Design notes
- Byte-level BPE (`gpt2`, an own `bpe`): one merge per token, recovered from tiktoken's ranks (bytelevel).
  The pre-tokenizer is the tokenizer's own regex (`Split`, isolated) then `ByteLevel` without its own
  regex: the pipeline `gpt.data.bpe.train_hf_bpe` trains with. `ignore_merges` stays off (tiktoken takes a
  pre-token that is a whole token as is, but the recovered merges reach every token from its own bytes
  anyway, and tokenizers 0.19 gives tokens found that way empty offsets, which breaks transformers'
  assistant mask).
- `char`: a `WordLevel` model over the characters, a pre-tokenizer that splits every character, a `Fuse`
  decoder (no spaces between tokens). Our encoder refuses a character outside the vocabulary; the
  `unk_token` names a token that is not in the vocabulary, so `tokenizers` raises too ("Missing [UNK]
  token") instead of substituting anything.
- End-of-text and a chat template's markers are added tokens (special, one id each).
- Text that spells a special token. Our `encode` never produces special ids. `tokenizer(text)` on the
  Hugging Face side matches them, as every HF tokenizer does by default; `split_special_tokens=True`
  gives ours. Inside `apply_chat_template` the exported template does better: it escapes any special
  token spelled in a message's content (U+FDD0 after its first character, gpt/data/chat_jinja.py), and
  the tokenizer's normalizer takes that character out again before the model sees the text. So a message
  cannot forge a turn and its text encodes as ours. The one exception: content that itself holds such an
  escaped spelling ("<" U+FDD0 "|end|>") encodes as the unescaped text.
"""

from __future__ import annotations

import json

from gpt.data.bpe import byte_level_alphabet
from gpt.data.bytelevel import (
    TokenizerExportError,
    special_tokens,
    vocabulary,
)
from gpt.data.chat import ChatTemplate
from gpt.data.chat_jinja import chat_template_jinja, check_escapable, escaped
from gpt.data.tokenizer import EOT_TEXT, GPT2_PATTERN, check_pattern

UNKNOWN_CHAR = "<unknown character: not in this char vocabulary>"  # a WordLevel unk_token absent from the vocabulary
CHAR_SPLIT = r"[\s\S]"  # every single character (Oniguruma: `.` skips newlines)


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
        config["chat_template"] = chat_template_jinja(chat_template, list(special_tokens(tok)), generation=True)
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
    ids are its ranks and whose regex is GPT-2's (gpt.data.tokenizer.KNOWN_PATTERNS), or a char WordLevel;
    end-of-text right after the vocabulary, then the chat markers (four of them: system, user, assistant,
    end). TokenizerExportError for any other tokenizer, one line naming `source`."""

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
        base = _bpe_spec(tokens, data.get("pre_tokenizer"), refuse, source)
    else:
        raise refuse(f"a {model.get('type')} model")
    specials = [t for _, t in added[1:]]
    if not specials:
        return base, None
    spec = {"kind": "specials", "base": base, "specials": specials}
    return spec, dict(zip(("system", "user", "assistant", "end"), specials)) if len(specials) == 4 else None


def _bpe_spec(tokens: list[str], pre_tokenizer, refuse, source) -> dict:
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
    check_pattern(pattern, source, TokenizerExportError)  # tiktoken will run it: only GPT-2's
    if pattern == GPT2_PATTERN and len(raw) == 50256:
        try:
            gpt2 = get_tokenizer("gpt2")
            if all(gpt2.enc.decode_single_token_bytes(i) == t for i, t in enumerate(raw)):
                return {"kind": "gpt2"}
        except TokenizerError:  # GPT-2's ranks not at hand: the same BPE, as an own one
            pass
    return {"kind": "bpe", "pattern": pattern, "ranks": dump_ranks({t: i for i, t in enumerate(raw)})}
