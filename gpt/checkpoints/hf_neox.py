"""RoPE models as Hugging Face GPT-NeoX (`GPTNeoXForCausalLM`): config and weights, both ways.

    hf_config = config_to_neox(cfg, eot, dtype)        # config.json for a pos_encoding="rope" GPTConfig
    hf_sd = state_dict_to_neox(sd, n_head)             # our names -> GPT-NeoX's
    cfg = config_from_neox(hf_config, source)          # and back (a GPTConfig dict)
    sd = state_dict_from_neox(hf_sd, n_head)

Design notes
- Our block is GPT-NeoX's with `use_parallel_residual=False` (x + attn(ln1(x)), then + mlp(ln2(x))),
  `rotary_pct=1.0` (every dimension of a head rotates) and theta ROPE_THETA. The half-split rotation
  (pairs (x[i], x[i + hs/2]), cos/sin repeated over both halves) is NeoX's `rotate_half`.
- NeoX's fused `query_key_value` is laid out per head, [q_h, k_h, v_h] for each head h, where ours is
  [q (all heads), k, v]: the rows are regrouped both ways (`_per_head` / `_per_kind`).
- The head is tied to the embedding (`tie_word_embeddings`); `embed_out.weight` is written anyway (a
  copy: safetensors refuses shared tensors), the name every transformers version and converter reads.
- config.json carries both spellings of the rotary settings: `rotary_pct` / `rotary_emb_base` (what
  transformers 4.x reads) and what later versions derive from them, so older versions load it too.
- Import refuses what our block cannot compute (parallel residual, partial rotary, another theta, an
  MLP width other than 4 * n_embd, untied heads), naming the field.
- A context extension (GPTConfig.rope_scaling) is `rope_scaling` {"rope_type": "linear" | "yarn", "factor",
  and for yarn "original_max_position_embeddings", "beta_fast" 32, "beta_slow" 1}: transformers' rope
  types of those names compute our angles and attention factor. Import takes back linear and yarn at those
  betas (another rope type, beta or attention factor is refused, named); without
  original_max_position_embeddings transformers takes max_position_embeddings, and so does import.
"""

from __future__ import annotations

import torch

from gpt.errors import UserError
from gpt.model.positions import YARN_BETA_FAST, YARN_BETA_SLOW, RopeScaling
from gpt.model.transformer import ROPE_THETA

NEOX_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu2": "relu2",
    "gelu_fast": None,
}
NEOX_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# our parameter name (after transformer.h.{i}.) -> GPT-NeoX's (after gpt_neox.layers.{i}.)
LAYER_NAMES = {
    "ln_1": "input_layernorm",
    "attn.c_attn": "attention.query_key_value",
    "attn.c_proj": "attention.dense",
    "ln_2": "post_attention_layernorm",
    "mlp.c_fc": "mlp.dense_h_to_4h",
    "mlp.c_proj": "mlp.dense_4h_to_h",
}
BUFFERS = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")  # older versions saved these


class NeoXError(UserError, ValueError):
    """A GPT-NeoX config this model cannot compute; the message names the field."""


def config_to_neox(cfg, eot_token: int, dtype: torch.dtype) -> dict:
    """GPT-NeoX config.json for a rope GPTConfig (the caller has refused what no target can express)."""
    return {
        "model_type": "gpt_neox",
        "architectures": ["GPTNeoXForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "intermediate_size": 4 * cfg.n_embd,
        "hidden_act": {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu2": "relu2"}[cfg.activation],
        "rotary_pct": 1.0,
        "rotary_emb_base": ROPE_THETA,
        "max_position_embeddings": cfg.block_size,
        "layer_norm_eps": 1e-5,
        "use_parallel_residual": False,
        "attention_bias": True,
        "tie_word_embeddings": not cfg.untied_head,
        "hidden_dropout": cfg.dropout,
        "attention_dropout": cfg.dropout,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eot_token,
        "eos_token_id": eot_token,
        "torch_dtype": str(dtype).replace("torch.", ""),
        **rope_scaling_to_neox(cfg),
    }


def rope_scaling_to_neox(cfg) -> dict:
    """{"rope_scaling": ...} for a config with a context extension (transformers 4.x and 5.x read that key;
    5.x adds rope_theta and partial_rotary_factor to it), else {}."""
    scaling = RopeScaling.of(cfg)
    if scaling is None:
        return {}
    out = {"rope_type": scaling.kind, "factor": scaling.factor}
    if scaling.kind == "yarn":
        original = scaling.original
        out["original_max_position_embeddings"] = int(original) if float(original).is_integer() else original
        out |= {"beta_fast": YARN_BETA_FAST, "beta_slow": YARN_BETA_SLOW}
    return {"rope_scaling": out}


def rope_scaling_from_neox(rope: dict, block_size: int, problems: list[str]) -> dict:
    """Our rope_scaling fields of a GPT-NeoX rope_parameters / rope_scaling dict; what they cannot say goes
    to `problems`."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    if kind not in ("linear", "yarn"):
        problems.append(f"rope scaling {kind!r} (only plain RoPE, 'linear' or 'yarn')")
        return {}
    factor = rope.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1:
        problems.append(f"rope scaling factor {factor!r} (a number >= 1)")
        return {}
    out = {"rope_scaling": kind, "rope_factor": float(factor)}
    if kind == "linear":
        return out
    defaults = {"beta_fast": YARN_BETA_FAST, "beta_slow": YARN_BETA_SLOW, "truncate": True}
    for key, value in defaults.items():
        if rope.get(key) not in (None, value):
            problems.append(f"yarn {key} {rope[key]!r} (only {value!r})")
    ours = RopeScaling("yarn", float(factor), 1).attention
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        value = rope.get(key)
        if value is not None and not (key == "attention_factor" and abs(value - ours) < 1e-9):
            problems.append(f"yarn {key} {value!r} (only the default attention factor 0.1 ln(factor) + 1)")
    original = rope.get("original_max_position_embeddings", block_size)
    if isinstance(original, float) and original.is_integer():
        original = int(original)
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        problems.append(f"original_max_position_embeddings {original!r} (a whole number of positions)")
        return out
    return out | {"rope_original_block": original}


def config_from_neox(hf: dict, source) -> dict:
    """Our model config (a GPTConfig dict) from a GPT-NeoX config.json dict; NeoXError for what our block
    cannot compute."""
    missing = [k for k in NEOX_SIZES if k not in hf]
    if missing:
        raise NeoXError(f"{source} lacks {', '.join(missing)}: a GPT-NeoX config.json gives the model's sizes")
    get = hf.get
    rope = get("rope_parameters") or get("rope_scaling") or {}
    rope = rope if isinstance(rope, dict) else {}
    n_embd = hf["hidden_size"]
    pct = rope.get("partial_rotary_factor", get("partial_rotary_factor", get("rotary_pct", 0.25)))
    theta = rope.get("rope_theta", get("rope_theta", get("rotary_emb_base", 10000)))
    problems = []
    if get("use_parallel_residual", True):
        problems.append("use_parallel_residual is true (this model adds attention and MLP one after the other)")
    if pct != 1.0:
        problems.append(f"rotary_pct {pct!r} (only 1.0: every dimension rotates)")
    if theta != ROPE_THETA:
        problems.append(f"rotary base {theta!r} (only {ROPE_THETA:g})")
    scaling = rope_scaling_from_neox(rope, get("max_position_embeddings", 2048), problems)
    activation = NEOX_ACTIVATIONS.get(get("hidden_act", "gelu"))
    if activation is None:
        problems.append(f"hidden_act {get('hidden_act')!r} (only 'gelu_new', 'gelu' or 'relu2')")
    if get("intermediate_size", 4 * n_embd) != 4 * n_embd:
        problems.append(f"intermediate_size {get('intermediate_size')!r} (only 4 * hidden_size)")
    if abs(get("layer_norm_eps", 1e-5) - 1e-5) > 1e-12:
        problems.append(f"layer_norm_eps {get('layer_norm_eps')!r} (only 1e-5)")
    if problems:
        raise NeoXError(f"{source}: unsupported GPT-NeoX config: " + "; ".join(problems))
    return dict(
        vocab_size=hf["vocab_size"],
        block_size=get("max_position_embeddings", 2048),
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"],
        n_embd=n_embd,
        dropout=0.0,
        bias=True,
        pos_encoding="rope",
        activation=activation,
        # transformers' GPTNeoXConfig leaves the head untied unless told otherwise
        untied_head=not get("tie_word_embeddings", False),
        **scaling,
    )


def _per_head(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Our fused qkv rows [q; k; v] (3C, ...) as NeoX's [q_0, k_0, v_0, q_1, ...] per head."""
    rest = w.shape[1:]
    return w.reshape(3, n_head, -1, *rest).transpose(0, 1).reshape(w.shape).contiguous()


def _per_kind(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """NeoX's per-head qkv rows back to our [q; k; v]."""
    rest = w.shape[1:]
    return w.reshape(n_head, 3, -1, *rest).transpose(0, 1).reshape(w.shape).contiguous()


def state_dict_to_neox(sd: dict[str, torch.Tensor], n_head: int) -> dict[str, torch.Tensor]:
    """Our state dict (biases already filled in) under GPT-NeoX's names and qkv layout."""
    out = {}
    for k, v in sd.items():
        if k == "transformer.wte.weight":
            out["gpt_neox.embed_in.weight"] = v
            out.setdefault("embed_out.weight", v.clone())  # tied: the head is the embedding
        elif k == "lm_head.weight":  # an untied head (a tied one is left out of `sd`)
            out["embed_out.weight"] = v
        elif k.startswith("transformer.ln_f."):
            out["gpt_neox.final_layer_norm." + k.rsplit(".", 1)[1]] = v
        elif k.startswith("transformer.h."):
            _, _, i, rest = k.split(".", 3)
            module, param = rest.rsplit(".", 1)
            out[f"gpt_neox.layers.{i}.{LAYER_NAMES[module]}.{param}"] = (
                _per_head(v, n_head) if module == "attn.c_attn" else v
            )
        else:
            raise AssertionError(f"no GPT-NeoX name for {k}")
    return out


def state_dict_from_neox(hf_sd: dict[str, torch.Tensor], n_head: int) -> dict[str, torch.Tensor]:
    """A GPT-NeoX state dict under our names (unknown keys kept, so loading names them)."""
    theirs = {v: k for k, v in LAYER_NAMES.items()}
    out = {}
    for k, v in hf_sd.items():
        if k.endswith(BUFFERS):
            continue
        if k == "gpt_neox.embed_in.weight":
            out["transformer.wte.weight"] = v
        elif k in ("embed_out.weight", "lm_head.weight"):
            out["lm_head.weight"] = v
        elif k.startswith("gpt_neox.final_layer_norm."):
            out["transformer.ln_f." + k.rsplit(".", 1)[1]] = v
        elif k.startswith("gpt_neox.layers."):
            _, _, i, rest = k.split(".", 3)
            module, param = rest.rsplit(".", 1)
            if module in theirs:
                ours = theirs[module]
                out[f"transformer.h.{i}.{ours}.{param}"] = _per_kind(v, n_head) if ours == "attn.c_attn" else v
            else:
                out[k] = v
        else:
            out[k] = v
    if "transformer.wte.weight" in out:
        out.setdefault("lm_head.weight", out["transformer.wte.weight"])
    return out
