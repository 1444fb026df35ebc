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
seconds (408); at `max_connections` open connections, a new one closes the one that has waited longest
for a head, and uvicorn answers 503 when every place has a request under way; at shutdown (SIGTERM,
Ctrl-C) every open completion ends at once with a 503 error (a stream's last event) before uvicorn
closes the connections.

How a request flows: the body is read up to `max_body_bytes`, validated (`api.CompletionRequest`),
checked against the server's limits and the model, and encoded; each prompt becomes one engine
`Request` with `n` samples, all queued together or answered 429 when the waiting queue is full. The
engine's thread hands pieces to the request's asyncio queue (`call_soon_threadsafe`); the handler
turns them into the response or stream chunks. When the client goes away (a stream is cancelled by
Starlette; a plain request polls for the disconnect) the requests are cancelled and their rows freed
at the engine's next step.

Every client mistake is a 4xx in OpenAI's error shape (`api.APIError`); anything else that goes
wrong is a 500 in the same shape (`guards.Hardened`, BaseExceptions such as a tokenizer's Rust panic
included), logged with its traceback, and the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from importlib import resources

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpt.data.chat import ChatError, check_conversation
from gpt.errors import UserError
from gpt.infer.batching import (
    BatchEngine,
    BatchWorker,
    QueueFull,
    Request,
    Seq2seqEngine,
)
from gpt.infer.chat import chat_template, end_tokens
from gpt.infer.sampling import SampleConfig, prompt_ids
from gpt.serve import ServeError
from gpt.serve.api import (
    APIError,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    logprobs_object,
    model_card,
    validation_error,
)
from gpt.serve.guards import Hardened, HostCheck, http_protocol

log = logging.getLogger("gpt.serve")


@dataclass
class ServeConfig:
    """The server's settings (`gpt serve` flags are the field names with dashes)."""

    model_name: str
    api_key: str | None = None  # None: no authentication
    max_batch: int = 32  # rows (samples) decoded together
    max_queue: int = 64  # requests waiting for rows; beyond that, 429
    max_tokens: int = 1024  # the largest max_tokens a request may ask for
    max_prompt_tokens: int | None = None  # None: the model's block_size
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0  # seconds a request body may take to arrive; then 408
    header_timeout: float = 5.0  # seconds a connection may wait before a whole request head; then it is closed
    send_timeout: float = 30.0  # seconds an answer may sit unread (the send buffer full); then the connection drops
    max_connections: int | None = None  # uvicorn's limit_concurrency (503 beyond); None: 2 x (max_batch + max_queue)
    allowed_hosts: tuple[str, ...] = ()  # Host names answered without an API key besides the loopback ones; "*": any
    docs: bool = False  # serve /docs and /openapi.json (Swagger UI loads its script from a CDN)
    fingerprint: str = ""  # system_fingerprint: what the backend runs (device, dtype, quantisation)

    def __post_init__(self):
        problems = [
            f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)!r}"
            for name in ("max_batch", "max_queue", "max_tokens", "max_body_bytes")
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1
        ]
        for name in ("max_prompt_tokens", "max_connections"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("body_timeout", "header_timeout", "send_timeout"):
            if not getattr(self, name) > 0:
                problems.append(
                    f"--{name.replace('_', '-')} must be a number of seconds > 0, got {getattr(self, name)!r}"
                )
        if not self.model_name:
            problems.append("--model-name must not be empty")
        if problems:
            raise ServeError("invalid server settings: " + "; ".join(problems))
        if self.max_connections is None:
            self.max_connections = 2 * (self.max_batch + self.max_queue)


def create_app(model, tokenizer, meta: dict, config: ServeConfig) -> FastAPI:
    """The ASGI app serving `model`; its engine thread starts and stops with the app (lifespan)."""
    seq2seq = model.config.n_encoder_layer > 0
    engine = (
        Seq2seqEngine(model, tokenizer, meta, config.max_batch)
        if seq2seq
        else BatchEngine(model, tokenizer, config.max_batch)
    )
    worker = BatchWorker(engine, config.max_queue)
    block_size = model.config.block_size
    max_prompt = min(config.max_prompt_tokens or block_size, block_size)
    created = int(time.time())
    template = None if seq2seq else chat_template(meta)
    eos_text = tokenizer.decode([tokenizer.eot_token])
    ends = end_tokens(template, tokenizer) if template else ()

    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

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
    open_completions: weakref.WeakSet[asyncio.Queue] = weakref.WeakSet()  # the queues of the answers under way
    stopping = APIError(
        503, "The server is shutting down; try again later.", type="server_error", code="server_shutting_down"
    )

    def end_completions() -> None:
        """End every completion under way with a 503, and refuse new ones (on the event loop's thread)."""
        app.state.stopping = True
        for queue in list(open_completions):
            queue.put_nowait((0, stopping))

    app.state.worker, app.state.config, app.state.end_completions = worker, config, end_completions
    app.state.stopping = False

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        headers = {429: {"Retry-After": "1"}, 408: {"Connection": "close"}}.get(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        message = {
            404: f"Unknown request URL: {request.method} {request.url.path}.",
            405: f"Method {request.method} is not allowed for {request.url.path}.",
        }.get(e.status_code, e.detail)
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(APIError(e.status_code, message, code=code).body(), status_code=e.status_code)

    def authorize(request: HTTPRequest) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(
                401, "You didn't provide an API key: send it as 'Authorization: Bearer KEY'.", code="invalid_api_key"
            )
        if not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    page = (resources.files("gpt.serve") / "playground.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground():
        return page

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.model_name, **worker.load}

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        authorize(request)
        return {"object": "list", "data": [model_card(config.model_name, created, template is not None)]}

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str, request: HTTPRequest):
        authorize(request)
        if name != config.model_name:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{config.model_name}'.",
                param="model",
                code="model_not_found",
            )
        return model_card(config.model_name, created, template is not None)

    @app.post(
        "/v1/completions",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": CompletionRequest.model_json_schema()}},
            }
        },
    )
    async def completions(request: HTTPRequest):
        req = await parse(request, CompletionRequest)
        if req.max_tokens == 0 and (req.stream or not req.echo):
            raise APIError(
                400,
                "max_tokens is 0: that only scores the prompt, which needs 'echo': true (and 'logprobs'), "
                "and is not streamed.",
                param="max_tokens",
                code="invalid_value",
            )
        if req.logprobs is not None and (req.stream or seq2seq):
            why = "with 'stream'" if req.stream else "for a translation (encoder-decoder) model"
            raise APIError(
                400,
                f"'logprobs' {why} is not supported by this server; leave one out.",
                param="logprobs",
                code="unsupported_parameter",
            )
        sample, prompts = check(req)
        echoes = [tokenizer.decode(ids) if req.echo else "" for ids in prompts]
        scoring = {"logprobs": req.logprobs, "echo": bool(req.echo), "generate": req.max_tokens != 0}
        if req.max_tokens == 0 and req.logprobs is None:  # echo alone: the prompt is the whole answer
            return Completion(config.model_name, config.fingerprint).body(
                [e for e in echoes for _ in range(sample.num_samples)],
                ["length"] * len(echoes) * sample.num_samples,
                sum(len(ids) for ids in prompts),
                0,
            )
        completion = Completion(config.model_name, config.fingerprint)
        return await answer(request, req, sample, prompts, completion, echoes, scoring)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: HTTPRequest):
        """What lm-evaluation-harness's remote tokenizer reads first (vLLM's route): the end-of-text token
        (the prefix of every scored text), the context length."""
        authorize(request)
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": eos_text,
            "eos_token_id": tokenizer.eot_token,
            "bos_token": None,
            "pad_token": None,
            "vocab_size": tokenizer.vocab_size,
            "model_max_length": block_size,
        }

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        """Text -> ids, the end-of-text token's text included as its id (lm-eval reads the end-of-text id
        as `tokenize(eos_token)[0]`)."""
        req = await parse(request, TokenizeRequest)
        with encoding("prompt"):
            parts = [tokenizer.encode(part) if part else [] for part in req.prompt.split(eos_text)]
        ids = [*parts[0]]
        for part in parts[1:]:
            ids += [tokenizer.eot_token, *part]
        return {"count": len(ids), "max_model_len": block_size, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        req = await parse(request, DetokenizeRequest)
        if any(not 0 <= i < tokenizer.vocab_size for i in req.tokens):
            raise APIError(
                400,
                f"Invalid tokens: token ids must be in [0, {tokenizer.vocab_size}).",
                param="tokens",
                code="invalid_value",
            )
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.post(
        "/v1/chat/completions",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ChatCompletionRequest.model_json_schema()}},
            }
        },
    )
    async def chat_completions(request: HTTPRequest):
        req = await parse(request, ChatCompletionRequest)
        if template is None:
            raise APIError(
                400,
                f"The model '{config.model_name}' is a plain language model, not a chat model (its checkpoint has no "
                "chat template): use /v1/completions, or fine-tune it on a chat dataset.",
                param="model",
                code="not_a_chat_model",
            )
        try:
            messages = req.conversation()
            check_conversation(messages, for_prompt=True)
        except (ValueError, ChatError) as e:
            raise APIError(400, f"Invalid messages: {e}.", param="messages", code="invalid_messages") from None
        req.max_tokens = req.max_completion_tokens or req.max_tokens or config.max_tokens
        sample, _ = check(req, texts=[])
        with encoding("messages"):
            ids = template.prompt(messages, tokenizer)
        if len(ids) >= max_prompt:
            raise APIError(
                400,
                f"The conversation has {len(ids)} tokens, more than this server's limit of {max_prompt - 1} "
                f"(the model's context is {block_size} tokens, the answer needs at least one): shorten it.",
                param="messages",
                code="context_length_exceeded",
            )
        sample = dataclasses.replace(
            sample, max_new_tokens=min(sample.max_new_tokens, block_size - len(ids)), end_tokens=ends
        )
        return await answer(request, req, sample, [ids], ChatCompletion(config.model_name, config.fingerprint), [""])

    async def parse(request: HTTPRequest, schema):
        """The request's JSON body as `schema`, or the 4xx that says what is wrong with it."""
        authorize(request)
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(
                415,
                "The request body must be JSON sent with 'Content-Type: application/json' (got "
                f"{repr(media_type) if media_type else 'no Content-Type'}).",
                code="unsupported_media_type",
            )
        body = await read_body(request, config.max_body_bytes, config.body_timeout)
        try:
            return schema.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e, body) from None

    async def answer(request: HTTPRequest, req, sample: SampleConfig, prompts, completion, echoes, scoring=None):
        """Queue one engine request per prompt, then answer: the whole body, or a stream of chunks.
        `scoring`: the engine Request's logprobs, echo and generate (completions only)."""
        if app.state.stopping:
            raise stopping
        queue: asyncio.Queue = asyncio.Queue()
        open_completions.add(queue)
        loop = asyncio.get_running_loop()
        scoring = scoring or {}
        requests = [
            Request(ids, sample, emit_to(loop, queue, i * sample.num_samples), **scoring)
            for i, ids in enumerate(prompts)
        ]
        try:
            worker.submit(requests)
        except QueueFull as e:
            raise APIError(429, f"The server is busy: {e}.", type="requests", code="rate_limit_exceeded") from None
        total = len(requests) * sample.num_samples
        prompt_tokens = sum(len(ids) for ids in prompts)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = stream(completion, queue, requests, total, echoes, prompt_tokens, include_usage)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
        token_text = (lambda i: tokenizer.decode([i])) if scoring.get("logprobs") is not None else None
        return await respond(request, completion, queue, requests, total, echoes, prompt_tokens, token_text)

    def check(req, texts: list | None = None) -> tuple[SampleConfig, list[list[int]]]:
        """The request's sampling settings and prompt ids (of `texts`, default the request's prompts), or
        the 4xx that says what is wrong."""
        unsupported = req.unsupported()
        if unsupported:
            raise APIError(
                400,
                f"'{unsupported}' is not supported by this server; leave it out.",
                param=unsupported,
                code="unsupported_parameter",
            )
        if req.model != config.model_name:
            raise APIError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{config.model_name}'.",
                param="model",
                code="model_not_found",
            )
        max_tokens = 16 if req.max_tokens is None else max(1, req.max_tokens)  # 0 scores only (completions())
        if max_tokens > config.max_tokens:
            raise APIError(
                400,
                f"max_tokens is {max_tokens}, more than this server allows ({config.max_tokens}).",
                param="max_tokens",
                code="invalid_value",
            )
        n = req.n or 1
        texts = req.prompts() if texts is None else texts
        if n * max(1, len(texts)) > config.max_batch:
            raise APIError(
                400,
                f"n x prompts is {n} x {max(1, len(texts))} = {n * max(1, len(texts))} completions, more than this "
                f"server decodes together ({config.max_batch}).",
                param="n",
                code="invalid_value",
            )
        sample = SampleConfig(
            num_samples=n,
            max_new_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            repetition_penalty=req.repetition_penalty or 1.0,
            stop=tuple(req.stop or ()),
            seed=req.seed,
        )
        prompts = []
        for text in texts:
            with encoding("prompt"):
                ids = (
                    (tokenizer.encode(text) if isinstance(text, str) else list(text))
                    if seq2seq
                    else prompt_ids(model, tokenizer, text)
                )
            if any(not 0 <= i < tokenizer.vocab_size for i in ids):
                raise APIError(
                    400,
                    f"Invalid prompt: token ids must be in [0, {tokenizer.vocab_size}).",
                    param="prompt",
                    code="invalid_prompt",
                )
            if len(ids) > max_prompt:
                raise APIError(
                    400,
                    f"The prompt has {len(ids)} tokens, more than this server's limit of {max_prompt} "
                    f"(the model's context is {block_size} tokens): shorten it.",
                    param="prompt",
                    code="context_length_exceeded",
                )
            prompts.append(ids)
        return sample, prompts

    return app


@contextlib.contextmanager
def encoding(param: str):
    """Around the encoding of a request's text: a 400 naming `param` (the field the text came from) when the
    text cannot be encoded, e.g. a character a char vocabulary lacks. The one path for prompts and chats."""
    try:
        yield
    except UserError as e:
        raise APIError(400, f"Invalid {param}: {e}.", param=param, code=f"invalid_{param}") from None


async def read_body(request: HTTPRequest, limit: int, timeout: float) -> bytes:
    """The request body; a 413 as soon as it is known to be longer than `limit` bytes, a 408 when it has not
    all arrived after `timeout` seconds."""
    too_long = APIError(
        413, f"The request body is larger than this server's limit of {limit} bytes.", code="request_too_large"
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_long

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_long
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout:g} s.", code="request_timeout") from None


def emit_to(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, first_index: int):
    """An engine `emit` (called on the engine's thread) that puts (choice index, piece) on `queue`."""

    def emit(item) -> None:
        index = first_index + getattr(item, "sample", 0)
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (index, item))
        except RuntimeError:  # the event loop is closed: the server is going down
            pass

    return emit


async def pieces(queue: asyncio.Queue, total: int):
    """(choice index, Piece) until every choice has finished; a failed step is a 500, an APIError itself."""
    finished = 0
    while finished < total:
        index, item = await queue.get()
        if isinstance(item, APIError):
            raise item
        if isinstance(item, Exception):
            log.error("decoding failed: %r", item)
            raise APIError(500, f"Decoding failed on the server ({type(item).__name__}).", type="server_error")
        finished += item.finish is not None
        yield index, item


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def stream(
    completion: Completion,
    queue,
    requests: list[Request],
    total: int,
    echoes: list[str],
    prompt_tokens: int,
    include_usage: bool,
):
    """The server-sent events of a streamed completion; cancelled by Starlette if the client leaves."""
    n = total // len(requests)
    generated = 0
    try:
        for index in range(total):
            if echoes[index // n]:
                yield sse(completion.chunk(index, echoes[index // n], None))
        try:
            async for index, piece in pieces(queue, total):
                generated += len(piece.ids)
                if piece.text or piece.finish:
                    yield sse(completion.chunk(index, piece.text, piece.finish))
        except APIError as e:
            yield sse(e.body())
            return
        if include_usage:
            yield sse(completion.usage_chunk(prompt_tokens, generated))
        yield sse("[DONE]")
    finally:
        for request in requests:  # a no-op for finished requests; frees the rows of a client that left
            request.cancel()


async def respond(
    http: HTTPRequest,
    completion: Completion,
    queue,
    requests: list[Request],
    total: int,
    echoes: list[str],
    prompt_tokens: int,
    token_text=None,
):
    """The whole completion as one JSON body; gives up (and frees the rows) if the client disconnects.
    With `token_text` (id -> its text), each choice carries its logprobs."""
    n = total // len(requests)
    texts = [echoes[i // n] for i in range(total)]
    finishes: list[str] = [""] * total
    scores: list[list] = [[] for _ in range(total)]
    generated = 0
    waiting = asyncio.ensure_future(_disconnected(http))
    try:
        it = pieces(queue, total)
        while True:
            nxt = asyncio.ensure_future(anext(it, None))
            done, _ = await asyncio.wait({nxt, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:  # the client is gone
                nxt.cancel()
                return JSONResponse({}, status_code=499)
            item = nxt.result()
            if item is None:
                break
            index, piece = item
            texts[index] += piece.text
            scores[index] += piece.logprobs or []
            generated += len(piece.ids)
            finishes[index] = piece.finish or finishes[index]
    finally:
        waiting.cancel()
        for request in requests:
            request.cancel()
    if token_text is None:
        return completion.body(texts, finishes, prompt_tokens, generated)
    logprobs = [logprobs_object(s, token_text) for s in scores]
    return completion.body(texts, finishes, prompt_tokens, generated, logprobs)


async def _disconnected(http: HTTPRequest) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(0.25)


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
    last event is a 503 error) when it begins to shut down, before uvicorn waits for the connections."""

    def __init__(self, app: FastAPI, **settings):
        config = app.state.config
        super().__init__(
            uvicorn.Config(
                app,
                http=http_protocol(config.header_timeout, config.send_timeout),
                limit_concurrency=config.max_connections,
                **settings,
            )
        )
        self.app = app

    async def shutdown(self, sockets=None) -> None:
        self.app.state.end_completions()
        await super().shutdown(sockets)


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
