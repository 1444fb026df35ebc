"""The server as a small service: create_app only wires routes to a `Service`, and the chat route builds its
prompt the one way `sample.py --chat` does (gpt.infer.chat.chat_prompt)."""

import inspect

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="the dev extra is not installed: pip install -e '.[dev]'")

from gpt import load_checkpoint  # noqa: E402
from gpt.data.chat import ChatTemplate  # noqa: E402
from gpt.data.tokenizer import CharTokenizer  # noqa: E402
from gpt.infer import chat as infer_chat  # noqa: E402
from gpt.infer.chat import Chat, PromptTooLong, chat_prompt, chat_template  # noqa: E402
from gpt.infer.sampling import SampleConfig  # noqa: E402
from gpt.serve.app import ServeConfig, create_app, running  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
SYSTEM = "Be brief."
TURNS = [
    {"role": "user", "content": "Translate to English: Ein Hund."},
    {"role": "assistant", "content": "A dog."},
    {"role": "user", "content": "Translate to English: Eine Katze."},
]


def test_create_app_only_wires_routes_to_a_service(trained_run):
    assert len(inspect.getsource(create_app).splitlines()) < 80
    model, tok, meta = load_checkpoint(trained_run)
    app = create_app(model, tok, meta, ServeConfig(model_name="m"))
    service = app.state.service
    routes = [r for r in app.routes if getattr(r, "endpoint", None) and r.path not in ("/docs", "/openapi.json")]
    assert {r.path for r in routes} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for route in routes:  # every route is a method of the one Service, none a closure inside create_app
        assert getattr(route.endpoint, "__self__", None) is service, route.path


def test_chat_prompt_renders_system_and_turns_with_the_assistant_marker():
    template = ChatTemplate()
    tok = template.tokenizer(CharTokenizer("abcdefghijklmnopqrstuvwxyzABDEHKT.: "))
    sp = tok.special
    prompt = chat_prompt(template, tok, TURNS, SampleConfig(max_new_tokens=5), block_size=200, system=SYSTEM)
    expected = [sp(template.system), *tok.encode(SYSTEM), sp(template.end)]
    for m in TURNS:
        expected += [sp(template.marker(m["role"])), *tok.encode(m["content"]), sp(template.end)]
    assert prompt.ids == [*expected, sp(template.assistant)]
    assert prompt.messages[0] == {"role": "system", "content": SYSTEM} and prompt.dropped == 0
    assert prompt.config.max_new_tokens == 5 and prompt.config.end_tokens[0] == sp(template.end)
    # too long for the context: sample.py drops the oldest turn, the server (a limit) keeps it whole and refuses
    short = chat_prompt(template, tok, TURNS, SampleConfig(max_new_tokens=5), block_size=60, system=SYSTEM)
    assert short.dropped == 1 and short.messages[1:] == TURNS and len(short.ids) + 5 <= 60
    with pytest.raises(PromptTooLong) as e:
        chat_prompt(template, tok, TURNS, SampleConfig(max_new_tokens=5), block_size=60, system=SYSTEM, limit=60)
    assert e.value.length == len(prompt.ids)
    # kept whole (the server), the answer is cut to the room left in the context
    roomy = chat_prompt(template, tok, TURNS, SampleConfig(max_new_tokens=150), 200, system=SYSTEM, limit=200)
    assert roomy.ids == prompt.ids and roomy.config.max_new_tokens == 200 - len(prompt.ids)


def test_the_server_and_sample_chat_give_the_model_the_same_ids(chat_run, monkeypatch):
    model, tok, meta = load_checkpoint(chat_run)
    template = chat_template(meta)
    seen = []
    generate = infer_chat.generate
    monkeypatch.setattr(infer_chat, "generate", lambda m, t, ids, cfg: seen.append(ids) or generate(m, t, ids, cfg))
    config = SampleConfig(max_new_tokens=2, temperature=0, top_k=None)
    "".join(p.text for p in Chat(model, tok, template, system=SYSTEM, config=config).answer(TURNS))  # --chat, --system
    app = create_app(model, tok, meta, ServeConfig(model_name="chat", max_tokens=100))
    submit = app.state.worker.submit
    app.state.worker.submit = lambda requests: seen.extend(r.ids for r in requests) or submit(requests)
    with running(app) as url:
        messages = [{"role": "system", "content": SYSTEM}, *TURNS]
        body = {"model": "chat", "messages": messages, "max_tokens": 2, "temperature": 0}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    assert len(seen) == 2 and list(seen[0]) == list(seen[1]) == template.prompt(messages, tok)
    assert r.json()["usage"]["prompt_tokens"] == len(seen[0])
