"""Speculative decoding in the batch engine: every row that can guesses up to k tokens, and one forward of the
model over all rows checks every guess (gpt/infer/speculative.py says how a check keeps or refuses them).

    engine = BatchEngine(model, tok, max_rows=32, speculator=Speculator(k=8))            # prompt lookup
    engine = BatchEngine(model, tok, max_rows=32, speculator=Speculator(k=4, draft=small))  # a draft model
    engine.speculator.stats.acceptance                                                # guesses kept / drafted

A step (`decode`, called by `BatchEngine.step` in place of its one-token step): the rows that speculate
(every row but a grammar's, while its request wants more than one token) get their guesses: prompt lookup
over the row's context (`PromptLookup.propose`), or the draft model's, batched over the rows in its own pool
of KV caches that mirrors the engine's (rows join, leave and move with the engine's; a row's draft cache is
caught up with the tokens the model kept since its last guess, and rolled back past the ones it refused).
The engine's `_forward` then feeds each row its pending token and its guesses (right-padded, one forward),
the head gives the logits at every position, and each row keeps its guesses as far as the model agrees
(greedy: the argmax, token for token plain decoding's; sampled: `accept`, from the row's own generator, with
the request's temperature, top-k, top-p, min-p, penalties and bias through `probabilities`). A row's
`written` moves on by the tokens that stand: the keys of refused guesses stay in its cache, past its
position, masked and then overwritten. Rows without guesses take their one token from the same forward's
first position, sampled as the engine samples (`BatchEngine._sample`); each kept token is handed out as a
piece as the plain step hands out its one (stop strings, max_new_tokens, end-of-text, logprobs from the
logits at its position), so a row that ends mid-way stops there.

Footguns
- A row speculates only with k + 1 positions left in its block (the forward's right-padding writes k + 1
  positions in each of its rows, and past the block it would wrap onto the row's oldest keys): the rows
  near the end of their block are swapped after the others and take one token a step in a second, plain
  forward, until they slide; a RoPE row past block_size (whose cache rolls, never slides) does so for good.
- Not for windowed models (a ring cannot roll back) nor encoder-decoder ones (`attach` says so).
- The draft model's cache of a row that does not draft at a step is written over (its padding goes to
  position 0): it is fed from the row's start again the next time the row drafts.
"""

from __future__ import annotations

import torch

from gpt.infer.batching import BatchEngine
from gpt.infer.sampling import SamplingError
from gpt.infer.speculative import PromptLookup, Stats, accept, draw, probabilities
from gpt.model.transformer import GPT


class Speculator:
    """Guesses for the batch engine's rows (prompt lookup, or `draft`'s) and their check: see the module notes."""

    def __init__(self, k: int, draft: GPT | None = None):
        if k < 1:
            raise SamplingError(f"speculative decoding needs k >= 1 guesses, got {k}")
        self.k = k
        self.draft_model = draft
        self.draft = None  # the draft model's BatchEngine (its pool of caches), made by `attach`
        self.lookup = PromptLookup(k=k)
        self.stats = Stats()
        self.vocab = 0

    @property
    def kind(self) -> str:
        return "prompt lookup" if self.draft_model is None else "draft model"

    def attach(self, engine) -> None:
        """Check the engine's model (and the draft) can speculate; a pool of draft caches for its rows."""
        model = engine.model
        if model.config.n_encoder_layer:
            raise SamplingError("speculative decoding continues text with decoder-only models")
        if any(m.windows.any for m in (model, self.draft_model or model)):
            raise SamplingError("speculative decoding rolls its caches back, which a windowed model's ring cannot do")
        block = min(m.config.block_size for m in (model, self.draft_model or model))
        if self.k + 2 > block:
            raise SamplingError(f"{self.k} guesses, the pending token and one of context do not fit a block of {block}")
        self.vocab = min(engine.tokenizer.vocab_size, model.config.vocab_size)
        if self.draft_model is not None:
            if self.draft_model.config.vocab_size < engine.tokenizer.vocab_size:
                raise SamplingError(
                    "the draft model's vocabulary is smaller than the tokenizer's: not the same tokenizer"
                )
            self.draft = BatchEngine(self.draft_model, engine.tokenizer, engine.max_rows)

    def move(self, src: int, dst: int) -> None:
        """The engine moved row `src` into row `dst`: the draft's caches too."""
        if self.draft is not None:
            self.draft.pool.move(src, dst)

    def decode(self, engine) -> tuple[torch.Tensor, dict[int, tuple[list[int], torch.Tensor]]]:
        """One step of every active row: the next-token logits (n, V) from which the rows that did not speculate
        take their token (their `written` moved on by one, as `_decode_step` does), and for each row that did,
        its new tokens (the kept guesses, then the model's own) with the logits (len, V) that chose them (its
        `written` moved on by as many)."""
        engine._slide()
        m = self._fitting_first(engine)  # rows [0, m) have k + 1 positions left in their block
        rows = engine.rows
        wants = [self._wants(row, self.k) if i < m else 0 for i, row in enumerate(rows)]
        if not any(wants):
            return engine._decode_step(), {}
        guesses, qs = self._lookup(rows, wants) if self.draft is None else self._drafted(rows, wants)
        if not any(guesses):
            return engine._decode_step(), {}
        contexts = [row.tokens[-1:] + g for row, g in zip(rows[:m], guesses)]
        _, h = engine._forward(contexts, 0, [row.written for row in rows[:m]], hidden=True)
        logits = engine.model.head(h).float()  # (m, T, V)
        best = logits[..., : self.vocab].argmax(-1).tolist()  # (m, T): the greedy rows' check
        self.stats.passes += 1
        spec = {}
        for i, row in enumerate(rows[:m]):
            if not guesses[i]:
                row.written += 1
                continue
            new = self._check(row, guesses[i], qs[i], logits[i, :, : self.vocab], best[i])
            self.stats.drafted += len(guesses[i])
            self.stats.kept += len(new) - 1
            row.written += len(new)  # the pending token and the kept guesses; the last new one is pending
            if row.draft is not None:  # the draft's cache holds the context as far as it stands
                context = len(row.tokens) - row.start + len(new)
                row.draft = (row.draft[0], min(row.draft[1], context - 1))
            spec[i] = (new, logits[i, : len(new)])
        out = [logits[:, 0]]
        if m < len(rows):  # the rows near the end of their block: one token each, in a forward of their own
            out.append(engine._forward([row.tokens[-1:] for row in rows[m:]], m, [row.written for row in rows[m:]]))
            for row in rows[m:]:
                row.written += 1
        return torch.cat(out), spec

    def _fitting_first(self, engine) -> int:
        """Put the rows with k + 1 positions left in their block first (their right-padded forward must not pass
        it, where it would wrap onto their oldest keys), the others after them (swapped, caches and all); how
        many fit."""
        m = 0
        for i, row in enumerate(engine.rows):
            if engine.block_size - row.written >= self.k + 1:
                if i != m:
                    self._swap(engine, i, m)
                m += 1
        return m

    def _swap(self, engine, i: int, j: int) -> None:
        rows = engine.rows
        rows[i], rows[j] = rows[j], rows[i]
        for pool in [engine.pool] + ([self.draft.pool] if self.draft is not None else []):
            for layer in pool.layers:
                layer.k[[i, j]] = layer.k[[j, i]]
                layer.v[[i, j]] = layer.v[[j, i]]

    def _wants(self, row, k: int) -> int:
        """How many guesses row can take: none for a grammar's (each token changes what may follow) or for its
        last token."""
        cfg = row.request.config
        if cfg.grammar is not None:
            return 0
        return max(0, min(k, cfg.max_new_tokens - row.generated - 1))

    def _check(self, row, guess: list[int], qs: list, logits: torch.Tensor, best: list[int]) -> list[int]:
        """The row's new tokens: its guesses as far as the model keeps them, then the model's token (`accept`)."""
        cfg = row.request.config
        greedy = cfg.temperature == 0
        plain = greedy and not cfg.penalises and not cfg.logit_bias  # the argmax of the raw logits
        new: list[int] = []
        for t, d in enumerate(guess):
            if plain:
                kept, token = best[t] == d, best[t]
            else:
                p = probabilities(logits[t], cfg, row.tokens + new, row.generated + len(new))
                kept, token = accept(p, qs[t], d, row.generator, greedy)
            new.append(token)
            if not kept:
                return new
        if plain:
            return new + [best[len(guess)]]
        p = probabilities(logits[len(guess)], cfg, row.tokens + new, row.generated + len(new))
        return new + [int(p.argmax()) if greedy else draw(p, row.generator)]

    def _lookup(self, rows, wants):
        out = [self.lookup.propose(row.tokens[row.start :], w) if w else ([], []) for row, w in zip(rows, wants)]
        return [g for g, _ in out], [q for _, q in out]

    def _drafted(self, rows, wants):
        """The draft model's guesses for every row that wants some and whose context and guesses fit the draft's
        block: K = max(wants) for each (cut to what each wants), one batched forward a guess."""
        draft, K, eot = self.draft, max(wants), self.draft.tokenizer.eot_token
        drafting, contexts, pos = [], [], []
        for i, (row, w) in enumerate(zip(rows, wants)):
            context = row.tokens[row.start :]
            start, fed = row.draft or (row.start, 0)
            fed = fed if start == row.start else 0  # the context slid: fed again
            if w and len(context) + K <= draft.block_size:
                if len(context) - fed > K + 1:  # a long catch-up (a new row's prompt) alone, but the newest token
                    draft._forward([context[fed:-1]], i, [fed])
                    fed = len(context) - 1
                drafting.append(i)
                contexts.append(context[fed:])
                pos.append(fed)
            else:  # its draft row takes padding at position 0: fed from the start when it drafts again
                contexts.append([eot])
                pos.append(0)
            row.draft = (row.start, 0)
        guesses: list[list[int]] = [[] for _ in rows]
        qs: list[list] = [[] for _ in rows]
        logits = draft._forward(contexts, 0, pos)[:, : self.vocab]
        pos = [p + len(c) for p, c in zip(pos, contexts)]
        for j in range(K):
            best = logits.argmax(-1).tolist()
            for i in drafting:
                row, cfg = rows[i], rows[i].request.config
                if cfg.temperature == 0 and not cfg.penalises and not cfg.logit_bias:
                    guesses[i].append(best[i])
                    qs[i].append(None)
                    continue
                q = probabilities(logits[i], cfg, row.tokens + guesses[i], row.generated + len(guesses[i]))
                guesses[i].append(int(q.argmax()) if cfg.temperature == 0 else draw(q, row.generator))
                qs[i].append(None if cfg.temperature == 0 else q)
            if j < K - 1:
                step = [[guesses[i][-1]] if guesses[i] else [eot] for i in range(len(rows))]
                logits = draft._forward(step, 0, [p if guesses[i] else 0 for i, p in enumerate(pos)])[:, : self.vocab]
                pos = [p + 1 if guesses[i] else 0 for i, p in enumerate(pos)]
        for i in drafting:
            rows[i].draft = (rows[i].start, pos[i])
        return [g[:w] for g, w in zip(guesses, wants)], [q[:w] for q, w in zip(qs, wants)]
