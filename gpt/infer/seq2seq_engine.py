"""Batched translation for encoder-decoder checkpoints, behind the batch engine's interface (`gpt serve` on a
seq2seq checkpoint: a completion's prompt is the source sentence).

    engine = Seq2seqEngine(model, tokenizer, meta, max_rows=32)   # meta: the checkpoint's (its BOS and EOS ids)
    BatchWorker(engine).start()                                   # as BatchEngine's (gpt/infer/engine.py)

Footguns
- A translation is one piece, the whole text: nothing streams token by token.
- Sampling requests are translated one at a time (each with its own generator); greedy ones together.
"""

from __future__ import annotations

import torch

from gpt.infer.engine import Engine, Request
from gpt.infer.sampling import seeded_generator
from gpt.infer.stream import Piece, StopMatcher
from gpt.infer.translate import check_vocab, seq2seq_ids
from gpt.infer.translate import generate as translate_ids
from gpt.model.transformer import GPT


class Seq2seqEngine(Engine):
    """Translation requests for an encoder-decoder checkpoint, with BatchEngine's interface.

    Each step takes the waiting requests (up to `max_rows` rows): those that decode greedily are
    translated as one batch (`gpt.infer.translate.generate`), each sampling one alone with its own
    generator. A translation is one piece: the whole text, cut at the first stop string. A prompt's
    `ids` are the source sentence (may be empty); `meta` is the checkpoint's.
    """

    def __init__(self, model: GPT, tokenizer, meta: dict, max_rows: int = 32):
        super().__init__(model, tokenizer, max_rows)
        self.bos, self.eos = seq2seq_ids(meta)
        check_vocab(tokenizer, model)

    @torch.no_grad()
    def step(self) -> None:
        """Translate the waiting requests that fit; a group that fails answers its requests with the error
        (a sampling group is one request: its own fault), and the other groups go on."""
        requests = self._admit()
        greedy = [r for r in requests if r.config.temperature == 0]
        groups = ([greedy] if greedy else []) + [[r] for r in requests if r.config.temperature > 0]
        for group in groups:
            try:
                self._translate(group)
            except Exception as e:
                for request in group:
                    if request in self.taken:  # not answered yet
                        self._reject(request, e)
        self.steps += bool(requests)

    def _translate(self, group: list[Request]) -> None:
        sources = [r.ids[: self.block_size - 1] + [self.eos] for r in group for _ in range(r.config.num_samples)]
        S = max(len(s) for s in sources)
        src = torch.tensor([s + [self.eos] * (S - len(s)) for s in sources], device=self.device)
        mask = torch.tensor([[j < len(s) for j in range(S)] for s in sources], device=self.device)
        cfg = group[0].config  # a sampling group is one request; a greedy one ignores the settings below
        n_new = min(max(r.config.max_new_tokens for r in group), self.block_size)
        generator = seeded_generator(cfg.seed, self.device) if cfg.temperature > 0 else None
        hyps = iter(
            translate_ids(
                self.model,
                src,
                mask,
                self.bos,
                self.eos,
                n_new,
                cfg.temperature,
                cfg.top_k,
                generator,
                self.tokenizer.vocab_size,
                top_p=cfg.top_p,
            )
        )
        for request in group:
            limit = min(request.config.max_new_tokens, n_new)
            for sample in range(request.config.num_samples):
                ids = next(hyps)[:limit]  # greedy rows do not depend on the others: a shorter limit is a cut
                stops = StopMatcher(request.config.stop)
                text, hit = stops.push(self.tokenizer.decode(ids))
                finish = "stop" if hit else ("length" if len(ids) == limit else "eot")
                if not request.cancelled:
                    request.emit(Piece(sample, text + stops.flush(), ids, finish))
            self.taken.remove(request)  # answered
