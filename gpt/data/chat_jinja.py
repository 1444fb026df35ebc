"""A ChatTemplate as a Jinja chat template: the one rendering both exports write (Hugging Face's
tokenizer_config.json `chat_template`, gpt/checkpoints/hf_tokenizer.py; GGUF's `tokenizer.chat_template`,
gpt/checkpoints/gguf.py).

    text = chat_template_jinja(ChatTemplate(), escape=specials, generation=True)   # what HF gets
    text = chat_template_jinja(ChatTemplate(), escape=specials)                    # what a char GGUF gets

The text renders exactly `ChatTemplate.render`'s conversation (and, with `add_generation_prompt`,
`ChatTemplate.prompt`): each message as its role's marker, its content, the end token; a system message
anywhere but first, or an unknown role, raises (`raise_exception`, which transformers and llama.cpp both
provide), as our template refuses them. Options, for what the two sides differ in:
- `generation`: the assistant's content and end inside `{% generation %}` (transformers' extension: TRL's
  assistant-only loss and `return_assistant_tokens_mask` then give our loss mask). llama.cpp's Jinja has
  no such tag.
- `escape`: special tokens that must stay text inside a message. Our `encode` never produces a special id,
  but the other side tokenizes the whole rendered text with special tokens parsed, so content spelling a
  marker would forge a turn. The template writes U+FDD0 (a Unicode noncharacter, reserved for internal
  use) after the first character of each such spelling; the other side's tokenizer must take it out again
  before the model sees it (Hugging Face: tokenizer.json's normalizer; llama.cpp: only for a char
  vocabulary, which drops bytes it has no token for; gguf.py says why a byte-level BPE cannot). Content
  that itself holds an escaped spelling ("<" U+FDD0 "|end|>") then reads as the unescaped text.
"""

from __future__ import annotations

from gpt.data.bytelevel import TokenizerExportError
from gpt.data.chat import ChatTemplate

ESCAPE = "\ufdd0"  # a noncharacter: inserted into special tokens spelled in chat content, taken out by the tokenizer


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


def chat_template_jinja(template: ChatTemplate, escape: list[str] | None = None, generation: bool = False) -> str:
    """A Jinja chat template rendering exactly `template.render` / `template.prompt` (module docs); content
    spelling any of `escape` is escaped, the assistant's part inside `{% generation %}` with `generation`."""
    content = "message['content']"
    if escape:
        check_escapable(escape)
        content += "".join(f" | replace({_jinja_str(t)}, {_jinja_str(escaped(t))})" for t in sorted(escape))
    markers = "{" + ", ".join(f"{_jinja_str(r)}: {_jinja_str(template.marker(r))}" for r in ("system", "user")) + "}"
    end, assistant = _jinja_str(template.end), _jinja_str(template.assistant)
    answer = "{{ content }}" + f"{{{{ {end} }}}}"
    if generation:
        answer = "{% generation %}" + answer + "{% endgeneration %}"
    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' and not loop.first -%}"
        "{{ raise_exception('only the first message may be a system message') }}"
        "{%- endif -%}"
        f"{{%- set content = {content} -%}}"
        "{%- if message['role'] == 'assistant' -%}"
        f"{{{{ {assistant} }}}}{answer}"
        f"{{%- elif message['role'] in {markers} -%}}"
        f"{{{{ {markers}[message['role']] }}}}{{{{ content }}}}{{{{ {end} }}}}"
        "{%- else -%}"
        "{{ raise_exception('unknown role ' + message['role'] + ': expected system, user or assistant') }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{{{{ {assistant} }}}}{{%- endif -%}}"
    )
