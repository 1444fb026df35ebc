"""Hugging Face GPT-2 interoperability: import a GPT-2 directory, export one transformers loads.

    python -m gpt.hf export --ckpt out/NAME --out hf/NAME      # then GPT2LMHeadModel.from_pretrained("hf/NAME")
    python sample.py --ckpt path/to/hf-gpt2-dir                # import happens in load_checkpoint

    model, meta = gpt.checkpoints.native.load_model("path/to/gpt2")    # config.json + model.safetensors / pytorch_model.bin
    export_hf(model, tok, "hf/NAME")                           # config.json, model.safetensors (+ tokenizer files)

Design notes
- Parameter names match; HF's GPT-2 stores the four projection matrices as Conv1D, i.e.
  (in_features, out_features), where ours are nn.Linear (out_features, in_features): transposed on
  the way in and out. Everything else maps key for key; HF's causal-mask buffers are dropped.
- Loading never executes code: config.json is JSON, weights are safetensors or a `torch.load` with
  `weights_only=True`; sharded checkpoints (`*.index.json`) are followed.
- This module reads and writes the GPT-2 format only (`read_config`, `read_weights`,
  `tokenizer_spec`); gpt/checkpoints/native.py turns those into a model and the same meta a checkpoint has,
  with the same checks (a config that builds no model, weights that do not fit it). So this module
  never imports gpt.checkpoints.native, except the command line at the bottom, which loads `--ckpt` as
  sample.py does.
- Only GPT-2's architecture maps: learned positions, pre-norm, no encoder, tied embeddings, GELU
  (tanh 'gelu_new', or exact 'gelu'), LayerNorm eps 1e-5. Anything else is an error naming the field, never a silent change.
  A model without biases exports zero biases (GPT-2 always has them), which computes the same thing.
- Tokenizer on import: the one named in `gpt_tokenizer.json` (written by `export_hf`), else GPT-2's
  BPE when the vocabulary is GPT-2's (vocab_size 50257, or a vocab.json of 50257 entries).
- A padded vocabulary (50304 rows for 50257 ids) exports as is: config.json's vocab_size is the
  number of rows, which is what the weights hold; the sampler never picks the padded ids.
- For the gpt2 tokenizer, export also writes vocab.json and merges.txt, derived from tiktoken's
  ranks: each token's merge is recovered by running BPE on its bytes with the ranks below its own,
  which ends in exactly two parts; bytes are spelled with GPT-2's printable byte-to-unicode table.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from gpt.data.tokenizer import EOT_TEXT
from gpt.errors import UserError, storage_error
from gpt.fsutil import replacing, write_text

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
GPT2_VOCAB = 50257
HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}  # theirs -> ours
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


def read_config(path) -> dict:
    """Our model config (a GPTConfig dict, validated by the caller: gpt.checkpoints.native) from a GPT-2 directory's
    config.json."""
    config_file = Path(path) / "config.json"
    hf = _read_json(config_file)
    if not isinstance(hf, dict):
        raise HFError(f"{config_file} is not a GPT-2 config: expected a JSON object, got a {type(hf).__name__}")
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
    if get("model_type", "gpt2") != "gpt2":
        problems.append(f"model_type is {get('model_type')!r}, only 'gpt2' maps onto this model")
    activation = HF_ACTIVATIONS.get(get("activation_function", "gelu_new"))
    if activation is None:
        problems.append(f"activation_function {get('activation_function')!r} (only GELU: 'gelu_new' or 'gelu')")
    if get("n_inner") is not None and (not isinstance(n_embd, int) or get("n_inner") != 4 * n_embd):
        problems.append(f"n_inner {get('n_inner')!r} (only 4 * n_embd)")
    if not isinstance(eps, (int, float)) or abs(eps - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon {eps!r} (only 1e-5)")
    if not get("scale_attn_weights", True) or get("scale_attn_by_inverse_layer_idx", False):
        problems.append("attention scaling other than 1/sqrt(head_dim)")
    if get("add_cross_attention", False):
        problems.append("add_cross_attention")
    if not get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings false (this model ties lm_head to wte)")
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
    )


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Weights of an HF directory: safetensors preferred, then pytorch_model.bin (weights_only)."""
    from safetensors.torch import load_file

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


def read_weights(path) -> dict[str, torch.Tensor]:
    """A GPT-2 directory's weights under our names and layouts (gpt.checkpoints.native checks them against the
    config); nothing in them is executed."""
    path = Path(path)
    try:
        sd = state_dict_from_hf(_load_weights(path))
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
    head, wte = sd.get("lm_head.weight"), sd.get("transformer.wte.weight")
    if head is not None and wte is not None and head is not wte and not torch.equal(head, wte):
        raise HFError(f"{path}: lm_head differs from wte, but this model ties them")
    return sd


def chat_template_spec(path) -> dict | None:
    """The chat template a chat checkpoint's export wrote (gpt_chat_template.json), or None."""
    file = Path(path) / CHAT_TEMPLATE_FILE
    return _read_json(file) if file.is_file() else None


def tokenizer_spec(path, vocab_size: int) -> dict:
    """The tokenizer spec of a GPT-2 directory: gpt_tokenizer.json (written by export_hf), else GPT-2's
    BPE when the vocabulary is GPT-2's."""
    path = Path(path)
    if (path / TOKENIZER_SPEC_FILE).is_file():
        return _read_json(path / TOKENIZER_SPEC_FILE)
    if vocab_size == GPT2_VOCAB:
        return {"kind": "gpt2"}
    vocab_file = path / "vocab.json"
    if vocab_file.is_file():
        vocab = _read_json(vocab_file)
        if isinstance(vocab, dict) and len(vocab) == GPT2_VOCAB:
            return {"kind": "gpt2"}
    raise HFError(
        f"cannot tell which tokenizer {path} uses: vocab_size {vocab_size} is not GPT-2's {GPT2_VOCAB}, and there "
        f"is no {TOKENIZER_SPEC_FILE} or GPT-2 vocab.json beside config.json"
    )


# ---- export ----------------------------------------------------------------------------------------


def config_to_hf(cfg, eot_token: int, dtype: torch.dtype = torch.float32) -> dict:
    """A GPT-2 config.json dict for our config (HFError for what GPT-2 cannot express)."""
    problems = []
    if cfg.n_encoder_layer:
        problems.append(f"n_encoder_layer={cfg.n_encoder_layer} (GPT-2 has no encoder)")
    if cfg.pos_encoding != "learned":
        problems.append(f"pos_encoding={cfg.pos_encoding!r} (GPT-2 learns its positions)")
    if cfg.norm != "pre":
        problems.append(f"norm={cfg.norm!r} (GPT-2 is pre-norm)")
    if problems:
        raise HFError("cannot export as GPT-2: " + "; ".join(problems))
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
        "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "use_cache": True,
        "bos_token_id": eot_token,
        "eos_token_id": eot_token,
        "tie_word_embeddings": True,
        "dtype": str(dtype).replace("torch.", ""),
    }


def _hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Our weights under GPT-2's names and layouts, zero biases where ours have none, lm_head left
    out (tied to wte: transformers re-ties it, and safetensors refuses shared tensors)."""
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and name != "lm_head":
            if module.bias is None:
                n = module.out_features if isinstance(module, torch.nn.Linear) else module.weight.numel()
                sd[f"{name}.bias"] = torch.zeros(n, dtype=module.weight.dtype)
    return {k: v.contiguous() for k, v in state_dict_to_hf(sd).items()}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table spelling every byte as a printable character: printable Latin-1 bytes stand for
    themselves, the other 68 take the characters from U+0100 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bpe_merges(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The merge that made each multi-byte token, tokens given in rank order (rank = index)."""
    ranks = {t: r for r, t in enumerate(tokens)}
    merges = []
    for rank, token in enumerate(tokens):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while True:  # byte-level BPE on the token, allowing only merges ranked below it
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not one merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def write_gpt2_tokenizer_files(tokenizer, out_dir: Path, model_max_length: int) -> None:
    """vocab.json, merges.txt and tokenizer_config.json for GPT2Tokenizer(Fast), from tiktoken's ranks."""
    tokens = [tokenizer.enc.decode_single_token_bytes(i) for i in range(tokenizer.eot_token)]
    spell = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(spell[x] for x in b)

    vocab = {text(t): i for i, t in enumerate(tokens)}
    vocab[EOT_TEXT] = tokenizer.eot_token
    write_text(out_dir / "vocab.json", json.dumps(vocab, ensure_ascii=False))
    merges = "".join(f"{text(a)} {text(b)}\n" for a, b in bpe_merges(tokens))
    write_text(out_dir / "merges.txt", "#version: 0.2\n" + merges)
    tok_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": model_max_length,
        "add_prefix_space": False,
        "bos_token": EOT_TEXT,
        "eos_token": EOT_TEXT,
        "unk_token": EOT_TEXT,
    }
    write_text(out_dir / "tokenizer_config.json", json.dumps(tok_config, indent=2))


def export_hf(model, tokenizer, out_dir, chat_template: dict | None = None) -> Path:
    """Write `out_dir` so `transformers.GPT2LMHeadModel.from_pretrained(out_dir)` loads it.

    Files: config.json, model.safetensors, gpt_tokenizer.json (our tokenizer spec, for re-import),
    gpt_chat_template.json for a chat model (its template, so the re-imported model still chats) and,
    when the tokenizer is GPT-2's, vocab.json / merges.txt / tokenizer_config.json for AutoTokenizer.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    dtype = next(model.parameters()).dtype
    hf_config = config_to_hf(model.config, tokenizer.eot_token, dtype)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise HFError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size} rows")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with replacing(out_dir / "model.safetensors") as tmp:  # (every file: a link there is replaced, not followed)
            save_file(_hf_state_dict(model), str(tmp), metadata={"format": "pt"})
        write_text(out_dir / "config.json", json.dumps(hf_config, indent=2) + "\n")
        write_text(out_dir / TOKENIZER_SPEC_FILE, json.dumps(tokenizer.spec) + "\n")
        if chat_template is not None:
            write_text(out_dir / CHAT_TEMPLATE_FILE, json.dumps(chat_template) + "\n")
        if tokenizer.spec.get("kind") == "gpt2":
            write_gpt2_tokenizer_files(tokenizer, out_dir, model.config.block_size)
    except OSError as e:
        raise storage_error(e, "write", out_dir) from None
    return out_dir
