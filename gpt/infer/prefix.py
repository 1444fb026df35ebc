"""A prefix cache: the keys and values of prompt prefixes kept across requests, so a prompt that starts as an
earlier one did (a system prompt, a few-shot header, the earlier turns of a conversation) prefills only what
is new (`gpt serve --prefix-cache-mb`; the batch engine in gpt/infer/batching.py uses it).

    cache = PrefixCache(budget_bytes=256 << 20)
    n = cache.load(tokens, layers, row)     # the longest cached prefix copied into a pool row: its length
    ...                                     # prefill tokens[n:] at positions n onwards
    cache.store(tokens, layers, row)        # the prompt's whole blocks kept for the next requests

    n = cache.load(tokens, layers, row, top=1)  # a prompt to score: only blocks that keep its top-1 scores
    kept = cache.entries(tokens, n, top=1)      # their TokenLogprobs, positions 0 .. n-1
    cache.store(tokens, layers, row, entries=kept + computed, top=1)    # an entry per token of the prompt

Blocks of BLOCK tokens, each keyed by its tokens and every token before it (a hash chain), so a block is only
ever reused after the very same prefix; least recently used blocks go first when the budget is full. A hit
leaves at least one token of the prompt to prefill (its logits start the answer).

Scores. A prompt scored for its logprobs (`echo`, what lm-evaluation-harness sends) needs every position's
log-probability, not only the last logits. A block also keeps, for each of its positions, that token's
TokenLogprob (gpt/infer/logprobs.py) for a given `top`: they are fully determined by its key (position p's
comes from the logits at p - 1, inside the same prefix). A scoring prompt stores its entries with its blocks
(and attaches them to blocks a generating prompt stored without), and loads only as many blocks as carry
entries for its very `top` (an exact match: lm-eval always asks for 1). The engine then prefills from one
token before the loaded prefix's end, whose logits score the first token after it, and appends the rest.

Prompts that arrive together (lm-eval's batches: a context's choices side by side) would all look up before
any of them stored: `later` picks those that share more with an earlier one of the same step than the cache
holds, and the engine prefills them in a second wave, after the first stored its blocks.

Footguns
- Keys hold their absolute positions (learned positions are added before attention, rotary ones rotate the
  keys), so a block is valid only at the positions it was computed at: prefixes start at position 0, and a
  row whose context slid (a prompt longer than the block) neither loads nor stores.
- The answer after a hit equals the answer without up to float rounding: the cached keys came out of a
  prefill of another length, whose matrix products round differently (tests/test_prefix_cache.py checks
  greedy and seeded texts are equal on its models). So do the scores: the loaded entries are the ones an
  earlier prefill computed, the others this one's (tests/test_prefix_cache.py checks them within 1e-5).
- The entries are Python objects shared by every answer that loads them: read them, never change them. Their
  bytes count approximately (`entry_bytes`), beside the keys' and values' exact ones.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from gpt.infer.logprobs import TokenLogprob
from gpt.model.cache import KVCache

BLOCK = 16  # tokens a block holds


@dataclass
class Block:
    """One block's keys and values, one (k, v) per layer, and its positions' TokenLogprobs by `top`."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    entries: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    bytes: int = 0


def entry_bytes(entries: list[TokenLogprob]) -> int:
    """About what `entries` hold in memory: each object and its attributes (about 300 bytes), its top table, and
    an int and a float per id in it."""
    return sum(sys.getsizeof(e) + 300 + (sys.getsizeof(e.top) + 52 * len(e.top) if e.top else 0) for e in entries)


class PrefixCache:
    """Blocks of keys and values of prompt prefixes, LRU within `budget_bytes` (module notes)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.blocks: OrderedDict[int, Block] = OrderedDict()
        self.bytes = 0
        self.hits = self.lookups = self.reused = 0  # requests that found a prefix, requests, tokens not prefilled

    @staticmethod
    def keys(tokens: list[int], n_blocks: int, salt: int = 0) -> list[int]:
        """The chained keys of the first `n_blocks` blocks of `tokens` (`salt`: the LoRA adapter that computed
        them, whose keys and values differ from the base's)."""
        out, key = [], hash(("prefix", salt))
        for b in range(n_blocks):
            key = hash((key, tuple(tokens[b * BLOCK : (b + 1) * BLOCK])))
            out.append(key)
        return out

    def load(self, tokens: list[int], layers: list[KVCache], row: int, salt: int = 0, top: int | None = None) -> int:
        """Copy the longest cached prefix of `tokens` (whole blocks, leaving at least one token) into pool row
        `row` of every layer; its length in tokens (0: none). With `top`, only blocks that keep their scores for
        that `top` (a prompt to score)."""
        self.lookups += 1
        found = []
        for key in self.keys(tokens, (len(tokens) - 1) // BLOCK, salt):
            if key not in self.blocks or (top is not None and top not in self.blocks[key].entries):
                break
            found.append(key)
        for b, key in enumerate(found):
            self.blocks.move_to_end(key)
            for layer, (k, v) in zip(layers, self.blocks[key].kv):
                layer.k[row, :, b * BLOCK : (b + 1) * BLOCK] = k
                layer.v[row, :, b * BLOCK : (b + 1) * BLOCK] = v
        n = len(found) * BLOCK
        self.hits += bool(n)
        self.reused += n
        return n

    def entries(self, tokens: list[int], n: int, salt: int = 0, top: int = 0) -> list[TokenLogprob]:
        """The kept entries of positions [0, n) of `tokens` (n: what `load(..., top=top)` returned)."""
        return [e for key in self.keys(tokens, n // BLOCK, salt) for e in self.blocks[key].entries[top]]

    def store(
        self,
        tokens: list[int],
        layers: list[KVCache],
        row: int,
        salt: int = 0,
        entries: list[TokenLogprob] | None = None,
        top: int = 0,
    ) -> None:
        """Keep the whole blocks of `tokens` (written at positions 0.. of pool row `row`) not cached yet; with
        `entries` (one per token of `tokens`, for `top`), keep them with the blocks that lack them."""
        for b, key in enumerate(self.keys(tokens, len(tokens) // BLOCK, salt)):
            block = self.blocks.pop(key, None)
            if block is not None:
                self.bytes -= block.bytes  # back in below, as the most recent
            else:
                kv = [
                    (
                        layer.k[row, :, b * BLOCK : (b + 1) * BLOCK].clone(),
                        layer.v[row, :, b * BLOCK : (b + 1) * BLOCK].clone(),
                    )
                    for layer in layers
                ]
                block = Block(kv, bytes=sum(k.nbytes + v.nbytes for k, v in kv))
            if entries is not None and top not in block.entries:
                block.entries[top] = entries[b * BLOCK : (b + 1) * BLOCK]
                block.bytes += entry_bytes(block.entries[top])
            if block.bytes > self.budget:
                return
            self.blocks[key] = block  # the most recent
            self.bytes += block.bytes
            while self.bytes > self.budget:
                _, old = self.blocks.popitem(last=False)
                self.bytes -= old.bytes

    def later(self, prompts: list[tuple[list[int], int, int | None]]) -> list[bool]:
        """Which of one step's joining prompts (tokens, salt, top: None unless scored) prefill after the others:
        those that share more whole blocks with an earlier one of the step than the cache holds for them (they
        then load what it stored). Only a prompt that does not wait itself is waited for."""
        stored: set[tuple[int, int | None]] = set()  # (key, top) the first wave will store
        out = []
        for tokens, salt, top in prompts:
            keys = self.keys(tokens, (len(tokens) - 1) // BLOCK, salt)
            missing = (
                k for k in keys if k not in self.blocks or (top is not None and top not in self.blocks[k].entries)
            )
            out.append(any((k, top) in stored for k in missing))
            if not out[-1]:
                stored |= {(k, t) for k in self.keys(tokens, len(tokens) // BLOCK, salt) for t in (None, top)}
        return out

    @property
    def stats(self) -> dict:
        return {"hits": self.hits, "lookups": self.lookups, "tokens_reused": self.reused, "bytes": self.bytes}
