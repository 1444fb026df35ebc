"""Log-probabilities of tokens, as the completions API's `logprobs` (and `echo`) report them.

    entries = token_logprobs(logits, ids, vocab=tok.vocab_size, top=5)   # logits (T, V) predict ids (T,)

What the numbers are (OpenAI's and vLLM's default semantics): the log-probability of each token under the
model's raw next-token distribution, i.e. the log-softmax of its logits at temperature 1, before any
temperature, top-k, top-p or repetition penalty the request samples with; over the tokenizer's real ids
only (a padded vocabulary's extra rows are cut off first, as gpt/infer/perplexity.py does); in float32
whatever precision the model ran in. `top` also lists the `top` most likely ids at that position, and the
token itself when it is not among them (vLLM's rule: so a client can always read the token's own entry).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprob:
    """One token's log-probability (None for a prompt's first token: nothing before it predicts it) and
    the most likely ids at its position with theirs (None with the first token)."""

    id: int
    logprob: float | None
    top: dict[int, float] | None


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, vocab: int, top: int) -> list[TokenLogprob]:
    """A TokenLogprob for each of `ids` (T,) given the logits (T, V) that predict them."""
    lp = torch.log_softmax(logits[:, :vocab].float(), dim=-1)  # (T, vocab)
    chosen = lp.gather(1, ids[:, None].long())[:, 0].tolist()
    best_lp, best_id = lp.topk(min(top, vocab), dim=-1) if top else (lp[:, :0], lp[:, :0].long())
    out = []
    for t, (token, value) in enumerate(zip(ids.tolist(), chosen)):
        table = dict(zip(best_id[t].tolist(), best_lp[t].tolist()))
        table.setdefault(token, value)
        out.append(TokenLogprob(token, value, table))
    return out


def first_token(token: int) -> TokenLogprob:
    """The entry of a prompt's first token, which nothing before it predicts."""
    return TokenLogprob(token, None, None)
