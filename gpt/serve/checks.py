"""The server's checks of a parsed request, one concern each; every one answers a mistake with the 4xx
that names the field (`api.APIError`) and returns a new resolved value, never changing the request.

    limits = Limits.of(config, block_size=1024, vocab_size=50257)
    scoring(req, seq2seq=False)                             # completions: max_tokens 0, logprobs
    sample = sampling(req, req.max_tokens, len(texts), limits)  # supported fields, model, limits -> SampleConfig
    prompts = prompt_ids(texts, encode, limits)             # each prompt's ids, in the vocabulary and the limit
    logprob_values(req.logprobs, prompts, sample, limits)   # the logprobs its answer would carry, within the limit
    grammar(req, tokenizer, seq2seq=False)                  # response_format / regex / grammar, compiled

The pydantic shapes (`api.py`) check what a request is on its own; these check it against this server:
its model, its limits, the model's vocabulary and context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from gpt.errors import UserError
from gpt.infer.constrain import Grammar, GrammarError
from gpt.infer.sampling import SampleConfig
from gpt.serve.api import APIError
from gpt.serve.config import ServeConfig

DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the served name, the server's limits, the model's vocabulary and
    context (`max_prompt`: the longest prompt, at most the context)."""

    model_name: str
    max_tokens: int
    max_batch: int
    max_prompt: int
    block_size: int
    vocab_size: int
    max_logprob_values: int
    adapters: tuple[str, ...] = ()  # the LoRA adapters' names (gpt serve --lora): models 1..n beside the base

    @classmethod
    def of(cls, config: ServeConfig, block_size: int, vocab_size: int) -> Limits:
        max_prompt = min(config.max_prompt_tokens or block_size, block_size)
        return cls(
            config.model_name,
            config.max_tokens,
            config.max_batch,
            max_prompt,
            block_size,
            vocab_size,
            config.max_logprob_values,
            tuple(config.adapters),
        )


def supported(req) -> None:
    """A field asked for with a value this server does not implement is a 400 naming it."""
    unsupported = req.unsupported()
    if unsupported:
        raise APIError(
            400,
            f"'{unsupported}' is not supported by this server; leave it out.",
            param=unsupported,
            code="unsupported_parameter",
        )


def served_model(name: str, limits: Limits) -> int:
    """The model a request names: 0 for the one served, i for its i-th LoRA adapter (`gpt serve --lora`); any
    other name is a 404."""
    if name == limits.model_name:
        return 0
    if name in limits.adapters:
        return limits.adapters.index(name) + 1
    served = ", ".join(repr(n) for n in (limits.model_name, *limits.adapters))
    raise APIError(
        404,
        f"The model '{name}' does not exist; this server serves {served}.",
        param="model",
        code="model_not_found",
    )


def scoring(req, seq2seq: bool) -> None:
    """A completion's `max_tokens: 0` only scores the prompt (it needs `echo`, and is not streamed); `logprobs`
    is neither streamed nor given for a translation model."""
    if req.max_tokens == 0 and (req.stream or not req.echo):
        raise APIError(
            400,
            "max_tokens is 0: that only scores the prompt, which needs 'echo': true (and 'logprobs'), "
            "and is not streamed.",
            param="max_tokens",
            code="invalid_value",
        )
    if req.logprobs is not None:
        unstreamed_logprobs(req.stream, seq2seq)


def within_limits(max_tokens: int, n: int, prompts: int, limits: Limits) -> None:
    """`max_tokens` and the number of completions (n x prompts) within what this server allows."""
    if max_tokens > limits.max_tokens:
        raise APIError(
            400,
            f"max_tokens is {max_tokens}, more than this server allows ({limits.max_tokens}).",
            param="max_tokens",
            code="invalid_value",
        )
    if n * prompts > limits.max_batch:
        raise APIError(
            400,
            f"n x prompts is {n} x {prompts} = {n * prompts} completions, more than this "
            f"server decodes together ({limits.max_batch}).",
            param="n",
            code="invalid_value",
        )


# settings the translation engine does not apply, at their values that change nothing
TEXT_ONLY = {
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": (),
}


def sampling(req, max_tokens: int | None, prompts: int, limits: Limits, seq2seq: bool = False) -> SampleConfig:
    """The request's sampling settings for `prompts` prompts, once its fields are supported, its model is the
    one served and it is within the limits. `max_tokens` None is OpenAI's default; 0 (scoring only) decodes
    one token for the engine, which the completion's scoring then leaves out."""
    supported(req)
    served_model(req.model, limits)
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max(1, max_tokens)
    n = req.n or 1
    within_limits(max_tokens, n, max(1, prompts), limits)
    bias = {int(token): value for token, value in (req.logit_bias or {}).items()}
    outside = [token for token in bias if token >= limits.vocab_size]
    if outside:
        raise APIError(
            400,
            f"Invalid 'logit_bias': token id {outside[0]} is not in the vocabulary (ids 0 to {limits.vocab_size - 1}).",
            param="logit_bias",
            code="invalid_value",
        )
    sample = SampleConfig(
        num_samples=n,
        max_new_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=req.top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        repetition_penalty=req.repetition_penalty or 1.0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=tuple(bias.items()),
        stop=tuple(req.stop or ()),
        seed=req.seed,
    )
    if seq2seq:  # the translation engine samples with temperature, top_k and top_p (gpt/infer/translate.py)
        asked = [name for name, off in TEXT_ONLY.items() if getattr(sample, name) != off]
        if asked:
            raise APIError(
                400,
                f"'{asked[0]}' is not supported for a translation (encoder-decoder) model; leave it out.",
                param=asked[0],
                code="unsupported_parameter",
            )
    return sample


def prompt_ids(texts: list, encode: Callable, limits: Limits) -> list[list[int]]:
    """Each prompt's ids (`encode`: a text or a list of ids -> ids), every id in the vocabulary and no prompt
    longer than the server's limit."""
    prompts = []
    for text in texts:
        with encoding("prompt"):
            ids = encode(text)
        if any(not 0 <= i < limits.vocab_size for i in ids):
            raise APIError(
                400,
                f"Invalid prompt: token ids must be in [0, {limits.vocab_size}).",
                param="prompt",
                code="invalid_prompt",
            )
        if len(ids) > limits.max_prompt:
            raise APIError(
                400,
                f"The prompt has {len(ids)} tokens, more than this server's limit of {limits.max_prompt} "
                f"(the model's context is {limits.block_size} tokens): shorten it.",
                param="prompt",
                code="context_length_exceeded",
            )
        prompts.append(ids)
    return prompts


def logprob_values(
    top: int | None, prompts: list[list[int]], sample: SampleConfig, limits: Limits, echo: bool = False, generate=True
) -> None:
    """The logprobs one answer would carry within what it may: each choice's tokens (the prompt's with `echo`,
    then up to max_tokens generated unless it only scores) x (`top` + 1) log-probabilities, summed over the
    choices. `top` None: no logprobs asked."""
    if top is None:
        return
    generated = sample.max_new_tokens if generate else 0
    tokens = sample.num_samples * sum((len(ids) if echo else 0) + generated for ids in prompts)
    values = tokens * (top + 1)
    if values > limits.max_logprob_values:
        raise APIError(
            400,
            f"'logprobs' {top} over {tokens:,} tokens (each choice's prompt with echo, and up to max_tokens "
            f"generated) is {values:,} log-probabilities, more than this server returns for one request "
            f"({limits.max_logprob_values:,}, --max-logprob-values): send fewer or shorter prompts, or a smaller "
            "logprobs or max_tokens.",
            param="logprobs",
            code="invalid_value",
        )


def grammar(req, tokenizer, seq2seq: bool) -> Grammar | None:
    """The grammar the answer must match (`response_format`, `regex` or `grammar`), compiled for the model's
    tokenizer up front: what the engine cannot enforce is a 400 that names it, never an answer that ignores it.
    Runs off the event loop (the first request builds the tokenizer's view: about a second for 50k ids)."""
    try:
        asked = req.constraint()
    except ValueError as e:
        param = "tool_choice" if "tool_choice" in str(e) else "response_format"
        raise APIError(400, f"{e}.", param=param, code="invalid_value") from None
    if asked is None:
        return None
    param, grammar = asked
    if seq2seq:
        raise APIError(
            400,
            f"'{param}' is not supported for a translation (encoder-decoder) model; leave it out.",
            param=param,
            code="unsupported_parameter",
        )
    try:
        grammar.check(tokenizer)
    except GrammarError as e:
        raise APIError(400, f"Invalid '{param}': {e}.", param=param, code="invalid_value") from None
    return grammar


def chat_logprobs(req, seq2seq: bool) -> int | None:
    """A chat request's `logprobs` / `top_logprobs` as the engine's count of top entries (None: not asked): not
    streamed, and `top_logprobs` only with `logprobs` (OpenAI's rule)."""
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs", code="invalid_value")
    if not req.logprobs:
        return None
    unstreamed_logprobs(req.stream, seq2seq)
    return req.top_logprobs or 0


def unstreamed_logprobs(stream: bool | None, seq2seq: bool) -> None:
    """Logprobs are answered whole, by a language model: with a stream or a translation model, a 400."""
    if stream or seq2seq:
        why = "with 'stream'" if stream else "for a translation (encoder-decoder) model"
        raise APIError(
            400,
            f"'logprobs' {why} is not supported by this server; leave one out.",
            param="logprobs",
            code="unsupported_parameter",
        )


def token_ids(ids: list[int], limits: Limits) -> None:
    """Ids to decode (`/detokenize`), each in the vocabulary."""
    if any(not 0 <= i < limits.vocab_size for i in ids):
        raise APIError(
            400,
            f"Invalid tokens: token ids must be in [0, {limits.vocab_size}).",
            param="tokens",
            code="invalid_value",
        )


@contextlib.contextmanager
def encoding(param: str):
    """Around the encoding of a request's text: a 400 naming `param` (the field the text came from) when the
    text cannot be encoded, e.g. a character a char vocabulary lacks. The one path for prompts and chats."""
    try:
        yield
    except UserError as e:
        raise APIError(400, f"Invalid {param}: {e}.", param=param, code=f"invalid_{param}") from None
