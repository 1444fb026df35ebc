"""Hugging Face GPT-2 interoperability: parameter names match, Conv1D weights are transposed.

HF's GPT-2 stores the four projection matrices as Conv1D, i.e. (in_features, out_features); ours are
nn.Linear, (out_features, in_features). Everything else maps key for key.
"""

from __future__ import annotations

import torch

# Suffixes of HF GPT-2 weights stored transposed (Conv1D).
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _transposed(key: str) -> bool:
    return key.endswith(CONV1D_SUFFIXES)


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a GPT2LMHeadModel state dict onto ours (buffers such as `attn.bias` are dropped)."""
    out = {}
    for k, v in hf_sd.items():
        if k.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # HF's causal-mask buffers, not parameters
        k = k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k
        out[k] = v.t().contiguous() if _transposed(k) else v
    out.setdefault("lm_head.weight", out["transformer.wte.weight"])
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map our state dict onto GPT2LMHeadModel's names and layouts."""
    return {k: (v.t().contiguous() if _transposed(k) else v) for k, v in sd.items()}
