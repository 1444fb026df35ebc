"""What stands between the network and the routes: the connection's deadlines and the app's wrappers.

    Server(app)                 # gpt.serve.app: uvicorn with `http_protocol(header_timeout, send_timeout, per_client)`
    app.add_middleware(HostCheck, allowed=("my.lan",))

- `http_protocol(head_timeout, send_timeout, per_client)`: uvicorn's h11 connection with two deadlines
  and a share per client. uvicorn starts its keep-alive timer only after a response and stops it at the
  first byte received, so a client that sends nothing, or half a head, holds its place under
  `--max-connections` for ever (192 such sockets answered every other client 503). Here a connection has
  `head_timeout` seconds to send a whole head, counted from the moment it opens and again from the end of
  each response; then it is closed. The other way round, a client that stops reading (a stream it asked
  for, or the end of an answer) held its place just as long: when the transport's buffer stays full, or an
  answer's last bytes stay unsent, for `send_timeout` seconds, the connection is dropped.
  A deadline alone still lets a client that reconnects as fast as it is closed keep the places taken;
  so a connection that opens at the limit makes room first: it closes a connection that waits for a head
  or whose request body has not all arrived (a body trickled one byte at a time held its place for the
  whole `--body-timeout` and, 192 times over, shut everyone out), never one whose request is under way.
  It takes that connection from the client address holding the most connections (so a client that keeps
  its own sockets fresh closes its own, not others' idle keep-alive ones), idle before half-sent, the
  longest waiting first. One address holds at most `per_client` connections (`--max-connections-per-client`,
  half the places by default): a new one closes the address's own idle or half-sent ones, and when all of
  them have requests under way its request is a 429 that names the option. Sockets that send no whole
  request can then never shut out a client that does; only requests under way fill the places (themselves
  bounded by --max-batch and --max-queue, 429 beyond, and per address), and past them uvicorn answers 503.
  A body has its own deadlines (`--body-timeout` for all of it, `--body-idle-timeout` between two bytes,
  in answers.read_body); h11 answers 400 to a head it cannot finish within 16 KiB of buffer (one read of
  up to 256 KiB may pass whole). The h11 protocol is named, not uvicorn's `auto`, so installing httptools
  changes nothing here.
- `HostCheck`: without an API key, only a `Host` naming this server is answered (DNS rebinding); the
  header is parsed strictly (a name or an address, then at most a numeric port).
- `Hardened`, the outermost wrapper: every response carries `X-Frame-Options: DENY`,
  `Content-Security-Policy: frame-ancestors 'none'` (no page can frame the playground) and
  `X-Content-Type-Options: nosniff`; and anything a route raises that nothing else answered (a
  `BaseException` too, such as a Rust panic in a tokenizer) is a 500 in OpenAI's error shape, logged
  with its traceback, instead of uvicorn's plain-text 500. Interrupts and cancellation pass through.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import re

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
    """uvicorn's h11 connection with two deadlines and a share per client address (see the module's
    docstring): closed when a request head has not arrived `head_timeout` seconds after the connection
    opened or after the last response ended; dropped when an answer has sat unread for `send_timeout`
    seconds; closed to make room, while it waits for a head or for the rest of a body, when a new
    connection finds the limit reached or its address holding more than `per_client` connections."""

    head_timeout: float = 5.0
    send_timeout: float = 30.0
    per_client: int | None = None  # connections one client address may hold; None: no limit

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head: asyncio.TimerHandle | None = None
        self._send: asyncio.TimerHandle | None = None
        self._since = 0.0  # when it began to wait for a head, or for the body of its request (loop time)
        self._address = client_address(self.client)
        self._wait_for_head()
        self._fit_address()
        self._make_room()
        self._app, self.app = self.app, self._within_share  # (uvicorn runs `self.app` for each request)

    def _make_room(self) -> None:
        """Keep a place for this connection's request: past the limit (uvicorn counts this connection too),
        close waiting connections of the addresses holding the most."""
        if self.limit_concurrency is None:
            return
        live = [c for c in self.connections if not _gone(c.transport)]
        _close_some(live, self, len(live) + 1 - self.limit_concurrency)

    def _fit_address(self) -> bool:
        """Whether this connection's address holds at most `per_client` connections, once its own waiting ones
        (the longest waiting first, never this one) are closed to get there."""
        if self.per_client is None or self._address is None:
            return True
        mine = [c for c in self.connections if getattr(c, "_address", None) == self._address]
        mine = [c for c in mine if not _gone(c.transport)]
        _close_some(mine, self, len(mine) - self.per_client)
        return sum(not _gone(c.transport) for c in mine) <= self.per_client

    async def _within_share(self, scope, receive, send) -> None:
        """The app, for a request whose address is within its share; a 429 naming the limit otherwise."""
        if self._fit_address():
            await self._app(scope, receive, send)
            return
        error = APIError(
            429,
            f"Too many connections from your address: this server lets one client address hold {self.per_client} "
            "(--max-connections-per-client), and all of yours have requests under way; try again later.",
            type="requests",
            code="rate_limit_exceeded",
        )
        answer = JSONResponse(error.body(), status_code=429, headers={"Retry-After": "1", "Connection": "close"})
        await Hardened(answer)(scope, receive, send)

    def data_received(self, data: bytes) -> None:
        idle = self._idle()
        super().data_received(data)  # a complete head starts a request: self.cycle is a new one
        if not self._idle():
            self._head = _cancel(self._head)
            if idle:  # its body (if any) is awaited from now
                self._since = self.loop.time()

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

    def _waiting(self) -> bool:
        """Idle, or its request's body has not all arrived: a connection that may be closed to make room."""
        return self._idle() or self.cycle.more_body

    def _wait_for_head(self) -> None:
        self._since = self.loop.time()
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


def _close_some(live: list, keep, count: int) -> None:
    """Close `count` of the waiting connections in `live` (never `keep`): each time one of the client address
    that holds the most of `live`, idle ones before half-sent requests, the longest waiting first."""
    if count <= 0:
        return
    held = collections.Counter(getattr(c, "_address", None) for c in live)
    waiting = [c for c in live if c is not keep and isinstance(c, Deadlines) and c._waiting()]
    waiting.sort(key=lambda c: (not c._idle(), c._since))
    for _ in range(min(count, len(waiting))):
        c = max(waiting, key=lambda c: held[c._address])  # (the first of the most held: idle, then oldest)
        waiting.remove(c)
        held[c._address] -= 1
        c._drop()


def client_address(client: tuple[str, int] | None) -> str | None:
    """What one client holds connections as: its IPv4 address, or its IPv6 /64 (a host is given a whole /64,
    so one address each would be no limit); None for a Unix socket."""
    if not client:
        return None
    try:
        ip = ipaddress.ip_address(client[0].partition("%")[0])
    except ValueError:
        return client[0]
    if ip.version == 6 and ip.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def _gone(transport) -> bool:
    """Closed with nothing left to send: the connection leaves uvicorn's count at the loop's next turn."""
    return transport.is_closing() and not transport.get_write_buffer_size()


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


def http_protocol(head_timeout: float, send_timeout: float, per_client: int | None = None) -> type[Deadlines]:
    """The connection class for uvicorn's `http` setting, with these deadlines and share per address."""
    settings = {"head_timeout": head_timeout, "send_timeout": send_timeout, "per_client": per_client}
    return type("Deadlines", (Deadlines,), settings)


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
        self.names = {_compressed(name.lower().strip("[]")) for name in (*LOOPBACK_NAMES, *allowed)}
        self.any_ip = any(_is_ip(name) and ipaddress.ip_address(name).is_unspecified for name in self.names)

    def allows(self, host: str) -> bool:
        if "*" in self.names:
            return True
        name = host_name(host)
        return name is not None and (name in self.names or (self.any_ip and _is_ip(name)))

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


HOST = re.compile(r"(?:\[([0-9a-f:.]+)\]|([a-z0-9._~-]+))(?::[0-9]{1,5})?")  # RFC 3986's host [":" port], strictly


def host_name(host: str) -> str | None:
    """The name (or address, without brackets) in a `Host` header, lower-cased; None unless the whole header is
    a name or an address and at most a numeric port: `127.0.0.1:80@evil.com`, `[::1]evil.com` and
    `localhost:evil` name nothing."""
    match = HOST.fullmatch(host.lower())
    if match is None:
        return None
    ipv6, name = match.groups()
    if ipv6 is not None:
        try:
            return str(ipaddress.IPv6Address(ipv6))  # (compressed, as the allowed names are)
        except ValueError:
            return None
    return name


def _compressed(name: str) -> str:
    """An IPv6 address in its one short form (`0::1` is `::1`); any other name as it is."""
    try:
        return str(ipaddress.IPv6Address(name))
    except ValueError:
        return name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
