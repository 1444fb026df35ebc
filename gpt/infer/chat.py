"""Talk to a checkpoint fine-tuned on conversations (train.py on a `data/prepare.py --chat` dataset).

    model, tok, meta = load_checkpoint("out/chat")
    chat = Chat(model, tok, chat_template(meta), system="Answer briefly.")
    for piece in chat.say("Translate to English: Ein Hund rennt."):   # streamed Pieces of the answer
        print(piece.text, end="", flush=True)
    chat.reset()                                                     # a new conversation, same system
    ids, config, dropped, messages = chat_prompt(template, tok, messages, config, block_size, system)  # the prompt

The checkpoint's meta holds the template it was trained with (`chat_template`); the prompt is the
conversation so far rendered by it, ending in the assistant's marker, and the answer ends at the
template's end-of-turn token (or at a role marker: the model starting another turn has finished its own).

Policies
- A conversation longer than the context loses its oldest whole turns (a user message and the answer to
  it), never the system message nor the newest user message; if those alone do not fit with room for
  `max_new_tokens`, the answer is shortened to what fits, and if not even one token fits, ChatError.
- `answer_ids` decodes many prompts greedily at once (gpt evaluate on chat checkpoints): prompts of
  equal length share a batch, as absolute positions forbid padding them on the left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import NamedTuple

import torch

from gpt.data.chat import ChatError, ChatTemplate, check_conversation, openai_messages
from gpt.data.records import BadJSONError, parse_json_line
from gpt.infer import speculative
from gpt.infer.sampling import Decoder, SampleConfig, generate
from gpt.infer.stream import Piece

DEFAULT_CHAT = SampleConfig(max_new_tokens=256, temperature=0.7, top_k=50)


def chat_template(meta: dict) -> ChatTemplate | None:
    """The template of a chat checkpoint (None for a plain language model)."""
    spec = meta.get("chat_template")
    return None if spec is None else ChatTemplate.from_spec(spec, "the checkpoint's chat_template")


def end_tokens(template: ChatTemplate, tok) -> tuple[int, ...]:
    """The ids that end an answer: end-of-turn first, then the role markers."""
    return tuple(tok.special(t) for t in (template.end, template.user, template.assistant, template.system))


def fit(template: ChatTemplate, tok, messages: list[dict], block_size: int, max_new_tokens: int):
    """(prompt ids, max_new_tokens that fit, turns dropped): the conversation cut by whole turns to fit
    the context with room for the answer (see the module's policies).

    Linear in the conversation: each message is encoded at most once, newest first, and only as far back
    as the context reaches (a long chat history costs no more than the turns that still fit)."""
    check_conversation(messages, for_prompt=True)
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system) :]
    starts = [0, *(i for i in range(1, len(turns)) if turns[i]["role"] == "user")]  # where the kept turns may begin
    bodies = [tok.encode(m["content"]) for m in system] + [[] for _ in turns]
    size = 1 + sum(2 + len(b) for b in bodies[: len(system)])  # every message is marker, body, end; then a marker
    chosen, end = len(starts) - 1, len(turns)  # the newest user message is kept even if it does not fit
    for k in reversed(range(len(starts))):  # earlier starts keep more turns: stop at the first that overflows
        for i in range(starts[k], end):
            bodies[len(system) + i] = tok.encode(turns[i]["content"])
            size += 2 + len(bodies[len(system) + i])
        end = starts[k]
        if size + max_new_tokens > block_size:
            break
        chosen = k
    kept = system + turns[starts[chosen] :]
    ids = template.prompt(kept, tok, bodies[: len(system)] + bodies[len(system) + starts[chosen] :])
    room = block_size - len(ids)
    if room < 1:
        raise ChatError(
            f"the conversation needs {len(ids)} tokens without any answer, more than the model's context of "
            f"{block_size}: shorten the last message (or the system message)"
        )
    return ids, min(max_new_tokens, room), chosen


class PromptTooLong(ChatError):
    """A conversation that must be kept whole (the server's) is `length` tokens, at or over its limit."""

    def __init__(self, length: int, limit: int):
        super().__init__(f"the conversation has {length} tokens; at most {limit - 1} fit")
        self.length, self.limit = length, limit


class ChatPrompt(NamedTuple):
    """A conversation made ready for the model: the ids it continues, the sampling settings that end the answer
    at the end of turn within the context, how many of the oldest turns were dropped to fit, and the whole
    conversation (the system message included) that the answer continues."""

    ids: list[int]
    config: SampleConfig
    dropped: int
    messages: list[dict]


def chat_prompt(
    template: ChatTemplate,
    tok,
    messages: list[dict],
    config: SampleConfig,
    block_size: int,
    system: str | None = None,
    limit: int | None = None,
) -> ChatPrompt:
    """The one way a conversation becomes a prompt (`sample.py --chat`, `--prompt` on a chat checkpoint, the
    server's chat route): `system` put first when the conversation has no system message, the messages rendered
    by the template ending in the assistant's marker, the answer ending at the template's end tokens and cut to
    the room left in the context.

    `limit` None: the oldest turns are dropped to fit (`fit`). `limit` N: the conversation is kept whole, and
    one of N tokens or more is PromptTooLong (the client keeps its own context, as OpenAI's API does)."""
    check_conversation(messages, for_prompt=True)
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    if limit is None:
        ids, budget, dropped = fit(template, tok, messages, block_size, config.max_new_tokens)
    else:
        ids, dropped = template.prompt(messages, tok), 0
        if len(ids) >= min(limit, block_size):
            raise PromptTooLong(len(ids), min(limit, block_size))
        budget = min(config.max_new_tokens, block_size - len(ids))
    config = dataclasses.replace(config, max_new_tokens=budget, end_tokens=end_tokens(template, tok))
    return ChatPrompt(ids, config, dropped, messages)


class Chat:
    """One conversation with a chat model: the messages so far, and the next answer, streamed."""

    def __init__(
        self,
        model,
        tok,
        template: ChatTemplate,
        system: str | None = None,
        config: SampleConfig = DEFAULT_CHAT,
        drafter: speculative.Drafter | None = None,
    ):
        self.model, self.tok, self.template = model, tok, template
        self.drafter = drafter  # speculative decoding's guesses (gpt/infer/speculative.py), or None
        self.system = system
        self.config = dataclasses.replace(config, end_tokens=end_tokens(template, tok), num_samples=1)
        self.dropped = 0  # turns dropped to fit the context, in the last answer
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def say(self, text: str) -> Iterator[Piece]:
        """Add the user's message; yield the answer's pieces. Both join the conversation once the answer
        is complete (an interrupted answer leaves the conversation as it was)."""
        return self.answer([*self.messages, {"role": "user", "content": text}])

    def answer(self, messages: list[dict]) -> Iterator[Piece]:
        """The answer to `messages` (ending in the user's; the system message is added if they have none),
        streamed; the conversation becomes `messages` and the answer once it is complete."""
        prompt = chat_prompt(self.template, self.tok, messages, self.config, self.model.config.block_size, self.system)
        self.dropped = prompt.dropped
        return self._stream(prompt)

    def _stream(self, prompt: ChatPrompt) -> Iterator[Piece]:
        answer = []
        if self.drafter is None:
            pieces = generate(self.model, self.tok, prompt.ids, prompt.config)
        else:
            pieces = speculative.generate(self.model, self.tok, prompt.ids, prompt.config, self.drafter)
        for piece in pieces:
            answer.append(piece.text)
            yield piece
        self.messages = [*prompt.messages, {"role": "assistant", "content": "".join(answer)}]


def conversation_line(line: str) -> list[dict]:
    """One line of `sample.py --chat`'s input: a JSON list of messages, or an object with "messages"."""
    try:
        value = parse_json_line(line)
    except BadJSONError as e:
        raise ChatError(str(e)) from None
    if isinstance(value, dict) and "messages" in value:
        value = value["messages"]
    if not isinstance(value, list):
        raise ChatError('a conversation is a JSON list of messages (or an object with "messages")')
    messages = openai_messages(value)
    check_conversation(messages, for_prompt=True)
    return messages


@torch.no_grad()
def answer_ids(
    model, prompts: list[list[int]], ends: tuple[int, ...], vocab_size: int, max_new_tokens: int, batch_size: int = 64
) -> list[list[int]]:
    """Greedy answers (ids, without the ending token) to many prompts, prompts of equal length batched;
    `vocab_size` is the tokenizer's (a padded embedding's extra rows are never chosen)."""
    device = next(model.parameters()).device
    model.eval()
    out: list[list[int]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    stop = torch.tensor(ends, device=device)
    for length, members in sorted(by_length.items()):
        budget = min(max_new_tokens, model.config.block_size - length)
        for first in range(0, len(members), batch_size):
            rows = members[first : first + batch_size]
            dec = Decoder(model, torch.tensor([prompts[i] for i in rows], device=device))
            for step in range(budget):
                new = dec.logits[:, :vocab_size].argmax(-1)
                done = torch.isin(new, stop)
                for r, token, end in zip(rows, new.tolist(), done.tolist()):
                    if not end:
                        out[r].append(token)
                if done.all() or step == budget - 1:
                    break
                if done.any():
                    keep = (~done).nonzero().flatten()
                    rows = [rows[k] for k in keep.tolist()]
                    dec.select(keep)
                    new = new[keep]
                dec.advance(new)
    return out
