"""POST /v1/chat/completions against the official `openai` client, with a chat checkpoint fine-tuned by train.py."""

import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the dev extra is not installed: pip install -e '.[dev]'")
import httpx  # noqa: E402  (installed with openai)

from gpt import load_checkpoint  # noqa: E402
from gpt.infer.chat import Chat, chat_template  # noqa: E402
from gpt.infer.sampling import SampleConfig  # noqa: E402
from gpt.serve.app import ServeConfig, create_app, running  # noqa: E402

NAME = "chat"
USER = "Translate to English: Ein Hund rennt durch den Park."
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def loaded(chat_run):
    return load_checkpoint(chat_run)


@pytest.fixture(scope="module")
def server(loaded):
    model, tok, meta = loaded
    with running(create_app(model, tok, meta, ServeConfig(model_name=NAME, max_batch=8, max_tokens=100))) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(loaded, messages, **settings):
    """The library's own answer (gpt.infer.chat.Chat) with these settings."""
    model, tok, meta = loaded
    chat = Chat(model, tok, chat_template(meta), config=SampleConfig(**{"top_k": None, **settings}))
    return "".join(p.text for p in chat.answer(messages))


def test_a_chat_completion_is_the_librarys_answer(client, loaded):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == NAME
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert choice.message.content == reference(loaded, messages, max_new_tokens=30, temperature=0)
    model, tok, meta = loaded
    prompt = chat_template(meta).prompt(messages, tok)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens >= 1


def test_streamed_chunks_carry_the_role_then_the_text(client, loaded):
    messages = [{"role": "user", "content": USER}]
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert chunks[0].object == "chat.completion.chunk" and deltas[0].role == "assistant"
    assert all(d.role is None for d in deltas[1:]) and len(deltas) > 3
    assert "".join(d.content or "" for d in deltas) == reference(loaded, messages, max_new_tokens=30, temperature=0)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_n_seed_and_stop(client):
    messages = [{"role": "user", "content": USER}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, n=3, seed=7, temperature=1.0)
    again = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, n=3, seed=7, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0).choices[0]
    text = full.message.content
    assert len(text) > 2
    stop = text[2:4]
    cut = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"messages": ["hi"]}, "messages[0]", "input should be an object"),  # (before: "must be a JSON object")
        ({"messages": "hi"}, "messages", "valid array"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "valid string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content",
            "valid string",
        ),
        ({"messages": [{"content": "hi"}]}, "messages[0].role", "Missing required parameter"),
        ({"messages": [{"role": "user", "content": "hi", "tool": 1}]}, "messages[0].tool", "Unrecognized"),
        ({"stream_options": 5}, "stream_options", "input should be an object"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "valid boolean"),
        ({"logit_bias": {"12": "a"}}, "logit_bias.12", "valid number"),
        ({"stop": [1]}, "stop", "valid string"),
    ],
)
def test_a_field_of_the_wrong_type_is_named(server, fields, param, words):
    body = {"model": NAME, "messages": [{"role": "user", "content": USER}], **fields}
    r = httpx.post(server + "/v1/chat/completions", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and words in error["message"], error
    assert f"'{param}'" in error["message"] or f": {param}" in error["message"], error


def test_errors_in_openais_shape(client, server, trained_run):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "assistant", "content": "hi"}])
    assert e.value.body["code"] == "invalid_messages" and "ends with the user's" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "tool", "content": "x"}])
    assert e.value.body["code"] == "invalid_messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hallo " * 300}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    r = httpx.post(server + "/v1/chat/completions", json={"model": NAME, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:  # (before the fix: a 500 and a traceback in the log)
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Ein Schneemann: \u2603"}])
    assert e.value.status_code == 400 and e.value.param == "messages" and e.value.code == "invalid_messages"
    assert "not in the char vocabulary: '\u2603'" in e.value.message, e.value.message
    assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": USER}], max_tokens=2)
    models = {m.id: m for m in client.models.list().data}
    assert models[NAME].model_extra["chat"] is True
    model, tok, meta = load_checkpoint(trained_run)  # a plain language model: one clear 4xx
    with running(create_app(model, tok, meta, ServeConfig(model_name="plain"))) as url:
        plain = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            plain.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["code"] == "not_a_chat_model"
        assert json.loads(httpx.get(url + "/v1/models").text)["data"][0]["chat"] is False


def test_logprobs_and_top_logprobs_are_the_models_own_numbers(client, loaded):
    import torch

    model, tok, meta = loaded
    messages = [{"role": "user", "content": USER}]
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    prompt = chat_template(meta).prompt(messages, tok)
    ids = [tok.encode(c.token)[0] for c in content]
    with torch.no_grad():  # the full forward over prompt + answer: each answer token's log-probability
        logits = model(torch.tensor([prompt + ids]))[0][0, len(prompt) - 1 : -1, : tok.vocab_size]
    expected = torch.log_softmax(logits.float(), -1)
    for t, c in enumerate(content):
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 3
        assert abs(c.logprob - expected[t, ids[t]].item()) < 1e-4
        best = expected[t].topk(3)
        assert [x.token for x in c.top_logprobs] == [tok.decode([i]) for i in best.indices.tolist()]
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the most likely
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None
    for fields, words in [
        (dict(top_logprobs=2), "needs 'logprobs': true"),
        (dict(logprobs=True, stream=True), "with 'stream' is not supported"),
        (dict(logprobs=True, top_logprobs=21), "less than or equal to 20"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=messages, **fields)
        assert words in e.value.message, e.value.message
