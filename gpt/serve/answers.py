"""A completion's answer, once its engine requests are queued: the pieces the engine thread hands over, turned
into one JSON body (`respond`) or a stream of server-sent events (`stream`); and the request body, read within
the server's limits (`read_body`).

    requests = [Request(ids, sample, emit_to(loop, queue, i * sample.num_samples)) for i, ids in enumerate(prompts)]
    worker.submit(requests)
    return StreamingResponse(stream(completion, queue, requests, total, echoes, prompt_tokens, include_usage))

The engine's thread hands pieces to the request's asyncio queue (`call_soon_threadsafe`). When the client goes
away (a stream is cancelled by Starlette; a plain request polls for the disconnect) the requests are cancelled
and their rows freed at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from gpt.infer.constrain import GrammarError
from gpt.infer.engine import Request
from gpt.serve.api import APIError
from gpt.serve.responses import Completion

log = logging.getLogger("gpt.serve")


async def read_body(request: HTTPRequest, limit: int, timeout: float, idle_timeout: float) -> bytes:
    """The request body; a 413 as soon as it is known to be longer than `limit` bytes, a 408 when it has not
    all arrived after `timeout` seconds or no byte of it has for `idle_timeout` seconds."""
    too_long = APIError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes (--max-body-bytes).",
        code="request_too_large",
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_long
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    chunks, size = [], 0
    stream = request.stream()
    try:
        while True:
            left = deadline - loop.time()
            try:
                chunk = await asyncio.wait_for(anext(stream, None), min(left, idle_timeout))
            except asyncio.TimeoutError:
                if left <= idle_timeout:
                    why = f"did not all arrive within {timeout:g} s (--body-timeout)"
                else:
                    why = f"sent no byte for {idle_timeout:g} s (--body-idle-timeout)"
                raise APIError(408, f"The request body {why}.", code="request_timeout") from None
            if chunk is None:
                return b"".join(chunks)
            size += len(chunk)
            if size > limit:
                raise too_long
            chunks.append(chunk)
    except ClientDisconnect:  # it went away, or was closed to make room (guards.Deadlines): no one reads this
        raise APIError(499, "The client closed the connection before its request body arrived.") from None


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
        if isinstance(item, GrammarError):  # the request's grammar, not the server, could not go on
            raise APIError(400, f"The answer cannot follow the request's grammar: {item}.", code="invalid_value")
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
                chunk = completion.chunk(index, piece.text, piece.finish) if piece.text or piece.finish else None
                if chunk is not None:  # (a chat answer of tool calls sends each call whole)
                    yield sse(chunk)
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
    off_loop,
    tokenizer=None,
):
    """The whole completion as one JSON response, built by `off_loop` (`Service.off_loop`: a scored answer can
    be megabytes); gives up (and frees the rows) if the client disconnects. With the `tokenizer`, each choice
    carries its logprobs."""
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
    return await off_loop(answer_json, completion, texts, finishes, prompt_tokens, generated, scores, tokenizer)


def answer_json(completion: Completion, texts, finishes, prompt_tokens: int, generated: int, scores, tokenizer=None):
    """The answer as a JSONResponse (its bytes made here, on a text thread); with the `tokenizer`, with each
    choice's logprobs (`completion.logprobs`), every distinct id among them decoded once."""
    if tokenizer is None:
        return JSONResponse(completion.body(texts, finishes, prompt_tokens, generated))
    ids = {e.id for entries in scores for e in entries}
    ids.update(i for entries in scores for e in entries if e.top is not None for i in e.top)
    token_bytes = {i: tokenizer.decode_bytes([i]) for i in ids}.__getitem__
    token_text = {i: tokenizer.decode([i]) for i in ids}.__getitem__
    logprobs = [completion.logprobs(entries, token_text, token_bytes) for entries in scores]
    return JSONResponse(completion.body(texts, finishes, prompt_tokens, generated, logprobs))


async def _disconnected(http: HTTPRequest) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(0.25)
