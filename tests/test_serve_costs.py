"""What a request's text costs the server: its encoding, decoding and answer are built off the event loop (a slow
tokenizer delays that request alone, never /health or other clients), and a completion's logprobs are bounded
(--max-logprob-values). Tiny random models: the cost here is the tokenizer's, slowed on purpose."""

import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="the dev extra is not installed: pip install -e '.[dev]'")

from test_serve import tiny_bpe_model  # noqa: E402

from gpt import GPT, GPTConfig  # noqa: E402
from gpt.data.chat import ChatTemplate  # noqa: E402
from gpt.data.tokenizer import CharTokenizer  # noqa: E402
from gpt.serve.app import ServeConfig, create_app, running  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
SLOW = 1.5  # seconds one slowed encode or decode takes; /health must answer meanwhile


def slowed(fn, seconds: float, calls: list | None = None, spans: list | None = None):
    """`fn`, taking `seconds` longer (time.sleep: the GIL is free meanwhile, as tiktoken frees it); each call's
    argument is appended to `calls`, its (start, end) on time.monotonic to `spans`."""

    def slow(arg):
        if calls is not None:
            calls.append(arg)
        start = time.monotonic()
        time.sleep(seconds)
        if spans is not None:
            spans.append((start, time.monotonic()))
        return fn(arg)

    return slow


def health_while(url: str, send) -> tuple[list[float], httpx.Response]:
    """When each /health answer came (time.monotonic) while `send()` ran on another thread, and the response
    `send` returned."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(response=send()))
    thread.start()
    answered = []
    while thread.is_alive():
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        answered.append(time.monotonic())
        time.sleep(0.05)
    thread.join()
    return answered, result["response"]


def answered_during(answered: list[float], spans: list[tuple[float, float]]) -> int:
    """How many /health answers came while the slowed calls ran (from the first one's start to the last one's
    end): none when they run on the event loop, which then answers nothing else (a time bound on each answer
    instead failed on a loaded machine)."""
    start, end = spans[0][0], spans[-1][1]
    return sum(start < t < end for t in answered)


def tiny_chat_model():
    template = ChatTemplate()
    tok = template.tokenizer(CharTokenizer("abcdefghijklmnopqrstuvwxyz .:"))
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=1, n_embd=8)).eval()
    return model, tok, {"model_config": model.config.to_dict(), "tokenizer": tok.spec, "chat_template": template.spec}


ROUTES = {
    "tokenize": ("encode", "/tokenize", {"prompt": "hello world"}),
    "detokenize": ("decode", "/detokenize", {"tokens": [104, 105]}),
    "completion": ("encode", "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 2}),
    "chat": ("encode", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
}


@pytest.mark.parametrize("route", ROUTES)
def test_a_slow_tokenizer_delays_its_own_request_not_the_server(monkeypatch, route):
    method, path, body = ROUTES[route]
    model, tok, meta = tiny_chat_model() if route == "chat" else tiny_bpe_model()
    app = create_app(model, tok, meta, ServeConfig(model_name="m", max_tokens=2))
    spans = []
    monkeypatch.setattr(tok, method, slowed(getattr(tok, method), SLOW, spans=spans))
    with running(app) as url:
        answered, r = health_while(url, lambda: httpx.post(url + path, json={**body}, timeout=60))
        assert r.status_code == 200, r.text
        assert answered_during(answered, spans) >= 2, f"/health did not answer while {path} was encoded"


def test_an_echo_with_logprobs_is_built_off_the_loop_each_id_decoded_once(monkeypatch):
    model, tok, meta = tiny_bpe_model()
    app = create_app(model, tok, meta, ServeConfig(model_name="m"))
    calls, spans = [], []
    monkeypatch.setattr(tok, "decode", slowed(tok.decode, 0.005, calls, spans))
    prompt = list(range(97, 97 + 30))  # 30 ids (a prompt of ids is taken as it is), within the context (32)
    body = {"model": "m", "prompt": [prompt] * 4, "echo": True, "logprobs": 5, "max_tokens": 0}
    with running(app) as url:
        answered, r = health_while(url, lambda: httpx.post(url + "/v1/completions", json=body, timeout=60))
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4 and all(len(c["logprobs"]["tokens"]) == 30 for c in choices)
    assert answered_during(answered, spans) >= 2, "/health did not answer while the answer was built"
    single = [tuple(ids) for ids in calls if len(ids) == 1]  # (the echoed texts are decoded whole, once a prompt)
    assert len(single) == len(set(single)), "an id was decoded more than once"  # (before: 4 x 30 x 7 calls)


def test_logprobs_past_the_servers_limit_are_a_400_naming_the_option():
    model, tok, meta = tiny_bpe_model()
    app = create_app(model, tok, meta, ServeConfig(model_name="m", max_batch=4, max_logprob_values=1000))
    prompt = list(range(97, 97 + 30))
    with running(app) as url:
        body = {"model": "m", "prompt": [prompt] * 4, "echo": True, "logprobs": 20, "max_tokens": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text  # 4 prompts x 30 tokens x (20 + 1) = 2,520 values
        error = r.json()["error"]
        assert error["param"] == "logprobs" and error["type"] == "invalid_request_error"
        assert "2,520 log-probabilities" in error["message"] and "(1,000, --max-logprob-values)" in error["message"]
        generated = {"model": "m", "prompt": "hi", "logprobs": 20, "max_tokens": 20, "n": 4}  # 4 x 20 x 21 = 1,680
        assert httpx.post(url + "/v1/completions", json=generated, timeout=60).status_code == 400
        for within in (  # 4 x 30 x (7 + 1) = 960; 4 x 20 x (11 + 1) = 960
            {**body, "logprobs": 7},
            {**generated, "logprobs": 11},
        ):
            r = httpx.post(url + "/v1/completions", json=within, timeout=60)
            assert r.status_code == 200, r.text
