"""Sampling: logits -> next token, the KV-cached decode loop, and `generate` for text.

    from gpt import generate, load_checkpoint
    model, tok, meta = load_checkpoint("out/shakespeare-char")
    for piece in generate(model, tok, "ROMEO:", max_new_tokens=200, temperature=0.8, top_k=200, seed=1337):
        print(piece.text, end="", flush=True)

Layers, bottom up
- `gpt.infer.logits`: pure functions on a (B, V) logits tensor (penalties, filters, `next_token`, which
  composes them and draws with an explicit `torch.Generator`); `gpt.infer.stream`: ids -> text (`TextStream`,
  stop strings) and the `Piece`s handed out.
- `SampleConfig`: every setting, checked once.
- `Decoder`: next-token logits for a batch of sequences; one prefill of the prompt, then one token
  per step through a `KVCache` per layer; finished rows can be dropped from the batch.
- `generate`: a prompt string in, `Piece`s of text out (streamed UTF-8, stop strings, end-of-text).

Design notes
- Sliding window. Positions are learned and absolute, so when the context is full the cache cannot
  just drop its oldest entry: every kept token would need a new position. When appending a token
  would make the context longer than block_size, the context becomes its last `keep` tokens
  (default block_size // 2) and the cache is rebuilt by one prefill of them. That prefill happens
  once every block_size - keep + 1 steps, so the amortised cost stays about one token's worth per
  step, while the model always sees at least `keep` tokens of context. keep=block_size reproduces
  nanoGPT's crop-to-the-last-block_size-tokens behaviour, at the price of a full prefill per step.
  RoPE models (`pos_encoding="rope"`) slide without any prefill: their keys are cached already
  rotated and attention depends on relative positions only, so the cache rolls (the new token
  overwrites the oldest entry, see `KVCache`) at one token's cost per step. Every layer then
  attends over the last block_size positions: sliding-window attention, as Mistral's rolling
  cache, which equals a full forward with a banded causal mask (tested). It is not nanoGPT's crop:
  the cached keys of the window's first tokens still carry what they saw before the window.
  `keep` does not apply to them.
- Attention windows (`attention_window`): a windowed layer's cache is a ring of its window and the global
  tokens (gpt/model/cache.py), so memory stays constant; a RoPE model whose layers are all windowed decodes
  past block_size exactly as the dense masked forward of the whole sequence would (tests/test_ring_cache.py).
  Learned positions still crop and prefill again.
- Only the last position goes through the head (`model.hidden` then `model.head(h[:, -1])`); the
  model's `forward` keeps returning full logits.
- Logits are processed in float32 whatever the model's dtype.
- A padded vocabulary (e.g. 50304 rows for GPT-2's 50257 ids) never yields a padded id: logits
  of ids at or above the tokenizer's vocab_size are cut off before sampling.
- Repetition penalty (CTRL, Keskar et al. 2019): for every id present in the sequence so far
  (prompt included, as Hugging Face does), a positive logit is divided by the penalty and a negative
  one multiplied by it. 1.0 is off; > 1 discourages repetition.
- Text is decoded incrementally: bytes of a character split across tokens are held back until the
  character is complete, and text that could be the start of a stop string is held back until it
  is known not to be one, so a stop string is never printed, even across token boundaries. An
  incomplete character left at the very end (the length limit cut it) is dropped, not printed as
  U+FFFD.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from gpt.data.tokenizer import Tokenizer
from gpt.errors import UserError
from gpt.infer.constrain import Grammar, Matchers
from gpt.infer.logits import next_token
from gpt.infer.stream import Piece, TextStream
from gpt.model.positions import Positions
from gpt.model.transformer import GPT


class SamplingError(UserError, ValueError):
    """Invalid sampling settings (the message names the flag, the value and what is allowed)."""


class ContextWarning(UserWarning):
    """The prompt is longer than the model's context: only its last block_size tokens are used."""


# ---- settings -------------------------------------------------------------------------------------


@dataclass
class SampleConfig:
    """Decoding settings shared by `generate` and `sample.py` (flags are the field names with dashes)."""

    num_samples: int = 1
    max_new_tokens: int = 500
    temperature: float = 0.8  # 0 is greedy (argmax)
    top_k: int | None = 200  # keep the k most likely ids; None keeps all
    top_p: float = 1.0  # nucleus: the smallest set of ids whose probability reaches top_p; 1.0 is off
    repetition_penalty: float = 1.0  # CTRL-style; 1.0 is off
    min_p: float = 0.0  # llama.cpp's min-p: drop ids less likely than min_p times the top id; 0 is off
    presence_penalty: float = 0.0  # OpenAI's: minus this from the logits of ids generated at least once
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often each id was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (id, bias in [-100, 100]) added to the logits
    grammar: Grammar | None = None  # what every sample must match (gpt/infer/constrain.py); None: free text
    stop: tuple[str, ...] = ()  # stop strings, not included in the output
    stop_at_eot: bool = True  # end a sample at the end-of-text token
    end_tokens: tuple[int, ...] = ()  # more ids that end a sample as end-of-text does (a chat's end of turn)
    seed: int | None = None  # None: a fresh random seed
    window_keep: int | None = None  # tokens kept when the context slides; None: block_size // 2
    cuda_graph: bool = True  # on CUDA, replay each one-token step as a CUDA graph (see Decoder)
    batch_rows: int | None = None  # samples decoded at once; None: as many as BATCH_BYTES allows (`batch_rows`)

    def __post_init__(self):
        self.stop = tuple(self.stop)
        self.end_tokens = tuple(self.end_tokens)
        self.logit_bias = tuple(sorted(dict(self.logit_bias).items()))  # one entry per id, hashable
        problems = []

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.num_samples) or self.num_samples < 1:
            problems.append(f"--num-samples must be an integer >= 1, got {self.num_samples!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            problems.append(f"--max-new-tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            problems.append(f"--temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            problems.append(f"--top-k must be an integer >= 1 (or none to disable), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            problems.append(f"--top-p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0:
            problems.append(f"--repetition-penalty must be > 0 (1 disables it), got {self.repetition_penalty!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            problems.append(f"--min-p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2 <= value <= 2:
                problems.append(f"--{name.replace('_', '-')} must be in [-2, 2] (0 disables it), got {value!r}")
        for token, bias in self.logit_bias:
            if not is_int(token) or token < 0 or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                problems.append(f"--logit-bias takes token ids >= 0 and biases in [-100, 100], got {token!r}={bias!r}")
                break
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            problems.append(f"grammar must be a gpt.infer.constrain.Grammar, got {type(self.grammar).__name__}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(f"--stop must be non-empty text, got {self.stop!r}")
        if self.seed is not None and not (is_int(self.seed) and -(2**63) <= self.seed < 2**63):
            problems.append(f"--seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.window_keep is not None and (not is_int(self.window_keep) or self.window_keep < 1):
            problems.append(f"window_keep must be an integer >= 1, got {self.window_keep!r}")
        if self.batch_rows is not None and (not is_int(self.batch_rows) or self.batch_rows < 1):
            problems.append(f"batch_rows must be an integer >= 1, got {self.batch_rows!r}")
        if problems:
            raise SamplingError("invalid sampling settings: " + "; ".join(problems))

    @property
    def penalises(self) -> bool:
        """Some penalty reads the tokens so far (each request's rows are then sampled apart)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty)

    def filters(self) -> dict:
        """The settings `next_token` takes from this config."""
        names = ("temperature", "top_k", "top_p", "repetition_penalty", "min_p", "presence_penalty")
        return {name: getattr(self, name) for name in (*names, "frequency_penalty", "logit_bias")}

    def check_vocab(self, vocab_size: int) -> None:
        """Every logit_bias id within the vocabulary (SamplingError otherwise)."""
        wrong = [token for token, _ in self.logit_bias if token >= vocab_size]
        if wrong:
            raise SamplingError(
                f"--logit-bias: token id {wrong[0]} is not in the vocabulary (ids 0 to {vocab_size - 1})"
            )

    def ends(self, tokenizer: Tokenizer) -> frozenset[int]:
        """The ids that end a sample: end-of-text (unless stop_at_eot is off) and `end_tokens`."""
        return frozenset(self.end_tokens) | ({tokenizer.eot_token} if self.stop_at_eot else set())


# ---- the KV-cached decode loop --------------------------------------------------------------------


class Decoder:
    """Next-token logits for a batch of equally long sequences, advanced one token at a time.

        dec = Decoder(model, idx)                 # one prefill of idx (B, T)
        ids = next_token(dec.logits, ...)         # (B,)
        dec.advance(ids)                          # one cached step (or a window slide)

    `tokens` is the whole history (B, T_total); the model sees `tokens[:, start:]`, at most
    block_size tokens, slid as described in the module notes.

    `graph=True` runs each one-token step with static shapes (the caches' position is a device
    tensor and the whole cache is attended with a mask, see `KVCache`) and, on CUDA, records that
    step once as a CUDA graph and replays it: one launch per token instead of a few hundred, which
    is most of a small model's decode time on a GPU. Prefills stay eager. A change of batch rows
    (`select`) records the graph again. A model with a compiled step (`GPT.compile_decoding`) always
    decodes this way, through that step (no CUDA graph): one compile for every length.
    """

    def __init__(self, model: GPT, idx: torch.Tensor, keep: int | None = None, graph: bool = False):
        cfg = model.config
        if cfg.n_encoder_layer:
            raise ValueError(
                "Decoder runs decoder-only models; an encoder-decoder model decodes with gpt.infer.translate"
            )
        self.model = model
        self.block_size = cfg.block_size
        self.keep = min(keep or max(1, cfg.block_size // 2), cfg.block_size)
        self.rolling = Positions.of(cfg).slides  # the window slides in the cache (module notes)
        self.caches = model.new_caches(idx.size(0))
        # the compiled step's symbolic length: the slots of the caches of every position (rings are whole)
        self.span = max((c.max_len for c in self.caches if not c.ring), default=self.caches[0].max_len)
        self.tokens = idx
        self.start = max(0, idx.size(1) - cfg.block_size)
        self.prefills = 0
        self.fed = 0  # tokens in the caches since the last prefill: the next token's position
        self.compiled = getattr(model, "decode_step", None)  # GPT.compile_decoding's step, if made
        self.graph = graph or self.compiled is not None
        self._static = None  # (ids, pos, logits, torch.cuda.CUDAGraph or None), made at the first step
        self.logits = self._prefill()

    @torch.no_grad()
    def _forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.model.hidden(idx.contiguous(), self.caches)  # (B, T, C)
        return self.model.head(h[:, -1]).float()  # (B, V): the last position only

    def _prefill(self) -> torch.Tensor:
        for cache in self.caches:
            cache.pos = 0
        self.prefills += 1
        self.fed = self.context_len
        return self._forward(self.tokens[:, self.start :])

    @property
    def context_len(self) -> int:
        return self.tokens.size(1) - self.start

    def advance(self, ids: torch.Tensor) -> None:
        """Append ids (B,) and compute the logits that follow them."""
        self.tokens = torch.cat([self.tokens, ids.view(-1, 1).to(self.tokens.device)], dim=1)
        if self.context_len > self.block_size and not self.rolling:  # full: keep the last `keep`, rebuild
            self.start = self.tokens.size(1) - self.keep
            self.logits = self._prefill()
            return
        self.start = max(self.start, self.tokens.size(1) - self.block_size)
        if self.graph:
            self.logits = self._static_step(self.tokens[:, -1:])
        else:
            self.logits = self._forward(self.tokens[:, -1:])
        self.fed += 1

    def _static_step(self, ids: torch.Tensor) -> torch.Tensor:
        """The one-token step with static shapes: the compiled step if the model has one, else replayed as a
        CUDA graph on CUDA, eager elsewhere."""
        if self._static is None:
            device = ids.device
            static_ids = torch.zeros(ids.shape, dtype=ids.dtype, device=device)  # contiguous: one compiled step
            self._static = (static_ids, torch.zeros((), dtype=torch.long, device=device), None, None)
        static_ids, pos, logits, graph = self._static
        static_ids.copy_(ids)
        pos.fill_(self.fed)  # the new token's position (its key and value go to that slot, or to pos % L)
        for cache in self.caches:
            cache.pos = pos  # static mode until the next prefill resets it
        if self.compiled is not None:
            # over the written slots only (the whole buffer would cost a 1024-slot attention per layer at
            # every step: GPT-2 bf16 decoded 0.7x eager that way); one compile serves every length
            with torch.no_grad():
                return self.compiled(static_ids, self.caches, min(self.fed + 1, self.span))
        if ids.device.type != "cuda":
            return self._forward(static_ids)
        if graph is None:
            # Warm up on a side stream (library handles, kernel choice) as CUDA graphs require, then
            # record. The warm-up computes this very step (it writes the same keys and values).
            stream = torch.cuda.Stream(ids.device)
            stream.wait_stream(torch.cuda.current_stream(ids.device))
            with torch.cuda.stream(stream):
                self._forward(static_ids)
            torch.cuda.current_stream(ids.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._forward(static_ids)
            self._static = (static_ids, pos, logits, graph)
        graph.replay()
        return logits.clone()  # the next replay overwrites the graph's output

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished samples leave the batch)."""
        rows = rows.to(self.tokens.device)
        self.tokens = self.tokens.index_select(0, rows)
        self.logits = self.logits.index_select(0, rows)
        for cache in self.caches:
            cache.reorder(rows)
        self._static = None  # new buffers and batch size: record again


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """Prompt text (or ids) -> ids; an empty prompt starts from end-of-text."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    return ids or [tokenizer.eot_token]


def prompt_ids(model: GPT, tokenizer: Tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """`encode_prompt`, checked: the tokenizer belongs to the model and every id is one of its ids."""
    ids = encode_prompt(tokenizer, prompt)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise SamplingError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
            f"{model.config.vocab_size} embedding rows: they do not belong together"
        )
    if any(not 0 <= i < tokenizer.vocab_size for i in ids):
        raise SamplingError(f"prompt ids must be in [0, {tokenizer.vocab_size}), the tokenizer's ids")
    return ids


def generate(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int] = "",
    config: SampleConfig | None = None,
    *,
    generator: torch.Generator | None = None,
    **settings,
) -> Iterator[Piece]:
    """Sample `num_samples` continuations of `prompt`, yielding `Piece`s as they come.

    The samples are decoded in batches of `batch_rows` (at most BATCH_BYTES of KV cache and logits), one
    after the other, all drawing from the one generator: any number of samples fits in bounded memory.
    Up to one batch's worth they are exactly one batch; after that, the samples of later batches differ
    from what one huge batch would draw (the draws come in another order), but the same seed and
    `batch_rows` still give the same output.

    Settings are `SampleConfig` fields, as a config and/or keywords (keywords win), e.g.
    `generate(model, tok, "ROMEO:", max_new_tokens=100, temperature=0, stop=["\\n\\n"])`.
    `generator` overrides `seed` (pass one to control the randomness yourself). Settings and the
    prompt are checked here, before the first piece is asked for.
    """
    cfg = dataclasses.replace(config or SampleConfig(), **settings) if settings else (config or SampleConfig())
    if model.config.n_encoder_layer:
        raise SamplingError(
            f"this model has an encoder (n_encoder_layer={model.config.n_encoder_layer}): "
            "generate continues text with decoder-only models; translate with gpt.infer.translate"
        )
    ids = prompt_ids(model, tokenizer, prompt)
    block_size = model.config.block_size
    if len(ids) > block_size:
        warnings.warn(
            f"the prompt has {len(ids)} tokens, more than the model's context of {block_size}: "
            f"only its last {block_size} tokens are used",
            ContextWarning,
            stacklevel=2,
        )
    cfg.check_vocab(tokenizer.vocab_size)
    if cfg.grammar is not None:  # one the engine would not follow in full: refused before the first piece
        cfg.grammar.check(tokenizer)
    device = next(model.parameters()).device
    if generator is None:
        generator = seeded_generator(cfg.seed, device)
    model.eval()
    return _generate_batches(model, tokenizer, ids, cfg, generator)


BATCH_BYTES = 1 << 30  # the KV cache and logits of one batch of samples, at most (one row always fits)


def batch_rows(model: GPT, budget: int | None = None) -> int:
    """How many samples one decoding batch holds: as many as keep the KV cache (keys and values of
    every layer over the whole context) and the float32 logits within `budget` bytes (default
    BATCH_BYTES), at least 1."""
    c = model.config
    itemsize = model.cache_dtype().itemsize
    slots_of = getattr(model, "cache_slots", lambda i: c.block_size)  # (windowed layers: their rings; stand-ins)
    slots = sum(slots_of(i) for i in range(c.n_layer))
    per_row = 2 * slots * c.n_embd * itemsize + 2 * c.vocab_size * 4
    return max(1, (budget or BATCH_BYTES) // per_row)


def _generate_batches(model: GPT, tokenizer: Tokenizer, ids: list[int], cfg: SampleConfig, generator):
    rows = cfg.batch_rows or batch_rows(model)
    for first in range(0, cfg.num_samples, rows):
        for piece in _generate(model, tokenizer, ids, min(rows, cfg.num_samples - first), cfg, generator):
            piece.sample += first
            yield piece


def seeded_generator(seed: int | None, device) -> torch.Generator:
    """The random stream of one request: from `seed`, or from a fresh seed when it is None."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def _generate(
    model: GPT, tokenizer: Tokenizer, ids: list[int], n: int, cfg: SampleConfig, generator
) -> Iterator[Piece]:
    """`n` samples as one batch (numbered from 0)."""
    device = generator.device
    idx = torch.tensor([ids] * n, dtype=torch.long, device=device)
    dec = Decoder(model, idx, cfg.window_keep, graph=cfg.cuda_graph and device.type == "cuda")
    rows = list(range(n))  # the sample each batch row belongs to
    streams = [TextStream(tokenizer, cfg.stop) for _ in rows]
    ends = cfg.ends(tokenizer)
    vocab_size = tokenizer.vocab_size if tokenizer.vocab_size < model.config.vocab_size else None
    grammar = Matchers(cfg.grammar, tokenizer, ends, n) if cfg.grammar is not None else None
    for step in range(cfg.max_new_tokens):
        new = next_token(
            dec.logits,
            **cfg.filters(),
            prev_ids=dec.tokens if cfg.penalises else None,
            generated=step,
            vocab_size=vocab_size,
            generator=generator,
            allowed=grammar.allowed(tokenizer.vocab_size, rows, device) if grammar else None,
        )
        if grammar:
            grammar.advance(new.tolist(), rows)
        alive = []
        for row, (sample, token) in enumerate(zip(rows, new.tolist())):
            piece = streams[sample].piece(sample, token, ends, last=step == cfg.max_new_tokens - 1)
            yield piece
            if piece.finish is None:
                alive.append(row)
        if not alive:
            return
        if len(alive) < len(rows):
            keep = torch.tensor(alive, device=device)
            dec.select(keep)
            new = new.index_select(0, keep)
            rows = [rows[r] for r in alive]
        dec.advance(new)


def complete(model: GPT, tokenizer: Tokenizer, prompt: str | Sequence[int] = "", **settings) -> list[str]:
    """The generated text of each sample (without the prompt), for scripts and tests."""
    cfg = SampleConfig(**settings)
    out = [""] * cfg.num_samples
    for piece in generate(model, tokenizer, prompt, cfg):
        out[piece.sample] += piece.text
    return out
