"""Positions: absolute position ids (per token, per packed document), the sinusoidal table, and rotary
embeddings (`GPT.embed` adds the first two; `gpt.model.attention.Attention` rotates by the last).

`pos_encoding="rope"` (rotary embeddings, Su et al. 2021, in GPT-NeoX / LLaMA's half-split layout):
self-attention rotates queries and keys by their positions, so scores depend on relative
positions only and there is no position table. Cross-attention is not rotated (its queries and
keys come from different sequences). Angles are computed in float64, so positions past
block_size (a sliding KV cache, gpt/infer/sampling.py) stay exact; the base is ROPE_THETA.
"""

from __future__ import annotations

import math

import torch

ROPE_THETA = 10000.0


def positions(start: int | torch.Tensor, T: int, device) -> torch.Tensor:
    """Absolute positions start .. start + T - 1: (T,) for an int start; (B or 1, T) for a device
    tensor start (0-dim, or one start per row)."""
    pos = torch.arange(T, device=device)
    return start.view(-1, 1) + pos if isinstance(start, torch.Tensor) else start + pos


def doc_positions(doc: torch.Tensor) -> torch.Tensor:
    """For (B, T) document ids of packed rows (each document's positions contiguous): each token's position
    within its document, 0 at the document's first token."""
    T = doc.size(1)
    t = torch.arange(T, device=doc.device).expand_as(doc)
    first = torch.ones_like(doc, dtype=torch.bool)
    first[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return t - torch.where(first, t, 0).cummax(dim=1).values


def doc_mask(doc: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean attention mask of packed rows: a token attends only within its own document
    (the causal part is added by attention itself)."""
    return (doc[:, :, None] == doc[:, None, :]).unsqueeze(1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., T, head_dim) of the rotary angles pos * ROPE_THETA^(-2i/head_dim), each frequency
    repeated for the two halves of a head; float32, from angles computed in float64 (but on MPS)."""
    wide = torch.float32 if positions.device.type == "mps" else torch.float64
    inv_freq = ROPE_THETA ** (-torch.arange(0, head_dim, 2, dtype=wide, device=positions.device) / head_dim)
    angles = positions.to(wide)[..., None] * inv_freq  # (..., T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., T, hs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + hs/2]) of x (B, nh, T, hs) by its position's angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


def sinusoidal_positions(n_pos: int, dim: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    pos = torch.arange(n_pos, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(n_pos, dim)
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv[: dim // 2])
    return pe
