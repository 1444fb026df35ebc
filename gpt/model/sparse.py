"""Windowed attention at linear cost: the one place that chooses how a layer with an attention window runs
when there is no KV cache (training, evaluation, the encoder).

    spec = Band(size=64, global_tokens=4, causal=True)     # what a layer sees, not a mask
    y = attend(q, k, v, spec, dropout_p)                  # (B, nh, T, hs), as SDPA returns
    spec.dense(T, device)                                 # the same pattern as a (B or 1, 1, T, T) mask

A `Band` describes a layer's keys (windows.py's pattern: the last `size` positions, or within `size` - 1
either way in the encoder, plus the first `global_tokens` positions; padding keys and packed documents
narrowed further) without building a T x T mask. `attend` runs it one of two ways:

- dense: SDPA with the (T, T) boolean mask of `dense`, when T <= DENSE_MAX (a short sequence: one fused
  call beats the chunks' bookkeeping) or T <= size (the window covers the whole block anyway), and in
  torch.export (ONNX, .pt2: one graph right at every length, quadratic in it; gpt/infer/export.py); a
  window that holds the whole sequence with no padding or documents is plain attention (is_causal);
- chunks ("sliding chunks"): the queries split into chunks of C >= size positions; each chunk attends to
  the global keys, its own chunk and the one before (and the one after in the encoder) under a small
  (C, G + 2C or 3C) mask, as one batched SDPA call. Memory and time O(T (G + C)); eager PyTorch, so
  autograd, dropout, torch.compile and tensor-parallel heads work as for full attention. In the encoder
  the global queries see every key: their rows are one more SDPA call over all T keys, O(G T).

FlexAttention (torch.nn.attention.flex_attention) was the other candidate: in torch 2.13 its compiled CPU
kernel raises "torch.compile on CPU only supports inference", so it cannot train here, and the CUDA kernel
has not been measured on this project's machines; the chunks run on every device until it is.

Footguns
- Global tokens with packed documents (`doc`) are refused: each document's first tokens would be global
  for that document, keys a chunk does not hold. Windows alone with documents are fine (a window never
  crosses into another document's keys: the chunk mask compares document ids).
- A caller's own (T, T) mask cannot ride along: `GPT.hidden` keeps the dense reference for those (the mask
  is T x T already). Key masks (B, T) and documents (B, T) are what a Band carries.
- Query rows with no key to see (a padded query far from any real key) see their own key instead, so the
  softmax has no empty row (no NaN in the backward); those rows are padding, never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpt.model.windows import Windows

DENSE_MAX = 256  # at most this many positions: the dense mask (T^2 booleans, 64 KiB); chosen by timing both
MIN_CHUNK = 64  # chunks of at least this many queries: fewer, larger SDPA calls for small windows


@dataclass(frozen=True)
class Band:
    """One layer's attention pattern (module notes); tensors (B, T) or None."""

    size: int  # the window in tokens (>= 1)
    global_tokens: int = 0
    causal: bool = True
    keys: torch.Tensor | None = None  # boolean (B, T): True at real keys (padding masks)
    doc: torch.Tensor | None = None  # (B, T) document ids of packed rows

    def chunk(self) -> int:
        return max(self.size, MIN_CHUNK)

    def dense(self, T: int, device) -> torch.Tensor:
        """The same pattern as a boolean (B or 1, 1, T, T) mask, causality included: the reference."""
        at = torch.arange(T, device=device)
        m = Windows((self.size,), self.global_tokens).allowed(self.size, at, at, self.causal)
        if self.causal:
            m = m & (at[:, None] >= at[None, :])
        m = m[None, None]
        if self.keys is not None:
            m = m & self.keys[:, None, None, :]
        if self.doc is not None:
            m = m & (self.doc[:, :, None] == self.doc[:, None, :]).unsqueeze(1)
        return m


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band, dropout_p: float = 0.0) -> torch.Tensor:
    """Self-attention of q, k, v (B, nh, T, hs) through `band`: dense for short sequences, chunks otherwise."""
    T = q.size(2)
    if band.doc is not None and band.global_tokens:
        raise ValueError("global tokens with packed documents are not supported (each document's own first tokens)")
    exporting = torch.compiler.is_exporting()
    if not exporting and T <= band.size and band.keys is None and band.doc is None:  # the window holds every key
        return F.scaled_dot_product_attention(q, k, v, is_causal=band.causal, dropout_p=dropout_p)
    if exporting or T <= DENSE_MAX or T <= band.size:  # an export: one graph for any T
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band.dense(T, q.device), dropout_p=dropout_p)
    return chunked(q, k, v, band, dropout_p)


def _chunks(t: torch.Tensor, C: int, n: int, before: int, span: int) -> torch.Tensor:
    """(B, h, T, hs) -> (B, h, n, span * C, hs): for chunk j, the positions (j - before) * C .. (j - before +
    span) * C - 1, zero outside 0 .. T - 1."""
    T = t.size(2)
    after = (n + span - 1) * C - T - before * C  # pad to n + span - 1 chunks in all
    padded = F.pad(t, (0, 0, before * C, after)) if t.dim() == 4 else F.pad(t, (before * C, after), value=-1)
    if span == 1:
        return padded.unflatten(2, (n, C)) if t.dim() == 4 else padded.unflatten(-1, (n, C))
    parts = [padded.narrow(2 if t.dim() == 4 else -1, i * C, n * C) for i in range(span)]
    if t.dim() == 4:
        return torch.cat([p.unflatten(2, (n, C)) for p in parts], dim=3)
    return torch.cat([p.unflatten(-1, (n, C)) for p in parts], dim=-1)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band, dropout_p: float = 0.0) -> torch.Tensor:
    """Sliding-chunk attention (module notes): O(T (G + C)) memory."""
    B, nh, T, hs = q.shape
    C, G, dev = band.chunk(), min(band.global_tokens, T), q.device
    n = -(-T // C)
    before, span = 1, 2 if band.causal else 3
    qc = _chunks(q, C, n, 0, 1)  # (B, nh, n, C, hs)
    kc, vc = _chunks(k, C, n, before, span), _chunks(v, C, n, before, span)  # (B, nh, n, span C, hs)
    # positions: query j*C + i, local key (j - 1)*C + m
    qpos = torch.arange(n * C, device=dev).view(n, C, 1)
    kpos = (torch.arange(n, device=dev).view(n, 1, 1) - before) * C + torch.arange(span * C, device=dev)
    d = qpos - kpos  # (n, C, span C)
    local = (d >= 0) & (d < band.size) if band.causal else d.abs() < band.size
    local = local & (kpos >= G) & (kpos < T)  # global keys come once, from their own block
    mask = local.unsqueeze(0)  # (1 or B, n, C, span C)
    if band.keys is not None:
        mask = mask & _chunks(band.keys[:, None].long(), C, n, before, span).squeeze(1).unsqueeze(2).bool()
    if band.doc is not None:
        dq = _chunks(band.doc[:, None], C, n, 0, 1).squeeze(1)  # (B, n, C), -1 past the end
        dk = _chunks(band.doc[:, None], C, n, before, span).squeeze(1)  # (B, n, span C)
        mask = mask & (dq[..., :, None] == dk[..., None, :])
    seen = mask.any(-1, keepdim=True)
    if G:
        glob = torch.arange(G, device=dev) <= qpos if band.causal else torch.ones(n, C, G, dtype=torch.bool, device=dev)
        glob = glob.expand(n, C, G).unsqueeze(0)
        if band.keys is not None:
            glob = glob & band.keys[:, None, None, :G]
        seen = seen | glob.any(-1, keepdim=True)
    mask = mask | (~seen & (d == 0))  # no empty rows (module notes)
    if G:
        mask = torch.cat([glob.expand(mask.size(0), n, C, G), mask], dim=-1)
        kc = torch.cat([k[:, :, None, :G].expand(B, nh, n, G, hs), kc], dim=3)
        vc = torch.cat([v[:, :, None, :G].expand(B, nh, n, G, hs), vc], dim=3)
    if mask.size(0) == 1:  # one mask for every row: heads and rows together as SDPA's batch
        y = F.scaled_dot_product_attention(
            qc.flatten(0, 1), kc.flatten(0, 1), vc.flatten(0, 1), attn_mask=mask, dropout_p=dropout_p
        )
        y = y.unflatten(0, (B, nh))
    else:  # a mask per row: chunks of every row as SDPA's heads, the row's heads as its batch
        flat = lambda t: t.transpose(0, 1).flatten(1, 2)  # noqa: E731  (nh, B n, ., hs)
        y = F.scaled_dot_product_attention(
            flat(qc), flat(kc), flat(vc), attn_mask=mask.flatten(0, 1), dropout_p=dropout_p
        )
        y = y.unflatten(1, (B, n)).transpose(0, 1)
    y = y.flatten(2, 3)[:, :, :T]  # (B, nh, T, hs)
    if G and not band.causal:  # the encoder's global queries see every key
        keys = band.keys[:, None, None, :] if band.keys is not None else None
        yg = F.scaled_dot_product_attention(q[:, :, :G], k, v, attn_mask=keys, dropout_p=dropout_p)
        y = torch.cat([yg, y[:, :, G:]], dim=2)
    return y
