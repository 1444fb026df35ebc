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

Context extension (`rope_scaling`, `rope_factor`, `rope_original_block` of GPTConfig; `RopeScaling`): a rope
model trained at block B is fine-tuned briefly at block F * B with its frequencies stretched by F, "linear"
(position interpolation) or "yarn" (only the slow frequencies, and cos and sin times 0.1 ln F + 1). The
angles are Hugging Face's rope types "linear" and "yarn" (beta_fast 32, beta_slow 1, truncated ramp), so
exports carry them (gpt/checkpoints/hf_neox.py, gguf.py); `rope_cos_sin` is the one place they are computed.

Footguns
- `GPT.__init__` builds `transformer.wpe` for every scheme and deletes it where the scheme has no learned
  table: its construction draws from the random generator, and the weights a seed gives must not change.
- `rope_original_block = 0` means block_size / rope_factor: a config whose block_size changes afterwards
  (`GPT.crop_block_size`) describes other yarn angles than the model built from it computes; `gpt train
  --init-from` pins the number before it moves the block (gpt/train/start.py `context_extension`).
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


YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # YaRN's ramp bounds, in rotations over the original context


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies stretch to a longer context than the block trained at (`original`):
    "linear" (position interpolation, Chen et al. 2023) divides every frequency by `factor`; "yarn" (Peng
    et al. 2023) divides only the slow ones (fewer than YARN_BETA_SLOW turns over `original` positions),
    keeps the fast ones (more than YARN_BETA_FAST turns), ramps linearly between them, and multiplies cos
    and sin by `attention` = 0.1 ln(factor) + 1. Hugging Face's rope types of the same names compute the same
    angles (tests/test_rope_scaling.py checks against transformers)."""

    kind: str  # "linear" or "yarn" (gpt/model/config.py ROPE_SCALINGS)
    factor: float
    original: float  # the block trained at (GPTConfig.rope_original_block, or block_size / factor)

    @classmethod
    def of(cls, config) -> RopeScaling | None:
        """The scaling of a GPTConfig (or anything with its fields), None when it has none."""
        kind = getattr(config, "rope_scaling", "")
        if not kind:
            return None
        factor = float(config.rope_factor)
        return cls(kind, factor, config.rope_original_block or config.block_size / factor)

    @property
    def attention(self) -> float:
        """What cos and sin are multiplied by (YaRN's mscale; HF's attention_factor): 1 for linear."""
        return 0.1 * math.log(self.factor) + 1.0 if self.kind == "yarn" and self.factor > 1 else 1.0

    def ramp(self, head_dim: int) -> tuple[float, float]:
        """YaRN's (low, high): the frequency indices where the ramp from kept (below) to divided (above)
        begins and ends, whole numbers, low >= 0 and high <= head_dim - 1 (high < low for a tiny `original`)."""

        def index(turns: float) -> float:  # the index i whose frequency turns `turns` times over `original`
            return head_dim * math.log(self.original / (turns * 2 * math.pi)) / (2 * math.log(ROPE_THETA))

        return max(math.floor(index(YARN_BETA_FAST)), 0), min(math.ceil(index(YARN_BETA_SLOW)), head_dim - 1)

    def frequencies(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled frequencies of the plain ones `inv_freq` (head_dim / 2,)."""
        if self.kind == "linear":
            return inv_freq / self.factor
        low, high = self.ramp(2 * inv_freq.numel())
        i = torch.arange(inv_freq.numel(), dtype=inv_freq.dtype, device=inv_freq.device)
        span = high - low if high != low else 0.001  # (high may fall below low for a tiny `original`)
        divided = ((i - low) / span).clamp(0, 1)  # 0: kept as is, 1: divided by factor
        return inv_freq * (1 - divided) + inv_freq / self.factor * divided


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., T, head_dim) of the rotary angles pos * ROPE_THETA^(-2i/head_dim) (stretched by
    `scaling`, and times its attention factor), each frequency repeated for the two halves of a head; float32,
    from angles computed in float64 (but on MPS)."""
    wide = torch.float32 if positions.device.type == "mps" else torch.float64
    inv_freq = ROPE_THETA ** (-torch.arange(0, head_dim, 2, dtype=wide, device=positions.device) / head_dim)
    if scaling is not None:
        inv_freq = scaling.frequencies(inv_freq)
    angles = positions.to(wide)[..., None] * inv_freq  # (..., T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., T, hs)
    if scaling is None or scaling.attention == 1.0:
        return angles.cos().float(), angles.sin().float()
    return (angles.cos() * scaling.attention).float(), (angles.sin() * scaling.attention).float()


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
    scaling: RopeScaling | None = None  # rotary frequencies stretched to a longer context (GPTConfig.rope_scaling)

    @classmethod
    def of(cls, config) -> Positions:
        """The scheme of `config.pos_encoding` (a GPTConfig, or anything with its fields), sized for it."""
        return dataclasses.replace(
            SCHEMES[config.pos_encoding],
            n_embd=config.n_embd,
            head_dim=config.n_embd // config.n_head,
            scaling=RopeScaling.of(config),
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
        cos, sin = rope_cos_sin(pos, self.head_dim, self.scaling)
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
