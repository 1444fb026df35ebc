"""Tool calls (issue 47 section 2): OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`, `tool_calls` in answers
(whole and streamed) and `role: "tool"` messages, through the official openai client; the calls' text in a
conversation (gpt/data/tools.py) and its loss mask; a tiny model fine-tuned on such conversations that learns to
call a function (slow)."""

import json
import random

import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
pytest.importorskip("llguidance", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the dev extra is not installed: pip install -e '.[dev]'")
jsonschema = pytest.importorskip("jsonschema", reason="the dev extra is not installed: pip install -e '.[dev]'")

from gpt import GPT, GPTConfig, load_checkpoint  # noqa: E402
from gpt.data.chat import ChatError, ChatTemplate, conversation  # noqa: E402
from gpt.data.tokenizer import CharTokenizer, SpecialsTokenizer, get_tokenizer  # noqa: E402
from gpt.data.tools import parse_calls  # noqa: E402
from gpt.serve.app import ServeConfig, create_app, running  # noqa: E402
from tests.conftest import GPT2_RANKS, prepare, train_run, write_jsonl  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "additionalProperties": False}},
    },
]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def client():
    """A random chat model over GPT-2's vocabulary: whatever it calls, the grammar shaped."""
    if not GPT2_RANKS.is_file():
        pytest.skip(f"GPT-2's BPE file is not at {GPT2_RANKS}")
    template = ChatTemplate()
    tok = SpecialsTokenizer(get_tokenizer("gpt2", str(GPT2_RANKS)), template.specials)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=512, n_layer=1, n_head=2, n_embd=32)).eval()
    meta = {"model_config": model.config.to_dict(), "tokenizer": tok.spec, "chat_template": template.spec}
    with running(create_app(model, tok, meta, ServeConfig(model_name="chat", max_batch=8, max_tokens=200))) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_required_and_named_choices_give_calls_that_validate(client):
    r = client.chat.completions.create(
        model="chat", messages=ASK, tools=TOOLS, tool_choice="required", n=6, seed=1, temperature=1.0, max_tokens=150
    )
    names = set()
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            names.add(call.function.name)
            arguments = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                jsonschema.validate(arguments, WEATHER)
            else:
                assert call.function.name == "get_time" and isinstance(arguments, dict)
    named = client.chat.completions.create(
        model="chat",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        n=4,
        seed=2,
        temperature=1.0,
        max_tokens=150,
    )
    for choice in named.choices:
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]  # one call, that function
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER)
    single = client.chat.completions.create(
        model="chat", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=4, seed=3,
        max_tokens=150,
    )  # fmt: skip
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)
    none = client.chat.completions.create(
        model="chat", messages=ASK, tools=TOOLS, tool_choice="none", seed=4, max_tokens=20
    )
    assert none.choices[0].message.tool_calls is None and not none.choices[0].message.content.startswith("<")


def test_calls_stream_as_tool_call_deltas_and_a_result_goes_back(client):
    kwargs = dict(model="chat", messages=ASK, tools=TOOLS, tool_choice="required", seed=5, max_tokens=150)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed = [call for d in deltas for call in d.tool_calls or []]
    assert [c.index for c in streamed] == list(range(len(whole)))
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert all(d.content is None for d in deltas)  # the call's text is not sent as content
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in whole]},
        {"role": "tool", "tool_call_id": whole[0].id, "content": "sunny"},
    ]
    after = client.chat.completions.create(model="chat", messages=turn, tools=TOOLS, seed=6, max_tokens=10)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "letters, digits"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0] is not"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not among the tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "send one of them"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400s(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="chat", messages=ASK, max_tokens=5, extra_body=fields)
    assert e.value.param == param and words in e.value.message, e.value.message


def test_a_tool_conversation_renders_its_calls_as_text_with_the_loss_on_them():
    row = {
        "tools": TOOLS[:1],
        "messages": [
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
                    }
                ],
            },  # fmt: skip
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ],
    }
    messages = conversation(row)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo","days":2}}</tool_call>'
    assert messages[2]["content"] == call and messages[3]["content"] == "<tool_response>sunny</tool_response>"
    assert messages[0]["content"].startswith("Tools:\n{") and parse_calls(call) == [
        {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}
    ]
    template = ChatTemplate()
    tok = template.tokenizer(CharTokenizer("".join(sorted(set("".join(m["content"] for m in messages))))))
    ids, mask = template.render(messages, tok)
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert call in learned and "Oslo?" not in learned and "sunny<" not in learned
    with pytest.raises(ChatError, match="not JSON"):
        bad = {**row, "messages": [*ASK, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}  # fmt: skip
        conversation(bad)


CITIES = ["Oslo", "Paris", "Rome", "Lima", "Kyiv", "Bern", "Doha", "Riga"]
SIMPLE = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}]  # fmt: skip


def weather_rows(n: int, seed: int) -> list[dict]:
    """Conversations that call get_weather for a city (and answer with its result), or only say hello."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        city, sky, name = rng.choice(CITIES), rng.choice(["sunny", "rainy", "windy"]), rng.choice(["Ann", "Bob", "Eve"])
        ask = {"role": "user", "content": f"What is the weather in {city}?"}
        call = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}  # fmt: skip
        messages = [
            [ask, call],
            [ask, call, {"role": "tool", "tool_call_id": f"c{i}", "content": sky}, {"role": "assistant", "content": f"It is {sky} in {city}."}],
            [{"role": "user", "content": f"Say hello to {name}."}, {"role": "assistant", "content": f"Hello, {name}!"}],
        ][i % 3]  # fmt: skip
        rows.append({"tools": SIMPLE, "messages": messages})
    return rows


@pytest.mark.slow
def test_a_tiny_model_fine_tuned_on_tool_conversations_calls_the_function(tmp_path):
    from gpt.data.sft import prepare_chat

    train, val = weather_rows(600, 0), weather_rows(60, 1)
    text = tmp_path / "text.txt"  # the base vocabulary: every character of the conversations
    text.write_text("\n".join(m["content"] for row in train for m in conversation(row)))
    base = prepare(text, tmp_path / "base", "--tokenizer", "char", "--block-size", "64")
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "val.jsonl", val)
    data = tmp_path / "chat"
    prepare_chat(
        [tmp_path / "train.jsonl"], data, val_inputs=[tmp_path / "val.jsonl"], tokenizer_from=base, block_size=384
    )
    out = tmp_path / "run"
    train_run("--data", data, "--out-dir", out, "--n-layer", "2", "--n-head", "4", "--n-embd", "96", "--block-size",
              "384", "--batch-size", "8", "--max-iters", "600", "--learning-rate", "3e-3", "--min-lr", "3e-4",
              "--warmup-iters", "20", "--eval-interval", "600", "--eval-iters", "5", "--device", "cpu", "--dtype",
              "float32", "--no-plot", "--dropout", "0", "--seed", "0")  # fmt: skip
    model, tok, meta = load_checkpoint(out)
    with running(create_app(model, tok, meta, ServeConfig(model_name="t", max_batch=4))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for city in ("Oslo", "Lima", "Riga"):  # auto: the model chooses to call, and with the city asked about
            r = client.chat.completions.create(
                model="t", messages=[{"role": "user", "content": f"What is the weather in {city}?"}], tools=SIMPLE,
                temperature=0, max_tokens=80,
            )  # fmt: skip
            calls = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
            assert json.loads(calls[0].function.arguments) == {"city": city}
        hello = client.chat.completions.create(
            model="t", messages=[{"role": "user", "content": "Say hello to Eve."}], tools=SIMPLE, temperature=0
        )
        assert hello.choices[0].message.tool_calls is None and hello.choices[0].message.content == "Hello, Eve!"
        chunks = list(client.chat.completions.create(
            model="t", messages=[{"role": "user", "content": "What is the weather in Doha?"}], tools=SIMPLE,
            temperature=0, max_tokens=80, stream=True,
        ))  # fmt: skip
        streamed = [c for ch in chunks for c in ch.choices[0].delta.tool_calls or []]
        assert json.loads(streamed[0].function.arguments) == {"city": "Doha"}
