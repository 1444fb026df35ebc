"""The OpenAI completions and chat completions APIs' shapes: requests (validated) and errors; the responses and
stream chunks they get are built by `responses.py`.

Shapes follow OpenAI's `POST /v1/completions` as the official `openai` client reads them
(`openai.types.Completion`): `{"id", "object": "text_completion", "created", "model",
"system_fingerprint", "choices": [{"text", "index", "logprobs", "finish_reason"}], "usage"}`; a
stream sends the same object per chunk with the new text, then `data: [DONE]`. Errors are
`{"error": {"message", "type", "param", "code"}}` with a 4xx status for every mistake a client can
make.

Supported: prompt (text, texts, token ids, lists of token ids), max_tokens, temperature, top_p, n,
stop, seed (a signed 64-bit integer, as OpenAI's), stream, stream_options.include_usage, echo, user,
logprobs (0 to 20; not with stream), logit_bias (token id -> bias in [-100, 100], added to the logits),
presence_penalty and frequency_penalty (in [-2, 2], over the choice's own generated tokens, as vLLM counts
them); extensions top_k, min_p (llama.cpp's, before temperature) and repetition_penalty (the openai client
sends them with `extra_body`). Asked for with other than their neutral value, best_of and suffix are a 400
that says so; unknown fields are a 400 that names them.

Logprobs (the legacy completions shape, as vLLM serves it; `gpt.infer.logprobs` says what the numbers
are): `choices[i].logprobs` is `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry
per token of the choice's text: under `echo` the prompt's tokens first (the first one's logprob and top
are null), then the generated ones. `tokens` and the keys of `top_logprobs` are each token's own text
(a byte-level token that ends inside a character shows U+FFFD); `text_offset` is where each token's
text starts in the choice's text. `max_tokens: 0` only scores the prompt: it needs `echo` and returns
no new text (lm-evaluation-harness's loglikelihood asks `max_tokens: 1` and drops the last entry).
One answer carries at most the server's `--max-logprob-values` numbers (`checks.logprob_values`: tokens
x (logprobs + 1), over every choice); more is a 400.

`POST /v1/chat/completions` (`openai.types.chat.ChatCompletion`): `messages` (system / developer,
user and assistant; content a string or a list of text parts) instead of a prompt, the same sampling
fields (`max_completion_tokens` is a synonym of `max_tokens`); the answer is `choices[i].message`
`{"role": "assistant", "content"}`, streamed as `chat.completion.chunk` objects whose `delta` carries
the role first, then the text; `logprobs: true` (with `top_logprobs` 0 to 20; not with stream) gives
`choices[i].logprobs` in the chat shape, `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpt.data.chat import openai_messages
from gpt.data.tools import ToolError, calls_grammar, check_tools, with_tools
from gpt.infer.constrain import Grammar

STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema every answer must match (OpenAI's shape)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: free text, any JSON object, or JSON that matches a schema."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class Constrained:
    """The fields that constrain an answer (both routes): `response_format`, and the extensions `regex` and
    `grammar` (Lark, or llama.cpp's GBNF when it has `::=`), at most one of them."""

    def constraint(self) -> tuple[str, Grammar] | None:
        """(the field that asked, its Grammar), or None for free text; ValueError when two are asked for."""
        asked = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", Grammar.json_object()))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format: type 'json_schema' needs its 'json_schema' object")
            asked.append(("response_format", Grammar.json_schema(fmt.json_schema.json_schema)))
        if self.regex is not None:
            asked.append(("regex", Grammar.regex(self.regex)))
        if self.grammar is not None:
            kind = Grammar.gbnf if "::=" in self.grammar else Grammar.lark
            asked.append(("grammar", kind(self.grammar)))
        if len(asked) > 1:
            raise ValueError(f"{asked[0][0]} and {asked[1][0]} both constrain the answer: send one of them")
        return asked[0] if asked else None


class CompletionRequest(Constrained, BaseModel):
    """The body of `POST /v1/completions` (field bounds that depend on the server are checked in checks.py)."""

    model_config = STRICT

    model: str
    prompt: str | list[str] | list[int] | list[list[int]] = ""  # "" starts from end-of-text
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default; 0 (scoring only) needs echo: checked in checks.py
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)  # extension (vLLM's name): None keeps every token
    repetition_penalty: float | None = Field(None, gt=0.0)  # extension: CTRL's penalty, 1 is off
    n: int | None = Field(1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # OpenAI's int64 range (torch's manual_seed takes it)
    echo: bool | None = False
    user: str | None = None
    logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI's (and vLLM's) bounds
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension (llama.cpp's and vLLM's name)
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    regex: str | None = None  # extension: the answer matches this regular expression
    grammar: str | None = None  # extension: the answer is a sentence of this Lark (or GBNF) grammar
    # accepted at their neutral value only
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (digits), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias!r} for token {key}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("prompt must not hold an empty list of token ids")
        return v

    def unsupported(self) -> str | None:
        """The first field asked for with a value this server does not implement, if any."""
        if self.suffix not in (None, ""):
            return "suffix"
        if self.best_of not in (None, self.n):
            return "best_of"
        return None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TokenizeRequest(BaseModel):
    """The body of `POST /tokenize` (vLLM's shape, as lm-evaluation-harness's remote tokenizer sends it)."""

    model_config = STRICT
    prompt: str
    add_special_tokens: bool = True  # no effect: these tokenizers add no begin-of-text token
    model: str | None = None


class DetokenizeRequest(BaseModel):
    """The body of `POST /detokenize`."""

    model_config = STRICT
    tokens: list[int]
    model: str | None = None


class TextPart(BaseModel):
    model_config = STRICT
    type: str
    text: str


class CalledFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """An assistant message's call (OpenAI's shape)."""

    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str | list[TextPart] | None = None  # None: an assistant message of tool calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        kinds = [p.type for p in self.content if p.type != "text"]
        if kinds:
            raise ValueError(f"content parts of type {kinds[0]!r} are not supported (text only)")
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(Constrained, BaseModel):
    """The body of `POST /v1/chat/completions` (bounds that depend on the server are checked in checks.py)."""

    model_config = STRICT

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    repetition_penalty: float | None = Field(None, gt=0.0)
    n: int | None = Field(1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    user: str | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    regex: str | None = None
    grammar: str | None = None
    tools: list[dict] | None = None  # [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice: str | dict | None = None  # none | auto (the default with tools) | required | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # False: at most one call
    logprobs: bool | None = None  # each generated token's log-probability (not with stream)
    top_logprobs: int | None = Field(None, ge=0, le=20)  # with logprobs: the most likely tokens at each position

    _stops = field_validator("stop")(CompletionRequest._stops.__func__)
    _bias = field_validator("logit_bias")(CompletionRequest._bias.__func__)

    def unsupported(self) -> str | None:
        return None

    def conversation(self) -> list[dict]:
        """The messages as gpt.data.chat takes them (`developer` is OpenAI's newer name for `system`), calls and
        tool results written in the template's text (gpt/data/tools.py), the tools listed in the system message."""
        messages = [
            {
                "role": m.role,
                "content": m.text(),
                **({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {}),
            }
            for m in self.messages
        ]
        return openai_messages(with_tools(messages, self.tool_list()))

    def tool_list(self) -> list[dict] | None:
        """`tools` checked (`check_tools`' shape), None without; ValueError naming what is wrong."""
        if self.tools is None:
            if self.tool_choice is not None:
                raise ValueError("tool_choice needs tools")
            return None
        try:
            return check_tools(self.tools)
        except ToolError as e:
            raise ValueError(str(e)) from None

    def constraint(self) -> tuple[str, Grammar] | None:
        """`Constrained.constraint`, or with `tools` the grammar of an answer of text or calls (tool_choice,
        parallel_tool_calls); tools and another constraint together are a ValueError."""
        tools = self.tool_list()
        asked = super().constraint()
        if not tools:
            return asked
        if asked is not None:
            raise ValueError(f"tools and {asked[0]} both constrain the answer: send one of them")
        try:
            lark = calls_grammar(tools, self.tool_choice or "auto", self.parallel_tool_calls is not False)
        except ToolError as e:
            raise ValueError(str(e)) from None
        return "tools", Grammar.lark(lark)

    def calls_expected(self) -> bool:
        """The answer may be tool calls (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"


class APIError(Exception):
    """An error answered in OpenAI's shape: status, message, type, param, code."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(e: ValidationError, body: bytes = b"") -> APIError:
    """A pydantic error as OpenAI's 400, naming the first offending field by its path in `body` (the JSON
    that failed), e.g. `messages[0].content`."""
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return APIError(
            400,
            f"We could not parse the JSON body of your request: it is not valid JSON ({err['msg']}).",
            code="invalid_json",
        )
    if not err["loc"]:
        return APIError(400, "The request body must be a JSON object.", code="invalid_json")
    param = field_path(err["loc"], body, missing=err["type"] == "missing")
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if err["type"] == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param)
    value = err.get("input")
    shown = repr(value) if not isinstance(value, (dict, list)) or len(str(value)) < 80 else type(value).__name__
    return APIError(
        400, f"Invalid value for '{param}': {shown} ({err['msg'].lower()}).", param=param, code="invalid_value"
    )


def field_path(loc: tuple, body: bytes, missing: bool = False) -> str:
    """A pydantic error location as the path of the value in the request, `messages[0].content`.

    pydantic puts the name of a union's member in the location (`('prompt', 'list[int]', 1)`); walking the
    JSON itself tells such names from keys: a name is kept only where the value at that point has that key
    (or, for a missing field, it is the last one)."""
    unknown = object()  # no JSON to walk there: every name is kept
    try:
        node = json.loads(body)
    except (ValueError, RecursionError):
        node = unknown
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
            node = node[part] if isinstance(node, list) and -len(node) <= part < len(node) else unknown
        elif isinstance(node, dict) and part in node:
            path += f".{part}" if path else part
            node = node[part]
        elif node is unknown or (missing and i == len(loc) - 1):
            path += f".{part}" if path else part
    return path
