"""The KV cache: keys and values of one attention layer, kept between decoding steps (gpt/infer/ reads
through it one token at a time; gpt/model/attention.py's `Attention` writes to it)."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of one attention layer for incremental decoding.

    Preallocated to `max_len`; `append` writes the new keys/values at `pos` and returns views of
    everything cached so far.

    Static mode (CUDA graphs, continuous batching): when `pos` is a device tensor instead of an int,
    `append` writes the new keys/values at that position and returns the whole buffers, so every
    step has the same shapes and addresses; `GPT.hidden` masks out the keys not written yet, and the
    caller advances `pos` (see `gpt.infer.sampling.Decoder`). A 0-dim `pos` is one position for every row
    (one token per step); a (B,) `pos` is one position per row, so rows of different lengths decode
    together (`gpt.infer.batching`): row b's T new tokens go to positions pos[b] .. pos[b] + T - 1.

    Rolling (RoPE models, `rolling=True`): keys carry their rotation, so once the cache is full a
    one-token append overwrites the oldest slot and attention runs over every slot, in any order
    (softmax attention does not care); `pos` keeps counting.
    """

    def __init__(self, batch: int, n_head: int, max_len: int, head_dim: int, device, dtype, rolling: bool = False):
        self.rolling = rolling
        shape = (batch, n_head, max_len, head_dim)
        # zeros, not empty: static mode attends over unwritten slots too (masked, but 0 * NaN = NaN)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos: int | torch.Tensor = 0

    @property
    def max_len(self) -> int:
        return self.k.size(2)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.pos, torch.Tensor):  # static mode: at device-side position(s), per row or shared
            B, nh, T, hs = k.shape
            if T == 1 and self.pos.dim() == 0:  # one token (a decode step): index_copy_, which torch.compile
                slot = (self.pos % self.max_len).view(1)  # writes in place (its scatter_ copied the whole cache)
                self.k.index_copy_(2, slot, k)
                self.v.index_copy_(2, slot, v)
                return self.k, self.v
            index = (
                self.pos.view(-1, 1) + torch.arange(T, device=k.device)
            ) % self.max_len  # (a rolling cache's slots)
            index = index.view(-1, 1, T, 1).expand(B, nh, T, hs)
            self.k.scatter_(2, index, k)
            self.v.scatter_(2, index, v)
            return self.k, self.v
        t = k.size(2)
        if self.rolling and t == 1 and self.pos >= self.max_len:
            slot = self.pos % self.max_len  # full: the oldest entry's slot
            self.k[:, :, slot : slot + 1] = k
            self.v[:, :, slot : slot + 1] = v
            self.pos += 1
            return self.k, self.v
        if self.pos + t > self.k.size(2):
            raise RuntimeError(f"KV cache overflow: {self.pos} + {t} > {self.k.size(2)}")
        self.k.narrow(2, self.pos, t).copy_(k)  # in place through one narrow view (indexing made three)
        self.v.narrow(2, self.pos, t).copy_(v)
        self.pos += t
        return self.k.narrow(2, 0, self.pos), self.v.narrow(2, 0, self.pos)

    def view(self, rows: slice, length: int, pos: int | torch.Tensor) -> KVCache:
        """A cache over `rows` and the first `length` positions of this one, at position(s) `pos`: views, no
        copy, so what the model writes through it lands here (continuous batching's pool)."""
        view = KVCache.__new__(KVCache)  # not copy.copy (~8 us a layer at every compiled step): four fields
        view.rolling, view.pos = self.rolling, pos
        view.k, view.v = self.k[rows, :, :length], self.v[rows, :, :length]
        return view

    def copy_row(self, src: int, dst: int) -> None:
        """Row `src`'s keys and values over row `dst`'s."""
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (beam search keeps the surviving hypotheses)."""
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)
