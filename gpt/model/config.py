"""The model's shape: `GPTConfig`, validated on construction (every problem named, led by its field).

    GPTConfig(vocab_size=65, block_size=256, n_layer=4, n_head=4, n_embd=128)
    GPTConfig.from_dict(meta["model_config"])            # a checkpoint's, unknown fields refused

    refusals(config, "gguf")                             # what an export format cannot carry (EXPORTS)

The training config (gpt/train/config.py) holds one of these under `model`; the checkpoint meta stores
`to_dict()`. `EXPORTS` is the one table of which export formats carry which option: every exporter reads
it for its refusals (gpt/checkpoints/hf.py, gpt/checkpoints/gguf.py, gpt/infer/export.py), so a new option
is refused everywhere it cannot go by a row here.

Footguns
- A reason in `EXPORTS` is a phrase that follows the option's name in the exporter's list ("qk_norm (no
  norm on queries and keys)"), unless it begins with "this checkpoint": then it is said alone, as the
  whole refusal (the exporter adds only its advice).
- Every GPTConfig field is a row of `EXPORTS` or one of `EVERY_EXPORT` (tests/test_positions.py checks):
  a new field must say where it goes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import NamedTuple

from gpt.errors import ConfigError
from gpt.model.windows import parse as parse_windows

POS_ENCODINGS = ("learned", "sinusoidal", "rope")
ROPE_SCALINGS = ("linear", "yarn")  # rope_scaling's values besides "" (gpt/model/positions.py computes them)
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
    # Sparse attention (gpt/model/windows.py): each layer's window, a pattern cycled over the layers ("64",
    # "128,128,512,full"; "" = full attention everywhere), and the global tokens every query sees
    attention_window: str = ""
    global_tokens: int = 0
    # Context extension of a rope model (gpt/model/positions.py `RopeScaling`): "" (none), "linear" or "yarn";
    # the frequencies stretch by rope_factor from the block trained at, rope_original_block (0: block_size /
    # rope_factor; `gpt train --init-from` records the checkpoint's block).
    rope_scaling: str = ""
    rope_factor: float = 1.0
    rope_original_block: int = 0

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
    try:
        pattern = parse_windows(c.attention_window)
    except ValueError as e:
        pattern = ()
        out.append(("attention_window", str(e)))
    if isinstance(c.global_tokens, bool) or not isinstance(c.global_tokens, int) or c.global_tokens < 0:
        out.append(("global_tokens", f"must be an integer >= 0, got {c.global_tokens!r}"))
    elif c.global_tokens and not pattern:
        out.append(("global_tokens", "needs an attention window (--attention-window): full attention sees every token"))
    softcap = c.logit_softcap
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0.0 <= softcap < float("inf"):
        out.append(("logit_softcap", f"must be a number >= 0 (0 = off; nanochat uses 15), got {softcap!r}"))
    if not isinstance(c.label_smoothing, (int, float)) or not 0.0 <= c.label_smoothing < 1.0:
        out.append(("label_smoothing", f"must be in [0, 1), got {c.label_smoothing!r}"))
    return out + rope_problems(c)


def rope_problems(c) -> list[tuple[str, str]]:
    """The context extension's problems (`problems`): scaling only of rope, a factor >= 1, and a block the
    stretched frequencies cover (at most rope_factor * rope_original_block)."""
    scaling, factor, original = c.rope_scaling, c.rope_factor, c.rope_original_block
    out = []
    if scaling not in ("", *ROPE_SCALINGS):
        out.append(
            ("rope_scaling", f"must be one of {', '.join(map(repr, ROPE_SCALINGS))} (or empty), got {scaling!r}")
        )
    elif scaling and c.pos_encoding != "rope":
        out.append(
            ("rope_scaling", f"stretches rotary frequencies: it needs pos_encoding 'rope', not {c.pos_encoding!r}")
        )
    bad_factor = isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1.0 <= factor < float("inf")
    if bad_factor:
        out.append(("rope_factor", f"must be a number >= 1, got {factor!r}"))
    elif factor != 1.0 and not scaling:
        out.append(("rope_factor", f"{factor:g} needs a rope_scaling ('linear' or 'yarn') to apply it"))
    if not isinstance(original, int) or isinstance(original, bool) or original < 0:
        out.append(("rope_original_block", f"must be an integer >= 0 (0 = block_size / rope_factor), got {original!r}"))
    elif original and not scaling:
        out.append(("rope_original_block", f"{original} needs a rope_scaling ('linear' or 'yarn')"))
    elif original and not bad_factor and isinstance(c.block_size, int) and c.block_size > factor * original:
        out.append(
            (
                "rope_factor",
                f"{factor:g} stretches the {original} positions trained at to {factor * original:g}, fewer than "
                f"block_size {c.block_size}: raise it to {c.block_size / original:g}",
            )
        )
    return out


# ---- what each export format carries ------------------------------------------------------------------

FORMATS = ("hf", "gguf", "onnx", "pt2")  # gpt/checkpoints/hf.py, gpt/checkpoints/gguf.py, gpt/infer/export.py's two
ONNX_HINT = "export it with `gpt export --format onnx`, or keep it as a gpt checkpoint"
SEQ2SEQ = "this checkpoint is an encoder-decoder (seq2seq) model"


class Export(NamedTuple):
    """One row of `EXPORTS`: a model option (`field` at `value`; None: at any value but the default) and, for
    each format that cannot carry it, why (module notes); the formats not named carry it."""

    field: str
    value: object
    refused: dict[str, str]


EXPORTS = (
    Export("pos_encoding", "learned", {}),  # the export families: gpt/model/positions.py's SCHEMES
    Export("pos_encoding", "sinusoidal", {}),
    Export("pos_encoding", "rope", {}),
    Export(
        "n_encoder_layer",
        None,
        {
            "hf": "an encoder-decoder: no Hugging Face decoder-only architecture has cross-attention; keep it as a "
            "gpt checkpoint for `gpt sample --source` and `gpt evaluate`",
            "gguf": f"{SEQ2SEQ}: llama.cpp has no architecture for it",
            "onnx": f"{SEQ2SEQ}: export covers decoder-only models",
            "pt2": f"{SEQ2SEQ}: export covers decoder-only models",
        },
    ),
    Export(
        "norm",
        "post",
        {
            "hf": "GPT-2 and GPT-NeoX are pre-norm: LayerNorm before each sublayer; train with --norm pre to "
            "export, or keep it as a gpt checkpoint",
            "gguf": "this checkpoint is post-norm (norm='post'): llama.cpp's gpt2 and gptneox graphs are pre-norm",
        },
    ),
    Export("activation", "gelu_tanh", {}),
    Export("activation", "gelu", {}),  # (llama.cpp computes the tanh form: within 1e-3)
    Export("activation", "relu2", {"gguf": "their MLP is GELU"}),
    Export(
        "qk_norm",
        None,
        {
            "hf": f"GPT-2 and GPT-NeoX have no norm on queries and keys; {ONNX_HINT}",
            "gguf": "no norm on queries and keys",
        },
    ),
    Export(
        "logit_softcap",
        None,
        {"hf": f"GPT-2 and GPT-NeoX have no cap on the logits; {ONNX_HINT}", "gguf": "no cap on the logits"},
    ),
    Export(
        "x0_skip",
        None,
        {
            "hf": f"GPT-2 and GPT-NeoX do not mix the embedding into each block's input; {ONNX_HINT}",
            "gguf": "no embedding mixed into each block's input",
        },
    ),
    Export(
        "value_embeds",
        None,
        {
            "hf": f"GPT-2 and GPT-NeoX have no embeddings added to the attention values; {ONNX_HINT}",
            "gguf": "no embeddings added to the attention values",
        },
    ),
    Export(
        "attention_window",
        None,
        {
            # GPT-Neo's "local" layers are the one transformers family our weights could map onto (LayerNorm,
            # GELU, learned positions, one window size beside full layers; but no q/k/v biases and no 1/sqrt(d)
            # scale, folded into the queries): not written. Mistral, Qwen2, Gemma2 (and llama.cpp's windowed
            # graphs, gemma2/gemma3) have sliding windows but RMSNorm and gated MLPs, weights ours are not.
            "hf": f"GPT-2 and GPT-NeoX attend to the whole context, and an export to GPT-Neo's local layers is not "
            f"written; {ONNX_HINT}",
            "gguf": "no sliding window there: llama.cpp windows only other families, e.g. gemma2",
        },
    ),
    Export(
        "global_tokens",
        None,
        {"hf": f"no global attention in GPT-2 or GPT-NeoX; {ONNX_HINT}", "gguf": "no global attention"},
    ),
    Export("rope_scaling", "linear", {}),  # Hugging Face's rope_scaling, llama.cpp's rope.scaling.* keys
    Export("rope_scaling", "yarn", {}),  # (onnx and pt2 trace our own forward: the angles are in the graph)
    Export("rope_factor", None, {}),  # (written with rope_scaling)
    Export("rope_original_block", None, {}),
    Export("untied_head", None, {}),  # the head written as its own matrix
    Export("bias", None, {}),  # bias=False: zero biases where a format needs them
)
# carried by every format as they are: the sizes, and what only training reads
EVERY_EXPORT = (
    "vocab_size",
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
    "dropout",
    "label_smoothing",
    "zero_init_proj",
)


class Refusal(NamedTuple):
    """An option of a model config that an export format cannot carry: the option as the user set it, and why."""

    option: str
    why: str

    @property
    def alone(self) -> bool:
        """The reason is a whole sentence, said alone (module notes)."""
        return self.why.startswith("this checkpoint")

    @property
    def text(self) -> str:
        return self.why if self.alone else f"{self.option} ({self.why})"


def refusals(config, fmt: str) -> list[Refusal]:
    """What of `config` (a GPTConfig) the export format `fmt` cannot carry, in `EXPORTS`' order."""
    assert fmt in FORMATS, fmt
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    out = []
    for row in EXPORTS:
        value = getattr(config, row.field)
        at = value != defaults[row.field] if row.value is None else value == row.value
        if at and fmt in row.refused:
            out.append(Refusal(_option(row.field, value), row.refused[fmt]))
    return out


def carried_by(field: str, value: object) -> tuple[str, ...]:
    """The export formats that carry `field` at `value` (every other field at its default)."""
    probe = SimpleNamespace(**{**{f.name: f.default for f in fields(GPTConfig)}, field: value})
    return tuple(fmt for fmt in FORMATS if not refusals(probe, fmt))


def _option(field: str, value: object) -> str:
    """How a refusal names an option: `qk_norm`, `logit_softcap=15`, `norm='post'`, `n_encoder_layer=1`."""
    if isinstance(value, bool):
        return field
    return f"{field}={value:g}" if isinstance(value, float) else f"{field}={value!r}"
