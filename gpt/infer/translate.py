"""Seq2seq decoding: greedy, sampling and beam search, batched over sentences.

    gpt sample --ckpt out/multi30k --source "Ein Mann fährt Fahrrad." --beam-size 4

    from gpt.infer.translate import translate
    hyps = translate(model, tok, ["Ein Mann fährt Fahrrad."], bos=eos, eos=eos, beam_size=4)

    model, tok, meta = load_checkpoint("out/multi30k")          # what sample.py --source does
    lines = translate_lines(model, tok, meta, sources, TranslateConfig(beam_size=4))

The source is encoded once; each decoder layer's cross-attention keys and values are computed once
per source (`GPT.cross_kv`), and self-attention keys and values are cached (`KVCache`),
so each step feeds only the newest token. Decoding starts from the start token and stops at the
end token or after `max_new_tokens` (default: the longest source in the batch + 50, at most
`block_size`). Returned hypotheses exclude the start and end tokens.

Beam search keeps `beam_size` live hypotheses per sentence. Each step ranks the 2K best
continuations; one ending in the end token among the top K is finished, and the K best others
live on. Finished hypotheses are compared by score / lp(length) with GNMT's length penalty
lp(n) = ((5 + n) / 6) ** alpha (Wu et al. 2016; alpha=0 ranks by total log-probability, larger
alpha favours longer outputs; n counts the end token). A sentence is done once it holds K finished
hypotheses none worse than the best its best live one could still reach (`reachable`): a score
only falls as tokens are added, but with alpha > 0 the penalty grows, up to lp(the length limit),
so a live hypothesis behind the finished ones now may finish ahead of them later (tensor2tensor's
rule; comparing it at its current length, Hugging Face's default, stopped before the longer
outputs the penalty prefers: on Multi30k's test_2016_flickr at alpha 1.5, length ratio 0.948 instead
of 0.996). At the length limit the live ones count as finished. With alpha <= 0, beam size 1 is exactly greedy.

Greedy and sampled decoding pick each token with `gpt.infer.logits.next_token`, the same logits -> token
step as text generation: argmax at temperature 0 (the generator is never touched), else a draw
restricted by top-k, then top-p, with an explicit `torch.Generator`; ids at or above the
tokenizer's vocab_size (a padded embedding's extra rows) are never chosen.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpt.errors import UserError
from gpt.infer.logits import next_token
from gpt.infer.sampling import seeded_generator
from gpt.model.transformer import GPT

# GNMT's alpha for beam search, chosen on Multi30k's val split, never on a test set (tuned on the test set,
# a setting flatters the figure reported on it: 1.5, the default before, was chosen on test_2016_flickr and
# runs 3% long on val). `bench/bench_seq2seq.py --ckpt RUN/last.pt --sweep ...` on the 20-minute
# multi30k_cpu checkpoint (step 2450), beam 4, 1014 sentences, val BLEU / length ratio: 0: 39.77 / 0.958,
# 0.6: 40.23 / 0.971, 0.8: 40.36 / 0.978, 1.0: 40.81 / 0.986, 1.2: 40.80 / 0.994, 1.5: 39.51 / 1.032.
# See bench/results/seq2seq-val.md.
DEFAULT_LENGTH_PENALTY = 1.0


class TranslateError(UserError, ValueError):
    """Settings or a checkpoint that cannot translate (the message names the flag or what is missing)."""


@dataclass
class TranslateConfig:
    """Decoding settings of `sample.py --source` (flags are the field names with dashes).

    beam_size 1 decodes greedily at temperature 0 (the default) or samples at temperature > 0
    (top-k, then top-p, from `seed`); beam_size > 1 is beam search, deterministic, with GNMT's
    length penalty alpha. max_new_tokens None: the longest source in a batch + 50, at most
    block_size.
    """

    beam_size: int = 1
    length_penalty: float = DEFAULT_LENGTH_PENALTY
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    batch_size: int = 64
    max_new_tokens: int | None = None
    seed: int | None = None  # None: a fresh random seed (only drawn when sampling)

    def __post_init__(self):
        problems = []

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.beam_size) or self.beam_size < 1:
            problems.append(f"--beam-size must be an integer >= 1 (1 is greedy), got {self.beam_size!r}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            problems.append(
                f"--length-penalty must be a finite number (0 ranks by total log-probability), "
                f"got {self.length_penalty!r}"
            )
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            problems.append(f"--temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        elif self.temperature > 0 and is_int(self.beam_size) and self.beam_size > 1:
            problems.append(
                f"--beam-size {self.beam_size} searches deterministically: leave --temperature at 0 "
                f"(got {self.temperature!r}), or sample with --beam-size 1"
            )
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            problems.append(f"--top-k must be an integer >= 1 (or none to disable), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            problems.append(f"--top-p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if not is_int(self.batch_size) or self.batch_size < 1:
            problems.append(f"--batch-size must be an integer >= 1, got {self.batch_size!r}")
        if self.max_new_tokens is not None and (not is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            problems.append(f"--max-new-tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and not is_int(self.seed):
            problems.append(f"--seed must be an integer, got {self.seed!r}")
        if problems:
            raise TranslateError("invalid translation settings: " + "; ".join(problems))

    @property
    def sampling(self) -> bool:
        return self.beam_size == 1 and self.temperature > 0

    def describe(self) -> str:
        if self.beam_size > 1:
            return f"beam {self.beam_size}, length penalty {self.length_penalty:g}"
        if self.sampling:
            return f"sampling at temperature {self.temperature:g}, top-k {self.top_k}, top-p {self.top_p:g}"
        return "greedy"


def is_seq2seq(meta: dict) -> bool:
    """Whether a checkpoint's meta describes an encoder-decoder model."""
    return meta.get("model_config", {}).get("n_encoder_layer", 0) > 0


def seq2seq_ids(meta: dict) -> tuple[int, int]:
    """The (bos, eos) ids of a seq2seq checkpoint's meta."""
    if not is_seq2seq(meta):
        raise TranslateError(
            "this checkpoint is a decoder-only model (n_encoder_layer=0): translation and BLEU evaluation "
            "need an encoder-decoder model trained on a pairs dataset"
        )
    if "seq2seq" not in meta:
        raise TranslateError(
            'checkpoint meta has no "seq2seq" entry with the start/end token ids: the trainer must save '
            "meta['seq2seq'] = dataset.seq2seq_meta()"
        )
    return meta["seq2seq"]["bos"], meta["seq2seq"]["eos"]


def check_vocab(tok, model: GPT) -> None:
    """The tokenizer's ids must all have embedding rows (the model's may be padded up)."""
    if tok.vocab_size > model.config.vocab_size:
        raise TranslateError(
            f"the checkpoint's tokenizer has {tok.vocab_size} ids but the model only "
            f"{model.config.vocab_size}: meta['tokenizer'] is not the one it was trained with"
        )


def check_fits(model: GPT, tok, cfg: TranslateConfig) -> None:
    """Settings this model can decode with: output within its block_size, beams within the vocabulary."""
    limit = model.config.block_size
    if cfg.max_new_tokens is not None and cfg.max_new_tokens > limit:
        raise TranslateError(
            f"--max-new-tokens {cfg.max_new_tokens} is more than the model's block_size={limit}: "
            f"the decoder has no positions beyond it"
        )
    if cfg.beam_size > 1 and 2 * cfg.beam_size > tok.vocab_size:  # each step ranks 2K of the V continuations
        raise TranslateError(
            f"--beam-size {cfg.beam_size} is too large for a vocabulary of {tok.vocab_size} ids: "
            f"at most {tok.vocab_size // 2}"
        )


def length_penalty(n: int, alpha: float) -> float:
    """GNMT's ((5 + n) / 6) ** alpha: divides a hypothesis' total log-probability."""
    return ((5 + n) / 6) ** alpha


def reachable(score: torch.Tensor, length: int, max_length: int, alpha: float) -> torch.Tensor:
    """The best normalised score live hypotheses of total log-probability `score` and `length` tokens
    can still finish with, if no later token cost anything: with alpha > 0 the penalty of the longest
    output allowed (`max_length` tokens, the end token included), else that of the next length."""
    return score / length_penalty(max_length if alpha > 0 else length + 1, alpha)


def _default_max_new(model: GPT, src: torch.Tensor, max_new_tokens: int | None) -> int:
    limit = model.config.block_size
    n = min(src.size(1) + 50, limit) if max_new_tokens is None else max_new_tokens
    if not 1 <= n <= limit:
        raise ValueError(f"max_new_tokens must be in [1, block_size={limit}], got {n}")
    return n


def _start(model: GPT, src: torch.Tensor, src_mask: torch.Tensor, max_len: int, expand: int = 1):
    """Encode once; per decoder layer the cross-attention (k, v) and an empty self-attention cache."""
    memory = model.encode(src, src_mask)
    kv = model.cross_kv(memory)
    if expand > 1:  # beams of a sentence share its source: rows b*K .. b*K+K-1
        kv = [(k.repeat_interleave(expand, 0), v.repeat_interleave(expand, 0)) for k, v in kv]
        src_mask = src_mask.repeat_interleave(expand, 0)
    return memory, kv, src_mask, model.new_caches(src.size(0) * expand, max_len)


@torch.inference_mode()
def generate(
    model: GPT,
    src: torch.Tensor,
    src_mask: torch.Tensor,
    bos: int,
    eos: int,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
    use_cache: bool = True,
    top_p: float = 1.0,
) -> list[list[int]]:
    """Greedy (temperature 0) or sampled (top-k, then top-p) translations of a padded source batch,
    as token ids.

    `vocab_size` limits the choice to the tokenizer's ids (the model's may be padded up).
    `use_cache=False` recomputes the whole prefix every step (the reference the cache must equal).
    """
    B = src.size(0)
    n = _default_max_new(model, src, max_new_tokens)
    memory, kv, mask, caches = _start(model, src, src_mask, n)
    tokens = torch.full((B, 1), bos, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    for _ in range(n):
        if use_cache:
            h = model.decode(kv, mask, tokens[:, -1:], caches=caches)
        else:
            h = model.decode(memory, mask, tokens)
        logits = model.head(h[:, -1])  # (B, V)
        nxt = next_token(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, vocab_size=vocab_size, generator=generator
        )
        nxt = nxt.masked_fill(done, eos)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        done |= nxt == eos
        if done.all():
            break
    return [_strip(row, eos) for row in tokens[:, 1:].tolist()]


def _strip(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


@torch.inference_mode()
def beam_search(
    model: GPT,
    src: torch.Tensor,
    src_mask: torch.Tensor,
    bos: int,
    eos: int,
    beam_size: int = 4,
    alpha: float = DEFAULT_LENGTH_PENALTY,
    max_new_tokens: int | None = None,
    vocab_size: int | None = None,
) -> list[list[int]]:
    """The best hypothesis per source under beam search with GNMT's length penalty (module docs)."""
    B, K = src.size(0), beam_size
    n = _default_max_new(model, src, max_new_tokens)
    V = vocab_size or model.config.vocab_size
    if K < 1 or 2 * K > V:
        raise ValueError(f"beam_size must be between 1 and vocab_size / 2 = {V // 2}, got {K}")
    _, kv, mask, caches = _start(model, src, src_mask, n, expand=K)
    dev = src.device
    tokens = torch.full((B * K, 1), bos, dtype=torch.long, device=dev)
    scores = torch.zeros(B, K, device=dev)
    scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]  # (normalised score, ids)
    done = [False] * B
    rows = torch.arange(B, device=dev)[:, None] * K
    for t in range(n):
        h = model.decode(kv, mask, tokens[:, -1:], caches=caches)
        logp = F.log_softmax(model.head(h[:, -1])[:, :V].float(), dim=-1)  # (B*K, V)
        cand = (scores.view(-1, 1) + logp).view(B, K * V)
        top, idx = cand.topk(2 * K, dim=1)  # (B, 2K), best first
        beam, tok = idx // V, idx % V
        is_eos = tok == eos
        length = t + 1
        for b, r in (is_eos[:, :K] & top[:, :K].isfinite()).nonzero().tolist():  # finish the top-K ones
            if not done[b]:
                hyp = tokens[b * K + beam[b, r], 1:].tolist()
                finished[b].append((top[b, r].item() / length_penalty(length, alpha), hyp))
        alive, pos = top.masked_fill(is_eos, float("-inf")).topk(K, dim=1)  # the K best non-ending
        index = (rows + beam.gather(1, pos)).view(-1)
        tokens = torch.cat([tokens[index], tok.gather(1, pos).view(-1, 1)], 1)
        for cache in caches:
            cache.reorder(index)
        scores = alive
        best_alive = reachable(alive[:, 0], length, n, alpha).tolist()
        for b in range(B):
            if not done[b] and finished[b]:
                finished[b] = sorted(finished[b], key=lambda f: -f[0])[:K]
                done[b] = len(finished[b]) == K and finished[b][-1][0] >= best_alive[b]
        if all(done):
            break
    for b in range(B):  # at the length limit the live hypotheses count as finished
        if not done[b]:
            for k in range(K):
                if math.isfinite(scores[b, k].item()):
                    hyp = tokens[b * K + k, 1:].tolist()
                    finished[b].append((scores[b, k].item() / length_penalty(len(hyp), alpha), hyp))
    return [max(f, key=lambda x: x[0])[1] for f in finished]


def encode_sources(tok, texts: list[str], eos: int, max_len: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Padded source ids (B, S) with the end token appended, and the padding mask (True = real).

    A source longer than `max_len` (the model's block_size) is cut to fit, with a warning.
    """
    encoded = tok.encode_batch(texts)
    n_long = sum(len(x) > max_len - 1 for x in encoded)
    ids = [x[: max_len - 1] + [eos] for x in encoded]
    if n_long:
        warnings.warn(f"{n_long} source(s) longer than block_size={max_len} tokens were truncated", stacklevel=2)
    S = max(len(x) for x in ids)
    src = torch.full((len(ids), S), eos, dtype=torch.long)
    mask = torch.zeros(len(ids), S, dtype=torch.bool)
    for i, x in enumerate(ids):
        src[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = True
    return src.to(device), mask.to(device)


def translate(
    model: GPT,
    tok,
    texts: list[str],
    bos: int,
    eos: int,
    beam_size: int = 1,
    alpha: float = DEFAULT_LENGTH_PENALTY,
    temperature: float = 0.0,
    top_k: int | None = None,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
    generator: torch.Generator | None = None,
    top_p: float = 1.0,
) -> list[str]:
    """Translate `texts` (one output per input, same order), in batches of similar length.

    beam_size > 1 runs beam search (deterministic); otherwise greedy at temperature 0, or sampling.
    The settings are checked (`TranslateConfig`, `check_fits`) before anything is decoded.
    """
    check_fits(
        model,
        tok,
        TranslateConfig(
            beam_size=beam_size,
            length_penalty=alpha,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
        ),
    )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
    out: list[str] = [""] * len(texts)
    try:
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            src, mask = encode_sources(tok, [texts[i] for i in batch], eos, model.config.block_size, device)
            if beam_size > 1:
                ids = beam_search(model, src, mask, bos, eos, beam_size, alpha, max_new_tokens, tok.vocab_size)
            else:
                ids = generate(
                    model,
                    src,
                    mask,
                    bos,
                    eos,
                    max_new_tokens,
                    temperature,
                    top_k,
                    generator,
                    tok.vocab_size,
                    top_p=top_p,
                )
            for i, hyp in zip(batch, ids):
                out[i] = tok.decode(hyp)
    finally:
        model.train(was_training)
    return out


def one_line(text: str) -> str:
    """A translation as a single line: line breaks inside it (any str.splitlines boundary) become spaces."""
    return " ".join(text.splitlines()) if text else text


def translate_lines(model: GPT, tok, meta: dict, texts: list[str], config: TranslateConfig | None = None) -> list[str]:
    """Translate `texts` with a checkpoint's (model, tokenizer, meta): one single-line output per input.

    Checks the checkpoint (`seq2seq_ids`, `check_vocab`); `translate` checks the settings against the model.
    When sampling, the randomness comes from `config.seed` (set it to reproduce a run).
    """
    cfg = config or TranslateConfig()
    bos, eos = seq2seq_ids(meta)
    check_vocab(tok, model)
    generator = None
    if cfg.sampling:
        generator = seeded_generator(cfg.seed, next(model.parameters()).device)
    out = translate(
        model,
        tok,
        texts,
        bos,
        eos,
        beam_size=cfg.beam_size,
        alpha=cfg.length_penalty,
        temperature=cfg.temperature if cfg.beam_size == 1 else 0.0,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        batch_size=cfg.batch_size,
        max_new_tokens=cfg.max_new_tokens,
        generator=generator,
    )
    return [one_line(t) for t in out]
