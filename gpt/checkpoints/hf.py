"""Hugging Face interoperability: export every decoder so transformers loads it, import it back.

    gpt hf export --ckpt out/NAME --out hf/NAME     # then AutoModelForCausalLM.from_pretrained("hf/NAME")
    gpt hf import --hf-dir hf/NAME --out out/back  # a native checkpoint (best.pt)
    gpt sample --ckpt path/to/hf-dir                       # import happens in load_checkpoint

    export_hf(model, tok, "hf/NAME", chat_template=spec, meta=meta)   # the Python API
    config, state, facts = read("hf/NAME")                            # our config dict + state dict

| our model                  | Hugging Face                                                                |
|----------------------------|-----------------------------------------------------------------------------|
| learned positions          | GPT2LMHeadModel                                                             |
| sinusoidal positions       | GPT2LMHeadModel, `wpe` = our table; wte scaled by sqrt(n_embd), ln_f by 1/that |
| rope                       | GPTNeoXForCausalLM, sequential residual, full rotary (gpt/checkpoints/hf_neox.py) |
| rope scaling linear, yarn  | GPT-NeoX's `rope_scaling` (transformers' rope types of those names)         |
| activation relu2           | transformers' `relu2` (activation_function / hidden_act)                    |
| untied_head                | `tie_word_embeddings: false`, the head's own matrix (sinusoidal: ln_f unscaled) |
| encoder-decoder, post-norm,| refused in one line, as gpt/model/config.py's `EXPORTS` says (zero_init_proj is training only) |
| qk_norm, logit_softcap,    |                                                                             |
| x0_skip, value_embeds      |                                                                             |

Files: config.json, generation_config.json, model.safetensors, tokenizer.json + tokenizer_config.json
(+ the Jinja chat template) + special_tokens_map.json (gpt/checkpoints/hf_tokenizer.py), README.md
(the model card), and ours for a lossless way back: gpt_tokenizer.json (the tokenizer spec),
gpt_chat_template.json (a chat model's markers), gpt_model.json (our model config and training facts).

Design notes
- GPT-2 stores the four projection matrices as Conv1D, (in, out), where ours are nn.Linear (out, in):
  transposed on the way in and out. HF's causal-mask buffers are dropped.
- Sinusoidal: ours computes wte[idx] * sqrt(C) + PE[pos] and a head tied to the unscaled wte. GPT-2
  adds wte[idx] + wpe[pos] and ties its head to that same wte, so the export holds wte * s, wpe = PE
  and ln_f divided by s: logits are unchanged (to float rounding). Import divides back: wte and ln_f
  may then differ from the original in their last bit, but scale to the same bytes, so export ->
  import -> export is stable.
- A model without biases exports zero biases (GPT-2 and GPT-NeoX always have them), which computes
  the same thing; gpt_model.json says so, and import drops them again when they are still all zero.
- Loading never executes code: config.json is JSON, weights are safetensors or a `torch.load` with
  `weights_only=True`; sharded checkpoints (`*.index.json`) are followed, never outside the directory.
- This module reads and writes the formats only; gpt/checkpoints/loader.py turns `read` into a model
  and the same meta a checkpoint has, with the same checks.
- Tokenizer on import: the one named in gpt_tokenizer.json (written by `export_hf`), else tokenizer.json
  when it has our export's shape (transformers saved the directory again: hf_tokenizer.spec_from_tokenizer_json,
  which also gives the chat markers back), else GPT-2's BPE when the vocabulary is GPT-2's (vocab_size
  50257, or a vocab.json of 50257 entries). Without gpt_model.json a sinusoidal export comes back as
  learned positions holding the table: the same function.
- A padded vocabulary (50304 rows for 50257 ids) exports as is: config.json's vocab_size is the
  number of rows; the tokenizer has the real ids and the sampler never picks the padded ones.
- Every file goes through gpt.fsutil.replacing (a temporary file renamed into place), in a fixed order
  with fixed contents (no dates, no paths), so two exports of one model are byte-identical.
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import torch

from gpt.checkpoints import hf_card, hf_neox, hf_tokenizer
from gpt.data.chat import ChatTemplate
from gpt.data.tokenizer import check_spec
from gpt.errors import UserError, storage_error
from gpt.fsutil import replacing
from gpt.model.config import refusals
from gpt.model.positions import Positions
from gpt.model.transformer import sinusoidal_positions

# Suffixes of HF GPT-2 weights stored transposed (Conv1D).
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_SPEC_FILE = "gpt_tokenizer.json"
CHAT_TEMPLATE_FILE = "gpt_chat_template.json"  # a chat model's template (role markers, end of turn)
MODEL_FILE = "gpt_model.json"  # our model config and training facts: what config.json cannot say
# Every file `export_hf` may write into its directory (gpt.cli.hf checks them before an export replaces any).
EXPORT_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    TOKENIZER_SPEC_FILE,
    MODEL_FILE,
    CHAT_TEMPLATE_FILE,
    "README.md",
)
SAME_SHAPE = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
GPT2_VOCAB = 50257
HF_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu2": "relu2",
}  # theirs -> ours
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM"}  # by Positions.family("hf")
TO_HF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu2": "relu2"}  # ours -> transformers' ACT2FN
SIZES = ("vocab_size", "n_embd", "n_layer", "n_head")  # and n_positions (or n_ctx)


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
    if "transformer.wte.weight" in out:  # without it, loading names what is missing
        out.setdefault("lm_head.weight", out["transformer.wte.weight"])
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map our state dict onto GPT2LMHeadModel's names and layouts."""
    return {k: (v.t().contiguous() if _transposed(k) else v) for k, v in sd.items()}


# ---- import ----------------------------------------------------------------------------------------


class HFError(UserError, ValueError):
    """A Hugging Face directory that cannot be imported; the message names the file and what is wrong."""


def is_hf_dir(path) -> bool:
    """A directory holding a Hugging Face config.json and model weights."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and any((path / f).is_file() for f in WEIGHT_FILES)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise storage_error(e, "read", path) from None
    except ValueError as e:
        raise HFError(f"{path} is not valid JSON ({e})") from None


def _hf_config(path) -> tuple[dict, Path]:
    config_file = Path(path) / "config.json"
    hf = _read_json(config_file)
    if not isinstance(hf, dict):
        raise HFError(f"{config_file} is not a Hugging Face config: expected a JSON object, got a {type(hf).__name__}")
    return hf, config_file


def read_config(path) -> dict:
    """Our model config (a GPTConfig dict, validated by the caller: gpt.checkpoints.loader) from a GPT-2 or
    GPT-NeoX directory's config.json, before gpt_model.json's fields (`read` adds them)."""
    hf, config_file = _hf_config(path)
    model_type = hf.get("model_type", "gpt2")
    if model_type == "gpt_neox":
        try:
            return hf_neox.config_from_neox(hf, config_file)
        except hf_neox.NeoXError as e:
            raise HFError(str(e)) from None
    if model_type != "gpt2":
        raise HFError(
            f"{config_file}: model_type {model_type!r} does not map onto this model; it imports 'gpt2' "
            f"(GPT2LMHeadModel) and 'gpt_neox' (GPTNeoXForCausalLM, sequential residual, full rotary)"
        )
    missing = [k for k in SIZES if k not in hf] + ([] if "n_positions" in hf or "n_ctx" in hf else ["n_positions"])
    if missing:
        raise HFError(
            f"{config_file} lacks {', '.join(missing)}: a GPT-2 config.json gives the model's sizes "
            f"(vocab_size, n_positions, n_embd, n_layer, n_head)"
        )
    return config_from_hf(hf, config_file)


def config_from_hf(hf: dict, source="config.json") -> dict:
    """Our model config (a GPTConfig dict) from a GPT-2 config.json dict; GPT-2 options this model cannot
    compute are an HFError naming `source` and the fields."""
    get = hf.get
    n_embd, eps = hf["n_embd"], get("layer_norm_epsilon", 1e-5)
    problems = []
    activation = HF_ACTIVATIONS.get(get("activation_function", "gelu_new"))
    if activation is None:
        problems.append(f"activation_function {get('activation_function')!r} (only 'gelu_new', 'gelu' or 'relu2')")
    if get("n_inner") is not None and (not isinstance(n_embd, int) or get("n_inner") != 4 * n_embd):
        problems.append(f"n_inner {get('n_inner')!r} (only 4 * n_embd)")
    if not isinstance(eps, (int, float)) or abs(eps - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon {eps!r} (only 1e-5)")
    if not get("scale_attn_weights", True) or get("scale_attn_by_inverse_layer_idx", False):
        problems.append("attention scaling other than 1/sqrt(head_dim)")
    if get("add_cross_attention", False):
        problems.append("add_cross_attention")
    if problems:
        raise HFError(f"{source}: unsupported GPT-2 config: " + "; ".join(problems))
    return dict(
        vocab_size=hf["vocab_size"],
        block_size=get("n_positions", get("n_ctx")),
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=n_embd,
        dropout=0.0,
        bias=True,
        activation=activation,
        untied_head=not get("tie_word_embeddings", True),
    )


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Weights of an HF directory: safetensors preferred, then pytorch_model.bin (weights_only)."""
    from safetensors.torch import load_file  # optional: HF only

    def load_one(f: Path):
        if f.suffix == ".safetensors":
            return load_file(str(f), device="cpu")
        return torch.load(f, map_location="cpu", weights_only=True)

    for name in WEIGHT_FILES:
        f = path / name
        if not f.is_file():
            continue
        if name.endswith(".index.json"):
            sd = {}
            for shard in _shards(f):
                sd.update(load_one(path / shard))
            return sd
        return load_one(f)
    raise FileNotFoundError(f"no model weights in {path}: expected one of {', '.join(WEIGHT_FILES)}")


def _shards(index: Path) -> list[str]:
    """The shard files a `*.index.json` names: plain file names beside it, nothing elsewhere. (A shard may
    be a symbolic link: the Hugging Face cache links every file of a snapshot to its blob store.)"""
    data = _read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise HFError(f"{index} has no weight_map object")
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", "..") or "\\" in shard:
            raise HFError(
                f"{index}: {key} is in {shard!r}, which is not a file in {index.parent}; refused (an "
                f"index names shards beside it)"
            )
    return sorted(set(weight_map.values()))


def _state_dict(path: Path, config: dict) -> dict[str, torch.Tensor]:
    """The directory's weights under our names and layouts (not yet checked against the config)."""
    try:
        hf_sd = _load_weights(path)
    except HFError:
        raise
    except pickle.UnpicklingError:  # torch.load(weights_only=True) refused
        raise HFError(
            f"cannot read the weights in {path}: they hold objects other than tensors, whose code "
            f"loading would run; refused"
        ) from None
    except Exception as e:  # a corrupt or truncated file, a missing shard, ...
        reason = (str(e).splitlines() or [""])[0][:200]
        raise HFError(f"cannot read the weights in {path} ({type(e).__name__}: {reason})") from None
    if Positions.named(config.get("pos_encoding", "learned")).family("hf") == "gpt_neox":  # (read_config's)
        return hf_neox.state_dict_from_neox(hf_sd, config["n_head"])
    return state_dict_from_hf(hf_sd)


def read(path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(our model config dict, state dict, training facts) of a GPT-2 or GPT-NeoX directory. What
    gpt_model.json adds (our export's own record) is taken only where the weights still agree with it:
    no biases while they are all zero, sinusoidal positions while wpe is exactly the table."""
    path = Path(path)
    config = read_config(path)
    sd = _state_dict(path, config)
    head, wte = sd.get("lm_head.weight"), sd.get("transformer.wte.weight")
    tied = not config.get("untied_head")
    if tied and head is not None and wte is not None and head is not wte and not torch.equal(head, wte):
        raise HFError(f"{path}: lm_head differs from wte, but config.json ties them (tie_word_embeddings)")
    recorded = _read_json(path / MODEL_FILE) if (path / MODEL_FILE).is_file() else {}
    ours = recorded.get("model_config") if isinstance(recorded, dict) else None
    facts = recorded.get("training", {}) if isinstance(recorded, dict) else {}
    if isinstance(ours, dict) and all(ours.get(k) == config[k] for k in (*SAME_SHAPE, "activation")):
        config["dropout"] = ours.get("dropout", 0.0)
        config["label_smoothing"] = ours.get("label_smoothing", 0.0)
        config["zero_init_proj"] = ours.get("zero_init_proj", False)
        if config.get("rope_scaling") == "linear" and ours.get("rope_factor") == config.get("rope_factor"):
            config["rope_original_block"] = ours.get("rope_original_block", 0)  # (HF's linear type has no field for it)
        biases = [k for k in sd if k.endswith(".bias")]
        if ours.get("bias") is False and not any(sd[k].any() for k in biases):
            sd = {k: v for k, v in sd.items() if k not in biases}
            config["bias"] = False
        scheme = Positions.named(ours.get("pos_encoding"))
        if scheme and scheme.adds == "pe" and _is_table(sd.get("transformer.wpe.weight"), config):
            sd = _from_sinusoidal(sd, config["n_embd"], tied)
            config["pos_encoding"] = scheme.name
    if tied and "transformer.wte.weight" in sd:
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return config, sd, facts if isinstance(facts, dict) else {}


def read_weights(path) -> dict[str, torch.Tensor]:
    """A directory's weights under our names and layouts (gpt.checkpoints.loader checks them against the
    config); nothing in them is executed."""
    return read(path)[1]


def chat_template_spec(path) -> dict | None:
    """The chat template a chat checkpoint's export wrote (gpt_chat_template.json), else the markers a
    tokenizer.json of our shape holds, or None."""
    file = Path(path) / CHAT_TEMPLATE_FILE
    if file.is_file():
        return _read_json(file)
    if not (Path(path) / TOKENIZER_SPEC_FILE).is_file() and (Path(path) / "tokenizer.json").is_file():
        try:
            return _from_tokenizer_json(Path(path))[1]
        except HFError:  # another tokenizer's file (e.g. GPT-2's own): no template; tokenizer_spec decides
            return None
    return None


def _from_tokenizer_json(path: Path) -> tuple[dict, dict | None]:
    try:
        return hf_tokenizer.spec_from_tokenizer_json(_read_json(path / "tokenizer.json"), path / "tokenizer.json")
    except hf_tokenizer.TokenizerExportError as e:
        raise HFError(str(e)) from None


def tokenizer_spec(path, vocab_size: int) -> dict:
    """The tokenizer spec of a Hugging Face directory: gpt_tokenizer.json (written by export_hf), else its
    tokenizer.json when it has the shape our export writes (transformers saved it again), else GPT-2's BPE
    when the vocabulary is GPT-2's."""
    path = Path(path)
    if (path / TOKENIZER_SPEC_FILE).is_file():
        spec = _read_json(path / TOKENIZER_SPEC_FILE)
        check_spec(spec, path / TOKENIZER_SPEC_FILE, HFError)
        return spec
    if (path / "tokenizer.json").is_file() and vocab_size != GPT2_VOCAB:
        return _from_tokenizer_json(path)[0]
    if vocab_size == GPT2_VOCAB:
        return {"kind": "gpt2"}
    vocab_file = path / "vocab.json"
    if vocab_file.is_file():
        vocab = _read_json(vocab_file)
        if isinstance(vocab, dict) and len(vocab) == GPT2_VOCAB:
            return {"kind": "gpt2"}
    raise HFError(
        f"cannot tell which tokenizer {path} uses: vocab_size {vocab_size} is not GPT-2's {GPT2_VOCAB}, and there "
        f"is no {TOKENIZER_SPEC_FILE}, tokenizer.json of gpt's shape or GPT-2 vocab.json beside config.json"
    )


# ---- sinusoidal positions as GPT-2's ------------------------------------------------------------


def _scaled(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * torch.tensor(s, dtype=x.dtype)


def _unscaled(y: torch.Tensor, s: float) -> torch.Tensor:
    """The inverse of `_scaled`: not always the original x (scaling can map two floats to one), but a
    float that scales back to y bit for bit, so export -> import -> export gives the same bytes
    (tests/test_hf_export.py checks it over many values and scales)."""
    return y / torch.tensor(s, dtype=y.dtype)


def _is_table(wpe, config: dict) -> bool:
    table = sinusoidal_positions(config["block_size"], config["n_embd"])
    return wpe is not None and wpe.shape == table.shape and torch.equal(wpe, table.to(wpe.dtype))


def _to_sinusoidal(sd: dict, model) -> dict:
    """Our sinusoidal model's weights in GPT-2's form: wte * s, wpe = the table, ln_f / s (s = sqrt(C)); an
    untied head is not wte, so ln_f stays as it is."""
    s = math.sqrt(model.config.n_embd)
    wte = sd["transformer.wte.weight"]
    table = sinusoidal_positions(model.config.block_size, model.config.n_embd).to(wte.dtype)
    out = {**sd, "transformer.wte.weight": _scaled(wte, s), "transformer.wpe.weight": table}
    if not model.config.untied_head:
        for k in ("transformer.ln_f.weight", "transformer.ln_f.bias"):
            out[k] = _scaled(sd[k], 1 / s)
    return out


def _from_sinusoidal(sd: dict, n_embd: int, tied: bool = True) -> dict:
    s = math.sqrt(n_embd)
    out = {k: v for k, v in sd.items() if k != "transformer.wpe.weight"}
    out["transformer.wte.weight"] = _unscaled(sd["transformer.wte.weight"], s)
    for k in ("transformer.ln_f.weight", "transformer.ln_f.bias"):
        if k in sd and tied:
            out[k] = _unscaled(sd[k], 1 / s)
    return out


# ---- export ----------------------------------------------------------------------------------------


def check_exportable(cfg) -> None:
    """HFError, in one line, for what neither GPT-2 nor GPT-NeoX can express: gpt/model/config.py's `EXPORTS`
    (there, bias=False maps as zero biases, either GELU or ReLU squared as transformers' "relu2", an untied
    head as tie_word_embeddings false; dropout, label_smoothing and zero_init_proj, training only, are
    recorded in gpt_model.json)."""
    if found := refusals(cfg, "hf"):
        raise HFError("cannot export to Hugging Face: " + "; ".join(r.text for r in found))


def architecture(cfg) -> str:
    """The transformers class an export of `cfg` loads as (GPT2LMHeadModel, GPTNeoXForCausalLM)."""
    return ARCHITECTURES[Positions.of(cfg).family("hf")]


def config_to_hf(cfg, eot_token: int, dtype: torch.dtype = torch.float32) -> dict:
    """config.json for our config: GPT-2 for learned and sinusoidal positions, GPT-NeoX for RoPE."""
    check_exportable(cfg)
    if Positions.of(cfg).family("hf") == "gpt_neox":
        return hf_neox.config_to_neox(cfg, eot_token, dtype)
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": TO_HF_ACTIVATION[cfg.activation],
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "use_cache": True,
        "bos_token_id": eot_token,
        "eos_token_id": eot_token,
        "tie_word_embeddings": not cfg.untied_head,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }


def _hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Our weights under the target's names and layouts, zero biases where ours have none, a tied head left
    out (transformers re-ties it, and safetensors refuses shared tensors)."""
    tied = not model.config.untied_head
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and name != "lm_head":
            if module.bias is None:
                n = module.out_features if isinstance(module, torch.nn.Linear) else module.weight.numel()
                sd[f"{name}.bias"] = torch.zeros(n, dtype=module.weight.dtype)
    positions = Positions.of(model.config)
    if positions.family("hf") == "gpt_neox":
        sd = hf_neox.state_dict_to_neox(sd, model.config.n_head)
    else:
        if positions.adds == "pe":  # the fixed table, written as wpe (module notes)
            sd = _to_sinusoidal(sd, model)
        sd = state_dict_to_hf(sd)
    return {k: v.contiguous() for k, v in sorted(sd.items())}


def _write(path: Path, data: str | bytes) -> None:
    """One file, atomically (gpt.fsutil.replacing)."""
    with replacing(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)


def export_hf(model, tokenizer, out_dir, chat_template: dict | None = None, meta: dict | None = None) -> Path:
    """Write `out_dir` so `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` and
    `AutoTokenizer.from_pretrained(out_dir)` load the model, its tokenizer and (given `chat_template`, a
    ChatTemplate spec) its chat template. `meta` (the checkpoint's) adds training facts to the card."""
    from safetensors.torch import save as safetensors_bytes  # (safetensors is only needed here and on import)

    out_dir = Path(out_dir)
    cfg = model.config
    dtype = next(model.parameters()).dtype
    hf_config = config_to_hf(cfg, tokenizer.eot_token, dtype)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise HFError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {cfg.vocab_size} rows")
    template = None
    if chat_template is not None:
        template = ChatTemplate.from_spec(chat_template, "the checkpoint's chat_template")
        tokenizer = template.tokenizer(tokenizer)
    facts = {
        k: meta[k] for k in ("step", "val_loss", "tokens_seen") if meta and meta.get(k)
    }  # (an import's step 0: none)
    eos = [tokenizer.special(template.end), tokenizer.eot_token] if template else tokenizer.eot_token
    generation = {"bos_token_id": tokenizer.eot_token, "eos_token_id": eos, "pad_token_id": tokenizer.eot_token}
    files = {
        "config.json": hf_config,
        "generation_config.json": generation,
        "tokenizer.json": hf_tokenizer.tokenizer_json(tokenizer, template),
        "tokenizer_config.json": hf_tokenizer.tokenizer_config(tokenizer, cfg.block_size, template),
        "special_tokens_map.json": hf_tokenizer.special_tokens_map(template),
        TOKENIZER_SPEC_FILE: tokenizer.spec,
        MODEL_FILE: {"model_config": cfg.to_dict(), "training": facts},
    }
    if template is not None:
        files[CHAT_TEMPLATE_FILE] = template.spec
    weights = safetensors_bytes(_hf_state_dict(model), metadata={"format": "pt"})
    card = hf_card.model_card(model, tokenizer, hf_config, template, facts)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        _write(out_dir / "model.safetensors", weights)
        for name, data in files.items():
            _write(out_dir / name, hf_tokenizer.dumps(data))
        _write(out_dir / "README.md", card)
        if template is None:  # a chat model's template left by an export this one replaces (--force)
            (out_dir / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
    except OSError as e:
        raise storage_error(e, "write", out_dir) from None
    return out_dir
