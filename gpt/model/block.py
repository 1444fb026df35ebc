"""The Transformer block: self-attention, optional cross-attention and the MLP, each a residual sublayer
(pre- or post-norm); `GPT` stacks them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt.model.attention import Attention
from gpt.model.cache import KVCache
from gpt.model.config import GPTConfig


class ReLU2(nn.Module):
    """relu(x)^2: the "relu2" activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


class MLP(nn.Module):
    """Position-wise feed-forward network, width 4 * n_embd, GELU (or ReLU squared)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        if config.activation == "relu2":
            self.gelu = ReLU2()  # the attribute keeps its name: the activation has no weights either way
        else:
            self.gelu = nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c_proj(self.gelu(self.c_fc(x)))
        return self.dropout(y) if self.training else y  # dropout is the identity in eval: no call


class Block(nn.Module):
    """Self-attention, optional cross-attention, feed-forward; each a residual sublayer.

    Pre-norm (GPT-2): x + Sublayer(LN(x)). Post-norm (the paper): LN(x + Sublayer(x)).
    """

    def __init__(self, config: GPTConfig, cross: bool = False, value_embed: bool = False):
        super().__init__()
        self.post_norm = config.norm == "post"
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = Attention(config, value_embed)
        if cross:
            self.ln_cross = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.cross_attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        # Activation checkpointing (gpt/train/parallel.py): a wrapper the block's computation runs through,
        # e.g. torch.utils.checkpoint; None runs it directly. Parameter names and state dicts do not change.
        self.wrapper: Callable | None = None
        # A one-token decode step in one call of our C kernels (gpt/model/rowkernels.py's BlockStep, set by
        # gpt.model.packed.pack): given x and the cache it returns the block's output, or None for a call it
        # does not take.
        self.step: Callable | None = None

    def _sublayer(self, x, ln, fn):
        return ln(x + fn(x)) if self.post_norm else x + fn(ln(x))

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = True,
        cache: KVCache | None = None,
        memory=None,
        memory_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.wrapper is not None:
            return self.wrapper(self._compute, x, mask, causal, cache, memory, memory_mask, rope, ve)
        return self._compute(x, mask, causal, cache, memory, memory_mask, rope, ve)

    def _compute(self, x, mask, causal, cache, memory, memory_mask, rope, ve) -> torch.Tensor:
        if self.step is not None and mask is None and memory is None and rope is None and ve is None:
            y = self.step(x, cache)
            if y is not None:
                return y
        attend = lambda h: self.attn(h, mask=mask, causal=causal, cache=cache, rope=rope, ve=ve)  # noqa: E731
        x = self._sublayer(x, self.ln_1, attend)
        if memory is not None:
            x = self._sublayer(x, self.ln_cross, lambda h: self.cross_attn(h, kv=memory, mask=memory_mask))
        return self._sublayer(x, self.ln_2, self.mlp)
