"""The server's request handling: one `Service` per app holds the model's engine, the tokenizer, the chat
template and the limits, with one method per route (`app.create_app` wires them).

    service = Service(model, tokenizer, meta, ServeConfig(model_name="m"))
    service.worker.start()
    body = await service.completions(http_request)      # a dict, or a StreamingResponse

How a request flows: the body is read up to `max_body_bytes`, validated (`api.CompletionRequest`), checked
against the server's limits and the model (`checks`), and encoded; each prompt becomes one engine `Request`
with `n` samples, all queued together or answered 429 when the waiting queue is full; `answers` turns what
the engine hands back into the response or the stream. A chat's prompt is built by `gpt.infer.chat.chat_prompt`,
as `sample.py --chat` builds it, the conversation kept whole (a longer one is a 400).

The event loop answers every client, so no text work runs on it: encoding and decoding (a tokenizer's regex
can take seconds over one long text) and building a whole answer's JSON (echo with logprobs turns a small
request into megabytes) run on the service's text threads (`off_loop`), and `/health` and other clients are
answered meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from importlib import resources

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from gpt.data.chat import ChatError, check_conversation
from gpt.errors import UserError
from gpt.infer.batching import BatchEngine
from gpt.infer.chat import PromptTooLong, chat_prompt, chat_template
from gpt.infer.engine import BatchWorker, QueueFull, Request
from gpt.infer.sampling import SampleConfig, SamplingError, prompt_ids
from gpt.infer.seq2seq_engine import Seq2seqEngine
from gpt.infer.speculative import load_draft
from gpt.infer.speculative_batch import Speculator
from gpt.serve import ServeError, checks
from gpt.serve.answers import answer_json, emit_to, read_body, respond, stream
from gpt.serve.api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_error,
)
from gpt.serve.config import ServeConfig
from gpt.serve.responses import ChatCompletion, Completion, model_card


def speculation(config: ServeConfig, model, tokenizer, draft=None) -> Speculator | None:
    """The engine's speculator for --speculate (prompt lookup) or --draft-ckpt (its model, loaded on the main
    model's device and dtype unless given), or None."""
    if not config.speculate:
        return None
    if config.draft_ckpt is not None and draft is None:
        draft = load_draft(config.draft_ckpt, model, tokenizer)
    return Speculator(config.speculate, draft)


def speculation_stats(speculator: Speculator) -> dict:
    """/health's (and the shutdown line's) account of the guesses: how many were checked and kept."""
    stats = speculator.stats
    return {
        "k": speculator.k,
        "drafter": speculator.kind,
        "passes": stats.passes,
        "drafted": stats.drafted,
        "kept": stats.kept,
        "acceptance": round(stats.acceptance, 4),
    }


STOPPING = APIError(
    503, "The server is shutting down; try again later.", type="server_error", code="server_shutting_down"
)


class Service:
    """What the routes answer, for one model; its engine runs on `worker`'s thread, its text work on
    `text_threads` (`off_loop`); the app starts and stops both."""

    def __init__(self, model, tokenizer, meta: dict, config: ServeConfig, draft=None):
        """`draft`: the model of `config.draft_ckpt` loaded already (else it is loaded here)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.seq2seq = model.config.n_encoder_layer > 0
        if self.seq2seq:
            if config.speculate:
                raise ServeError("--speculate and --draft-ckpt decode decoder-only models, not encoder-decoder ones")
            engine = Seq2seqEngine(model, tokenizer, meta, config.max_batch)
        else:
            prefix = config.prefix_cache_mb << 20
            speculator = speculation(config, model, tokenizer, draft)
            try:
                engine = BatchEngine(
                    model, tokenizer, config.max_batch, prefix_cache_bytes=prefix, speculator=speculator
                )
            except SamplingError as e:
                raise ServeError(f"--speculate: {e}") from None
        self.worker = BatchWorker(engine, config.max_queue)
        self.limits = checks.Limits.of(config, model.config.block_size, tokenizer.vocab_size)
        self.template = None if self.seq2seq else chat_template(meta)
        self.eos_text = tokenizer.decode([tokenizer.eot_token])
        self.created = int(time.time())
        self.page = (resources.files("gpt.serve") / "playground.html").read_text(encoding="utf-8")
        self.stopping = False
        self.open: weakref.WeakSet[asyncio.Queue] = weakref.WeakSet()  # the queues of the answers under way
        self.text_threads = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="gpt-text")

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        """Stop the engine's thread; text work not started yet is dropped."""
        self.worker.stop()
        self.text_threads.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn, *args):
        """`fn(*args)` on a text thread, awaited: what it returns, or what it raises."""
        return await asyncio.get_running_loop().run_in_executor(self.text_threads, functools.partial(fn, *args))

    def end_completions(self) -> None:
        """End every completion under way with a 503, and refuse new ones (on the event loop's thread)."""
        self.stopping = True
        for queue in list(self.open):
            queue.put_nowait((0, STOPPING))

    # ---- the routes ------------------------------------------------------------------------------------

    async def playground(self) -> str:
        return self.page

    async def health(self) -> dict:
        prefix = getattr(self.worker.engine, "prefix", None)
        cached = {"prefix_cache": prefix.stats} if prefix is not None else {}
        speculator = getattr(self.worker.engine, "speculator", None)
        if speculator is not None:
            cached["speculation"] = speculation_stats(speculator)
        return {"status": "ok", "model": self.config.model_name, **self.worker.load, **cached}

    async def models(self, request: HTTPRequest) -> dict:
        self.authorize(request)
        return {"object": "list", "data": [self.card(name) for name in (self.config.model_name, *self.config.adapters)]}

    async def model_info(self, name: str, request: HTTPRequest) -> dict:
        self.authorize(request)
        checks.served_model(name, self.limits)
        return self.card(name)

    async def completions(self, request: HTTPRequest):
        req = await self.parse(request, CompletionRequest)
        checks.scoring(req, self.seq2seq)
        texts = req.prompts()
        sample = checks.sampling(req, req.max_tokens, len(texts), self.limits, self.seq2seq)
        sample = replace(sample, grammar=await self.off_loop(checks.grammar, req, self.tokenizer, self.seq2seq))
        prompts, echoes = await self.off_loop(self.prompts, texts, bool(req.echo))
        checks.logprob_values(req.logprobs, prompts, sample, self.limits, bool(req.echo), req.max_tokens != 0)
        completion = Completion(req.model, self.config.fingerprint)
        if req.max_tokens == 0 and req.logprobs is None:  # echo alone: the prompt is the whole answer
            echoed = [e for e in echoes for _ in range(sample.num_samples)]
            tokens = sum(len(ids) for ids in prompts)
            return await self.off_loop(answer_json, completion, echoed, ["length"] * len(echoed), tokens, 0, None)
        scoring = {"logprobs": req.logprobs, "echo": bool(req.echo), "generate": req.max_tokens != 0}
        return await self.answer(request, req, sample, prompts, completion, echoes, scoring)

    async def chat_completions(self, request: HTTPRequest):
        req = await self.parse(request, ChatCompletionRequest)
        if self.template is None:
            raise APIError(
                400,
                f"The model '{self.config.model_name}' is a plain language model, not a chat model (its checkpoint "
                "has no chat template): use /v1/completions, or fine-tune it on a chat dataset.",
                param="model",
                code="not_a_chat_model",
            )
        try:
            req.tool_list()
        except ValueError as e:
            param = "tools" if req.tools is not None else "tool_choice"
            raise APIError(400, f"Invalid '{param}': {e}.", param=param, code="invalid_value") from None
        try:
            messages = req.conversation()
            check_conversation(messages, for_prompt=True)
        except (ValueError, ChatError) as e:
            raise APIError(400, f"Invalid messages: {e}.", param="messages", code="invalid_messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens or self.config.max_tokens
        top = checks.chat_logprobs(req, self.seq2seq)
        sample = checks.sampling(req, max_tokens, 1, self.limits, self.seq2seq)
        sample = replace(sample, grammar=await self.off_loop(checks.grammar, req, self.tokenizer, self.seq2seq))
        ids, sample = await self.off_loop(self.chat_prompt, messages, sample)
        checks.logprob_values(top, [ids], sample, self.limits)
        completion = ChatCompletion(req.model, self.config.fingerprint, top, req.calls_expected())
        scoring = {"logprobs": top, "echo": False, "generate": True} if top is not None else None
        return await self.answer(request, req, sample, [ids], completion, [""], scoring)

    async def tokenizer_info(self, request: HTTPRequest) -> dict:
        """What lm-evaluation-harness's remote tokenizer reads first (vLLM's route): the end-of-text token
        (the prefix of every scored text), the context length."""
        self.authorize(request)
        return {
            "tokenizer_class": type(self.tokenizer).__name__,
            "eos_token": self.eos_text,
            "eos_token_id": self.tokenizer.eot_token,
            "bos_token": None,
            "pad_token": None,
            "vocab_size": self.tokenizer.vocab_size,
            "model_max_length": self.limits.block_size,
        }

    async def tokenize(self, request: HTTPRequest) -> JSONResponse:
        """Text -> ids, the end-of-text token's text included as its id (lm-eval reads the end-of-text id
        as `tokenize(eos_token)[0]`)."""
        req = await self.parse(request, TokenizeRequest)
        return await self.off_loop(self.tokens_of, req.prompt)

    async def detokenize(self, request: HTTPRequest) -> JSONResponse:
        req = await self.parse(request, DetokenizeRequest)
        return await self.off_loop(self.text_of, req.tokens)

    # ---- what the routes share -------------------------------------------------------------------------

    def card(self, name: str | None = None) -> dict:
        return model_card(name or self.config.model_name, self.created, self.template is not None)

    def authorize(self, request: HTTPRequest) -> None:
        """With an API key, a 401 unless the request carries it as `Authorization: Bearer KEY`."""
        if self.config.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(
                401, "You didn't provide an API key: send it as 'Authorization: Bearer KEY'.", code="invalid_api_key"
            )
        if not hmac.compare_digest(key.strip().encode(), self.config.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def parse(self, request: HTTPRequest, schema):
        """The request's JSON body as `schema`, or the 4xx that says what is wrong with it."""
        self.authorize(request)
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(
                415,
                "The request body must be JSON sent with 'Content-Type: application/json' (got "
                f"{repr(media_type) if media_type else 'no Content-Type'}).",
                code="unsupported_media_type",
            )
        config = self.config
        body = await read_body(request, config.max_body_bytes, config.body_timeout, config.body_idle_timeout)
        try:
            return schema.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e, body) from None

    async def answer(self, request: HTTPRequest, req, sample: SampleConfig, prompts, completion, echoes, scoring=None):
        """Queue one engine request per prompt, then answer: the whole body, or a stream of chunks.
        `scoring`: the engine Request's logprobs, echo and generate."""
        if self.stopping:
            raise STOPPING
        queue: asyncio.Queue = asyncio.Queue()
        self.open.add(queue)
        loop = asyncio.get_running_loop()
        scoring = scoring or {}
        adapter = checks.served_model(req.model, self.limits)  # (checked already: the base or an adapter)
        requests = [
            Request(ids, sample, emit_to(loop, queue, i * sample.num_samples), adapter=adapter, **scoring)
            for i, ids in enumerate(prompts)
        ]
        try:
            self.worker.submit(requests)
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
        scored = self.tokenizer if scoring.get("logprobs") is not None else None
        return await respond(request, completion, queue, requests, total, echoes, prompt_tokens, self.off_loop, scored)

    # ---- text work, on a text thread (`off_loop`) ------------------------------------------------------

    def tokens_of(self, text: str) -> JSONResponse:
        """`/tokenize`'s answer: the end-of-text token's text becomes its id."""
        with checks.encoding("prompt"):
            parts = [self.tokenizer.encode(part) if part else [] for part in text.split(self.eos_text)]
        ids = [*parts[0]]
        for part in parts[1:]:
            ids += [self.tokenizer.eot_token, *part]
        return JSONResponse({"count": len(ids), "max_model_len": self.limits.block_size, "tokens": ids})

    def text_of(self, ids: list[int]) -> JSONResponse:
        """`/detokenize`'s answer."""
        checks.token_ids(ids, self.limits)
        return JSONResponse({"prompt": self.tokenizer.decode(ids)})

    def prompts(self, texts: list, echo: bool) -> tuple[list[list[int]], list[str]]:
        """A completion's prompts as ids (`checks.prompt_ids`), and as texts to echo ("" without `echo`)."""
        prompts = checks.prompt_ids(texts, self.encode, self.limits)
        return prompts, [self.tokenizer.decode(ids) if echo else "" for ids in prompts]

    def encode(self, text: str | list[int]) -> list[int]:
        """A completion's prompt (a text or ids) as ids: a language model's starts from end-of-text."""
        if self.seq2seq:
            return self.tokenizer.encode(text) if isinstance(text, str) else list(text)
        return prompt_ids(self.model, self.tokenizer, text)

    def chat_prompt(self, messages: list[dict], sample: SampleConfig) -> tuple[list[int], SampleConfig]:
        """The conversation's ids and the sampling settings that end its answer (`gpt.infer.chat.chat_prompt`,
        the conversation kept whole), or the 400 that says why not."""
        limits = self.limits
        try:
            ids, sample, _, _ = chat_prompt(
                self.template, self.tokenizer, messages, sample, limits.block_size, limit=limits.max_prompt
            )
        except PromptTooLong as e:
            raise APIError(
                400,
                f"The conversation has {e.length} tokens, more than this server's limit of {limits.max_prompt - 1} "
                f"(the model's context is {limits.block_size} tokens, the answer needs at least one): shorten it.",
                param="messages",
                code="context_length_exceeded",
            ) from None
        except UserError as e:
            raise APIError(400, f"Invalid messages: {e}.", param="messages", code="invalid_messages") from None
        return ids, sample
