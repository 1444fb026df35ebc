"""What stands between the network and the routes: the connection's deadlines and the app's wrappers.

    Server(app)                 # gpt.serve.app: uvicorn with `http_protocol(header_timeout, send_timeout)`
    app.add_middleware(HostCheck, allowed=("my.lan",))

- `http_protocol(head_timeout, send_timeout)`: uvicorn's h11 connection with two deadlines. uvicorn
  starts its keep-alive timer only after a response and stops it at the first byte received, so a
  client that sends nothing, or half a head, holds its place under `--max-connections` for ever (192
  such sockets answered every other client 503). Here a connection has `head_timeout` seconds to send
  a whole head, counted from the moment it opens and again from the end of each response; then it is
  closed. The other way round, a client that stops reading (a stream it asked for, or the end of an
  answer) held its place just as long: when the transport's buffer stays full, or an answer's last
  bytes stay unsent, for `send_timeout` seconds, the connection is dropped.
  A deadline alone still lets a client that reconnects as fast as it is closed keep the places taken;
  so a connection that opens at the limit makes room first: it closes the connection that has waited
  longest for a head (never one with a request under way). Sockets that send no whole head can then
  never shut out a client that does; only requests under way (themselves bounded by --max-batch and
  --max-queue, 429 beyond) fill the places, and past them uvicorn answers 503.
  A body has its own deadline (`--body-timeout`, in app.read_body); h11 answers 400 to a head it
  cannot finish within 16 KiB of buffer (one read of up to 256 KiB may pass whole). The h11 protocol
  is named, not uvicorn's `auto`, so installing httptools changes nothing here.
- `HostCheck`: without an API key, only a `Host` naming this server is answered (DNS rebinding).
- `Hardened`, the outermost wrapper: every response carries `X-Frame-Options: DENY`,
  `Content-Security-Policy: frame-ancestors 'none'` (no page can frame the playground) and
  `X-Content-Type-Options: nosniff`; and anything a route raises that nothing else answered (a
  `BaseException` too, such as a Rust panic in a tokenizer) is a 500 in OpenAI's error shape, logged
  with its traceback, instead of uvicorn's plain-text 500. Interrupts and cancellation pass through.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from gpt.serve.api import APIError

log = logging.getLogger("gpt.serve")

SECURITY_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
]
PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)  # not failures: re-raised


class Deadlines(H11Protocol):
    """uvicorn's h11 connection with two deadlines (see the module's docstring): closed when a request
    head has not arrived `head_timeout` seconds after the connection opened or after the last response
    ended; dropped when an answer has sat unread for `send_timeout` seconds; closed to make room when
    it waits for a head and a new connection finds the limit reached."""

    head_timeout: float = 5.0
    send_timeout: float = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head: asyncio.TimerHandle | None = None
        self._send: asyncio.TimerHandle | None = None
        self._waiting_since = 0.0  # when it began to wait for a head (loop time)
        self._wait_for_head()
        self._make_room()

    def _make_room(self) -> None:
        """Keep a place for this connection's request: past the limit (uvicorn counts this connection too),
        close the connections that have waited longest for a head."""
        if self.limit_concurrency is None:
            return
        others = [c for c in self.connections if c is not self and not _gone(c.transport)]
        waiting = sorted((c for c in others if isinstance(c, Deadlines) and c._idle()), key=lambda c: c._waiting_since)
        for c in waiting[: max(0, len(others) + 2 - self.limit_concurrency)]:
            c._drop()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # a complete head starts a request: self.cycle is a new one
        if not self._idle():
            self._head = _cancel(self._head)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (may start the next, pipelined, request)
        if self._idle() and not self.transport.is_closing():
            self._wait_for_head()
        else:
            self._head = _cancel(self._head)
        if self.transport.get_write_buffer_size():  # the answer's end is not sent yet: the client must read it
            self._wait_for_reader()

    def pause_writing(self) -> None:  # the transport's buffer is full: the client does not read
        super().pause_writing()
        self._wait_for_reader()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._send = _cancel(self._send)

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self._head, self._send = _cancel(self._head), _cancel(self._send)

    def _idle(self) -> bool:
        """No request under way: before the first head, or after a response."""
        return self.cycle is None or self.cycle.response_complete

    def _wait_for_head(self) -> None:
        self._waiting_since = self.loop.time()
        _cancel(self._head)
        self._head = self.loop.call_later(self.head_timeout, self._no_head)

    def _no_head(self) -> None:
        self._head = None
        if self._idle() and not self.transport.is_closing():
            self.transport.close()  # (with unsent bytes, it waits for them: the send deadline is on)

    def _wait_for_reader(self) -> None:
        _cancel(self._send)
        self._send = self.loop.call_later(self.send_timeout, self._not_read)

    def _not_read(self) -> None:
        self._send = None
        if self.transport.get_write_buffer_size():
            self._drop()

    def _drop(self) -> None:
        """Close the connection now: close() would wait for the client to read what is still unsent."""
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()


def _gone(transport) -> bool:
    """Closed with nothing left to send: the connection leaves uvicorn's count at the loop's next turn."""
    return transport.is_closing() and not transport.get_write_buffer_size()


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


def http_protocol(head_timeout: float, send_timeout: float) -> type[Deadlines]:
    """The connection class for uvicorn's `http` setting, with these deadlines."""
    return type("Deadlines", (Deadlines,), {"head_timeout": head_timeout, "send_timeout": send_timeout})


class Hardened:
    """ASGI middleware, outermost: the security headers on every response, and a 500 in OpenAI's shape for
    anything unexpected (see the module's docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_hardened(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()), *SECURITY_HEADERS]}
            await send(message)

        try:
            await self.app(scope, receive, send_hardened)
        except PASS_THROUGH:
            raise
        except BaseException as e:
            if started:  # too late for an answer of its own: uvicorn logs it and closes the connection
                raise
            log.error("internal error on %s %s", scope["method"], scope["path"], exc_info=e)
            error = APIError(
                500, f"The server had an error while processing your request ({type(e).__name__}).", type="server_error"
            )
            await JSONResponse(error.body(), status_code=500)(scope, receive, send_hardened)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class HostCheck:
    """ASGI middleware: answer only requests whose `Host` names this server (a 400 otherwise).

    A web page can point a name of its own at 127.0.0.1 (DNS rebinding) and then read this server as
    if it were same-origin; its requests carry that name in `Host`. Allowed: the loopback names and
    `allowed` (`--host`, `--allowed-hosts`), any port; `*` allows any Host; an unspecified address
    (`0.0.0.0`, `::`) allows every IP address, which no rebinding can use. Used without an API key.
    """

    def __init__(self, app, allowed: tuple[str, ...] = ()):
        self.app = app
        self.names = {name.lower().strip("[]") for name in (*LOOPBACK_NAMES, *allowed)}
        self.any_ip = any(_is_ip(name) and ipaddress.ip_address(name).is_unspecified for name in self.names)

    def allows(self, host: str) -> bool:
        if "*" in self.names:
            return True
        name = host.lower()
        name = name[1 : name.find("]")] if name.startswith("[") else name.rpartition(":")[0] if ":" in name else name
        return name in self.names or (self.any_ip and _is_ip(name))

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not self.allows(host):
                error = APIError(
                    400,
                    f"This server does not answer to the Host {host!r} without an API key (a guard "
                    "against DNS rebinding): add the name with --allowed-hosts, or set --api-key.",
                    code="invalid_host",
                )
                await JSONResponse(error.body(), status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
