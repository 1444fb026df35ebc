"""Positions: one owner for the position scheme (`Positions`), and the pieces it uses: absolute position
ids (per token, per packed document), the sinusoidal table and rotary embeddings.

    p = Positions.of(config)      # the scheme of config.pos_encoding, sized for this model
    p.adds                        # what GPT.embed adds: "wpe" (learned table), "pe" (fixed table) or None
    p.attention(start, T, dev)    # what attention receives: rotary (cos, sin), or None
    p.slides                      # a full KV cache may drop its oldest entry (else: crop and prefill again)
    p.family("hf")                # the export family that carries it ("gpt2", "gpt_neox", ...)

Every question about positions goes to this object (GPT, the decoders, the compiled step, the exporters),
never to the `pos_encoding` string. The schemes:

| pos_encoding | GPT.embed adds                          | attention receives | KV cache | Hugging Face | GGUF    |
|--------------|-----------------------------------------|--------------------|----------|--------------|---------|
| learned      | `transformer.wpe` (a parameter)         | nothing            | crop     | gpt2         | gpt2    |
| sinusoidal   | the `pe` buffer, tokens * sqrt(n_embd)  | nothing            | crop     | gpt2         | gpt2    |
| rope         | nothing                                 | rotary (cos, sin)  | slide    | gpt_neox     | gptneox |

A new scheme is a row of `SCHEMES` here, its name in `POS_ENCODINGS` and a row of `EXPORTS` (which export
formats carry it, why the others cannot) in gpt/model/config.py, and whatever it computes (attention.py when
attention changes); an exporter that does not carry it refuses it in one line from `EXPORTS`, and one that
does needs its weights mapped (gpt/checkpoints/hf.py, gguf.py). So 2 files (3 with new attention maths) in
one room, plus one file per exporter that learns to carry it.

`pos_encoding="rope"` (rotary embeddings, Su et al. 2021, in GPT-NeoX / LLaMA's half-split layout):
self-attention rotates queries and keys by their positions, so scores depend on relative
positions only and there is no position table. Cross-attention is not rotated (its queries and
keys come from different sequences). Angles are computed in float64, so positions past
block_size (a sliding KV cache, gpt/infer/sampling.py) stay exact; the base is ROPE_THETA.

Footguns
- `GPT.__init__` builds `transformer.wpe` for every scheme and deletes it where the scheme has no learned
  table: its construction draws from the random generator, and the weights a seed gives must not change.
- The table lives in the model (`wpe`, `pe`): `Positions` holds no tensors, only the answers, so one object
  serves a model, a pipeline stage and a stand-in with a config.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

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


@dataclass(frozen=True)
class Positions:
    """The answers of one position scheme for one model (build it with `Positions.of(config)`)."""

    name: str
    adds: str | None  # what GPT.embed adds to the token embeddings: "wpe" (learned), "pe" (fixed), None
    scaled: bool  # token embeddings times sqrt(n_embd) before the table is added (the paper's sinusoidal)
    rotary: bool  # self-attention rotates queries and keys (rope_cos_sin)
    cache: str  # "slide": a full KV cache drops its oldest entry; "crop": the context is cropped, then prefilled
    families: tuple[tuple[str, str], ...]  # (export format, the family there that carries the scheme)
    n_embd: int = 0
    head_dim: int = 0

    @classmethod
    def of(cls, config) -> Positions:
        """The scheme of `config.pos_encoding` (a GPTConfig, or anything with its fields), sized for it."""
        return dataclasses.replace(
            SCHEMES[config.pos_encoding], n_embd=config.n_embd, head_dim=config.n_embd // config.n_head
        )

    @staticmethod
    def named(name) -> Positions | None:
        """The scheme called `name` (unsized: for what needs no sizes), None for a name no scheme has."""
        return SCHEMES.get(name) if isinstance(name, str) else None

    @property
    def absolute(self) -> bool:
        """The embedding adds a table of block_size rows: a context is at most block_size tokens."""
        return self.adds is not None

    @property
    def slides(self) -> bool:
        """A full KV cache may overwrite its oldest entry and go on past block_size (keys carry their
        positions already); otherwise a context past block_size is cropped and prefilled again."""
        return self.cache == "slide"

    def family(self, fmt: str) -> str:
        """The architecture family `fmt` ("hf", "gguf") writes this scheme as; gpt/model/config.py's `EXPORTS`
        has refused the formats that cannot carry it before this is asked."""
        return dict(self.families)[fmt]

    def table(self, block_size: int) -> torch.Tensor | None:
        """The fixed table (block_size, n_embd) of a scheme that adds one ("pe"), else None."""
        return sinusoidal_positions(block_size, self.n_embd) if self.adds == "pe" else None

    def build(self, model: nn.Module, block_size: int) -> None:
        """Give `model` (built with `transformer.wpe`, see the footguns) this scheme's table: keep wpe,
        or drop it and register the fixed `pe` buffer (not saved: it is computed), or neither."""
        if self.adds != "wpe":
            del model.transformer["wpe"]
        if self.adds == "pe":
            model.register_buffer("pe", self.table(block_size), persistent=False)

    def add(self, model: nn.Module, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Token embeddings `tok` (B, T, C) plus the table rows of positions `pos` (a scheme that adds one)."""
        if self.scaled:
            tok = tok * math.sqrt(self.n_embd)  # the paper scales embeddings by sqrt(d_model)
        return tok + (model.transformer.wpe(pos) if self.adds == "wpe" else model.pe[pos])

    def attention(self, start: int | torch.Tensor, T: int, device, pos: torch.Tensor | None = None):
        """What self-attention receives for positions start .. start + T - 1 (or `pos` (B, T)): rotary
        (cos, sin), (T, hs) or (B or 1, 1, T, hs); None for a scheme that does not rotate."""
        if not self.rotary:
            return None
        pos = positions(start, T, device) if pos is None else pos
        cos, sin = rope_cos_sin(pos, self.head_dim)
        return (cos, sin) if pos.dim() == 1 else (cos.unsqueeze(1), sin.unsqueeze(1))  # (B or 1, 1, T, hs)

    def crop(self, model: nn.Module, block_size: int) -> None:
        """Crop `model`'s table to its first block_size rows (`GPT.crop_block_size`)."""
        if self.adds == "wpe":
            model.transformer.wpe.weight = nn.Parameter(model.transformer.wpe.weight[:block_size])
        elif self.adds == "pe":
            model.pe = model.pe[:block_size]


GPT2_FAMILIES = (("hf", "gpt2"), ("gguf", "gpt2"))
SCHEMES = {  # every pos_encoding (gpt/model/config.py's POS_ENCODINGS), the table in the module notes
    "learned": Positions("learned", adds="wpe", scaled=False, rotary=False, cache="crop", families=GPT2_FAMILIES),
    "sinusoidal": Positions("sinusoidal", adds="pe", scaled=True, rotary=False, cache="crop", families=GPT2_FAMILIES),
    "rope": Positions(
        "rope", adds=None, scaled=False, rotary=True, cache="slide", families=(("hf", "gpt_neox"), ("gguf", "gptneox"))
    ),
}
