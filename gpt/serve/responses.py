"""The bodies the server answers with, in OpenAI's shapes (api.py says which fields and what they mean):
a completion or chat completion, its stream chunks, logprobs in the legacy and the chat shape, usage, and
the /v1/models cards.

    completion = Completion(model="shakespeare-char", fingerprint=fp)      # or ChatCompletion
    completion.body(texts, finishes, prompt_tokens, completion_tokens)      # an answer
    completion.chunk(index, text, finish)                                   # a stream's event

Footguns
- One `Completion` per response: its id and created time are every chunk's of that stream.
- A chat answer's tool calls are parsed out of its text here (`gpt.data.tools.parse_calls`).
"""

from __future__ import annotations

import time
import uuid

from gpt.data.tools import compact, parse_calls

FINISH = {"eot": "stop", "stop": "stop", "length": "length"}  # Piece.finish -> OpenAI's finish_reason


class Completion:
    """One response's identity; builds the response body and the stream chunks."""

    def __init__(self, model: str, fingerprint: str):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint

    def _head(self) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def body(
        self,
        texts: list[str],
        finishes: list[str],
        prompt_tokens: int,
        completion_tokens: int,
        logprobs: list[dict | None] | None = None,
    ) -> dict:
        choices = [choice(i, text, finish) for i, (text, finish) in enumerate(zip(texts, finishes))]
        for c, lp in zip(choices, logprobs or []):
            c["logprobs"] = lp
        return {**self._head(), "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, index: int, text: str, finish: str | None) -> dict:
        return {**self._head(), "choices": [choice(index, text, finish)]}

    def logprobs(self, entries: list, token_text, token_bytes) -> dict:
        """A choice's `logprobs` in this route's shape (`logprobs_object`)."""
        return logprobs_object(entries, token_text)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head(), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


class ChatCompletion(Completion):
    """A chat completion's identity, body and chunks (the first chunk of each choice carries the role)."""

    def __init__(self, model: str, fingerprint: str, top_logprobs: int | None = None, tools: bool = False):
        super().__init__(model, fingerprint)
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.started: set[int] = set()
        self.top = top_logprobs  # the request's top_logprobs (None: no logprobs asked)
        self.tools = tools  # an answer may be tool calls (gpt/data/tools.py's text, turned into tool_calls)
        self.mode: dict[int, str] = {}  # streaming with tools: each choice's "text" or "calls", once told
        self.held: dict[int, str] = {}  # ... a choice of calls: its text so far
        self.sent: dict[int, int] = {}  # ... and how many of its calls were sent

    def _head(self, chunk: bool = False) -> dict:
        return {**super()._head(), "object": "chat.completion.chunk" if chunk else "chat.completion"}

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A choice's message and finish_reason: its calls as `tool_calls` ("tool_calls") when it is calls."""
        calls = parse_calls(text) if self.tools else None
        if calls is None:
            return {"role": "assistant", "content": text}, FINISH[finish] if finish else None
        tool_calls = [self._call(call) for call in calls]
        return {"role": "assistant", "content": None, "tool_calls": tool_calls}, "tool_calls" if finish else None

    @staticmethod
    def _call(call: dict, index: int | None = None) -> dict:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
        out["function"] = {"name": call["name"], "arguments": compact(call["arguments"])}
        return out if index is None else {"index": index, **out}

    def body(
        self,
        texts: list[str],
        finishes: list[str],
        prompt_tokens: int,
        completion_tokens: int,
        logprobs: list[dict | None] | None = None,
    ) -> dict:
        choices = []
        for i, (text, finish) in enumerate(zip(texts, finishes)):
            message, reason = self.message(text, finish)
            choices.append(
                {"index": i, "message": message, "logprobs": logprobs[i] if logprobs else None, "finish_reason": reason}
            )
        return {**self._head(), "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    def logprobs(self, entries: list, token_text, token_bytes) -> dict:
        """A chat choice's `logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
        "refusal": None}`, the `top_logprobs` most likely tokens at each position, most likely first (the
        sampled token's own entry is the item itself, not added to the list as completions add it)."""

        def item(i: int, value: float) -> dict:
            return {"token": token_text(i), "logprob": value, "bytes": list(token_bytes(i))}

        content = [
            {**item(e.id, e.logprob), "top_logprobs": [item(i, v) for i, v in list(e.top.items())[: self.top]]}
            for e in entries
        ]
        return {"content": content, "refusal": None}

    def chunk(self, index: int, text: str, finish: str | None) -> dict | None:
        """The stream chunk of a choice's new text; None when there is nothing to send yet. An answer of calls
        (its first character `<`: text never starts so, see gpt/data/tools.py) is held back and sent as
        `tool_calls` deltas, each call whole as soon as it closes."""
        delta: dict = {"content": text}
        finish_reason = FINISH[finish] if finish else None
        if self.tools and self.mode.get(index) != "text":
            if index not in self.mode and text:
                self.mode[index] = "calls" if text.startswith("<") else "text"
            if self.mode.get(index) != "text":  # calls, or nothing to tell by yet
                held = self.held[index] = self.held.get(index, "") + text
                calls, sent = parse_calls(held) or [], self.sent.get(index, 0)
                self.sent[index] = len(calls)
                delta = {"tool_calls": [self._call(c, sent + k) for k, c in enumerate(calls[sent:])]}
                if not calls[sent:]:
                    delta = {}
                    if not finish:
                        return None
                if finish and self.mode.get(index) == "calls":
                    finish_reason = "tool_calls"
        if index not in self.started:
            self.started.add(index)
            delta = {"role": "assistant", **delta}
        return {
            **self._head(chunk=True),
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head(chunk=True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def choice(index: int, text: str, finish: str | None) -> dict:
    return {"text": text, "index": index, "logprobs": None, "finish_reason": FINISH[finish] if finish else None}


def logprobs_object(entries: list, token_text) -> dict:
    """A choice's `logprobs`: `entries` are `gpt.infer.logprobs.TokenLogprob`s in text order, `token_text`
    turns one id into its text."""
    tokens = [token_text(e.id) for e in entries]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.top is None else top_table(e.top, token_text) for e in entries],
        "text_offset": offsets,
    }


def top_table(top: dict[int, float], token_text) -> dict[str, float]:
    """{token text: logprob}; ids whose texts coincide (bytes of one character) keep the largest."""
    table: dict[str, float] = {}
    for i, value in top.items():
        text = token_text(i)
        table[text] = max(value, table.get(text, value))
    return table


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(name: str, created: int, chat: bool = False) -> dict:
    """OpenAI's model object; `chat` says whether /v1/chat/completions serves it (a chat template)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "gpt", "chat": chat}
