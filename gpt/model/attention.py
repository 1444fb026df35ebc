"""Multi-head attention: self-attention (with the KV cache and the recipe options qk_norm and value_embeds)
and cross-attention; `explicit_attention` spells out the weights when `GPT.attention_maps` records them.

`Attention` takes optional key/value input (cross-attention), an optional mask and an optional
`KVCache`; the decoder-only path uses `is_causal=True` and no explicit mask, the fast path of
`F.scaled_dot_product_attention`.

A one-token decode step is overhead bound on small models (each aten op has a fixed dispatch cost), so the
self-attention path keeps its op count low: the three heads come from one view and permute of the fused
projection, a cast happens only where dtypes differ, and one query's output is read back by a reshape
(tests/test_decode_ops.py counts them).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt.model.cache import KVCache
from gpt.model.config import GPTConfig
from gpt.model.positions import apply_rope
from gpt.model.sparse import Band, attend

QK_NORM_SCALE = 1.2  # qk_norm: each unit-RMS query and key times this (scores x 1.44; nanochat's value)
VE_GATE_CHANNELS = 12  # value_embeds: the gate reads this many leading channels of the attention's input (nanochat)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """softmax(QK^T / sqrt(d_k) + M) as a (B, nh, Tq, Tk) float32 tensor: what SDPA computes inside."""
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.size(-1))
    if causal:
        Tq, Tk = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA for one query per row (B, nh, 1, hs) over keys and values (B, nh, L, hs) where `mask` (broadcastable
    to (B, nh, 1, L)) allows, as products and sums a compiler fuses into its own loops (the fused SDPA
    kernel has a fixed cost per call on the CPU whatever the length); scores and sums in float32."""
    scores = (q * k).sum(-1, dtype=torch.float32) / math.sqrt(q.size(-1))  # (B, nh, L)
    weights = scores.masked_fill(~mask[:, :, 0], float("-inf")).softmax(-1)
    return (weights.unsqueeze(-1) * v).sum(-2, dtype=torch.float32, keepdim=True).to(v.dtype)  # (B, nh, 1, hs)


class Attention(nn.Module):
    """Multi-head scaled dot-product attention, softmax(QK^T/sqrt(d_k) + M)V.

    Self-attention when `kv is None`; cross-attention otherwise (queries from `x`, keys and values
    from `kv`, both through the one fused `c_attn` weight as torch.nn.MultiheadAttention does).
    `mask` is a boolean (B or 1, 1, Tq or 1, Tk) tensor, True where attention is allowed, or a window's
    `Band` (gpt/model/sparse.py: self-attention without a cache, at linear cost).
    """

    def __init__(self, config: GPTConfig, value_embed: bool = False):
        super().__init__()
        self.n_head = config.n_head  # heads this process computes (tensor parallelism: its share)
        self.n_embd = config.n_embd  # the model's width, whatever share of the heads this process holds
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        if value_embed:  # a raw matrix, not an nn.Linear: AdamW trains it (Muon takes the blocks' Linears)
            self.ve_gate = nn.Parameter(torch.zeros(config.n_head, min(VE_GATE_CHANNELS, config.n_embd)))
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        self.qk_norm = config.qk_norm
        self.weights: list[torch.Tensor] | None = None  # a list while GPT.attention_maps records, else None

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        B, T, _ = t.shape
        return t.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)

    def _normed(self, t: torch.Tensor) -> torch.Tensor:
        """qk_norm: each head's vector at unit RMS (no learned weight), times QK_NORM_SCALE."""
        return F.rms_norm(t, (t.size(-1),)) * QK_NORM_SCALE if self.qk_norm else t

    def _project(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        """`x` through the rows `rows` of the fused q|k|v projection (cross-attention reads q apart from k, v).

        On a tensor-parallel model `c_attn` is split column-wise (gpt/train/tensor_parallel.py) and this
        process's shard is [q | k | v] of its heads, n_head * head_dim rows each: `rows` counts in the shard.
        The slice is computed as a split DTensor product, so the gradient of the (replicated) input is summed
        over the processes in the backward, as `ColwiseParallel` does for the self-attention call."""
        w, b = self.c_attn.weight, self.c_attn.bias
        if not hasattr(w, "device_mesh"):
            return F.linear(x, w[rows], b[rows] if b is not None else None)
        from torch.distributed.tensor import DTensor, Replicate, Shard  # lazy: distributed (a split model)

        mesh = w.device_mesh
        part = lambda t: DTensor.from_local(t.to_local()[rows], mesh, [Shard(0)], run_check=False)  # noqa: E731
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return F.linear(x, part(w), part(b) if b is not None else None).to_local()

    def project_kv(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values for cross-attention over `kv` (computed once per source in generation)."""
        C = self.n_head * self.head_dim  # the model's width, or this process's share under tensor parallelism
        k, v = self._project(kv, slice(C, None)).split(C, dim=2)
        return self._normed(self._heads(k)), self._heads(v)

    def forward(
        self,
        x: torch.Tensor,
        kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        if kv is None:  # self-attention
            # one view and one permute give the three (B, nh, T, hs) heads (a split and three view/transposes
            # cost 7 dispatched ops a layer: a one-token decode step is overhead bound)
            q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            q, k = self._normed(q), self._normed(k)
            if ve is not None:  # value_embeds: v + gate * ve, one gate per head and token
                gate = 3 * torch.sigmoid(F.linear(x[..., : self.ve_gate.size(1)], self.ve_gate))  # (B, T, nh)
                v = v + gate.transpose(1, 2).unsqueeze(-1) * self._heads(ve.to(v.dtype))
            if rope is not None:  # (cos, sin) of these T positions; keys are cached rotated
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            past = 0
            if cache is not None:
                past = cache.pos
                dtype = cache.k.dtype  # attention runs in the cache's dtype (GPT.cache_dtype)
                if q.dtype != dtype:  # a cast only where one is needed (the common case has none)
                    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
                k, v = cache.append(k, v)
        else:  # cross-attention: kv is the memory (B, S, C) or its precomputed (k, v) heads
            q = self._normed(self._heads(self._project(x, slice(None, self.n_head * self.head_dim))))
            k, v = kv if isinstance(kv, tuple) else self.project_kv(kv)
            past, causal = 0, False
        band = mask if isinstance(mask, Band) else None  # a window, no cache (gpt/model/sparse.py)
        if band is not None:  # causal or not, the band says; recording spells it out as the dense reference
            mask, causal = (band.dense(T, x.device), False) if self.weights is not None else (None, False)
            band = band if self.weights is None else None
        if isinstance(past, torch.Tensor):  # a static cache: GPT.hidden's mask is already causal, per row
            causal = False
        if causal and (mask is not None or past > 0):
            # SDPA's is_causal assumes no cache and no other mask: build the mask explicitly.
            # Query i (at absolute position past + i) sees keys <= past + i; one new token sees all.
            if T > 1:
                allowed = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
                mask = allowed if mask is None else mask & allowed
            causal = False
        if band is not None:
            y = attend(q, k, v, band, dropout_p=self.dropout if self.training else 0.0)
        elif T == 1 and isinstance(past, torch.Tensor) and torch.compiler.is_compiling():
            y = one_query_attention(q, k, v, mask)  # a compiled decode step (gpt/model/compiled.py)
        elif self.weights is None:  # the fast path (flash / memory-efficient kernels)
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0
            )  # (B, nh, T, hs)
        else:  # recording: the same attention spelled out, its weights kept
            att = explicit_attention(q, k, mask, causal)
            self.weights.append(att)
            y = att.to(v.dtype) @ v
        # (B, nh, T, hs) -> (B, T, C); one query (a decode step) is that layout already, read as a view
        width = self.n_head * self.head_dim  # C, or this process's share of it under tensor parallelism
        y = y.reshape(B, T, width) if T == 1 else y.transpose(1, 2).contiguous().view(B, T, width)
        # back from the cache's dtype (GPT.cache_dtype); never without a cache: under autocast (training) x is
        # float32 and y bf16, which c_proj takes as it is (a cast would keep a float32 copy for backward)
        if cache is not None and y.dtype != x.dtype:
            y = y.to(x.dtype)
        y = self.c_proj(y)
        return self.resid_dropout(y) if self.training else y
