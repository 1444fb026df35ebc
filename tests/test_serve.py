"""gpt.serve against the official `openai` client, on loopback, with a trained checkpoint.

A server runs on a thread of the test process (uvicorn on a free port); a few tests start the
`gpt serve` command itself.
"""

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the dev extra is not installed: pip install -e '.[dev]'")
import httpx  # noqa: E402  (installed with openai)

from gpt import GPT, GPTConfig, load_checkpoint  # noqa: E402
from gpt.checkpoints import loader  # noqa: E402
from gpt.data.tokenizer import CharTokenizer  # noqa: E402
from gpt.infer.sampling import complete  # noqa: E402
from gpt.serve.app import ServeConfig, create_app, running  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "shakespeare-char"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def loaded(trained_run):
    return load_checkpoint(trained_run)


@pytest.fixture(scope="module")
def server(loaded):
    model, tok, meta = loaded
    app = create_app(model, tok, meta, ServeConfig(model_name=NAME, max_batch=8, max_tokens=1000, max_body_bytes=4096))
    with running(app) as url:
        yield url, app


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(loaded, prompt, **settings):
    """What the library itself generates for these settings (top-k off: the API's default)."""
    model, tok, _ = loaded
    return complete(model, tok, prompt, **{"top_k": None, **settings})


def test_completion_matches_the_library_and_reports_usage(client, loaded):
    r = client.completions.create(model=NAME, prompt="ROMEO:", max_tokens=40, temperature=0)
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
    assert [c.index for c in r.choices] == [0] and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == reference(loaded, "ROMEO:", max_new_tokens=40, temperature=0)[0]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 40, 46)


def test_streaming_sends_the_same_text_in_chunks_then_usage(client, loaded):
    stream = client.completions.create(
        model=NAME, prompt="ROMEO:", max_tokens=30, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 10  # token by token, not one block
    assert "".join(texts) == reference(loaded, "ROMEO:", max_new_tokens=30, temperature=0)[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30


def test_stop_strings_end_the_text_before_them(client, loaded):
    full = reference(loaded, "JULIET:", max_new_tokens=60, temperature=0)[0]
    stop = full[8:10]  # two characters the greedy text is known to contain
    r = client.completions.create(model=NAME, prompt="JULIET:", max_tokens=60, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=NAME, prompt="JULIET:", max_tokens=60, temperature=0, stop=stop, stream=True
    )
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.text for c in chunks) == full[: full.index(stop)] and chunks[-1].finish_reason == "stop"


def test_n_samples_with_a_seed_are_different_and_reproducible(client, loaded):
    kw = dict(model=NAME, prompt="KING:", max_tokens=25, temperature=1.0, n=3, seed=1234)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert [c.text for c in again.choices] == texts
    assert texts == reference(loaded, "KING:", max_new_tokens=25, temperature=1.0, num_samples=3, seed=1234)
    other = client.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in other.choices] != texts
    assert first.usage.completion_tokens == 75


def test_several_prompts_token_ids_echo_and_extensions(client, loaded):
    model, tok, _ = loaded
    r = client.completions.create(model=NAME, prompt=["ab", "cd"], n=2, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.choices[0].text == r.choices[1].text
    ids = tok.encode("To be")
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0, echo=True)
    by_text = client.completions.create(model=NAME, prompt="To be", max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == "To be" + by_text.choices[0].text
    topk = client.completions.create(
        model=NAME,
        prompt="To be",
        max_tokens=12,
        temperature=1,
        seed=5,
        extra_body={"top_k": 1, "repetition_penalty": 1.0},
    )
    assert topk.choices[0].text == by_text.choices[0].text  # top-1 sampling is greedy


def test_penalties_min_p_and_logit_bias_sample_as_the_library_does(client, loaded):
    z = loaded[1].encode("z")[0]
    fields = dict(min_p=0.05, presence_penalty=0.3, frequency_penalty=0.8, logit_bias=((z, 2.0),))
    r = client.completions.create(
        model=NAME,
        prompt="KING:",
        max_tokens=40,
        temperature=0.9,
        n=2,
        seed=7,
        presence_penalty=0.3,
        frequency_penalty=0.8,
        logit_bias={str(z): 2.0},
        extra_body={"min_p": 0.05},
    )
    same = reference(loaded, "KING:", max_new_tokens=40, temperature=0.9, num_samples=2, seed=7, **fields)
    assert [c.text for c in r.choices] == same
    assert same != reference(loaded, "KING:", max_new_tokens=40, temperature=0.9, num_samples=2, seed=7)
    banned = client.completions.create(
        model=NAME, prompt="KING:", max_tokens=40, temperature=0, logit_bias={str(i): -100 for i in range(1, 66)}
    )
    assert set(banned.choices[0].text) <= {loaded[1].decode([0])}  # every id but 0 banned


def test_concurrent_requests_are_decoded_together(server, client, loaded):
    engine = server[1].state.worker.engine
    prompts = ["ROMEO:", "First Citizen:\nBefore we", "O", "KING HENRY:"]
    results = {}

    def ask(p):
        results[p] = client.completions.create(model=NAME, prompt=p, max_tokens=40, temperature=0).choices[0].text

    before = engine.steps
    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    steps = engine.steps - before
    assert steps < 2 * 40, f"{steps} decode steps for 4 x 40 tokens: the requests were not batched"
    for p in prompts:
        assert results[p] == reference(loaded, p, max_new_tokens=40, temperature=0)[0]


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME] and client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = httpx.get(server[0] + "/health").json()
    assert health["status"] == "ok" and health["model"] == NAME and health["max_rows"] == 8


@pytest.mark.parametrize(
    "kwargs,error,param,words",
    [
        (dict(model="gpt-4"), openai.NotFoundError, "model", "does not exist"),
        (dict(temperature=5), openai.BadRequestError, "temperature", "less than or equal to 2"),
        (dict(top_p=0), openai.BadRequestError, "top_p", "greater than 0"),
        (dict(n=0), openai.BadRequestError, "n", "greater than or equal to 1"),
        (dict(n=9), openai.BadRequestError, "n", "more than this server decodes together (8)"),
        (dict(max_tokens=-1), openai.BadRequestError, "max_tokens", "greater than or equal to 0"),
        (dict(max_tokens=0), openai.BadRequestError, "max_tokens", "needs 'echo': true"),
        (dict(max_tokens=1001), openai.BadRequestError, "max_tokens", "more than this server allows (1000)"),
        (dict(stop=["a", "b", "c", "d", "e"]), openai.BadRequestError, "stop", "at most 4"),
        (dict(prompt="x" * 65), openai.BadRequestError, "prompt", "65 tokens, more than this server's limit of 64"),
        (dict(prompt="naïve €"), openai.BadRequestError, "prompt", "not in the char vocabulary"),
        (dict(prompt=[0, 10_000]), openai.BadRequestError, "prompt", "ids must be in [0, 66)"),
        (dict(prompt=[]), openai.BadRequestError, "prompt", "must not be an empty list"),
        (dict(logprobs=21), openai.BadRequestError, "logprobs", "less than or equal to 20"),
        (dict(logprobs=-1), openai.BadRequestError, "logprobs", "greater than or equal to 0"),
        (dict(logprobs=2, stream=True), openai.BadRequestError, "logprobs", "with 'stream' is not supported"),
        (dict(presence_penalty=2.5), openai.BadRequestError, "presence_penalty", "less than or equal to 2"),
        (dict(frequency_penalty=-3), openai.BadRequestError, "frequency_penalty", "greater than or equal to -2"),
        (dict(logit_bias={"a": 1}), openai.BadRequestError, "logit_bias", "must be token ids"),
        (dict(logit_bias={"5": 101}), openai.BadRequestError, "logit_bias", "in [-100, 100]"),
        (dict(logit_bias={"66": 1}), openai.BadRequestError, "logit_bias", "token id 66 is not in the vocabulary"),
        (dict(extra_body={"min_p": 1.5}), openai.BadRequestError, "min_p", "less than or equal to 1"),
        (dict(suffix="x"), openai.BadRequestError, "suffix", "not supported"),
        (dict(extra_body={"temprature": 0.5}), openai.BadRequestError, "temprature", "Unrecognized request argument"),
        (dict(extra_body={"max_tokens": "ten"}), openai.BadRequestError, "max_tokens", "valid integer"),
        (dict(extra_body={"seed": 1.5}), openai.BadRequestError, "seed", "valid integer"),
        (dict(seed=2**64), openai.BadRequestError, "seed", "less than 9223372036854775808"),
        (dict(seed=-(2**63) - 1), openai.BadRequestError, "seed", "greater than or equal to -9223372036854775808"),
        (dict(extra_body={"stream": "yes"}), openai.BadRequestError, "stream", "valid boolean"),
    ],
)
def test_bad_requests_are_openai_errors(client, kwargs, error, param, words):
    settings = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 5, **kwargs}
    with pytest.raises(error) as e:
        client.completions.create(**settings)
    assert e.value.param == param and words in e.value.message, e.value.message
    assert e.value.type == "invalid_request_error"


@pytest.mark.parametrize(
    "body,status,words",
    [
        (b'{"model": "shakespeare-char", "prompt": ', 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'"hello"', 400, "must be a JSON object"),
        (b"", 400, "not valid JSON"),
        (b'{"prompt": "hi"}', 400, "Missing required parameter: 'model'"),
        (b'{"model": "shakespeare-char", "prompt": [[1], []]}', 400, "empty list of token ids"),
        (b'{"model": "shakespeare-char", "prompt": [1, "a"]}', 400, "Invalid value for 'prompt'"),
        (b'{"model": "shakespeare-char", "prompt": "' + b"a" * 5000 + b'"}', 413, "larger than this server's limit"),
    ],
)
def test_malformed_bodies_are_4xx_and_the_server_lives_on(server, body, status, words):
    url = server[0]
    r = httpx.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/health").status_code == 200


def test_a_seed_out_of_range_is_a_400_and_a_stream_beside_it_goes_on(server, client, loaded):
    body = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=30) as r:
        events = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
        text = json.loads(next(events))["choices"][0]["text"]  # decoding when the bad request comes
        with pytest.raises(openai.BadRequestError) as e:  # (before the fix: no answer, and this stream's end a 500)
            client.with_options(timeout=10).completions.create(model=NAME, prompt="A", max_tokens=5, seed=2**64)
        assert e.value.param == "seed"
        rest = list(events)
    assert rest[-1] == "[DONE]"
    text += "".join(json.loads(event)["choices"][0]["text"] for event in rest[:-1])
    assert text == reference(loaded, "ROMEO:", max_new_tokens=200, temperature=0)[0]
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"


def test_a_cross_site_post_without_json_content_type_is_refused_and_no_cors_is_granted(server):
    url = server[0]
    body = json.dumps({"model": NAME, "prompt": "A", "max_tokens": 2}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):  # what a page sends unasked
        headers = {"Origin": "http://evil.example", **({"Content-Type": content_type} if content_type else {})}
        r = httpx.post(url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
        assert not any(h.startswith("access-control-") for h in r.headers)
    preflight = httpx.options(
        url + "/v1/completions",
        headers={
            "Origin": "http://evil.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert preflight.status_code >= 400 and not any(h.startswith("access-control-") for h in preflight.headers)
    r = httpx.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    page = httpx.get(url + "/").text  # the playground (same-origin) sends JSON with its own headers
    assert 'fetch(url, {method: "POST", headers: headers()' in page  # url: /v1/completions or /v1/chat/completions
    assert 'url = "/v1/completions"' in page and 'url = "/v1/chat/completions"' in page
    assert 'const h = {"Content-Type": "application/json"};' in page


def test_without_a_key_only_the_servers_own_host_names_are_answered(server, loaded):
    url = server[0]
    port = url.rsplit(":", 1)[1]
    for path in ("/", "/health", "/v1/models"):
        r = httpx.get(url + path, headers={"Host": "evil.example"})  # a rebound name pointing at 127.0.0.1
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (path, r.text)
        assert "--allowed-hosts" in r.json()["error"]["message"]
    r = httpx.post(
        url + "/v1/completions",
        json={"model": NAME, "prompt": "A", "max_tokens": 2},
        headers={"Host": f"evil.example:{port}"},
    )
    assert r.status_code == 400
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == 200, host

    model, tok, meta = loaded
    for config in (
        ServeConfig(model_name=NAME, allowed_hosts=("evil.example",)),  # named on purpose
        ServeConfig(model_name=NAME, api_key="s3cret"),
    ):  # with a key, the key is the check
        with running(create_app(model, tok, meta, config)) as url:
            client = openai.OpenAI(
                base_url=url + "/v1",
                api_key="s3cret",
                max_retries=0,
                timeout=60,
                default_headers={"Host": "evil.example"},
            )
            assert client.completions.create(model=NAME, prompt="A", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize(
    "allowed,host,ok",
    [
        ((), "localhost:8000", True),
        ((), "127.0.0.1", True),
        ((), "[::1]:8000", True),
        ((), "", False),
        ((), "evil.example", False),
        ((), "localhost.evil.example", False),
        ((), "127.0.0.1.nip.io:8000", False),
        ((), "192.168.1.5:8000", False),
        (("0.0.0.0",), "192.168.1.5:8000", True),
        (("0.0.0.0",), "my.lan", False),
        (("My.Lan",), "my.lan:8000", True),
        (("*",), "anything", True),
        (("::",), "[fe80::1]:8000", True),
        ((), "[0:0::1]:8000", True),  # (an address in another spelling)
        ((), "127.0.0.1:80@evil.example", False),  # (before: read as 127.0.0.1) malformed: no browser sends these,
        ((), "[::1]evil.example", False),  # but nothing that starts with a loopback name passes
        ((), "localhost:evil", False),
        ((), "localhost:8000:8000", False),
        ((), "localhost:", False),
        (("0.0.0.0",), "10.0.0.1:80@evil.example", False),
    ],
)
def test_host_check(allowed, host, ok):
    from gpt.serve.guards import HostCheck

    assert HostCheck(None, allowed).allows(host) == ok


def test_a_slow_body_is_a_408_and_the_server_answers_others(loaded):
    model, tok, meta = loaded
    app = create_app(model, tok, meta, ServeConfig(model_name=NAME, body_timeout=0.5))
    with running(app) as url:
        host, port = url[len("http://") :].split(":")
        body = json.dumps({"model": NAME, "prompt": "A" * 40, "max_tokens": 2}).encode()
        start = time.monotonic()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            )
            for byte in body:  # one byte every 0.1 s: 6 s for the whole body
                if select.select([sock], [], [], 0.1)[0]:  # the server has answered
                    break
                sock.sendall(bytes([byte]))
                assert httpx.get(url + "/health").status_code == 200  # the server answers others meanwhile
            answer = b""
            with contextlib.suppress(OSError):  # (the server closes the connection after its answer)
                while chunk := sock.recv(4096):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert time.monotonic() - start < 3
        assert b'"request_timeout"' in answer
        assert httpx.post(url + "/v1/completions", json=json.loads(body)).status_code == 200


def test_connections_past_the_limit_are_refused(loaded):
    assert ServeConfig(model_name=NAME, max_batch=8, max_queue=16).max_connections == 48
    model, tok, meta = loaded
    config = ServeConfig(model_name=NAME, max_connections=2, max_tokens=100000)
    with running(create_app(model, tok, meta, config)) as url:
        assert httpx.get(url + "/health").status_code == 200
        body = {"model": NAME, "prompt": "A", "max_tokens": 100000, "stream": True, "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as busy:  # a request under way
            lines = busy.iter_lines()  # (kept: a dropped iterator closes the connection)
            next(lines)
            assert httpx.get(url + "/health").status_code == 503
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 200:  # once the server has seen it close
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_connections_that_send_no_whole_head_are_closed_in_time(loaded):
    model, tok, meta = loaded
    with running(create_app(model, tok, meta, ServeConfig(model_name=NAME, header_timeout=1.0))) as url:
        host, port = url[len("http://") :].split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
        try:
            for sock in idle[::2]:  # half of them send half a head, the others nothing at all
                sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Ty".encode())
            start = time.monotonic()
            assert all(closed_by_server(sock) for sock in idle)  # (before the fix: never)
            assert time.monotonic() - start < 1.0 + 2.0
        finally:
            for sock in idle:
                sock.close()


def test_sockets_that_send_no_whole_head_never_shut_others_out(loaded):
    """More idle sockets than --max-connections, long before their deadline: a client that sends its request
    is answered at once, the sockets that waited longest making room for it; a request under way stays."""
    model, tok, meta = loaded
    config = ServeConfig(model_name=NAME, max_connections=4, header_timeout=60.0, max_tokens=1000)
    with running(create_app(model, tok, meta, config)) as url:
        host, port = url[len("http://") :].split(":")
        body = {"model": NAME, "prompt": "A", "max_tokens": 1000, "stream": True, "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as busy:
            lines = busy.iter_lines()
            next(lines)
            idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(10)]
            try:
                for sock in idle[::2]:
                    sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n".encode())
                for _ in range(3):  # (before the fix: 503 while they stay, here 60 s)
                    assert httpx.get(url + "/health").status_code == 200
                closed = [closed_by_server(sock) for sock in idle[:8]]  # the oldest made room
                assert all(closed), closed
            finally:
                for sock in idle:
                    sock.close()
            rest = list(lines)
        assert rest[-2] == "data: [DONE]" and json.loads(rest[-4][6:])["choices"][0]["finish_reason"] == "length"


def test_a_kept_alive_connection_must_send_its_next_head_in_time_even_byte_by_byte(loaded):
    model, tok, meta = loaded
    with running(create_app(model, tok, meta, ServeConfig(model_name=NAME, header_timeout=1.0))) as url:
        host, port = url[len("http://") :].split(":")
        head = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n"
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall((head + "\r\n").encode())
            assert read_answer(sock).startswith(b"HTTP/1.1 200 ")  # the connection stays open for the next request
            start = time.monotonic()
            for byte in (head + "X-Padding: " + "a" * 200).encode():  # one byte every 0.1 s: 24 s for the head
                if select.select([sock], [], [], 0.1)[0]:  # (before the fix: each byte restarted the clock)
                    break
                sock.sendall(bytes([byte]))
            assert sock.recv(1) == b"" and time.monotonic() - start < 1.0 + 2.0
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # nothing at all after a response
            sock.sendall((head + "\r\n").encode())
            read_answer(sock)
            start = time.monotonic()
            assert sock.recv(1) == b"" and time.monotonic() - start < 1.0 + 2.0


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (a reset, if it had not read all the socket sent)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def read_answer(sock: socket.socket) -> bytes:
    """One HTTP answer with a Content-Length, read from a raw socket (and nothing after it)."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(1)
    length = int(next(line for line in answer.lower().split(b"\r\n") if line.startswith(b"content-length:"))[15:])
    while len(answer.partition(b"\r\n\r\n")[2]) < length:
        answer += sock.recv(length)
    return answer


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_does_not_read_its_answer_is_dropped(loaded, monkeypatch, stream):
    from gpt.serve import app as serve_app

    def small_buffers(host, port):  # the kernel's buffers small: the answer (~2 MB streamed, 12 KB whole) fills them
        sock = listen(host, port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # (inherited by the accepted sockets)
        return sock

    listen = serve_app.listen
    monkeypatch.setattr(serve_app, "listen", small_buffers)
    model, tok, meta = loaded
    config = ServeConfig(model_name=NAME, max_connections=2, send_timeout=1.0, max_tokens=1000, max_batch=8)
    with running(create_app(model, tok, meta, config)) as url:
        host, port = url[len("http://") :].split(":")
        body = {"model": NAME, "prompt": "A", "max_tokens": 1000, "n": 8, "stream": stream, "temperature": 0}
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            sock.connect((host, int(port)))
            sock.sendall(post("/v1/completions", body, f"{host}:{port}"))
            start = time.monotonic()
            assert httpx.get(url + "/health").status_code == 503  # it holds one of the two places
            while httpx.get(url + "/health").status_code != 200:  # (before the fix: 503 while it stays)
                assert time.monotonic() - start < 15, "the connection that reads nothing was kept"
                time.sleep(0.2)
            sock.settimeout(10)
            received = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(65536):  # what the kernel had taken before the drop
                    received += chunk
            assert received.startswith(b"HTTP/1.1 200 ")
            assert not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n" if stream else b"}}")  # cut short


def post(path: str, body: dict, host: str) -> bytes:
    """A raw HTTP/1.1 POST of `body` as JSON."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    return (head + "\r\n\r\n").encode() + data


SECURITY_HEADERS = {
    "x-frame-options": "DENY",
    "content-security-policy": "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
}


def test_every_answer_forbids_framing_and_sniffing_and_docs_are_off_unless_asked(server, loaded):
    url = server[0]
    answers = [
        httpx.get(url + "/"),  # the playground
        httpx.get(url + "/health"),
        httpx.get(url + "/v1/models"),
        httpx.get(url + "/nothing"),  # 404
        httpx.get(url + "/health", headers={"Host": "evil.example"}),  # HostCheck's 400
        httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "A", "max_tokens": 2}),
    ]
    body = {"model": NAME, "prompt": "A", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as streamed:
        answers.append(streamed)
    for r in answers:
        assert {k: r.headers.get(k) for k in SECURITY_HEADERS} == SECURITY_HEADERS, (r.url, r.status_code)
    for path in ("/docs", "/openapi.json", "/redoc"):  # (before: Swagger UI from a CDN, served by default)
        assert httpx.get(url + path).status_code == 404, path
    model, tok, meta = loaded
    with running(create_app(model, tok, meta, ServeConfig(model_name=NAME, docs=True))) as docs_url:
        assert "swagger" in httpx.get(docs_url + "/docs").text.lower()
        assert "/v1/completions" in httpx.get(docs_url + "/openapi.json").json()["paths"]


def tiny_bpe_model():
    """A random 1-layer model over a byte-level BPE (tiktoken, GPT-2's split pattern): 256 ids and end-of-text."""
    from gpt.data.tokenizer import bpe_tokenizer

    tok = bpe_tokenizer({bytes([i]): i for i in range(256)})
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=1, n_embd=8)).eval()
    return model, tok, {"model_config": model.config.to_dict(), "tokenizer": tok.spec}


def test_anything_unexpected_is_a_500_in_openais_shape_even_a_base_exception(monkeypatch):
    class Panic(BaseException):  # what a Rust panic in tiktoken raises (pyo3's PanicException)
        pass

    def panic(text):
        raise Panic("called `Result::unwrap()` on an `Err` value")

    model, tok, meta = tiny_bpe_model()
    monkeypatch.setattr(tok, "encode", panic)
    with running(create_app(model, tok, meta, ServeConfig(model_name="bpe"))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as e:  # (before: uvicorn's plain-text 500)
            client.completions.create(model="bpe", prompt="hi", max_tokens=2)
        assert e.value.status_code == 500 and e.value.type == "server_error" and "(Panic)" in e.value.message
        assert e.value.response.headers["x-frame-options"] == "DENY"
        assert client.completions.create(model="bpe", prompt=[1, 2], max_tokens=2).usage.completion_tokens == 2


def test_a_prompt_of_a_million_spaces_is_answered_in_openais_shape():
    """tiktoken panics on a run of more than ~1,000,390 whitespace characters (a stack overflow in its regex);
    the tokenizer encodes long texts in pieces, so this prompt is simply longer than the context."""
    model, tok, meta = tiny_bpe_model()
    with running(create_app(model, tok, meta, ServeConfig(model_name="bpe", max_body_bytes=2 << 20))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="bpe", prompt=" " * 1_100_000, max_tokens=2)
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"


def test_unknown_urls_and_methods_are_openai_errors(server):
    url = server[0]
    r = httpx.get(url + "/v1/chat/nothing")
    assert r.status_code == 404 and "Unknown request URL" in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_a_client_that_leaves_mid_stream_frees_its_rows(server):
    url, app = server
    worker = app.state.worker
    body = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 1000, "n": 2, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
        assert worker.load["rows"] == 2
    deadline = time.monotonic() + 10  # closed after one chunk: the engine drops the rows at its next step
    while worker.load["rows"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.load["rows"] == 0
    steps = worker.engine.steps
    time.sleep(0.3)
    assert worker.engine.steps == steps  # nothing left to decode


def test_a_client_that_gives_up_waiting_for_a_whole_completion_frees_its_rows(server):
    url, app = server
    worker = app.state.worker
    body = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 1000, "n": 3}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    assert worker.load["rows"] > 0  # still decoding when the client hung up (a sample may have ended early)
    deadline = time.monotonic() + 10
    while worker.load["rows"] and time.monotonic() < deadline:  # the server polls for the disconnect
        time.sleep(0.02)
    assert worker.load["rows"] == 0


def test_a_full_queue_answers_429_and_the_server_goes_on(loaded):
    model, tok, meta = loaded
    app = create_app(model, tok, meta, ServeConfig(model_name=NAME, max_batch=1, max_queue=1, max_tokens=1000))
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        body = {"model": NAME, "prompt": "A", "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as busy:
            busy_lines = busy.iter_lines()  # (kept: a dropped iterator closes the connection)
            next(busy_lines)  # decoding: the only row is taken
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as waiting:
                assert waiting.status_code == 200  # queued (its headers come at once)
                with pytest.raises(openai.RateLimitError) as e:
                    client.completions.create(model=NAME, prompt="B", max_tokens=2)
                assert e.value.code == "rate_limit_exceeded" and "waiting" in e.value.message
                assert e.value.response.headers["retry-after"] == "1"
        load = app.state.worker.load
        deadline = time.monotonic() + 10
        while (load["rows"] or load["waiting"]) and time.monotonic() < deadline:  # the server sees both leave
            time.sleep(0.02)
            load = app.state.worker.load
        r = client.completions.create(model=NAME, prompt="C", max_tokens=3)  # room again
        assert r.usage.completion_tokens == 3


def test_api_key(loaded):
    model, tok, meta = loaded
    app = create_app(model, tok, meta, ServeConfig(model_name=NAME, api_key="s3cret"))
    with running(app) as url:
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=NAME, prompt="A", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert e.value.code == "invalid_api_key"
        r = httpx.post(url + "/v1/completions", json={"model": NAME})
        assert r.status_code == 401 and "didn't provide an API key" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/").status_code == 200


def test_seq2seq_checkpoints_translate_through_the_same_endpoint():
    from gpt.infer.translate import translate

    tok = CharTokenizer("\n !,.?abcdefghijklmnopqrstuvwxyz")
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32, n_encoder_layer=2)
    ).eval()
    eos = tok.eot_token
    meta = {
        "model_config": model.config.to_dict(),
        "tokenizer": tok.spec,
        "seq2seq": {"bos": eos, "eos": eos, "pad": eos},
    }
    with running(create_app(model, tok, meta, ServeConfig(model_name="de-en"))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="de-en", prompt=["ein mann", "eine frau"], max_tokens=20, temperature=0)
        expected = translate(model, tok, ["ein mann", "eine frau"], eos, eos, max_new_tokens=20)
        assert [c.text for c in r.choices] == expected
        chunks = list(
            client.completions.create(model="de-en", prompt="ein mann", max_tokens=20, temperature=0, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks) == expected[0]
        with pytest.raises(openai.BadRequestError) as e:  # the translation engine would not apply it
            client.completions.create(model="de-en", prompt="ein mann", frequency_penalty=0.5)
        assert e.value.param == "frequency_penalty" and "translation" in e.value.message


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_the_command_serves_on_a_free_port(trained_run, capsys, quantize):
    cmd = [
        sys.executable,
        "-m",
        "gpt",
        "serve",
        "--ckpt",
        str(trained_run),
        "--port",
        "0",
        "--threads",
        "1",
        "--quantize",
        quantize,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert line.startswith("serving shakespeare-char at http://127.0.0.1:") and quantize in line, line
        assert "/docs" not in line, line  # only with --docs
        n_params = load_checkpoint(trained_run)[0].num_params()  # the float model's: int8 layers hold no Parameters
        assert f" {n_params / 1e6:.2f}M parameters" in line, line
        url = line.split(" at ")[1].split("/ ")[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model=NAME, prompt="A", max_tokens=3)
        assert r.usage.completion_tokens == 3 and r.system_fingerprint.startswith("fp_")
        port = int(url.rsplit(":", 1)[1])
        assert serve_main("--ckpt", trained_run, "--port", port) == 2  # the port is taken
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}:") and err.count("\n") == 1, err
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="POSIX signals")
def test_sigterm_ends_open_streams_with_an_error_event(trained_run):
    cmd = [
        sys.executable,
        "-m",
        "gpt",
        "serve",
        "--ckpt",
        str(trained_run),
        "--port",
        "0",
        "--threads",
        "1",
        "--max-tokens",
        "100000",
        "--speculate",
        "4",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stderr.readline().split(" at ")[1].split("/ ")[0]
        # greedy: sampled, the completion could draw end-of-text (p ~ 1e-4 a token) and end before the signal
        body = {"model": NAME, "prompt": "A", "max_tokens": 100000, "stream": True, "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            events = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(next(events))["choices"]
            proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            rest = list(events)  # (before the fix: cut after 3 s, no last event)
        assert time.monotonic() - start < 2.5
        assert json.loads(rest[-1])["error"]["code"] == "server_shutting_down", rest[-3:]
        assert proc.wait(30) in (0, -signal.SIGTERM)  # (uvicorn raises the signal again once it has stopped)
        assert re.search(r"speculation: \d+ of \d+ guesses kept", proc.stderr.read())  # the run's summary
    finally:
        proc.kill()
        proc.wait(30)


def test_help_never_prints_the_api_key(monkeypatch, capsys):
    monkeypatch.setenv("GPT_SERVE_API_KEY", "s3cret-from-the-environment")
    with pytest.raises(SystemExit) as e:
        serve_main("--help")
    out = capsys.readouterr().out
    assert e.value.code == 0 and "$GPT_SERVE_API_KEY, set here" in out and "s3cret" not in out


def test_help_shows_every_limit_with_its_default(capsys):
    with pytest.raises(SystemExit):
        serve_main("--help")
    out = " ".join(capsys.readouterr().out.split())
    for option, default in [
        ("--body-idle-timeout", "(default: 5.0)"),
        ("--max-logprob-values", "(default: 131072)"),
        ("--max-connections-per-client", "(default: half of --max-connections, plus one"),
    ]:
        assert default in out[out.rindex(option + " ") :][:600], option  # (its own entry: the last mention)


def serve_main(*args):
    from gpt.cli.serve import main

    return main([str(a) for a in args])


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-batch", 0], "error: invalid server settings: --max-batch must be an integer >= 1, got 0"),
        (
            ["--max-queue", -1, "--max-tokens", 0],
            "error: invalid server settings: --max-queue must be an integer >= 1, "
            "got -1; --max-tokens must be an integer >= 1, got 0",
        ),
        (
            ["--quantize", "int8", "--dtype", "bfloat16"],
            "error: --quantize int8 starts from float32 weights, not bfloat16",
        ),
        (["--device", "cuda:7"], "error: --device cuda:7: CUDA is not available on this machine"),
        (["--port", 65536], "error: --port must be in 0-65535 (0 picks a free one), got 65536"),
        (["--header-timeout", 0], "error: invalid server settings: --header-timeout must be a number of seconds > 0"),
        (
            ["--body-idle-timeout", 0, "--max-connections-per-client", 0, "--max-logprob-values", 0],
            "error: invalid server settings: --max-logprob-values must be an integer >= 1, got 0; "
            "--max-connections-per-client must be an integer >= 1, got 0; "
            "--body-idle-timeout must be a number of seconds > 0, got 0.0",
        ),
    ],
)
def test_command_mistakes_are_one_line(trained_run, capsys, args, message):
    if "cuda" in str(args) and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert serve_main("--ckpt", trained_run, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_command_without_a_checkpoint(tmp_path, capsys):
    assert serve_main("--ckpt", tmp_path / "nope") == 2
    assert capsys.readouterr().err == f"error: no checkpoint at {tmp_path / 'nope'}\n"


def test_checkpoint_fixture_is_trained(trained_run):
    meta = loader.read_meta(trained_run)
    assert meta["val_loss"] < 3.0  # well below log(66) = 4.19: the model has learned something
