"""Speculative decoding: a cheap guess of the next k tokens, checked by one forward pass of the model over all
of them, kept as far as the model agrees (Leviathan et al. 2023; Chen et al. 2023).

    for piece in generate(model, tok, "prompt", cfg, PromptLookup(k=8)):     # n-grams of the text so far
    for piece in generate(model, tok, "prompt", cfg, DraftModel(small, k=4)):  # a small model's guesses

Two ways to guess (`Drafter`s):
- `PromptLookup` (prompt lookup decoding): the last n tokens (n = 3, then 2, then 1) found earlier in the
  prompt or the text so far, and the k tokens that followed them there (the latest occurrence that has k
  after it, else the one with the most): free, and right often on text that copies its input (summaries,
  translations, edits of code).
- `DraftModel`: a smaller checkpoint with the same tokenizer samples k tokens with its own KV cache.

The check: the model reads the pending token and the k guesses in one pass, giving its distribution p at
each of the k + 1 positions. Greedy (temperature 0) keeps each guess equal to p's argmax and then adds the
argmax where they part (or after the last): the very text plain greedy decoding gives. Sampling keeps guess
d with probability min(1, p(d) / q(d)) (q: the drafter's distribution; a point mass for prompt lookup), and at
the first refusal draws from max(0, p - q) normalised; after k kept guesses it draws one more from p: each
token then has exactly p's distribution (the standard rule; tests/test_speculative.py checks it). p is the
distribution `next_token` samples from, with the same temperature, top-k, top-p, min-p, penalties and bias.

Footguns
- One sequence at a time (`num_samples` are decoded one after another) and only while the context fits the
  model's block: when it is full, the last half of it is prefilled again, as learned positions need; a RoPE
  model's plain decoding rolls its cache instead, so past block_size the two texts may differ.
- The caches roll back by moving their position (stale keys past it are overwritten): only caches with an
  integer position that keep every position, never the static ones of `--compile` nor a windowed model's rings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from gpt.checkpoints.loader import load_checkpoint
from gpt.data.tokenizer import Tokenizer
from gpt.infer.logits import (
    apply_logit_bias,
    apply_presence_frequency,
    apply_repetition_penalty,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)
from gpt.infer.sampling import SampleConfig, SamplingError, prompt_ids, seeded_generator
from gpt.infer.stream import Piece, TextStream
from gpt.model.cache import KVCache
from gpt.model.transformer import GPT


def probabilities(logits: torch.Tensor, cfg: SampleConfig, prev: list[int], generated: int) -> torch.Tensor:
    """The distribution (V,) `next_token` draws from for logits (V,) (float32, cut to the vocabulary), after the
    ids `prev` of which the last `generated` were generated; one-hot at the argmax for temperature 0."""
    logits = apply_logit_bias(logits[None], cfg.logit_bias)
    if cfg.penalises:
        ids = torch.tensor([prev], device=logits.device)
        logits = apply_repetition_penalty(logits, ids, cfg.repetition_penalty)
        if generated:
            logits = apply_presence_frequency(logits, ids[:, -generated:], cfg.presence_penalty, cfg.frequency_penalty)
    if cfg.temperature == 0:
        return torch.zeros_like(logits[0]).scatter_(0, logits[0].argmax().view(1), 1.0)
    logits = top_k_filter(min_p_filter(logits, cfg.min_p) / cfg.temperature, cfg.top_k)
    return torch.softmax(top_p_filter(logits, cfg.top_p), dim=-1)[0]


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One id from probs (V,), by inverting its CDF with a uniform from `generator`."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), generator=generator, device=probs.device, dtype=torch.float64)
    return int(torch.searchsorted(cdf, (u * cdf[-1]).view(1), right=True).clamp_(max=len(probs) - 1))


def accept(p: torch.Tensor, q: torch.Tensor | None, guess: int, generator: torch.Generator, greedy: bool):
    """(kept, token): whether the guess stands against the model's p (V,), and the token that goes on: the guess,
    or at a refusal the draw from max(0, p - q) normalised (q None: a point mass on the guess)."""
    if greedy:
        best = int(p.argmax())
        return best == guess, best
    q_guess = 1.0 if q is None else float(q[guess])
    u = float(torch.rand((), generator=generator, device=p.device, dtype=torch.float64))
    if u * q_guess < float(p[guess]):  # u < p / q, without dividing by a q of 0
        return True, guess
    residual = (p - q).clamp_(min=0) if q is not None else p.clone().index_fill_(0, torch.tensor(guess), 0.0)
    if float(residual.sum()) <= 0:  # p == q: the refusal cannot happen but for rounding; p itself then
        residual = p
    return False, draw(residual, generator)


class Drafter:
    """Guesses of the next tokens: `propose(tokens, k)` gives up to k ids (and each one's distribution q, or
    None for a point mass); `rollback(valid)` says how many of `tokens` stand after the check."""

    k: int

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], list[torch.Tensor | None]]:
        raise NotImplementedError

    def rollback(self, valid: int) -> None:
        pass


@dataclass
class PromptLookup(Drafter):
    """The tokens that followed the latest earlier occurrence of the text's last n tokens (n = max_ngram .. 1)."""

    k: int = 8
    max_ngram: int = 3

    def propose(self, tokens, k):
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            tail, guess = tokens[-n:], []
            for start in range(len(tokens) - n - 1, -1, -1):  # the latest occurrence with k tokens after it
                if tokens[start : start + n] == tail and len(tokens) - start - n > len(guess):
                    guess = tokens[start + n : start + n + k]  # (in a loop, the latest one has one token after it)
                    if len(guess) == k:
                        break
            if guess:
                return guess, [None] * len(guess)
        return [], []


@dataclass
class DraftModel(Drafter):
    """A smaller model's samples (greedy at temperature 0), each with its distribution, from its own KV cache."""

    model: GPT
    k: int = 4
    cfg: SampleConfig = field(default_factory=SampleConfig)
    generator: torch.Generator | None = None
    caches: list[KVCache] | None = None
    fed: int = 0  # tokens in the draft's cache
    vocab: int = 0  # the ids it may guess (the target's tokenizer's)

    def start(self, cfg: SampleConfig, generator: torch.Generator) -> None:
        self.cfg, self.generator = cfg, generator
        self.caches, self.fed = self.model.new_caches(1), 0

    def _logits(self, ids: list[int], vocab: int) -> torch.Tensor:
        idx = torch.tensor([ids], device=self.caches[0].k.device)
        out = self.model.head(self.model.hidden(idx, self.caches)[:, -1]).float()[0, :vocab]
        self.fed += len(ids)
        return out

    def propose(self, tokens, k):
        block = self.model.config.block_size
        if len(tokens) + k > block:  # (the caller re-prefills when the context is full)
            return [], []
        vocab = self.vocab
        logits = self._logits(tokens[self.fed :], vocab)
        guess, qs = [], []
        for i in range(k):
            q = probabilities(logits, self.cfg, tokens + guess, 0)
            token = int(q.argmax()) if self.cfg.temperature == 0 else draw(q, self.generator)
            guess.append(token)
            qs.append(None if self.cfg.temperature == 0 else q)
            if i < k - 1:
                logits = self._logits([token], vocab)
        return guess, qs

    def rollback(self, valid: int) -> None:
        self.fed = min(self.fed, valid)
        for cache in self.caches:
            cache.pos = self.fed


def load_draft(ckpt, model: GPT, tokenizer: Tokenizer, name: str = "the model") -> GPT:
    """The draft checkpoint `ckpt` (--draft-ckpt) on `model`'s device and in its dtype; a SamplingError unless
    its tokenizer is `tokenizer` (`name`: the model's, for the message)."""
    param = next(model.parameters())
    draft, draft_tok, _ = load_checkpoint(ckpt, param.device)
    if draft_tok.spec != tokenizer.spec:
        raise SamplingError(f"--draft-ckpt {ckpt} has another tokenizer than {name}: it must be the same")
    return draft.to(dtype=param.dtype).eval()


@dataclass
class Stats:
    """How the guesses fared: drafted and kept, per model pass."""

    passes: int = 0
    drafted: int = 0
    kept: int = 0

    @property
    def acceptance(self) -> float:
        return self.kept / self.drafted if self.drafted else 0.0


def generate(
    model: GPT,
    tokenizer: Tokenizer,
    prompt,
    cfg: SampleConfig,
    drafter: Drafter,
    generator: torch.Generator | None = None,
    stats: Stats | None = None,
) -> Iterator[Piece]:
    """`gpt.infer.sampling.generate`'s pieces, decoded speculatively with `drafter`: the samples one after the
    other, from the one generator (checked as generate checks them, before the first piece is asked for)."""
    if model.config.n_encoder_layer:
        raise SamplingError("speculative decoding continues text with decoder-only models")
    if cfg.grammar is not None:
        raise SamplingError("speculative decoding does not take a grammar (--json-schema, --grammar, --regex)")
    if any(m.windows.any for m in (model, getattr(drafter, "model", model))):
        raise SamplingError("speculative decoding rolls its caches back, which a windowed model's ring cannot do")
    if isinstance(drafter, DraftModel) and drafter.model.config.vocab_size < tokenizer.vocab_size:
        raise SamplingError("the draft model's vocabulary is smaller than the tokenizer's: not the same tokenizer")
    cfg.check_vocab(tokenizer.vocab_size)
    ids = prompt_ids(model, tokenizer, prompt)
    device = next(model.parameters()).device
    generator = generator if generator is not None else seeded_generator(cfg.seed, device)
    model.eval()
    return _samples(model, tokenizer, ids, cfg, generator, drafter, stats)


def _samples(model, tokenizer, ids, cfg, generator, drafter, stats) -> Iterator[Piece]:
    with torch.no_grad():
        for sample in range(cfg.num_samples):
            yield from speculate(model, tokenizer, ids, cfg, generator, drafter, sample, stats)


def speculate(
    model: GPT,
    tokenizer: Tokenizer,
    ids: list[int],
    cfg: SampleConfig,
    generator: torch.Generator,
    drafter: Drafter,
    sample: int = 0,
    stats: Stats | None = None,
) -> Iterator[Piece]:
    """One sample of `ids`'s continuation as `Piece`s, decoded speculatively (module notes)."""
    stats = stats if stats is not None else Stats()
    block, vocab = model.config.block_size, min(tokenizer.vocab_size, model.config.vocab_size)
    if isinstance(drafter, DraftModel):
        drafter.vocab = vocab
        drafter.start(cfg, generator)
    keep = max(1, block // 2)
    history = list(ids)  # every token: what the penalties read, as plain decoding's
    start = max(0, len(history) - block)  # the context is history[start:]
    caches, base = _prefilled(model, history[start:-1])
    stream, ends = TextStream(tokenizer, cfg.stop), cfg.ends(tokenizer)
    greedy, generated = cfg.temperature == 0, 0
    while generated < cfg.max_new_tokens:
        if len(history) - start > block:  # past full: the last `keep` tokens prefilled again, as plain decoding
            start = len(history) - keep
            caches, base = _prefilled(model, history[start:-1])
            if isinstance(drafter, DraftModel):
                drafter.start(cfg, generator)
        tokens = history[start:]
        room = min(drafter.k, cfg.max_new_tokens - generated - 1, block - len(tokens))
        guess, qs = drafter.propose(tokens, room) if room > 0 else ([], [])
        idx = torch.tensor([tokens[-1:] + guess], device=caches[0].k.device)
        logits = model.head(model.hidden(idx, caches)).float()[0, :, :vocab]  # (1 + len(guess), V)
        stats.passes += 1
        stats.drafted += len(guess)
        new: list[int] = []
        for i, d in enumerate(guess):
            p = probabilities(logits[i], cfg, history + new, generated + len(new))
            kept, token = accept(p, qs[i], d, generator, greedy)
            new.append(token)
            if not kept:
                break
            stats.kept += 1
        else:  # every guess kept: one more from the model's last distribution
            p = probabilities(logits[len(guess)], cfg, history + new, generated + len(new))
            new.append(int(p.argmax()) if greedy else draw(p, generator))
        base += len(new)  # the pending token and the kept guesses are in the cache; the new last is pending
        for cache in caches:
            cache.pos = base
        history += new
        drafter.rollback(len(history) - start - 1)
        for token in new:
            generated += 1
            piece = stream.piece(sample, token, ends, last=generated == cfg.max_new_tokens)
            yield piece
            if piece.finish is not None:
                return


def _prefilled(model: GPT, context: list[int]) -> tuple[list[KVCache], int]:
    """Fresh caches (integer positions, block_size long) holding `context`, and their position."""
    caches = model.new_caches(1)
    if context:
        model.hidden(torch.tensor([context], device=caches[0].k.device), caches)
    return caches, len(context)
