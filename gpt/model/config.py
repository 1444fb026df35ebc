"""The model's shape: `GPTConfig`, validated on construction (every problem named, led by its field).

    GPTConfig(vocab_size=65, block_size=256, n_layer=4, n_head=4, n_embd=128)
    GPTConfig.from_dict(meta["model_config"])            # a checkpoint's, unknown fields refused

The training config (gpt/train/config.py) holds one of these under `model`; the checkpoint meta stores
`to_dict()`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from types import SimpleNamespace

from gpt.errors import ConfigError

POS_ENCODINGS = ("learned", "sinusoidal", "rope")
# GELU of the MLP: "gelu_tanh" is GPT-2's tanh approximation (gelu_new); "gelu" the exact erf form, the
# same curve to 1e-3 and cheaper forward + backward on CPUs (bench/README.md, "Training");
# "relu2" is ReLU squared, relu(x)^2 (So et al. 2021, "Primer"; the speedruns' and nanochat's MLP).
ACTIVATIONS = ("gelu_tanh", "gelu", "relu2")
LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "wte")  # what LoRA can adapt
LORA_DEFAULT_TARGETS = LORA_TARGETS[:4]  # each block's four projections (wte: the tied embedding and head)


@dataclass
class LoRAConfig:
    """The adapters gpt/model/lora.py adds: rank, scaling alpha, dropout on their input, the layers adapted.
    Its owner builds it (training: `TrainConfig.lora_config`; a checkpoint: its meta["lora"])."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = dataclasses.field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}


@dataclass
class GPTConfig:
    """The model's shape (gpt/model/transformer.py builds it). Validated on construction: a ConfigError lists every
    problem, each led by its field name."""

    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64
    block_size: int = 1024  # longest sequence (learned positions are absolute)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2
    # Seq2seq (the encoder of "Attention Is All You Need"); 0 keeps the decoder-only model.
    n_encoder_layer: int = 0
    pos_encoding: str = "learned"  # "learned", "sinusoidal" or "rope" (rotary, in attention)
    norm: str = "pre"  # "pre" (GPT-2) or "post" (the paper: LayerNorm(x + Sublayer(x)))
    label_smoothing: float = 0.0
    activation: str = "gelu_tanh"  # one of ACTIVATIONS
    # The speedrun recipe's options (issue 35), each off by default (gpt/model/transformer.py's docstring):
    qk_norm: bool = False  # RMSNorm (no weights) on each head's queries and keys, then a fixed scale
    zero_init_proj: bool = False  # attention's and the MLP's output projections start at zero
    logit_softcap: float = 0.0  # > 0: logits = c * tanh(logits / c); 0 = off
    untied_head: bool = False  # lm_head a matrix of its own, not the token embedding
    x0_skip: bool = False  # block i's input resid_lambdas[i] * x + x0_lambdas[i] * x0 (x0: the embedding output)
    value_embeds: bool = False  # per-token embeddings added, gated, to the values of alternating layers

    def __post_init__(self):
        found = problems(dataclasses.asdict(self))
        if found:
            raise ConfigError("invalid model config: " + "; ".join(f"{name}: {why}" for name, why in found))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config fields {unknown}; valid: {sorted(known)}")
        return cls(**d)


def problems(values: dict) -> list[tuple[str, str]]:
    """(field, what is wrong) for every invalid field of a model config's `values` (the config's own check,
    and the training flags', which report them together with their own)."""
    c = SimpleNamespace(**values)
    out = []
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            out.append((name, f"must be a positive integer, got {value!r}"))
    if not {"n_head", "n_embd"} & {name for name, _ in out} and c.n_embd % c.n_head:
        out.append(("n_head", f"must divide n_embd ({c.n_embd}), got {c.n_head}"))
    if not isinstance(c.dropout, (int, float)) or not 0.0 <= c.dropout < 1.0:
        out.append(("dropout", f"must be in [0, 1), got {c.dropout!r}"))
    if not isinstance(c.n_encoder_layer, int) or c.n_encoder_layer < 0:
        out.append(("n_encoder_layer", f"must be an integer >= 0, got {c.n_encoder_layer!r}"))
    if c.pos_encoding not in POS_ENCODINGS:
        out.append(("pos_encoding", f"must be one of {', '.join(map(repr, POS_ENCODINGS))}, got {c.pos_encoding!r}"))
    if c.norm not in ("pre", "post"):
        out.append(("norm", f"must be 'pre' or 'post', got {c.norm!r}"))
    if c.activation not in ACTIVATIONS:
        out.append(("activation", f"must be one of {', '.join(map(repr, ACTIVATIONS))}, got {c.activation!r}"))
    for name in ("qk_norm", "zero_init_proj", "untied_head", "x0_skip", "value_embeds"):
        if not isinstance(getattr(c, name), bool):
            out.append((name, f"must be true or false, got {getattr(c, name)!r}"))
    softcap = c.logit_softcap
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0.0 <= softcap < float("inf"):
        out.append(("logit_softcap", f"must be a number >= 0 (0 = off; nanochat uses 15), got {softcap!r}"))
    if not isinstance(c.label_smoothing, (int, float)) or not 0.0 <= c.label_smoothing < 1.0:
        out.append(("label_smoothing", f"must be in [0, 1), got {c.label_smoothing!r}"))
    return out
