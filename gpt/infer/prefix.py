"""A prefix cache: the keys and values of prompt prefixes kept across requests, so a prompt that starts as an
earlier one did (a system prompt, a few-shot header, the earlier turns of a conversation) prefills only what
is new (`gpt serve --prefix-cache-mb`; the batch engine in gpt/infer/batching.py uses it).

    cache = PrefixCache(budget_bytes=256 << 20)
    n = cache.load(tokens, layers, row)     # the longest cached prefix copied into a pool row: its length
    ...                                     # prefill tokens[n:] at positions n onwards
    cache.store(tokens, layers, row)        # the prompt's whole blocks kept for the next requests

Blocks of BLOCK tokens, each keyed by its tokens and every token before it (a hash chain), so a block is only
ever reused after the very same prefix; least recently used blocks go first when the budget is full. A hit
leaves at least one token of the prompt to prefill (its logits start the answer).

Footguns
- Keys hold their absolute positions (learned positions are added before attention, rotary ones rotate the
  keys), so a block is valid only at the positions it was computed at: prefixes start at position 0, and a
  row whose context slid (a prompt longer than the block) neither loads nor stores.
- The answer after a hit equals the answer without up to float rounding: the cached keys came out of a
  prefill of another length, whose matrix products round differently (tests/test_prefix_cache.py checks
  greedy and seeded texts are equal on its models).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from gpt.model.cache import KVCache

BLOCK = 16  # tokens a block holds


class PrefixCache:
    """Blocks of keys and values of prompt prefixes, LRU within `budget_bytes` (module notes)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.blocks: OrderedDict[int, list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
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

    def load(self, tokens: list[int], layers: list[KVCache], row: int, salt: int = 0) -> int:
        """Copy the longest cached prefix of `tokens` (whole blocks, leaving at least one token) into pool row
        `row` of every layer; its length in tokens (0: none)."""
        self.lookups += 1
        found = []
        for key in self.keys(tokens, (len(tokens) - 1) // BLOCK, salt):
            if key not in self.blocks:
                break
            found.append(key)
        for b, key in enumerate(found):
            self.blocks.move_to_end(key)
            for layer, (k, v) in zip(layers, self.blocks[key]):
                layer.k[row, :, b * BLOCK : (b + 1) * BLOCK] = k
                layer.v[row, :, b * BLOCK : (b + 1) * BLOCK] = v
        n = len(found) * BLOCK
        self.hits += bool(n)
        self.reused += n
        return n

    def store(self, tokens: list[int], layers: list[KVCache], row: int, salt: int = 0) -> None:
        """Keep the whole blocks of `tokens` (written at positions 0.. of pool row `row`) not cached yet."""
        for b, key in enumerate(self.keys(tokens, len(tokens) // BLOCK, salt)):
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            block = [
                (
                    layer.k[row, :, b * BLOCK : (b + 1) * BLOCK].clone(),
                    layer.v[row, :, b * BLOCK : (b + 1) * BLOCK].clone(),
                )
                for layer in layers
            ]
            size = sum(k.nbytes + v.nbytes for k, v in block)
            if size > self.budget:
                return
            self.blocks[key] = block
            self.bytes += size
            while self.bytes > self.budget:
                _, old = self.blocks.popitem(last=False)
                self.bytes -= sum(k.nbytes + v.nbytes for k, v in old)

    @property
    def stats(self) -> dict:
        return {"hits": self.hits, "lookups": self.lookups, "tokens_reused": self.reused, "bytes": self.bytes}
