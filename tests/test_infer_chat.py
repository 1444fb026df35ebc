"""gpt.infer.chat without a model: fitting a conversation into the context, and reading sample.py's input lines."""

import json
import random

import pytest

from gpt.data.chat import ChatError, ChatTemplate
from gpt.data.tokenizer import CharTokenizer
from gpt.infer.chat import conversation_line, fit

TEMPLATE = ChatTemplate()
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 "


class CountingTokenizer:
    """The chat tokenizer, counting the characters it is asked to encode."""

    def __init__(self, limit=None):
        self.tok, self.encoded, self.limit = TEMPLATE.tokenizer(CharTokenizer(CHARS)), 0, limit

    def special(self, name):
        return self.tok.special(name)

    def encode(self, text):
        self.encoded += len(text)
        assert self.limit is None or self.encoded <= self.limit, f"more than {self.limit} characters encoded"
        return self.tok.encode(text)


def quadratic_fit(template, tok, messages, block_size, max_new_tokens):
    """fit as it was (each cut rendered the whole rest of the conversation again): the behaviour to keep."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system) :]
    dropped = 0
    while True:
        ids = template.prompt(system + turns, tok)
        if len(ids) + max_new_tokens <= block_size or len(turns) == 1:
            break
        cut = next((i for i in range(1, len(turns)) if turns[i]["role"] == "user"), len(turns) - 1)
        turns, dropped = turns[cut:], dropped + 1
    room = block_size - len(ids)
    if room < 1:
        raise ChatError(f"needs {len(ids)}")
    return ids, min(max_new_tokens, room), dropped


def random_conversation(rng):
    said = lambda: "".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(0, 12)))  # noqa: E731
    messages = [{"role": "system", "content": said()}] if rng.random() < 0.5 else []
    for _ in range(rng.randrange(0, 6)):
        messages += [{"role": rng.choice(["user", "assistant", "user"]), "content": said()}]
    return [*messages, {"role": "user", "content": said()}]


def test_fit_gives_what_the_quadratic_version_gave():
    rng, tok = random.Random(0), CountingTokenizer()
    checked = refused = 0
    for _ in range(3000):
        messages, block, new = random_conversation(rng), rng.randrange(4, 80), rng.randrange(1, 40)
        try:
            want = quadratic_fit(TEMPLATE, tok, messages, block, new)
        except ChatError:
            with pytest.raises(ChatError, match="tokens without any answer, more than the model's context"):
                fit(TEMPLATE, tok, messages, block, new)
            refused += 1
            continue
        assert fit(TEMPLATE, tok, messages, block, new) == want, (messages, block, new)
        checked += 1 + (want[2] > 0)
    assert checked > 2000 and refused > 100  # every branch was taken, turns dropped in many


def test_fit_is_linear_in_the_number_of_turns():
    """10,000 turns: each message is encoded at most once (the quadratic version encoded the whole rest of
    the conversation again for every turn it dropped: ~10,000 times as much)."""
    turns = [{"role": r, "content": f"{r[0]}{i % 7} abc"} for i in range(10_000) for r in ("user", "assistant")]
    messages = [{"role": "system", "content": "be brief"}, *turns, {"role": "user", "content": "hgf"}]
    total = sum(len(m["content"]) for m in messages)
    tok = CountingTokenizer(limit=total)
    ids, budget, dropped = fit(TEMPLATE, tok, messages, block_size=64, max_new_tokens=20)
    assert tok.encoded < 100  # only the turns that could still fit were encoded
    kept = [messages[0], *messages[1 + 2 * dropped :]]
    assert ids == TEMPLATE.prompt(kept, tok.tok) and budget == 20
    assert dropped == 9_999 and len(ids) == 32  # one more turn (16 tokens) would leave 4 for the answer
    whole = CountingTokenizer(limit=total)  # a context that holds it all: everything encoded, once
    ids, budget, dropped = fit(TEMPLATE, whole, messages, block_size=10**6, max_new_tokens=20)
    assert dropped == 0 and whole.encoded == total and ids == TEMPLATE.prompt(messages, whole.tok)


def test_a_line_nested_too_deeply_is_a_chat_error():
    for line in ["[" * 100_000 + "]" * 100_000, '{"messages": ' + "[" * 50_000]:
        with pytest.raises(ChatError, match="not JSON"):
            conversation_line(line)
    assert conversation_line(json.dumps([{"role": "user", "content": "hi"}])) == [{"role": "user", "content": "hi"}]
