"""Continuous batching: many requests decoded as one batch, joining and leaving as they start and finish.

    from gpt.infer.batching import BatchEngine, Request
    engine = BatchEngine(model, tokenizer, max_rows=32)
    engine.submit(Request(ids, SampleConfig(num_samples=2, max_new_tokens=50, seed=1), emit=print))
    while engine.busy:
        engine.step()                        # or BatchWorker(engine).start(): a thread does it

`BatchEngine` is the synchronous core (the tests drive it step by step); `gpt.infer.engine.BatchWorker`
runs it on a thread with a bounded waiting queue, which is what `gpt.serve` uses, and holds what it shares
with `gpt.infer.seq2seq_engine.Seq2seqEngine` (encoder-decoder checkpoints: a prompt is a source sentence).

Design notes
- Rows. A request asks for `num_samples` rows. The KV caches are one pool of `max_rows` rows per
  layer, allocated once (`SlotPool`); the active rows are always rows [0, n) and each step runs on
  views of those rows (and of the positions in use), so a step costs what the active rows cost, not
  what the pool could hold.
- Per-row positions. Rows are at different lengths: the caches' position is a (n,) tensor
  (`KVCache`'s per-row static mode), so each row writes its key and value at its own position,
  attends to its own keys only and gets its own position embedding.
- Joining. Waiting requests are admitted first-come first-served at the start of a step while rows
  are free; their prompts are prefilled together (right-padded, one forward) into the rows after the
  active ones, and from then on they decode with the others.
- Leaving. A row that ends (end-of-text, a stop string, max_new_tokens) or whose request was
  cancelled leaves at the end of the step: the last active row moves into its place (one row copied
  per layer), so the active rows stay [0, n).
- Sampling uses each request's own settings and generator, over its rows in sample order: the same
  draws `gpt.infer.sampling.generate` makes for that seed, so a request's output does not depend on which
  other requests share the batch (up to the float rounding of batched matmuls). Requests with the
  same settings are sampled in one batched call, each row with a uniform from its request's generator.
- The context window slides per row as in `gpt.infer.sampling.Decoder`: a row whose context would pass
  block_size keeps its last `keep` tokens, re-prefilled alone in its own row (all but the newest
  token, which the batched step then appends). RoPE rows never re-prefill: their keys carry their
  rotation, so a full row writes each new key over its oldest (slot pos % block_size), as the
  sampler's rolling cache does. Windowed layers keep a ring of their window per row (gpt/model/cache.py):
  a right-padded prefill tells it each row's real length, so padding never overwrites a row's keys.
- Prefix cache (`prefix_cache_bytes`, gpt/infer/prefix.py): a joining row loads the keys and values of the
  longest prefix of its prompt an earlier request left (with the same adapter), and prefills the rest; a
  prompt to score also loads its kept scores, and prefills from the prefix's last token on. Requests joining
  at one step that share a prefix with an earlier one of them prefill in a second wave, after it stored.
- Speculative decoding (`speculator`, gpt/infer/speculative_batch.py; `gpt serve --speculate K`, `--draft-ckpt`):
  each step every row that can guesses up to K tokens (prompt lookup or a draft model batched in its own
  pool), one forward checks every row's guesses, each row keeps them as far as the model agrees and sets its
  position back to what stands; the others take one token (from the same forward, or from a plain one for
  the rows near their block's end). Greedy text is plain decoding's, sampled text has its distribution.
- Adapters side by side (`gpt serve --lora`): a request names its LoRA adapter (`Request.adapter`), and every
  forward tells the model's MultiLoRALinear layers the adapter of each row: rows with different adapters
  decode in one batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpt.infer.constrain import GrammarError, Matchers
from gpt.infer.engine import Engine, Request
from gpt.infer.logits import draw_uniforms, next_token
from gpt.infer.logprobs import first_token, token_logprobs
from gpt.infer.prefix import PrefixCache
from gpt.infer.sampling import seeded_generator
from gpt.infer.stream import Piece, TextStream
from gpt.model import lora
from gpt.model.cache import KVCache
from gpt.model.positions import Positions
from gpt.model.transformer import GPT


class SlotPool:
    """Every decoder layer's KV cache for `rows` rows of block_size positions, allocated once.

    `caches(start, stop, length, pos)` are KVCaches over rows [start, stop) and positions
    [0, length) of the pool (views: what the model writes lands in the pool), in per-row static mode
    at positions `pos` (a (stop - start,) tensor). `move(src, dst)` copies one row over another.
    """

    def __init__(self, model: GPT, rows: int):
        self.layers = model.new_caches(rows)
        self.rows = rows

    def caches(
        self, start: int, stop: int, length: int, pos: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> list[KVCache]:
        """`lengths` (B,): each row's real tokens of a right-padded step, for the windowed layers' rings (whose
        views are whole: a ring is attended over every slot, `KVCache`)."""
        views = [layer.view(slice(start, stop), length, pos) for layer in self.layers]
        for view in views:
            view.lengths = lengths
        return views

    def move(self, src: int, dst: int) -> None:
        for layer in self.layers:
            layer.copy_row(src, dst)


@dataclass
class _Row:
    request: Request
    sample: int
    tokens: list[int]  # the whole history: prompt, then every generated token
    stream: TextStream
    written: int = 0  # context tokens in the cache (the newest token is written by the next step)
    generated: int = 0
    start: int = 0  # the model sees tokens[start:]
    generator: torch.Generator | None = field(default=None, repr=False)
    prompt_logprobs: list | None = field(default=None, repr=False)  # echo: handed out with the first piece
    draft: tuple[int, int] | None = None  # speculating with a draft model: (start, tokens[start:] in its cache)


class BatchEngine(Engine):
    """Decodes every active request one token per `step()`; see the module notes."""

    def __init__(
        self,
        model: GPT,
        tokenizer,
        max_rows: int = 32,
        keep: int | None = None,
        prefix_cache_bytes: int = 0,
        speculator=None,
    ):
        if model.config.n_encoder_layer:
            raise ValueError("BatchEngine runs decoder-only models; encoder-decoder ones use Seq2seqEngine")
        super().__init__(model, tokenizer, max_rows)
        # prompts' prefixes kept across requests (gpt/infer/prefix.py); not for windowed layers, whose rings
        # hold the last positions only
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes and not model.windows.any else None
        self.adapters = any(isinstance(m, lora.MultiLoRALinear) for m in model.modules())
        self.keep = min(keep or max(1, self.block_size // 2), self.block_size)
        self.rolling = Positions.of(model.config).slides  # full rows overwrite their oldest slot, no re-prefill
        self.pool = SlotPool(model, max_rows)
        self.rows: list[_Row] = []
        vocab = model.config.vocab_size
        self.vocab_size = tokenizer.vocab_size if tokenizer.vocab_size < vocab else None
        self.speculator = speculator  # gpt/infer/speculative_batch.py's Speculator, or None: one token a step
        if speculator is not None:
            speculator.attach(self)

    def submit(self, request: Request) -> None:
        if not request.ids:
            raise ValueError("a request needs at least one prompt id")
        if request.echo and request.logprobs is not None and len(request.ids) > self.block_size:
            raise ValueError(f"scoring a prompt needs it to fit the context: at most {self.block_size} ids")
        if not request.generate and not (request.echo and request.logprobs is not None):
            raise ValueError("a request that does not generate must ask for the prompt's logprobs (echo)")
        super().submit(request)

    # ---- one step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Admit waiting requests, advance every row by one token (or, speculating, by the guesses it keeps and one
        more), hand out the pieces."""
        self._leave([i for i, row in enumerate(self.rows) if row.request.cancelled])
        n_old = len(self.rows)
        logits, guessed = [], {}  # guessed: the rows that speculated, their new tokens and the logits that chose them
        if n_old:
            out, guessed = self.speculator.decode(self) if self.speculator is not None else (self._decode_step(), {})
            logits.append(out)
        self._join(self._admit())
        self.taken.clear()  # in rows now, or answered
        if len(self.rows) > n_old:
            logits.append(self._prefill(n_old))
        if not logits:
            return
        logits = torch.cat(logits)
        self.steps += 1
        finished = [i for i in range(n_old, len(self.rows)) if not self.rows[i].request.generate]
        for i in finished:  # scoring only: answered with the prompt's logprobs, no token sampled
            row = self.rows[i]
            if not row.request.cancelled:
                row.request.emit(Piece(row.sample, "", [], "length", logprobs=row.prompt_logprobs))
        for request, rows, new in self._sample(logits, skip=set(finished) | set(guessed)):
            scores = None
            if request.logprobs is not None:
                scores = token_logprobs(logits[rows], new, self.tokenizer.vocab_size, request.logprobs)
            for j, (i, token) in enumerate(zip(rows, new.tolist())):
                if self._emit(i, token, None if scores is None else scores[j]):
                    finished.append(i)
        for i, (new, chose) in guessed.items():
            top = self.rows[i].request.logprobs
            scores = (
                None
                if top is None
                else token_logprobs(chose, torch.tensor(new, device=self.device), self.tokenizer.vocab_size, top)
            )
            for j, token in enumerate(new):
                if self._emit(i, token, None if scores is None else scores[j]):
                    finished.append(i)  # a row that ends mid-way leaves; the rest of its tokens are dropped
                    break
        self._leave(finished)

    def _emit(self, i: int, token: int, score=None) -> bool:
        """Row i's next token (with its logprobs entry, if asked) handed out as a piece; whether the row ended."""
        row = self.rows[i]
        request = row.request
        row.tokens.append(token)
        row.generated += 1
        piece = row.stream.piece(
            row.sample, token, request.config.ends(self.tokenizer), last=row.generated == request.config.max_new_tokens
        )
        if score is not None:
            piece.logprobs = (row.prompt_logprobs or []) + [score]
            row.prompt_logprobs = None
        if not request.cancelled:
            request.emit(piece)
        return piece.finish is not None

    def _sample(self, logits: torch.Tensor, skip: set[int] = frozenset()):
        """(request, its rows in sample order, their next ids) for every request in the batch (but the
        rows in `skip`).

        Requests with the same settings are sampled in one call, each row with a uniform from its own
        request's generator (the draws generate() makes); with a repetition penalty, one by one.
        """
        by_request: dict[Request, list[int]] = {}
        for i in sorted(set(range(len(self.rows))) - skip, key=lambda i: self.rows[i].sample):
            by_request.setdefault(self.rows[i].request, []).append(i)
        groups: dict[tuple, list[Request]] = {}
        for request in by_request:
            c = request.config
            alone = c.penalises or c.grammar is not None  # rows that read their own tokens: one request a group
            key = (id(request),) if alone else (c.temperature, c.top_k, c.top_p, c.min_p, c.logit_bias)
            groups.setdefault(key, []).append(request)
        for members in groups.values():
            cfg = members[0].config
            rows = [i for request in members for i in by_request[request]]
            uniforms = prev = None
            if cfg.temperature > 0:
                uniforms = torch.cat(
                    [
                        draw_uniforms(len(by_request[r]), self.rows[by_request[r][0]].generator, self.device)
                        for r in members
                    ]
                )
            if cfg.penalises:  # a group of one request: its rows are equally long
                prev = torch.tensor([self.rows[i].tokens for i in rows], device=self.device)
            allowed = grammar = None
            if cfg.grammar is not None:  # a group of one request: its samples' matchers
                grammar, samples = members[0].matchers, [self.rows[i].sample for i in rows]
                try:
                    if grammar is None:
                        ends = cfg.ends(self.tokenizer)
                        grammar = Matchers(cfg.grammar, self.tokenizer, ends, cfg.num_samples)
                        members[0].matchers = grammar
                    allowed = grammar.allowed(self.tokenizer.vocab_size, samples, self.device)
                except GrammarError as e:  # this request's fault: it fails alone, its rows leave next step
                    members[0].emit(e)
                    members[0].cancel()
                    continue
            new = next_token(
                logits[rows],
                **cfg.filters(),
                allowed=allowed,
                prev_ids=prev,
                generated=self.rows[rows[0]].generated,
                vocab_size=self.vocab_size,
                uniforms=uniforms,
            )
            if grammar is not None:
                grammar.advance(new.tolist(), samples)
            start = 0
            for request in members:
                n = len(by_request[request])
                yield request, by_request[request], new[start : start + n]
                start += n

    def _forward(self, contexts: list[list[int]], start: int, pos: list[int], hidden: bool = False):
        """Next-token logits (B, V) after each context, fed right-padded to rows [start, start + B) of
        the pool at positions `pos` (each row's context goes to pos[b] ...); with `hidden`, also the
        hidden states (B, T, C) of every position."""
        T = max(len(c) for c in contexts)
        pad = self.tokenizer.eot_token
        idx = torch.tensor([c + [pad] * (T - len(c)) for c in contexts], device=self.device)  # (B, T)
        length = min(max(pos) + T, self.block_size)  # (a rolling row past block_size writes at pos % block_size)
        lengths = torch.tensor([len(c) for c in contexts], device=self.device) if T > 1 else None
        caches = self.pool.caches(start, start + len(contexts), length, torch.tensor(pos, device=self.device), lengths)
        if self.adapters:  # each row's adapter (gpt/model/lora.py's MultiLoRALinear)
            rows = [row.request.adapter for row in self.rows[start : start + len(contexts)]]
            lora.select(self.model, torch.tensor(rows, device=self.device) if any(rows) else None)
        h = self.model.hidden(idx, caches)  # (B, T, C)
        last = torch.tensor([len(c) - 1 for c in contexts], device=self.device)
        logits = self.model.head(h[torch.arange(len(contexts), device=self.device), last]).float()  # (B, V)
        return (logits, h) if hidden else logits

    def _slide(self) -> None:
        """Slide the window of every full row (module notes)."""
        for i, row in enumerate(self.rows):
            if row.written == self.block_size and not self.rolling:
                row.start = len(row.tokens) - self.keep
                row.written = self.keep - 1
                if row.written:  # refill row i's cache; these logits are not needed
                    self._forward([row.tokens[row.start : -1]], i, [0])

    def _decode_step(self) -> torch.Tensor:
        """The newest token of every active row, appended at the row's own position."""
        self._slide()
        logits = self._forward([row.tokens[-1:] for row in self.rows], 0, [row.written for row in self.rows])
        for row in self.rows:
            row.written += 1
        return logits

    def _join(self, requests: list[Request]) -> None:
        """Rows after the active ones for the joining requests; one whose own setup fails (its seed, its
        stop strings) is answered with the error, and the others go on."""
        for request in requests:
            start = max(0, len(request.ids) - self.block_size)
            try:
                generator = seeded_generator(request.config.seed, self.device)
                self.rows += [
                    _Row(
                        request,
                        sample,
                        list(request.ids),
                        TextStream(self.tokenizer, request.config.stop),
                        written=len(request.ids) - start,
                        start=start,
                        generator=generator,
                    )
                    for sample in range(request.config.num_samples)
                ]
            except Exception as e:
                self._reject(request, e)

    def _prefill(self, first: int) -> torch.Tensor:
        """Prompts of the rows from `first` on (the joining requests); their next-token logits. With a prefix
        cache, the requests that share a prefix with an earlier one of this step wait for a second wave, which
        loads what the first stored (`PrefixCache.later`)."""
        joined, n = self.rows[first:], len(self.rows)
        if self.prefix is None:
            return self._prefill_rows(first, n)
        requests = list(dict.fromkeys(row.request for row in joined))
        prompts = [(r.ids if len(r.ids) <= self.block_size else [], r.adapter, r.logprobs if r.echo else None)
                   for r in requests]  # fmt: skip
        wait = dict(zip(requests, self.prefix.later(prompts)))
        self.rows[first:] = sorted(joined, key=lambda row: wait[row.request])  # stable: the waiting ones last
        split = n - sum(wait[row.request] for row in joined)
        return torch.cat([self._prefill_rows(a, b) for a, b in ((first, split), (split, n)) if b > a])

    def _prefill_rows(self, first: int, stop: int) -> torch.Tensor:
        """Rows [first, stop)'s prompts: each row loads its longest cached prefix, and the rows prefill what is
        left, one forward per run of rows that start at the same position."""
        joined = self.rows[first:stop]
        cached = [self._cached_prefix(first + b, row) for b, row in enumerate(joined)]
        logits, hidden, b = [], [], 0
        while b < len(joined):  # runs of equal starts: right-padding never writes past a row's block
            e = b
            while e < len(joined) and cached[e] == cached[b]:
                e += 1
            run = [row.tokens[row.start + cached[b] :] for row in joined[b:e]]
            out, h = self._forward(run, first + b, [cached[b]] * (e - b), True)
            logits.append(out)
            hidden += list(h)
            b = e
        scored: dict[Request, list] = {}  # a request's samples share its prompt's scores
        for b, row in enumerate(joined):
            request = row.request
            if request.echo and request.logprobs is not None:
                if request not in scored:  # submit() checked that the prompt fits: row.start == 0
                    ids = torch.tensor(row.tokens[cached[b] + 1 :], device=self.device)  # hidden[b][0] predicts ids[0]
                    scores = token_logprobs(
                        self.model.head(hidden[b][: len(ids)]), ids, self.tokenizer.vocab_size, request.logprobs
                    )
                    scored[request] = (row.prompt_logprobs or [first_token(row.tokens[0])]) + scores
                row.prompt_logprobs = scored[request]
            if self.prefix is not None and row.start == 0 and row.sample == 0:
                self.prefix.store(row.tokens, self.pool.layers, first + b, request.adapter, row.prompt_logprobs,
                                  request.logprobs or 0)  # fmt: skip
        return torch.cat(logits)

    def _cached_prefix(self, index: int, row: _Row) -> int:
        """Where row `index`'s prefill starts: after the prompt's prefix loaded from the prefix cache (0 without
        one, for a context that slid). A prompt to score loads only blocks that keep its scores (into
        `row.prompt_logprobs`) and starts one token back, whose logits score the first token after them."""
        request = row.request
        if self.prefix is None or row.start:
            return 0
        top = request.logprobs if request.echo else None
        n = self.prefix.load(row.tokens, self.pool.layers, index, request.adapter, top)
        if top is None or not n:
            return n
        row.prompt_logprobs = self.prefix.entries(row.tokens, n, request.adapter, top)
        return n - 1

    def _leave(self, rows: list[int]) -> None:
        """Remove batch rows; the last active rows move into the holes."""
        for i in sorted(rows, reverse=True):
            last = len(self.rows) - 1
            if i != last:
                self.pool.move(last, i)
                if self.speculator is not None:
                    self.speculator.move(last, i)
                self.rows[i] = self.rows[last]
            self.rows.pop()
