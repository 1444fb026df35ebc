"""Loss, perplexity and bits-per-byte of a language model over a whole text file, in sliding windows.

    gpt evaluate --ckpt out/shakespeare-char --text ../shared/data/wikitext-2/test.txt --json res.json

    from gpt.infer.perplexity import score_text
    r = score_text(model, tok, text, stride=128)   # r["loss"], r["ppl"], r["bpb"], r["tokens"], r["bytes"]

Definitions (the same as EleutherAI's lm-evaluation-harness for `loglikelihood_rolling` tasks)
- The text is one document: its ids follow the end-of-text id, as every document does in training, so
  the first token is scored too (lm-eval's `prefix_token`), and every token is scored exactly once.
- nll = the sum over the text's tokens of -log p(token | the tokens before it in its window), in nats;
  loss = nll / tokens; perplexity = exp(loss); bits-per-byte = nll / ln 2 / (UTF-8 bytes of the text),
  lm-eval's `bits_per_byte` (its `count_bytes` is `len(doc.encode("utf-8"))`). Bits-per-byte does not
  depend on the tokenizer, so char, own-BPE and GPT-2 models compare on it.
- p is the model's distribution over the tokenizer's ids: logits of a padded vocabulary's extra rows are
  cut off first, as the sampler does (training's loss normalizes over the padded rows too; the
  difference is the little probability a trained model leaves on them).

Windows. A window holds W = min(block_size, tokens) inputs. The first scores all W of its targets;
each next one moves `stride` tokens on and scores only the `stride` targets no window scored yet, each
with at least W - stride tokens of context (the last window moves as far as the text goes, and keeps
its full W inputs). `stride = block_size` is lm-eval's rolling windows exactly
(`get_rolling_token_windows(ids, eot, max_seq_len=block_size, context_len=1)`: disjoint windows, the
first target of each with one token of context); the default, block_size // 2, costs twice the
forward passes and gives every token at least half a window of context (the usual choice, as in
Hugging Face's perplexity guide), so its perplexity is lower. Windows go through the model in batches
of `batch_size`, in order, and the logits only of the scored positions go through the head, one window
at a time (memory: batch x W hidden states, not batch x W x vocab logits). Scoring is deterministic:
the same text, settings and device give the same numbers.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from gpt.data.tokens import bits_per_byte
from gpt.errors import UserError
from gpt.progress import Progress


class PerplexityError(UserError, ValueError):
    """A text or settings that cannot be scored."""


def plan_windows(n: int, block_size: int, stride: int) -> list[tuple[int, int]]:
    """(end, scored) of each window over `seq` = [end-of-text] + the n ids: the window's inputs are
    seq[end - W : end] and its targets seq[end - W + 1 : end + 1] (W = min(block_size, n)), of which the
    last `scored` are scored (the module docstring says why)."""
    if n < 1:
        return []
    if not 1 <= stride <= block_size:
        raise PerplexityError(f"--stride must be from 1 to the model's block_size={block_size}, got {stride}")
    w = min(block_size, n)
    plan, done = [(w, w)], w
    while done < n:
        k = min(stride, n - done)
        done += k
        plan.append((done, k))
    return plan


@torch.no_grad()
def score_text(
    model,
    tok,
    text: str,
    stride: int | None = None,
    batch_size: int = 8,
    autocast=None,
    progress: bool | None = None,
) -> dict:
    """Score `text` with the decoder-only `model` (see the module docstring); returns the totals and the
    derived numbers: tokens, bytes, nll (nats), loss (nats per token), ppl, bpb, and the settings."""
    if model.config.n_encoder_layer:
        raise PerplexityError(
            "a seq2seq (translation) checkpoint scores targets given a source, not running text: --text needs a "
            "language model (score translations with --source-file and --reference)"
        )
    if batch_size < 1:
        raise PerplexityError(f"--batch-size must be an integer >= 1, got {batch_size}")
    n_bytes = len(text.encode("utf-8"))
    if not n_bytes:
        raise PerplexityError("the text is empty: nothing to score")
    block_size = model.config.block_size
    stride = (block_size // 2 or 1) if stride is None else stride
    ids = tok.encode(text)
    if not ids:
        raise PerplexityError("the text encodes to no tokens: nothing to score")
    seq = np.asarray([tok.eot_token, *ids], dtype=np.int64)
    plan = plan_windows(len(ids), block_size, stride)
    w = min(block_size, len(ids))
    vocab = tok.vocab_size
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    nll = torch.zeros((), dtype=torch.float64, device=device)
    try:
        with Progress("score", len(plan), unit="windows", scale=1, enabled=progress) as bar:
            for first in range(0, len(plan), batch_size):
                batch = plan[first : first + batch_size]
                starts = np.array([end - w for end, _ in batch])[:, None] + np.arange(w + 1)
                rows = torch.from_numpy(seq[starts]).to(device)  # (B, W + 1)
                x, y = rows[:, :-1], rows[:, 1:]
                with autocast() if autocast else nullcontext():
                    h = model.hidden(x)  # (B, W, C)
                    for i, (_, k) in enumerate(batch):
                        logits = model.head(h[i, w - k :])[:, :vocab].float()  # (k, V): the scored targets only
                        nll += F.cross_entropy(logits, y[i, w - k :], reduction="sum").double()
                bar.update(len(batch))
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - t0
    total = nll.item()
    return {
        "tokens": len(ids),
        "bytes": n_bytes,
        "nll": total,
        "loss": total / len(ids),
        "ppl": math.exp(min(total / len(ids), 700)),
        "bpb": bits_per_byte(total, n_bytes),
        "tokens_per_byte": len(ids) / n_bytes,
        "block_size": block_size,
        "window": w,
        "stride": stride,
        "windows": len(plan),
        "seconds": seconds,
        "tokens_per_s": len(ids) / max(seconds, 1e-9),
    }
