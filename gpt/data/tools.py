"""Tool calls in conversations: OpenAI's `tools`, assistant `tool_calls` and `role: "tool"` messages, written as
plain text inside the chat template's three roles, so every chat checkpoint's template carries them.

    tools = check_tools(request_tools)                    # [{"name", "description", "parameters"}], checked
    messages = with_tools(openai_messages, tools)         # the system / user / assistant conversation to render
    grammar = calls_grammar(tools, "auto", parallel=True)  # Lark: what an answer may be (gpt/infer/constrain.py)
    calls = parse_calls(text)                             # the answer's calls [{"name", "arguments"}], or None

The format (the one checkpoints trained here learn; docs/chat.md shows a whole conversation):
- the tools: the system message (after the conversation's own system prompt, if any) ends with a line
  `Tools:` and one compact JSON object per tool and line, `{"name":...,"description":...,"parameters":...}`;
- an assistant's calls: after its text (usually none), one `<tool_call>{"name":...,"arguments":{...}}</tool_call>`
  per call, compact JSON with `name` first, as the grammar generates them;
- a tool's result: a user turn `<tool_response>RESULT</tool_response>` (OpenAI's `tool` message's content).
The loss of a conversation (gpt prepare --chat) is on the assistant's turns, so on the calls.

Footguns
- Compact JSON (no spaces) in training data and in generation alike: a model trained on one spacing and
  forced to another by the grammar reads text unlike anything it saw.
- A tool's `parameters` is a JSON schema that the call's `arguments` must match (the grammar enforces it); a
  tool without one takes any object.
"""

from __future__ import annotations

import json
import re

from gpt.errors import UserError


class ToolError(UserError, ValueError):
    """Tools, calls or tool results that are not in OpenAI's shape (gpt/data/chat.py reports them as ChatError)."""


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
TOOLS_HEADER = "Tools:"
CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.S)


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def check_tools(tools) -> list[dict]:
    """OpenAI's `tools` (`[{"type": "function", "function": {"name", "description", "parameters"}}]`) as
    `[{"name", "description", "parameters"}]`; ToolError naming the first thing wrong."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    out, names = [], set()
    for n, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise ToolError(f"tools[{n}] is not {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{n}].function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        if name in names:
            raise ToolError(f"tools[{n}]: a second function named {name!r}")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{n}].function.parameters must be a JSON schema object")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise ToolError(f"tools[{n}].function.description must be a string")
        names.add(name)
        out.append({"name": name, "description": description, "parameters": params})
    return out


def tools_text(tools: list[dict]) -> str:
    """The system message's tool list (`check_tools`' shape)."""
    return "\n".join([TOOLS_HEADER, *(compact(t) for t in tools)])


def call_text(name: str, arguments) -> str:
    """One call as the model writes it; `arguments` an object, or OpenAI's JSON text of one."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ToolError(f"the arguments of a call to {name!r} are not JSON: {arguments[:80]!r}") from None
    return f"{TOOL_OPEN}{compact({'name': name, 'arguments': arguments})}{TOOL_CLOSE}"


def with_tools(messages: list, tools: list[dict] | None = None) -> list:
    """OpenAI-shaped messages (with `tool_calls` and `tool` messages) as the conversation the chat template
    renders: system / user / assistant messages of text, in the format of the module notes. Messages that are
    not objects are left for check_conversation to name."""
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        role, content = m.get("role"), m.get("content")
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise ToolError(f"message {n}'s tool_calls is not a list")
            text = content or ""
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ToolError(f"message {n} has a tool call without a function name")
                text += call_text(fn["name"], fn.get("arguments", {}))
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            if not isinstance(content, str):
                raise ToolError(f"message {n} (a tool's result) has no text content")
            out.append({"role": "user", "content": f"{RESULT_OPEN}{content}{RESULT_CLOSE}"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        listing = tools_text(tools)
        if out and isinstance(out[0], dict) and out[0].get("role") == "system":
            first = out[0]["content"]
            out[0] = {"role": "system", "content": f"{first}\n\n{listing}" if first else listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def parse_calls(text: str) -> list[dict] | None:
    """The calls of an answer that is calls (`<tool_call>...` first), `[{"name", "arguments"}]`; None for text."""
    if not text.lstrip().startswith(TOOL_OPEN):
        return None
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    return calls or None


def calls_grammar(tools: list[dict], choice="auto", parallel: bool = True) -> str | None:
    """The Lark grammar (llguidance's, with `%json` for each call) of what an answer may be under `choice`:
    "auto" text or calls, "required" calls, a function's name one call of it; "none" text that is no call.
    Text never starts with `<`, so an answer is plainly one or the other."""
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in {t["name"] for t in tools}:
            raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools")
        tools, choice, parallel = [t for t in tools if t["name"] == name], "required", False
    if choice not in CHOICES:
        raise ToolError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {choice!r}")
    rules = [
        "TEXT: /[^<](.|\\n)*/",
        f"calls: call{'+' if parallel else ''}",
        f'call: "{TOOL_OPEN}" ({" | ".join(f"c{i}" for i in range(len(tools)))}) "{TOOL_CLOSE}"',
    ]
    for i, tool in enumerate(tools):
        schema = {
            "type": "object",
            "properties": {"name": {"const": tool["name"]}, "arguments": tool["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        rules.append(f"c{i}: %json {compact(schema)}")
    start = {"none": "start: TEXT", "auto": "start: TEXT | calls", "required": "start: calls"}[choice]
    return "\n".join([start, *rules]) + "\n"
