"""The GPT decoder (and, switched on by config, the encoder of the full seq2seq Transformer).

    from gpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))
    logits, loss = model(idx, targets)          # logits always (B, T, vocab_size)

    # the full encoder-decoder Transformer ("Attention Is All You Need"): n_encoder_layer > 0
    model = GPT(GPTConfig(..., n_encoder_layer=6, norm="post", pos_encoding="sinusoidal"))
    logits, loss = model(tgt_in, tgt_out, src=src, src_mask=src_mask)   # teacher forcing
    memory = model.encode(src, src_mask)        # once per source
    h = model.decode(memory, src_mask, tgt_in)  # (B, T, C); logits = model.head(h)

Design notes (attention in attention.py, the blocks in block.py, positions in positions.py)
- Parameter names follow GPT-2 (`transformer.wte`, `transformer.h.0.attn.c_attn`, ...), so GPT-2
  weights map key for key (Hugging Face's Conv1D stores them transposed: see gpt/checkpoints/hf.py).
- `forward` always returns full logits; generation asks `hidden()` for the last position only
  (gpt/infer/sampling.py), so nothing here changes shape depending on whether targets were given.
- Seq2seq reuses the same `Block`s: the encoder's are not causal and mask padded source
  positions; the decoder's add cross-attention (`ln_cross`, `cross_attn`) over the encoder output
  with the same source mask. One embedding matrix serves source, target and output head (the
  vocabulary is shared). Masks are boolean, True = may attend; a (B, S) padding mask is True at
  real tokens. Every source needs at least one real token (pairs add an end token to each).
  With norm="post" the final `ln_f` of encoder and decoder match torch.nn.Transformer's final
  norms (tests/test_seq2seq_model.py checks equal outputs with copied weights).
- The speedrun recipe's options (GPTConfig, each off by default): `activation="relu2"` (relu(x)^2);
  `qk_norm` (each head's queries and keys at unit RMS, no weights, times QK_NORM_SCALE, before RoPE,
  which preserves the RMS, so the order does not matter; cached keys are stored normalised);
  `zero_init_proj` (see `_init_weights`); `logit_softcap` (in `head`, which every logits path
  calls instead of `lm_head`); `untied_head` (lm_head its own matrix; `lm_head.weight` is in the state
  dict either way, so checkpoint keys do not change).
- `x0_skip` (modded-nanogpt, nanochat): block i's input is `resid_lambdas[i] * x + x0_lambdas[i] * x0`, x0
  the embedding output as it enters the first block, two learned scalars per decoder layer (1 and 0 at
  init: the model starts as without the option). They are `param_groups`' "scalar" groups, trained by
  AdamW at LRs of their own, without weight decay and never by Muon.
- `value_embeds` (ResFormer's value residual as nanochat and modded-nanogpt do it): decoder layers
  `value_layers` (every other one, the last included) add a token embedding of their own to the
  attention values, each head gated by 3 * sigmoid(ve_gate . x[:VE_GATE_CHANNELS]) of the attention's
  input, in (0, 3), 1.5 at init (ve_gate starts at zero). Both options are per token, so the KV cache
  needs nothing new: cached values hold the embedding already.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt.model.attention import QK_NORM_SCALE, VE_GATE_CHANNELS, Attention, explicit_attention
from gpt.model.block import MLP, Block, ReLU2
from gpt.model.cache import KVCache
from gpt.model.compiled import AheadOfTimeStep, DynamoStep
from gpt.model.config import GPTConfig
from gpt.model.positions import (
    ROPE_THETA,
    Positions,
    apply_rope,
    doc_mask,
    doc_positions,
    positions,
    rope_cos_sin,
    sinusoidal_positions,
)
from gpt.model.sparse import Band
from gpt.model.windows import Windows

# the names other modules and tests import from here, wherever they now live
__all__ = [
    "GPT",
    "GPTConfig",
    "KVCache",
    "Attention",
    "Block",
    "MLP",
    "ReLU2",
    "explicit_attention",
    "value_layers",
    "ROPE_THETA",
    "QK_NORM_SCALE",
    "VE_GATE_CHANNELS",
    "apply_rope",
    "doc_mask",
    "doc_positions",
    "positions",
    "Positions",
    "rope_cos_sin",
    "sinusoidal_positions",
]


def value_layers(n_layer: int) -> list[int]:
    """The decoder layers that get value embeddings: every other one, ending with the last (nanochat's choice)."""
    return [i for i in range(n_layer) if i % 2 == (n_layer - 1) % 2]


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.positions = Positions.of(config)  # every question about the position scheme (positions.py)
        self.windows = Windows.of(config)  # each layer's attention window (windows.py)
        ve_layers = value_layers(config.n_layer) if config.value_embeds else []
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(
                    Block(config, cross=config.n_encoder_layer > 0, value_embed=i in ve_layers)
                    for i in range(config.n_layer)
                ),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.positions.build(self, config.block_size)  # wpe kept, or dropped (and the fixed pe buffer made)
        if config.n_encoder_layer > 0:
            self.encoder = nn.ModuleDict(
                dict(
                    h=nn.ModuleList(Block(config) for _ in range(config.n_encoder_layer)),
                    ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
                )
            )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if not config.untied_head:
            self.lm_head.weight = self.transformer.wte.weight  # weight tying: one matrix, two uses
        if config.x0_skip:  # per decoder layer (see _init_weights' table)
            self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
            self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
        if ve_layers:  # keyed by layer: value_embeds.<i>.weight
            self.value_embeds = nn.ModuleDict(
                {str(i): nn.Embedding(config.vocab_size, config.n_embd) for i in ve_layers}
            )
        self.apply(self._init_weights)
        # The whole one-token decode step in one call of our C kernels (gpt/model/rowkernels.py's StackStep, set
        # by gpt.model.packed.pack): given ids and caches it returns `hidden`'s result, or None for a call it
        # does not take.
        self.step = None

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 initialisation, all in one place:

        | parameter                                  | init                                  |
        |--------------------------------------------|---------------------------------------|
        | Linear weights, embeddings (wte, wpe)      | normal(0, 0.02)                       |
        | residual projections (attn/mlp `c_proj`)   | normal(0, 0.02 / sqrt(2 * n_layer))   |
        | biases                                     | zero                                  |
        | LayerNorm                                  | weight 1, bias 0 (PyTorch's default)  |
        | with zero_init_proj: the `c_proj` above    | zero (each block starts as identity)  |
        | with untied_head: lm_head                  | normal(0, 0.02), as any Linear        |
        | with x0_skip: resid_lambdas, x0_lambdas    | 1 and 0 (set in __init__)             |
        | with value_embeds: value_embeds            | normal(0, 0.02), as wte               |
        | with value_embeds: each ve_gate            | zero (every gate 3 * sigmoid(0) = 1.5) |
        """
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, (Attention, MLP)):  # residual projection, after its own Linear init
            n_residual = 2 * (self.config.n_layer + self.config.n_encoder_layer)
            torch.nn.init.normal_(module.c_proj.weight, mean=0.0, std=0.02 / math.sqrt(n_residual))
            if self.config.zero_init_proj:
                torch.nn.init.zeros_(module.c_proj.weight)

    # ---- forward paths -------------------------------------------------------------------------

    def embed(self, idx: torch.Tensor, start_pos: int | torch.Tensor = 0, pos: torch.Tensor | None = None):
        """Token embeddings plus absolute positions (`start_pos` onwards, or `pos` (B, T) given per token).
        RoPE adds none here (attention rotates) and has no table, so it has no length limit: past
        block_size, attention spans more than training did unless a mask narrows it (the rolling
        sampler's cache computes a band of block_size keys)."""
        T = idx.size(1)
        tok = self.transformer.wte(idx)  # (B, T, C)
        if not self.positions.absolute:
            return self.transformer.drop(tok)
        if not isinstance(start_pos, torch.Tensor) and start_pos + T > self.config.block_size:
            raise ValueError(
                f"sequence of length {start_pos + T} exceeds block_size {self.config.block_size}; "
                f"crop the input to its last {self.config.block_size} tokens"
            )
        pos = positions(start_pos, T, idx.device) if pos is None else pos
        return self.transformer.drop(self.positions.add(self, tok, pos))

    def rope(self, start: int | torch.Tensor, T: int, device, pos: torch.Tensor | None = None):
        """What self-attention receives for positions start .. start + T - 1 (or `pos` (B, T)): rotary
        (cos, sin), or None (`Positions.attention`)."""
        return self.positions.attention(start, T, device, pos)

    def hidden(
        self,
        idx: torch.Tensor,
        caches: list[KVCache] | None = None,
        memory=None,
        memory_mask: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        doc: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-LayerNorm hidden states (B, T, C) of the decoder stack.

        With `caches` (one KVCache per layer) the tokens continue the cached sequence. With an
        encoder, `memory` is its output (or, per layer, precomputed cross-attention key/values).
        `mask` (boolean, broadcastable to (B, nh, T, T_past + T)) further restricts self-attention,
        which is causal in any case. Static caches (a tensor `pos`, shared or per row) attend over
        their whole buffer: query t of row b sees the keys at positions <= pos[b] + t. `doc` (B, T) packs
        several documents in a row (chat fine-tuning): a token attends within its document only, and
        positions restart at each document's first token, as if each were alone. With attention windows and
        caches, each layer's mask comes from the positions its cache holds (`cache_masks`): a windowed
        layer's cache is a ring of its window (gpt/model/cache.py).
        """
        if self.step is not None and caches and memory is None and mask is None and doc is None:
            h = self.step(idx, caches)
            if h is not None:
                return h
        start = caches[0].pos if caches else 0
        pos = None
        bands = self.bands(mask, doc, idx.size(1), causal=True) if caches is None else None
        if doc is not None:
            pos = doc_positions(doc)
            if bands is None or None in bands:  # (a band compares document ids itself, at linear cost)
                mask = doc_mask(doc) if mask is None else mask & doc_mask(doc)
        windowed = bool(caches) and self.windows.any  # per-layer masks from each cache's key positions
        if isinstance(start, torch.Tensor) and not windowed:
            query_pos = start.view(-1, 1) + torch.arange(idx.size(1), device=idx.device)  # (B or 1, T)
            written = torch.arange(caches[0].max_len, device=idx.device) <= query_pos[..., None]  # (B or 1, T, L)
            written = written.unsqueeze(1)  # (B or 1, 1, T, L)
            mask = written if mask is None else mask & written
        x = x0 = self.embed(idx, start, pos)
        rope = self.rope(start, idx.size(1), idx.device, pos)
        ve = self.value_embeds if self.config.value_embeds else {}
        masks = None  # (no positions computed without windows: a decode step dispatches only the ops it needs)
        if windowed:
            masks = self.cache_masks(mask, caches, idx.size(1))
        elif bands is not None:  # no cache: each windowed layer's Band, the others `mask`
            masks = [mask if b is None else b for b in bands]
        elif self.windows.any:
            masks = self.window_masks(mask, *self._query_key_positions(idx, start, caches, pos), causal=True)
        for i, block in enumerate(self.transformer.h):
            mem = memory[i] if isinstance(memory, list) else memory
            if self.config.x0_skip:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            x = block(
                x,
                mask=masks[i] if masks else mask,
                causal=not windowed,  # (cache_masks are causal already; a ring's keys are in no order)
                cache=caches[i] if caches else None,
                memory=mem,
                memory_mask=memory_mask,
                rope=rope,
                ve=ve[str(i)](idx) if str(i) in ve else None,
            )
        return self.transformer.ln_f(x)

    def _query_key_positions(self, idx, start, caches, pos) -> tuple[torch.Tensor, torch.Tensor]:
        """The absolute positions of `hidden`'s queries and of the keys they attend over: (T,) and (L,), or
        per row (B or 1, T) / (B, L) with static caches and packed documents."""
        T, dev = idx.size(1), idx.device
        if pos is not None:  # packed documents: positions within each document
            return pos, pos
        if isinstance(start, torch.Tensor):  # static caches: every slot, slot i holding position i
            return positions(start, T, dev), torch.arange(caches[0].max_len, device=dev)
        return positions(start, T, dev), torch.arange(start + T, device=dev)

    def cache_masks(self, mask, caches: list[KVCache], T: int) -> list[torch.Tensor]:
        """Per decoder layer, the mask of T queries continuing `caches` over the keys that layer's cache returns
        (`KVCache.key_positions`: a ring's slots are in no order): written keys at positions up to the query's,
        within the layer's window (windows.py), and `mask`. Layers with equal windows and caches share one."""
        q = positions(caches[0].pos, T, caches[0].k.device)  # (T,) or (B or 1, T)
        by_kind, out = {}, []
        for i, cache in enumerate(caches):
            size = self.windows.size(i)
            kind = (size, cache.ring, cache.n_global, cache.period)  # (one call's caches of a kind are alike)
            if kind not in by_kind:
                k = cache.key_positions(T)[..., None, :]  # (1, L) or (B or 1, 1, L)
                allowed = (k >= 0) & (k <= q[..., :, None])
                if size:
                    allowed = allowed & self.windows.allowed(size, q, k[..., 0, :])
                allowed = allowed.unsqueeze(-3)  # (1, 1, T, L) or (B or 1, 1, T, L)
                by_kind[kind] = allowed if mask is None else mask & allowed
            out.append(by_kind[kind])
        return out

    def bands(self, mask, doc, T: int, causal: bool, encoder: bool = False) -> list[Band | None] | None:
        """Per layer, its window's `Band` (None for a full layer) for T tokens without a cache: attention at
        linear cost (gpt/model/sparse.py). None when no layer has a window, or when `mask` is more than a
        key mask (B or 1, 1, 1, T): such a mask is T x T already, and `window_masks` narrows it densely."""
        if not self.windows.any:
            return None
        if mask is not None and not (mask.dim() == 4 and mask.shape[1:3] == (1, 1) and mask.size(-1) == T):
            return None
        keys = mask[:, 0, 0, :] if mask is not None else None
        n = self.config.n_encoder_layer if encoder else self.config.n_layer
        G = self.windows.global_tokens
        return [Band(w, G, causal, keys, doc) if w else None for w in self.windows.sizes(n)]

    def window_masks(self, mask, q: torch.Tensor, k: torch.Tensor, causal: bool, encoder: bool = False):
        """Per layer, `mask` (None, or boolean broadcastable to (B, nh, Tq, Tk)) narrowed to that layer's window
        for queries at positions `q` over keys at `k` (windows.py); None when no layer has a window. One
        (Tq, Tk) mask per distinct window size: the dense reference, O(T^2) memory."""
        if not self.windows.any:
            return None
        n = self.config.n_encoder_layer if encoder else self.config.n_layer
        by_size, out = {}, []
        for size in self.windows.sizes(n):
            if size and size not in by_size:
                narrow = self.windows.allowed(size, q, k, causal).unsqueeze(-3)  # (B or 1, 1, Tq, Tk)
                by_size[size] = narrow if mask is None else mask & narrow
            out.append(by_size[size] if size else mask)
        return out

    # ---- seq2seq: encode the source once, decode against it -------------------------------------

    @staticmethod
    def key_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
        """A (B, S) padding mask (True = real token) as an attention mask over keys, (B, 1, 1, S)."""
        if mask is None or mask.dim() != 2:
            return mask
        if mask.dtype != torch.bool:
            raise ValueError(f"padding masks must be boolean (True = real token), got dtype {mask.dtype}")
        return mask[:, None, None, :]

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's output ("memory"), (B, S, C), for source ids `src` (B, S).

        `src_mask` (B, S) is True at real tokens and False at padding; padded positions are never
        attended to (each source needs at least one real token). Blocks are not causal.
        """
        if self.config.n_encoder_layer == 0:
            raise ValueError("encode() needs an encoder: this model has n_encoder_layer=0 (decoder-only)")
        mask = self.key_mask(src_mask)
        x = self.embed(src)
        rope = self.rope(0, src.size(1), src.device)
        bands = self.bands(mask, None, src.size(1), causal=False, encoder=True)
        if bands is not None:
            masks = [mask if b is None else b for b in bands]
        else:
            at = torch.arange(src.size(1), device=src.device)
            masks = self.window_masks(mask, at, at, causal=False, encoder=True)
        for i, block in enumerate(self.encoder.h):
            x = block(x, mask=masks[i] if masks else mask, causal=False, rope=rope)
        return self.encoder.ln_f(x)

    def decode(
        self,
        memory,
        src_mask: torch.Tensor | None,
        tgt: torch.Tensor,
        tgt_mask: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
    ) -> torch.Tensor:
        """Decoder hidden states (B, T, C) for target ids `tgt` given the encoder's `memory`.

        `memory` is `encode()`'s output, or per decoder layer the cross-attention (k, v) from
        `block.cross_attn.project_kv(memory)` (generation computes these once per source).
        `src_mask` (B, S) masks padded source positions in cross-attention. Self-attention is
        causal; `tgt_mask` (a (B, T) padding mask or anything broadcastable to (B, nh, T, T))
        restricts it further, though right-padded targets need none. Logits: `head(hidden)`.
        """
        if self.config.n_encoder_layer == 0:
            raise ValueError("decode() needs an encoder: this model has n_encoder_layer=0 (decoder-only)")
        return self.hidden(
            tgt, caches, memory=memory, memory_mask=self.key_mask(src_mask), mask=self.key_mask(tgt_mask)
        )

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (..., vocab_size) of hidden states `h` (..., C): `lm_head`, then with logit_softcap c > 0
        c * tanh(logits / c), computed in float32 (every caller of the head goes through here)."""
        logits = self.lm_head(h)
        c = self.config.logit_softcap
        return c * torch.tanh(logits.float() / c) if c else logits

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)).float(),
            targets.reshape(-1),
            ignore_index=-1,
            label_smoothing=self.config.label_smoothing,
        )

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        src: torch.Tensor | None = None,
        src_mask: torch.Tensor | None = None,
        doc: torch.Tensor | None = None,
    ):
        """Logits (B, T, vocab_size) and, given targets, the mean cross-entropy (ignore_index=-1).

        Decoder-only: `idx` is the token sequence; `doc` (B, T), if given, the document of each token
        in rows packed with several (attention stays within a document: see `hidden`). Seq2seq
        (n_encoder_layer > 0): `idx` is the teacher-forced target input (start token + target), `src`
        (B, S) the source ids and `src_mask` (B, S) True at real source tokens; targets are -1 at padding.
        """
        if src is None:
            if self.config.n_encoder_layer > 0:
                raise ValueError(
                    f"this model has an encoder (n_encoder_layer={self.config.n_encoder_layer}): pass src="
                )
            logits = self.head(self.hidden(idx, doc=doc))
        else:
            logits = self.head(self.decode(self.encode(src, src_mask), src_mask, idx))
        loss = self.loss(logits, targets) if targets is not None else None
        return logits, loss

    @torch.no_grad()
    def attention_maps(
        self, idx: torch.Tensor, src: torch.Tensor | None = None, src_mask: torch.Tensor | None = None
    ) -> dict[str, list[torch.Tensor]]:
        """The attention weights of one forward (in eval mode), per layer (B, n_head, T_query, T_key), each
        row summing to 1: "self" for the decoder's self-attention (causal), and for a seq2seq model
        (`src` given) "cross" (target over source tokens) and "encoder". The normal forward stays on
        SDPA's fast path: weights are computed only here, by switching each layer to recording."""
        layers = {"self": [b.attn for b in self.transformer.h]}
        if src is not None:
            layers["cross"] = [b.cross_attn for b in self.transformer.h]
            layers["encoder"] = [b.attn for b in self.encoder.h]
        was_training = self.training
        self.eval()
        try:
            for modules in layers.values():
                for m in modules:
                    m.weights = []
            self(idx, None, src, src_mask)
            return {kind: [m.weights[0] for m in modules] for kind, modules in layers.items()}
        finally:
            for modules in layers.values():
                for m in modules:
                    m.weights = None
            self.train(was_training)

    # ---- incremental decoding: the caches the forward paths above take ---------------------------

    def cache_dtype(self) -> torch.dtype:
        """The dtype of the KV caches: the model's, but float32 for a bf16 model on the CPU, where attention
        over a bf16 cache runs several times slower than over a float32 one for one query (PyTorch's CPU flash
        kernel; measured on a Zen 4 EPYC, 30 to 1000 keys) and a decode step's attention is dominated by it."""
        dtype = self.transformer.wte.weight.dtype
        cpu_bf16 = dtype == torch.bfloat16 and self.transformer.wte.weight.device.type == "cpu"
        return torch.float32 if cpu_bf16 else dtype

    ring_cache: bool = True  # windowed layers cache their window only (False: every position, the reference)

    def cache_window(self, layer: int, max_len: int | None = None) -> int:
        """The ring of decoder layer `layer`'s KV cache, in slots after the global ones (`KVCache`); 0 for a
        cache of every position: a layer without a window, `ring_cache` off, or a window whose ring would not
        be smaller than the context (but for RoPE, whose context has no end: gpt/model/cache.py)."""
        size = self.windows.size(layer) if self.ring_cache else 0
        bounded = self.windows.global_tokens + size < (max_len or self.config.block_size)
        return size if size and (bounded or self.positions.slides) else 0

    def cache_slots(self, layer: int, max_len: int | None = None) -> int:
        """The slots of decoder layer `layer`'s KV cache (`new_caches`): its ring and the global tokens, or every
        position."""
        ring = self.cache_window(layer, max_len)
        return self.windows.global_tokens + ring if ring else max_len or self.config.block_size

    def new_caches(self, batch: int, max_len: int | None = None) -> list[KVCache]:
        """One empty self-attention KVCache per decoder layer, on the model's device, in `cache_dtype`: a ring
        of the window (and the global tokens) for a windowed layer (`cache_window`), else `max_len` slots."""
        param = self.transformer.wte.weight
        head_dim = self.config.n_embd // self.config.n_head
        rolling = self.positions.slides  # (rotated keys: a full cache can drop its oldest entry)
        return [
            KVCache(
                batch,
                self.config.n_head,
                max_len or self.config.block_size,
                head_dim,
                param.device,
                self.cache_dtype(),
                rolling,
                window=self.cache_window(i, max_len),
                n_global=self.windows.global_tokens,
            )
            for i in range(len(self.transformer.h))
        ]

    def cross_kv(self, memory: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per decoder layer, the cross-attention keys and values of the encoder output `memory` (B, S, C):
        computed once per source and passed to `decode` as its memory at every step."""
        return [block.cross_attn.project_kv(memory) for block in self.transformer.h]

    def blocks(self) -> list[Block]:
        """Every transformer block, the encoder's first: what FSDP shards and activation checkpointing
        recomputes one at a time (gpt/train/parallel.py)."""
        return [*(self.encoder.h if self.config.n_encoder_layer else ()), *self.transformer.h]

    # ---- what users expect next to the model ---------------------------------------------------

    def num_params(self, non_embedding: bool = True) -> int:
        """Unique parameters (the tied head counted once); without position and value embeddings by default
        (lookups, no FLOPs)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        if non_embedding and self.config.value_embeds:
            n -= sum(p.numel() for p in self.value_embeds.parameters())
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6N + 12 * L * T * C (PaLM appendix B)."""
        T = seq_len or self.config.block_size
        L = self.config.n_layer + self.config.n_encoder_layer
        return 6 * self.num_params() + 12 * L * T * self.config.n_embd

    def param_groups(self, weight_decay: float, muon: bool = False) -> list[dict]:
        """Weight decay on matrices (Linear weights, embeddings, value embeddings); none on biases and LayerNorms.
        With `muon`, the blocks' trained Linear weights come first, in a group marked "muon" (gpt/train/muon.py).
        x0_skip's scalars come last, each kind in a group of its own marked "scalar" ("resid" or "x0": the
        trainer gives each its own LR), without weight decay and never Muon's."""
        scalars = {"resid": self.resid_lambdas, "x0": self.x0_lambdas} if self.config.x0_skip else {}
        scalars = {kind: p for kind, p in scalars.items() if p.requires_grad}
        own = {id(p) for p in scalars.values()}
        params = [p for p in self.parameters() if p.requires_grad and id(p) not in own]
        linears = [m for m in self.modules() if isinstance(m, nn.Linear) and m is not self.lm_head] if muon else []
        hidden = {id(m.weight) for m in linears}
        groups = [
            {"params": [p for p in params if p.dim() >= 2 and id(p) not in hidden], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            *({"params": [p], "weight_decay": 0.0, "scalar": kind} for kind, p in scalars.items()),
        ]
        matrices = [p for p in params if id(p) in hidden]
        return ([{"params": matrices, "weight_decay": weight_decay, "muon": True}] if matrices else []) + groups

    decode_step: Callable | None = None  # the compiled one-token step, once `compile_decoding` made it

    def compile_decoding(self) -> None:
        """Compile the one-token decode step (`sample.py --compile`): `decode_step(ids, caches, length)`, the
        logits (B, V) after ids (B, 1) over static caches (a tensor position: see `KVCache`) of which the
        first `length` slots are written, a length the compiled step keeps symbolic: one compile serves every
        length and every `gpt.infer.sampling.Decoder`, which calls it; prefills stay eager. The first compiled step waits
        for the compile. On the CPU the step is compiled ahead of time into one C++ function with the
        weights inside (`gpt.model.compiled`: the model must hold plain nn.Linear or Int8Linear layers);
        elsewhere it is torch.compile's, with this module's weights."""
        if self.transformer.wte.weight.device.type == "cpu":
            self.decode_step = AheadOfTimeStep(self)
        else:
            self.decode_step = DynamoStep(self)

    def _logits_after(self, idx: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        return self.head(self.hidden(idx, caches)[:, -1]).float()

    @torch.no_grad()
    def grow_vocab(self, vocab_size: int, fresh: range) -> None:
        """Give the embedding (and the head tied to it) `vocab_size` rows, at least its current count, and
        fresh rows for the new tokens `fresh` (a chat template's special tokens, after the base
        vocabulary): each the mean of the base vocabulary's rows plus a little noise, so a new token
        starts as an average token, neither dominating the softmax nor unreachable; the noise is drawn
        from a generator of its own, so growing the same base twice gives the same rows (a LoRA run's
        base is grown again when it is loaded). Padding rows beyond get normal(0, 0.02) the same way. The rows of the old tokens, hence their logits, stay as they are."""
        n = max(vocab_size, self.transformer.wte.weight.size(0))
        if fresh.start < 1 or fresh.stop > n:
            raise ValueError(f"fresh rows {fresh} must lie within 1..{n} after at least one base row")
        self.transformer.wte.weight = _grown(self.transformer.wte.weight, n, fresh)
        self.transformer.wte.num_embeddings = n
        # tied: the head shares the grown matrix; untied_head: its own rows grow the same way
        self.lm_head.weight = (
            self.transformer.wte.weight if not self.config.untied_head else _grown(self.lm_head.weight, n, fresh)
        )
        self.lm_head.out_features = n
        for table in self.value_embeds.values() if self.config.value_embeds else ():  # each grows as wte
            table.weight = _grown(table.weight, n, fresh)
            table.num_embeddings = n
        self.config.vocab_size = n

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the context (fine-tuning at a shorter block): position embeddings are cropped."""
        if block_size > self.config.block_size:
            raise ValueError(f"cannot grow block_size from {self.config.block_size} to {block_size}")
        self.config.block_size = block_size
        self.positions.crop(self, block_size)


def _grown(old: nn.Parameter, n: int, fresh: range) -> nn.Parameter:
    """`old` (rows, C) grown to n rows for `GPT.grow_vocab`: the old rows kept, the `fresh` ones the mean of
    the rows before them plus noise, the rest normal(0, 0.02); the noise from seeded generators of its own."""
    weight = torch.empty(n, old.size(1), dtype=old.dtype, device=old.device)
    weight[: old.size(0)] = old
    padding = torch.randn(n - old.size(0), old.size(1), generator=torch.Generator().manual_seed(n))
    weight[old.size(0) :] = (0.02 * padding).to(weight)
    noise = torch.randn(len(fresh), old.size(1), generator=torch.Generator().manual_seed(fresh.start))
    weight[fresh.start : fresh.stop] = (old[: fresh.start].float().mean(0) + 0.02 * noise.to(old.device)).to(old.dtype)
    return nn.Parameter(weight, requires_grad=old.requires_grad)
