"""Logits -> next token: pure functions on a (B, V) logits tensor, each with explicit arguments, so the
samplers (gpt/infer/sampling.py, speculative.py, batching.py) and the seq2seq decoder and beam search
(translate.py) share them.

    ids = next_token(logits, temperature=0.8, top_k=200, generator=g)   # penalties, filters, then one draw per row

`next_token` composes them in the usual order: the padded vocabulary's rows cut off, logit bias, repetition
penalty, presence and frequency penalties, a grammar's mask, then greedy argmax (temperature 0: the generator
is never touched) or min-p, temperature, top-k, top-p and a draw by inverting the CDF (`sample_probs`).

Footguns
- Logits are processed in float32 whatever the model's dtype.
- The repetition penalty counts the prompt (as Hugging Face does); presence and frequency only the
  sample's own tokens (as vLLM counts): `generated` says how many of prev_ids those are.
"""

from __future__ import annotations

import math

import torch


def apply_repetition_penalty(logits: torch.Tensor, prev_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty: logits (B, V) of the ids in prev_ids (B, T) are divided by `penalty` where
    positive and multiplied by it where negative. Each id counts once, however often it occurs."""
    if penalty == 1.0 or prev_ids.numel() == 0:
        return logits
    seen = logits.gather(-1, prev_ids)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(-1, prev_ids, seen)


def apply_presence_frequency(
    logits: torch.Tensor, generated: torch.Tensor, presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's penalties: logits[j] - frequency * c[j] - presence * (c[j] > 0), c[j] the times id j occurs in
    `generated` (B, n), each row's own sample so far (not its prompt, as vLLM counts)."""
    if (not presence and not frequency) or generated.size(-1) == 0:
        return logits
    counts = torch.zeros_like(logits).scatter_add_(-1, generated, torch.ones_like(generated, dtype=logits.dtype))
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """OpenAI's logit_bias: each (id, b) adds b to that id's logit in every row (-100 all but bans it)."""
    if not bias:
        return logits
    ids, values = zip(*bias)
    ids = torch.tensor(ids, device=logits.device)
    return logits.index_add(
        -1, ids, torch.tensor(values, dtype=logits.dtype, device=logits.device).expand(len(logits), -1)
    )


def min_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """llama.cpp's min-p: ids whose probability is below p times the most likely id's become -inf. Applied to
    the logits before temperature, where llama.cpp's sampler chain applies it (a ratio of probabilities is
    exp(logit difference), so no softmax is needed)."""
    if p <= 0:
        return logits
    return logits.masked_fill(logits < logits.amax(-1, keepdim=True) + math.log(p), float("-inf"))


def top_k_filter(logits: torch.Tensor, k: int | None) -> torch.Tensor:
    """Exactly the k largest logits per row survive (ties broken by torch.topk); the rest are -inf."""
    if k is None or k >= logits.size(-1):
        return logits
    values, indices = torch.topk(logits, k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, indices, values)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most likely ids whose total probability is >= p
    (an id survives when the probability of the ids ranked above it is < p; the top id always does)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass ranked above each id
    sorted_logits = sorted_logits.masked_fill(before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def draw_uniforms(n: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """The (n, 1) float64 uniforms `sample_probs` draws for n rows from `generator`."""
    return torch.rand(n, 1, generator=generator, device=device, dtype=torch.float64)


def sample_probs(
    probs: torch.Tensor, generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """One draw per row of probs (B, V) by inverting the CDF with a uniform from `generator`, or with
    `uniforms` (B, 1) drawn by the caller (`draw_uniforms`; rows from several generators in one batch).

    An id of probability 0 is never drawn. (torch.multinomial draws V exponentials per row, which
    is most of a decode step's sampling time with a 50k vocabulary on CPU.)
    """
    cdf = probs.double().cumsum(dim=-1)
    u = uniforms if uniforms is not None else draw_uniforms(probs.size(0), generator, probs.device)
    ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # first id whose cdf exceeds u * total
    return ids.clamp_(max=probs.size(-1) - 1).squeeze(-1)


def next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    prev_ids: torch.Tensor | None = None,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: tuple[tuple[int, float], ...] = (),
    generated: int = 0,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next ids (B,) from logits (B, V): only ids < vocab_size (a padded vocabulary's extra rows are
    cut off), logit_bias, the repetition penalty on prev_ids (B, T) and the presence and frequency
    penalties on its last `generated` ids, only the `allowed` ids (B, V) bool (a grammar's), then greedy
    argmax (temperature 0) or min-p, then a draw from
    softmax(logits / temperature) restricted by top-k, then top-p, with a uniform per row from
    `generator` or given as `uniforms` (see `sample_probs`).

    With top-k the draw happens among the k candidates only (the same distribution as filtering the
    whole vocabulary, at a fraction of the cost).
    """
    logits = logits.float()
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    logits = apply_logit_bias(logits, logit_bias)
    if prev_ids is not None:
        logits = apply_repetition_penalty(logits, prev_ids, repetition_penalty)
        if generated:
            logits = apply_presence_frequency(logits, prev_ids[:, -generated:], presence_penalty, frequency_penalty)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = min_p_filter(logits, min_p) / temperature
    if top_k is not None and top_k < logits.size(-1):
        values, candidates = torch.topk(logits, top_k, dim=-1)  # (B, k), sorted
        choice = sample_probs(torch.softmax(top_p_filter(values, top_p), dim=-1), generator, uniforms)
        return candidates.gather(-1, choice[:, None]).squeeze(-1)
    return sample_probs(torch.softmax(top_p_filter(logits, top_p), dim=-1), generator, uniforms)
