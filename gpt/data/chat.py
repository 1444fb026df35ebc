"""Chat conversations: the shapes they come in, and the template that turns one into tokens and a loss mask.

    template = ChatTemplate()                                   # <|system|> <|user|> <|assistant|> ... <|end|>
    tok = template.tokenizer(base_tokenizer)                    # the base's ids, then the four special tokens
    messages = conversation({"instruction": "Translate", "input": "Hallo", "output": "Hello"})
    ids, mask = template.render(messages, tok)                  # mask[i] == 1: token i is a target of the loss
    prompt = template.prompt(messages[:-1], tok)                # ... ending in <|assistant|>: the model answers

A conversation is a list of `{"role": "system" | "user" | "assistant", "content": str}`. Rows of a chat
file come in four shapes, recognised by their keys (or named with `fmt`):

| fmt          | row                                                   | becomes                              |
|--------------|-------------------------------------------------------|--------------------------------------|
| `messages`   | `{"messages": [{"role": ..., "content": ...}, ...]}` (OpenAI; `tools`, `tool_calls` and `tool` messages as gpt/data/tools.py writes them) | the messages |
| `prompt`     | `{"prompt": P, "completion": C}`                      | user P, assistant C                  |
| `alpaca`     | `{"instruction": I, "input": X, "output": O}` (input optional) | user `I\\n\\nX` (or I), assistant O |
| `sharegpt`   | `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}` | human: user, gpt: assistant |

The template renders each message as `<role marker> content <|end|>`, one after the other. The loss mask
is 1 exactly on the tokens an assistant message contributes after its marker: its words and its `<|end|>`
(so the model learns to stop); the markers, the system prompt and the user's words are context only. To
generate, `prompt` renders the conversation so far and the assistant's marker; the answer ends at
`<|end|>` (`template.end`).

Policies
- The special tokens are ids after the base vocabulary (gpt.data.tokenizer.SpecialsTokenizer); user text
  that spells a marker is encoded as plain text, so no message can forge a turn.
- A row that is not a conversation is one ChatError naming what is wrong (the caller adds file and row).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpt.data.tokenizer import SpecialsTokenizer, Tokenizer, TokenizerError
from gpt.data.tools import ToolError, check_tools, with_tools
from gpt.errors import UserError

ROLES = ("system", "user", "assistant")
FORMATS = ("messages", "prompt", "alpaca", "sharegpt")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}


class ChatError(UserError, ValueError):
    """A row or a request that is not a conversation the template can render."""


@dataclass(frozen=True)
class ChatTemplate:
    """Role markers and the end-of-turn token; `spec` is what meta.json and checkpoints store."""

    system: str = "<|system|>"
    user: str = "<|user|>"
    assistant: str = "<|assistant|>"
    end: str = "<|end|>"

    @property
    def specials(self) -> list[str]:
        return [self.system, self.user, self.assistant, self.end]

    @property
    def spec(self) -> dict:
        return {"system": self.system, "user": self.user, "assistant": self.assistant, "end": self.end}

    @classmethod
    def from_spec(cls, spec: dict, source: str = "the chat template") -> ChatTemplate:
        if not isinstance(spec, dict) or set(spec) != set(ROLES) | {"end"}:
            raise ChatError(f"{source}: {spec!r} is not a chat template (keys system, user, assistant, end)")
        if not all(isinstance(v, str) and v for v in spec.values()) or len(set(spec.values())) != 4:
            raise ChatError(f"{source}: its markers must be four distinct non-empty strings, got {spec!r}")
        return cls(**spec)

    def tokenizer(self, base: Tokenizer) -> SpecialsTokenizer:
        """`base` with this template's special tokens added (a tokenizer that has them already is returned
        as it is; one with other special tokens is an error)."""
        if isinstance(base, SpecialsTokenizer):
            if base.specials != self.specials:
                raise TokenizerError(f"the tokenizer's special tokens {base.specials} are not this template's")
            return base
        return SpecialsTokenizer(base, self.specials)

    def marker(self, role: str) -> str:
        return self.spec[role]

    def render(self, messages: list[dict], tok: SpecialsTokenizer) -> tuple[list[int], list[int]]:
        """The conversation's ids and its loss mask (1 on each assistant message's words and end token)."""
        check_conversation(messages)
        return self.assemble(messages, [tok.encode(m["content"]) for m in messages], tok)

    def assemble(self, messages: list[dict], contents: list[list[int]], tok: SpecialsTokenizer):
        """`render` with each message's content already encoded (a dataset encodes all of them in one batch)."""
        ids, mask = [], []
        for m, body in zip(messages, contents):
            ids.append(tok.special(self.marker(m["role"])))
            mask.append(0)
            ids.extend(body)
            ids.append(tok.special(self.end))
            mask.extend([int(m["role"] == "assistant")] * (len(body) + 1))
        return ids, mask

    def prompt(
        self, messages: list[dict], tok: SpecialsTokenizer, contents: list[list[int]] | None = None
    ) -> list[int]:
        """The ids of the conversation so far followed by the assistant's marker: what the model continues
        (`contents`: each message's content already encoded, as `assemble` takes them)."""
        check_conversation(messages, for_prompt=True)
        if contents is None:
            contents = [tok.encode(m["content"]) for m in messages]
        return self.assemble(messages, contents, tok)[0] + [tok.special(self.assistant)]


def check_conversation(messages, for_prompt: bool = False) -> None:
    """A list of role/content messages: the roles known, the contents strings; a conversation to train on
    has an assistant message, a prompt ends in a user message (after an optional system one)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("a conversation is a non-empty list of messages")
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatError(f"message {n} is not an object with a role and a content")
        if m["role"] not in ROLES:
            raise ChatError(f"message {n} has role {m['role']!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ChatError(f"message {n}'s content is {type(m['content']).__name__}, not a string")
        if m["role"] == "system" and n != 0:
            raise ChatError(f"message {n} is a system message; only the first message may be one")
    if for_prompt:
        if messages[-1]["role"] != "user":
            raise ChatError(f"the last message is the {messages[-1]['role']}'s; a prompt ends with the user's")
    elif not any(m["role"] == "assistant" for m in messages):
        raise ChatError("the conversation has no assistant message to learn from")


def openai_messages(messages: list) -> list:
    """OpenAI-shaped messages as a conversation: role and content kept (other keys, such as `name`, dropped),
    `developer`, OpenAI's newer name for the system role, read as `system`. Anything else is left for
    check_conversation to name."""
    return [
        {"role": "system" if m.get("role") == "developer" else m.get("role"), "content": m.get("content")}
        if isinstance(m, dict)
        else m
        for m in messages
    ]


def row_format(row: dict) -> str:
    """Which of FORMATS a row is, by its keys; ChatError if none."""
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt"
    if "instruction" in row and "output" in row:
        return "alpaca"
    if "conversations" in row:
        return "sharegpt"
    raise ChatError(
        f"a row with keys {', '.join(sorted(map(str, row))) or '(none)'} is none of the chat formats: "
        '"messages" (OpenAI), "prompt" + "completion", "instruction" (+ "input") + "output" (Alpaca), or '
        '"conversations" (ShareGPT)'
    )


def conversation(row, fmt: str | None = None) -> list[dict]:
    """The messages of one row of a chat file, in the shape `fmt` names (default: recognised by its keys)."""
    if not isinstance(row, dict):
        raise ChatError(f"a row is a JSON {type(row).__name__}, not an object")
    fmt = fmt or row_format(row)
    if fmt not in FORMATS:
        raise ChatError(f"unknown chat format {fmt!r}; expected one of {', '.join(FORMATS)}")

    def field(key, optional=False):
        if key not in row or (optional and row[key] is None):  # (Parquet and some JSONL write an absent one as null)
            if optional:
                return ""
            raise ChatError(f"the row lacks {key!r} (format {fmt})")
        if not isinstance(row[key], str):
            raise ChatError(f"field {key!r} is {type(row[key]).__name__}, not a string")
        return row[key]

    if fmt == "messages":
        messages = row.get("messages")
        if not isinstance(messages, list):
            raise ChatError("field 'messages' is not a list of messages")
        try:
            messages = openai_messages(with_tools(messages, check_tools(row["tools"]) if row.get("tools") else None))
        except ToolError as e:
            raise ChatError(str(e)) from None
    elif fmt == "sharegpt":
        turns = row.get("conversations")
        if not isinstance(turns, list):
            raise ChatError("field 'conversations' is not a list of turns")
        messages = []
        for n, t in enumerate(turns):
            if isinstance(t, dict) and t.get("from") not in SHAREGPT_ROLES:
                raise ChatError(f"turn {n} is from {t.get('from')!r}; expected one of system, human, gpt")
            messages.append(
                {"role": SHAREGPT_ROLES[t["from"]], "content": t.get("value")} if isinstance(t, dict) else t
            )
    elif fmt == "prompt":
        messages = [{"role": "user", "content": field("prompt")}, {"role": "assistant", "content": field("completion")}]
    else:
        instruction, extra = field("instruction"), field("input", optional=True)
        user = f"{instruction}\n\n{extra}" if extra else instruction
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": field("output")}]
    check_conversation(messages)
    return messages
