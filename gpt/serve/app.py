"""The HTTP server: FastAPI routes over a `gpt.infer.batching` engine running on its own thread.

    app = create_app(model, tokenizer, meta, ServeConfig(model_name="shakespeare-char"))
    Server(app).run(sockets=[listen("127.0.0.1", 8000)])  # what `gpt serve` does (uvicorn, guarded)

Routes: `POST /v1/completions` (OpenAI's completions API, streamed as server-sent events with
`"stream": true`; `logprobs` and `echo` score prompts, as lm-evaluation-harness asks: `api.py`), `POST
/v1/chat/completions` (its chat API, for checkpoints fine-tuned on a chat
dataset: the messages rendered by the checkpoint's chat template, the answer ending at its end of turn;
a plain model answers a 400 `not_a_chat_model`), `GET /tokenizer_info`, `POST /tokenize` and `POST /detokenize`
(vLLM's routes, which lm-eval's remote tokenizer reads), `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`,
the playground page at `/` (`playground.html`), and with `docs` the OpenAPI page at `/docs` (its Swagger
UI script comes from a CDN, so it is off by default). With an API key, `/v1/*` needs `Authorization:
Bearer KEY`. Every answer forbids framing and MIME sniffing (`guards.Hardened`).

Browsers. Without an API key, every route answers only a `Host` this server goes by (`HostCheck`:
the loopback names, `--host`, `--allowed-hosts`), so a web page cannot reach it through a name of its
own (DNS rebinding). The POST route takes `Content-Type: application/json` only (415 otherwise): a
cross-site page cannot send that without the browser asking first (a CORS preflight), and the server
sends no CORS headers at all, so browsers refuse every cross-origin call and read. The playground is
same-origin and unaffected.

Limits. A connection that has not sent a whole request head `header_timeout` seconds after it opened
or after its last response is closed, one that leaves an answer unread for `send_timeout` seconds is
dropped (`guards.Deadlines`); a body is read up to `max_body_bytes` (413) within `body_timeout`
seconds, with no `body_idle_timeout` seconds between two of its bytes (408); at `max_connections` open
connections, a new one closes one that waits for a head or a body, from the address that holds the most,
and uvicorn answers 503 when every place has a request under way; one address holds at most
`max_connections_per_client` connections (its own waiting ones make room, a 429 when none waits); a
completion's logprobs carry at most `max_logprob_values` numbers (400); at shutdown (SIGTERM, Ctrl-C)
every open completion ends at once with a 503 error (a stream's last event) before uvicorn closes the
connections.

Request handling is `service.Service` (one method per route; the request checks in `checks`, the answers
and streams in `answers`); `create_app` only builds the app and wires the routes to it.

Every client mistake is a 4xx in OpenAI's error shape (`api.APIError`); anything else that goes
wrong is a 500 in the same shape (`guards.Hardened`, BaseExceptions such as a tokenizer's Rust panic
included), logged with its traceback, and the server goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpt.serve import ServeError
from gpt.serve.api import APIError, ChatCompletionRequest, CompletionRequest
from gpt.serve.config import ServeConfig
from gpt.serve.guards import Hardened, HostCheck, http_protocol
from gpt.serve.service import Service

__all__ = ["ServeConfig", "Server", "create_app", "fingerprint", "listen", "running"]


def create_app(model, tokenizer, meta: dict, config: ServeConfig, draft=None) -> FastAPI:
    """The ASGI app serving `model`; its engine thread starts and stops with the app (lifespan). `draft`: the
    model of `config.draft_ckpt`, if loaded already."""
    service = Service(model, tokenizer, meta, config, draft)

    async def lifespan(app):
        service.start()
        yield
        service.stop()

    app = FastAPI(
        title="gpt.serve",
        description="OpenAI-compatible completions for a gpt checkpoint",
        lifespan=lifespan,
        docs_url="/docs" if config.docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if config.docs else None,
    )
    if config.api_key is None:
        app.add_middleware(HostCheck, allowed=config.allowed_hosts)
    app.add_middleware(Hardened)  # added last: the outermost, so its headers are on every answer
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.state.worker, app.state.config, app.state.end_completions = service.worker, config, service.end_completions
    app.state.service = service

    app.add_api_route("/", service.playground, response_class=HTMLResponse, include_in_schema=False)
    app.add_api_route("/health", service.health)
    app.add_api_route("/v1/models", service.models)
    app.add_api_route("/v1/models/{name:path}", service.model_info)
    app.add_api_route("/v1/completions", service.completions, methods=["POST"], openapi_extra=body(CompletionRequest))
    app.add_api_route("/tokenizer_info", service.tokenizer_info)
    app.add_api_route("/tokenize", service.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", service.detokenize, methods=["POST"])
    app.add_api_route(
        "/v1/chat/completions", service.chat_completions, methods=["POST"], openapi_extra=body(ChatCompletionRequest)
    )
    return app


def body(schema) -> dict:
    """The OpenAPI page's request body for a route that parses its JSON itself (`Service.parse`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema.model_json_schema()}}}}


async def api_error(request, e: APIError):
    headers = {429: {"Retry-After": "1"}, 408: {"Connection": "close"}}.get(e.status)
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def http_error(request, e: StarletteHTTPException):
    """Starlette's 404 and 405 in OpenAI's error shape."""
    message = {
        404: f"Unknown request URL: {request.method} {request.url.path}.",
        405: f"Method {request.method} is not allowed for {request.url.path}.",
    }.get(e.status_code, e.detail)
    code = {404: "unknown_url", 405: "method_not_allowed"}.get(e.status_code)
    return JSONResponse(APIError(e.status_code, message, code=code).body(), status_code=e.status_code)


def fingerprint(*parts) -> str:
    """A short stable id of what the backend runs, for `system_fingerprint`."""
    return "fp_" + hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); a port in use or a bad address is a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    except OSError as e:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port or --host"
        ) from None
    return sock


class Server(uvicorn.Server):
    """uvicorn serving one of our apps: its connection limit, and every open completion ended (a stream's
    last event is a 503 error) when it begins to shut down, before uvicorn waits for the connections;
    `farewell` is called once it has shut down (uvicorn then raises a SIGTERM again: code after `run` never
    runs)."""

    def __init__(self, app: FastAPI, farewell=None, **settings):
        config = app.state.config
        super().__init__(
            uvicorn.Config(
                app,
                http=http_protocol(config.header_timeout, config.send_timeout, config.max_connections_per_client),
                limit_concurrency=config.max_connections,
                **settings,
            )
        )
        self.app = app
        self.farewell = farewell

    async def shutdown(self, sockets=None) -> None:
        self.app.state.end_completions()
        await super().shutdown(sockets)
        if self.farewell is not None:
            self.farewell()


@contextlib.contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    """Serve `app` with uvicorn on a thread of this process (tests, notebooks); yields the base URL.

    with running(create_app(model, tok, meta, ServeConfig(model_name="m"))) as url:
        OpenAI(base_url=url + "/v1", api_key="unused").completions.create(model="m", prompt="Hi")
    """
    sock = listen(host, port)
    server = Server(app, log_level=log_level)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="gpt-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ServeError(f"the server on {host}:{sock.getsockname()[1]} did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
