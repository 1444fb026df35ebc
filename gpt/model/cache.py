"""The KV cache: keys and values of one attention layer, kept between decoding steps (gpt/infer/ reads
through it one token at a time; gpt/model/attention.py's `Attention` writes to it).

    cache = KVCache(B, nh, L, hs, device, dtype)                           # every position, up to L
    ring = KVCache(B, nh, 0, hs, device, dtype, window=64, n_global=4)  # 4 + 64 slots, for any length
    cache.key_positions(T)     # the position each key `append` returns for T new tokens holds (-1: none)

A layer with an attention window of W tokens (gpt/model/windows.py) needs only the last W positions and
the global ones: its cache is a ring (`window=W`), G = `n_global` slots for positions 0 .. G-1 (written
once), then W slots that positions G, G+1, ... take in turn, position p in slot G + (p - G) % W. A
decode step writes its key first and then attends over the G + W slots, so W is exact: the query at p
sees p - W + 1 .. p, and p overwrites p - W, the one key it may no longer see. Memory is constant in the
generated length. Prefill of T > 1 tokens: the queries need keys the ring cannot hold at once (the first
of T > W queries sees keys the last one's ring has overwritten), so `append` returns the slots as they
were plus the T new keys, (G + W + T) keys, and writes only the newest of the new ones into the ring.

Every cache answers `key_positions(T)`, the position held by each key `append` returns (computed from
`pos`, nothing stored: a slot holds the newest position written to it, as positions come in order);
`GPT.hidden` builds each windowed layer's mask from them (causality, unwritten slots, the window).

Footguns
- A ring's keys are not in position order: attention must use the mask `GPT.hidden` builds from
  `key_positions`, never `is_causal` or a tril.
- Right-padded prefills into a ring (the batch engine) must set `lengths` (the real tokens of each row):
  padding written into a ring would overwrite real keys still in the window.
"""

from __future__ import annotations

import torch

from gpt.runtime import zeros_on_huge_pages


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

    def __init__(
        self,
        batch: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        device,
        dtype,
        rolling: bool = False,
        window: int = 0,
        n_global: int = 0,
    ):
        self.rolling = rolling
        self.ring = window > 0  # a ring of `window` slots after `n_global` global ones (module notes)
        self.n_global = n_global if self.ring else 0
        max_len = n_global + window if self.ring else max_len
        self.period = window if self.ring else max_len  # slots G.. cycle with this period (a plain cache: all)
        self.lengths: torch.Tensor | None = None  # real new tokens per row of a right-padded prefill (a ring's)
        shape = (batch, n_head, max_len, head_dim)
        # zeros, not empty: static mode attends over unwritten slots too (masked, but 0 * NaN = NaN)
        # (on the CPU on huge pages where the kernel gives them: a decode step streams the whole cache)
        self.k = zeros_on_huge_pages(shape, dtype, device)
        self.v = zeros_on_huge_pages(shape, dtype, device)
        self.pos: int | torch.Tensor = 0

    @property
    def max_len(self) -> int:
        return self.k.size(2)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def slot(self, p: int | torch.Tensor) -> int | torch.Tensor:
        """The slot position `p` is written to."""
        G = self.n_global
        if isinstance(p, torch.Tensor):
            return torch.where(p < G, p, G + (p - G) % self.period)
        return p if p < G else G + (p - G) % self.period

    def held(self, last: int | torch.Tensor, count: int | None = None) -> torch.Tensor:
        """The position held by each of the first `count` slots (all by default) once positions 0 .. `last`
        are written (`last` an int, 0-dim, or one per row: (L,) or (B or 1, L)); -1 where none is. A slot
        holds the newest position written to it: slot s < G holds s, a ring slot the newest p <= last with
        p = s modulo the period (p >= G)."""
        slots = torch.arange(self.max_len if count is None else count, device=self.k.device)
        if isinstance(last, torch.Tensor):
            last = last.view(-1, 1)
        G = self.n_global
        cycled = last - (last - slots) % self.period
        pos = torch.where(slots < G, slots, cycled)
        valid = torch.where(slots < G, slots <= last, cycled >= G)
        return torch.where(valid, pos, -1)

    def key_positions(self, T: int) -> torch.Tensor:
        """The positions of the keys `append` returns for T new tokens (at `pos` ..), -1 for unwritten slots:
        (L,) for an int `pos`, (B or 1, L) for a tensor one. Asked before the append."""
        pos = self.pos
        if self.ring and T > 1:  # the slots as they were, then the new keys (module notes)
            new = torch.arange(T, device=self.k.device)
            new = pos.view(-1, 1) + new if isinstance(pos, torch.Tensor) else pos + new
            return torch.cat([self.held(pos - 1), new], dim=-1)
        if isinstance(pos, torch.Tensor) or self.ring or pos + T > self.max_len:  # the whole buffer
            return self.held(pos + T - 1)
        return self.held(pos + T - 1, pos + T)  # a plain cache's first pos + T slots

    def _ring_append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, nh, T, hs = k.shape
        pos = self.pos
        if T == 1:  # a decode step: written first, then every slot attended (masked by position)
            slot = self.slot(pos)
            if not isinstance(pos, torch.Tensor):
                self.k[:, :, slot : slot + 1] = k
                self.v[:, :, slot : slot + 1] = v
                self.pos += 1
            elif pos.dim() == 0:
                self.k.index_copy_(2, slot.view(1), k)
                self.v.index_copy_(2, slot.view(1), v)
            else:  # one position per row
                index = slot.view(-1, 1, 1, 1).expand(B, nh, 1, hs)
                self.k.scatter_(2, index, k)
                self.v.scatter_(2, index, v)
            return self.k, self.v
        keys, values = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        # each slot takes the newest of the new positions that lands in it, if any (a gather: no two writes
        # to one slot, and a padded row's padding is never written)
        n = T if self.lengths is None else self.lengths
        start = pos.view(-1, 1) if isinstance(pos, torch.Tensor) else pos
        held = self.held(pos + n - 1)  # (L,) or (B or 1, L)
        fresh = held >= start
        index = (held - start).clamp(0, T - 1).expand(B, -1)[:, None, :, None].expand(B, nh, -1, hs)
        fresh = fresh.expand(B, -1)[:, None, :, None]
        self.k.copy_(torch.where(fresh, k.gather(2, index), self.k))
        self.v.copy_(torch.where(fresh, v.gather(2, index), self.v))
        if not isinstance(pos, torch.Tensor):
            self.pos += T
        return keys, values

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ring:
            return self._ring_append(k, v)
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
        view = KVCache.__new__(KVCache)  # not copy.copy (~8 us a layer at every compiled step): a few fields
        view.rolling, view.pos, view.lengths = self.rolling, pos, None
        view.ring, view.n_global, view.period = self.ring, self.n_global, self.period
        length = self.max_len if self.ring else length  # a ring is attended whole
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
