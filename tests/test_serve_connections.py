"""The places under --max-connections, tried as an attacker would from an address of its own (127.0.0.2: Linux
answers all of 127/8 on loopback): half-sent bodies, sockets kept fresh, and more connections than one address's
share never shut another client out. A tiny random model: these are the connections' costs, not the model's."""

import contextlib
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="the dev extra is not installed: pip install -e '.[dev]'")

from test_serve import closed_by_server, tiny_bpe_model  # noqa: E402

from gpt.serve.app import ServeConfig, create_app, running  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ATTACKER = "127.0.0.2"


def serve(**settings):
    model, tok, meta = tiny_bpe_model()
    return running(create_app(model, tok, meta, ServeConfig(model_name="m", **settings)))


def connect(url: str, source: str = "127.0.0.1") -> socket.socket:
    host, port = url[len("http://") :].split(":")
    return socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))


def head(url: str, path: str = "/health", method: str = "GET", length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {url[len('http://') :]}"]
    if length is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(sock: socket.socket) -> bytes:
    """One HTTP answer with a Content-Length read from a raw socket, or what came before the server closed it."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while b"\r\n\r\n" not in data and (chunk := sock.recv(1)):
            data += chunk
        heads = data.lower().split(b"\r\n")
        length = int(next((line[15:] for line in heads if line.startswith(b"content-length:")), 0))
        while len(data.partition(b"\r\n\r\n")[2]) < length and (chunk := sock.recv(length)):
            data += chunk
    return data


def test_a_body_that_stops_coming_is_a_408_long_before_the_body_timeout():
    with serve(body_idle_timeout=0.5) as url:  # --body-timeout stays 30 s
        with connect(url) as sock:
            sock.sendall(head(url, "/v1/completions", "POST", length=1000) + b'{"model": "m", ')
            start = time.monotonic()
            got = answer(sock)
        assert got.startswith(b"HTTP/1.1 408 ") and b"sent no byte for 0.5 s (--body-idle-timeout)" in got, got
        assert time.monotonic() - start < 0.5 + 2.0
        assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("per_client", [None, 4])  # the default share (3 of 4), or none: the limit alone makes room
def test_half_sent_bodies_from_one_address_never_shut_others_out(per_client):
    settings = {} if per_client is None else {"max_connections_per_client": per_client}
    with serve(max_connections=4, header_timeout=60.0, **settings) as url:
        attacker = [connect(url, ATTACKER) for _ in range(8)]
        try:
            for sock in attacker:  # each a request whose body is 1,000 bytes, one of which is sent
                sock.sendall(head(url, "/v1/completions", "POST", length=1000) + b"{")
                time.sleep(0.05)  # (the server reads the head: a request under way)
            for _ in range(3):  # (before the fix: 503 until --body-timeout, 30 s, and again when they reconnect)
                assert httpx.get(url + "/health", timeout=10).status_code == 200
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
            assert sum(closed_by_server(sock) for sock in attacker[:4]) >= 3  # the oldest made room
        finally:
            for sock in attacker:
                sock.close()


@pytest.mark.parametrize("per_client", [None, 4])
def test_at_the_limit_the_address_holding_the_most_makes_room_not_an_idle_keep_alive(per_client):
    settings = {} if per_client is None else {"max_connections_per_client": per_client}
    with serve(max_connections=4, header_timeout=60.0, **settings) as url:
        with connect(url) as victim:
            victim.sendall(head(url))
            assert answer(victim).startswith(b"HTTP/1.1 200 ")  # kept alive, idle: the longest waiting
            attacker = []
            try:
                for _ in range(8):  # each new socket sends a request at once: always fresher than the victim's
                    sock = connect(url, ATTACKER)
                    attacker.append(sock)
                    sock.sendall(head(url))
                    assert answer(sock).startswith(b"HTTP/1.1 200 ")
                victim.sendall(head(url))  # (before the fix: closed to make room for the attacker's third)
                assert answer(victim).startswith(b"HTTP/1.1 200 ")
            finally:
                for sock in attacker:
                    sock.close()


def test_one_address_holds_at_most_its_share_and_the_rest_is_a_429_naming_the_option(monkeypatch):
    model, tok, meta = tiny_bpe_model()
    app = create_app(model, tok, meta, ServeConfig(model_name="m", max_connections=8, max_connections_per_client=2))
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: time.sleep(2.0) or encode(text))  # requests under way a while
    with running(app) as url:
        busy = []
        attacker = httpx.Client(transport=httpx.HTTPTransport(local_address=ATTACKER), timeout=30)
        threads = [
            threading.Thread(target=lambda: busy.append(attacker.post(url + "/tokenize", json={"prompt": "x"})))
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # both under way
        with httpx.Client(transport=httpx.HTTPTransport(local_address=ATTACKER), timeout=30) as more:
            r = more.get(url + "/health")
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        error = r.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "(--max-connections-per-client)" in error["message"]
        assert httpx.get(url + "/health").status_code == 200  # another address is answered
        for thread in threads:
            thread.join(30)
        assert [b.status_code for b in busy] == [200, 200]
        with httpx.Client(transport=httpx.HTTPTransport(local_address=ATTACKER), timeout=30) as again:
            assert again.get(url + "/health").status_code == 200  # its requests done: room again
        attacker.close()
