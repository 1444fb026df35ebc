"""Quantisation-aware training: the forward pass multiplies by the weights the quantised model will hold.

    gpt train --init-from out/run --qat int4 [--qat-group-size 32]   # then: gpt sample --quantize int4
    gpt train --init-from out/run --qat int8                          # then: --quantize int8
    gpt train --init-from out/run --qat q4_0                          # then: gpt export --format gguf --quant q4_0

    qat.apply(model, "int4", 32)     # in place: each quantised layer's forward fake-quantises
    qat.layers(model, "q4_0")        # the names of the layers the scheme quantises

Each layer that inference will quantise (gpt/model/quantize.py's `linear_names` for int8 and int4; for q4_0
every matrix the GGUF writer stores in Q4_0: the Linear layers whose rows split into 32s and the token
embedding, tied to the head) computes with its weight on the grid of gpt/model/grids.py, the same function
inference and the GGUF writer use, so the trained model is the deployed one, bit for bit in the weights. The
gradient passes the rounding unchanged (straight-through: `w + (grid(w) - w).detach()`), so the float weights
the optimizer keeps move as in float training while the loss sees their grid. int8 also rounds each input row
to its own 8-bit grid, as `Int8Linear` does at run time.

- Float weights stay the model's parameters: checkpoints, optimizer state and parameter names do not change
  (the forward of each layer is replaced on the instance, as gpt/model/compiled.py's row products are).
- LoRA: the layer multiplies by the grid of its merged weight, W + scale x B A, which is what a merged
  checkpoint is quantised from (no adapter dropout: refused with --qat).

Footguns
- The grid is computed from the whole weight at every forward: under FSDP the weight is gathered by then;
  tensor and pipeline parallelism are refused (a split row has no whole grid on one process).
- Sinusoidal positions and q4_0: the GGUF writer folds the embedding's scale into `token_embd`, off the grid
  (refused in one line); seq2seq models have no GGUF (refused for q4_0; int8 and int4 leave cross-attention
  float, as inference does).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt.errors import ConfigError
from gpt.model import grids
from gpt.model.positions import Positions
from gpt.model.quantize import TINY, linear_names

SCHEMES_RUN = grids.SCHEMES  # what --qat trains for: --quantize int8 / int4, gguf --quant q4_0


def _weight(m: nn.Module) -> torch.Tensor:
    """The weight `m` multiplies by: its own, or W + scale x B A for a LoRA layer (gpt/model/lora.py)."""
    if hasattr(m, "lora_A"):
        return m.weight + (m.lora_B @ m.lora_A) * m.scale
    return m.weight


def on_grid(w: torch.Tensor, scheme: str, group_size: int = 32) -> torch.Tensor:
    """`w` on the grid in the forward pass, the gradient straight through to `w` in the backward."""
    return w + (grids.dequantized(w, scheme, group_size).to(w.dtype) - w).detach()


def rows_on_grid(x: torch.Tensor) -> torch.Tensor:
    """Each row of `x` on its own 8-bit grid ([-127, 127] times its largest magnitude / 127), as Int8Linear
    quantises its input; the gradient straight through."""
    scale = x.detach().abs().amax(dim=-1, keepdim=True).clamp_min(TINY) / 127
    return x + (torch.round(x / scale) * scale - x).detach()


def _linear(m: nn.Module, scheme: str, group_size: int, x: torch.Tensor) -> torch.Tensor:
    if scheme == "int8":
        x = rows_on_grid(x)
    return F.linear(x, on_grid(_weight(m), scheme, group_size), m.bias)


def _embedding(m: nn.Module, scheme: str, group_size: int, idx: torch.Tensor) -> torch.Tensor:
    return F.embedding(idx, on_grid(_weight(m), scheme, group_size))


def layers(model: nn.Module, scheme: str, group_size: int = 32) -> list[str]:
    """The names of the layers `scheme` quantises at inference (module notes), sorted."""
    if scheme == "q4_0":
        fits = {
            name
            for name, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor)
            and hasattr(m, "in_features")
            and m.in_features % grids.Q4_0_GROUP == 0
        }
        wte = model.transformer.wte
        embedding = ["transformer.wte"] if wte.weight.size(1) % grids.Q4_0_GROUP == 0 else []
        return sorted(fits | set(embedding))
    return sorted(linear_names(model, scheme, group_size) | _lora_linears(model, scheme, group_size))


def _lora_linears(model: nn.Module, scheme: str, group_size: int) -> set[str]:
    """LoRA layers (not nn.Linear themselves) that inference will quantise once merged."""
    return {
        name
        for name, m in model.named_modules()
        if hasattr(m, "lora_A")
        and hasattr(m, "in_features")
        and ".cross_attn." not in name
        and (scheme != "int4" or m.in_features % group_size == 0)
    }


def apply(model: nn.Module, scheme: str, group_size: int = 32) -> list[str]:
    """Make each layer `scheme` quantises compute on its grid (in place); returns their names."""
    names = layers(model, scheme, group_size)
    for name in names:
        m = model.get_submodule(name)
        kind = _embedding if hasattr(m, "num_embeddings") else _linear
        m.forward = partial(kind, m, scheme, group_size)
    return names


def start(model: nn.Module, scheme: str, group_size: int = 32) -> tuple[str, dict]:
    """What the trainer does for `--qat`: the model's refusals (one line), `apply`, and (the run's log line,
    the checkpoint meta's `qat`)."""
    cfg = model.config
    if scheme == "q4_0" and Positions.of(cfg).scaled:
        raise ConfigError(
            f"--qat q4_0: not with {cfg.pos_encoding} positions (the GGUF export scales the embedding off the grid)"
        )
    if scheme == "q4_0" and cfg.n_encoder_layer:
        raise ConfigError("--qat q4_0: a seq2seq model has no GGUF export; use --qat int8 or int4")
    names = apply(model, scheme, group_size)
    grouping = f", groups of {group_size}" if scheme == "int4" else ""
    line = f"qat: {scheme}{grouping}: {len(names)} layers compute on the grid they will be quantised to"
    return line, meta(scheme, group_size)


def meta(scheme: str, group_size: int = 32) -> dict:
    """A checkpoint's `qat` field: the scheme, and its group where it has one."""
    groups = {"int4": group_size, "q4_0": grids.Q4_0_GROUP}
    return {"scheme": scheme, **({"group_size": groups[scheme]} if scheme in groups else {})}


def _named(spec: dict) -> str:
    return spec["scheme"] + (f" (groups of {spec['group_size']})" if spec["scheme"] == "int4" else "")


def mismatch(trained: dict | None, scheme: str, group_size: int = 32, flag: str = "--quantize") -> str | None:
    """The warning for a checkpoint trained quantisation-aware (its meta `qat`) quantised on another grid
    (`scheme`: a --quantize mode or a GGUF --quant), None when the grids agree or nothing is quantised."""
    if not trained or scheme in ("none", "f32", "f16"):
        return None
    if scheme in SCHEMES_RUN and meta(scheme, group_size) == trained:
        return None
    wanted = _named(meta(scheme, group_size)) if scheme in SCHEMES_RUN else scheme
    return (
        f"this checkpoint was trained for {_named(trained)} (--qat); {flag} {wanted} quantises it on another "
        f"grid, which QAT did not train for"
    )
