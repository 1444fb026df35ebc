"""Hugging Face GPT-2 interoperability: import a GPT-2 directory, export one transformers loads.

    python -m gpt.hf export --ckpt out/NAME --out hf/NAME      # then GPT2LMHeadModel.from_pretrained("hf/NAME")
    python sample.py --ckpt path/to/hf-gpt2-dir                # import happens in load_checkpoint

    model, meta = load_hf_dir("path/to/gpt2")                  # config.json + model.safetensors / pytorch_model.bin
    export_hf(model, tok, "hf/NAME")                           # config.json, model.safetensors (+ tokenizer files)

Design notes
- Parameter names match; HF's GPT-2 stores the four projection matrices as Conv1D, i.e.
  (in_features, out_features), where ours are nn.Linear (out_features, in_features): transposed on
  the way in and out. Everything else maps key for key; HF's causal-mask buffers are dropped.
- Loading never executes code: config.json is JSON, weights are safetensors or a `torch.load` with
  `weights_only=True`; sharded checkpoints (`*.index.json`) are followed.
- Only GPT-2's architecture maps: learned positions, pre-norm, no encoder, tied embeddings, GELU
  (tanh), LayerNorm eps 1e-5. Anything else is an error naming the field, never a silent change.
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

import argparse
import json
import sys
from pathlib import Path

import torch

# Suffixes of HF GPT-2 weights stored transposed (Conv1D).
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_SPEC_FILE = "gpt_tokenizer.json"
GPT2_VOCAB = 50257


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


# ---- import ----------------------------------------------------------------------------------------


def is_hf_dir(path) -> bool:
    """A directory holding a Hugging Face config.json and model weights."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and any((path / f).is_file() for f in WEIGHT_FILES)


def config_from_hf(hf: dict):
    """Our GPTConfig from a GPT-2 config.json dict (HF's defaults where a key is absent)."""
    from gpt.checkpoint import CheckpointError
    from gpt.model import GPTConfig

    get = hf.get
    n_embd = get("n_embd", 768)
    problems = []
    if get("model_type", "gpt2") != "gpt2":
        problems.append(f"model_type is {get('model_type')!r}, only 'gpt2' maps onto this model")
    if get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function {get('activation_function')!r} (only GELU with tanh, 'gelu_new')")
    if get("n_inner") not in (None, 4 * n_embd):
        problems.append(f"n_inner {get('n_inner')} (only 4 * n_embd = {4 * n_embd})")
    if abs(get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon {get('layer_norm_epsilon')} (only 1e-5)")
    if not get("scale_attn_weights", True) or get("scale_attn_by_inverse_layer_idx", False):
        problems.append("attention scaling other than 1/sqrt(head_dim)")
    if get("add_cross_attention", False):
        problems.append("add_cross_attention")
    if not get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings false (this model ties lm_head to wte)")
    if problems:
        raise CheckpointError("unsupported GPT-2 config: " + "; ".join(problems))
    return GPTConfig(
        vocab_size=get("vocab_size", GPT2_VOCAB), block_size=get("n_positions", get("n_ctx", 1024)),
        n_layer=get("n_layer", 12), n_head=get("n_head", 12), n_embd=n_embd, dropout=0.0, bias=True,
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
            shards = sorted(set(json.loads(f.read_text())["weight_map"].values()))
            sd = {}
            for shard in shards:
                sd.update(load_one(path / shard))
            return sd
        return load_one(f)
    raise FileNotFoundError(f"no model weights in {path}: expected one of {', '.join(WEIGHT_FILES)}")


def _tokenizer_spec(path: Path, vocab_size: int) -> dict:
    from gpt.checkpoint import CheckpointError

    if (path / TOKENIZER_SPEC_FILE).is_file():
        return json.loads((path / TOKENIZER_SPEC_FILE).read_text())
    if vocab_size == GPT2_VOCAB:
        return {"kind": "gpt2"}
    vocab_file = path / "vocab.json"
    if vocab_file.is_file() and len(json.loads(vocab_file.read_text(encoding="utf-8"))) == GPT2_VOCAB:
        return {"kind": "gpt2"}
    raise CheckpointError(
        f"cannot tell which tokenizer {path} uses: vocab_size {vocab_size} is not GPT-2's {GPT2_VOCAB}, and there "
        f"is no {TOKENIZER_SPEC_FILE} or GPT-2 vocab.json beside config.json"
    )


def load_hf_dir(path, device="cpu"):
    """(model, meta) from a Hugging Face GPT-2 directory, like `gpt.checkpoint.load_model`.

    meta has "model_config" and "tokenizer" as a training checkpoint's does, plus "hf_dir", so
    `train.py --init-from DIR` can fine-tune it.
    """
    from gpt.checkpoint import FORMAT_VERSION, CheckpointError
    from gpt.model import GPT

    path = Path(path)
    try:
        hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'} is not a readable JSON config ({e})") from None
    cfg = config_from_hf(hf_config)
    try:
        sd = state_dict_from_hf(_load_weights(path))
    except Exception as e:  # a corrupt file, or a pickle that wants to run code (weights_only refuses)
        raise CheckpointError(f"cannot read the weights in {path} ({type(e).__name__}: {str(e)[:200]})") from None
    if not torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"]):
        raise CheckpointError(f"{path}: lm_head differs from wte, but this model ties them")
    model = GPT(cfg)
    try:
        model.load_state_dict({k: v.float() for k, v in sd.items()})
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not match config.json ({str(e)[:300]})") from None
    spec = _tokenizer_spec(path, cfg.vocab_size)
    meta = {"format": FORMAT_VERSION, "step": 0, "model_config": cfg.to_dict(), "tokenizer": spec, "hf_dir": str(path)}
    return model.to(device).eval(), meta


# ---- export ----------------------------------------------------------------------------------------


def config_to_hf(cfg, eot_token: int, dtype: torch.dtype = torch.float32) -> dict:
    """A GPT-2 config.json dict for our config (raises ValueError for what GPT-2 cannot express)."""
    problems = []
    if cfg.n_encoder_layer:
        problems.append(f"n_encoder_layer={cfg.n_encoder_layer} (GPT-2 has no encoder)")
    if cfg.pos_encoding != "learned":
        problems.append(f"pos_encoding={cfg.pos_encoding!r} (GPT-2 learns its positions)")
    if cfg.norm != "pre":
        problems.append(f"norm={cfg.norm!r} (GPT-2 is pre-norm)")
    if problems:
        raise ValueError("cannot export as GPT-2: " + "; ".join(problems))
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
        "activation_function": "gelu_new",
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
    from gpt.tokenizer import EOT_TEXT

    tokens = [tokenizer.enc.decode_single_token_bytes(i) for i in range(tokenizer.eot_token)]
    spell = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(spell[x] for x in b)

    vocab = {text(t): i for i, t in enumerate(tokens)}
    vocab[EOT_TEXT] = tokenizer.eot_token
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges = "".join(f"{text(a)} {text(b)}\n" for a, b in bpe_merges(tokens))
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + merges, encoding="utf-8")
    tok_config = {
        "tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length, "add_prefix_space": False,
        "bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2), encoding="utf-8")


def export_hf(model, tokenizer, out_dir) -> Path:
    """Write `out_dir` so `transformers.GPT2LMHeadModel.from_pretrained(out_dir)` loads it.

    Files: config.json, model.safetensors, gpt_tokenizer.json (our tokenizer spec, for re-import) and,
    when the tokenizer is GPT-2's, vocab.json / merges.txt / tokenizer_config.json for AutoTokenizer.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    dtype = next(model.parameters()).dtype
    hf_config = config_to_hf(model.config, tokenizer.eot_token, dtype)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size} rows")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(_hf_state_dict(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (out_dir / TOKENIZER_SPEC_FILE).write_text(json.dumps(tokenizer.spec) + "\n")
    if tokenizer.spec.get("kind") == "gpt2":
        write_gpt2_tokenizer_files(tokenizer, out_dir, model.config.block_size)
    return out_dir


# ---- command line ----------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpt.hf", description="Hugging Face GPT-2 import/export.")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a directory transformers' GPT2LMHeadModel.from_pretrained loads")
    ex.add_argument("--ckpt", required=True, help="run directory, checkpoint file or HF GPT-2 directory")
    ex.add_argument("--out", required=True, help="output directory (created; existing files are replaced)")
    args = p.parse_args(argv)
    from gpt.checkpoint import load_checkpoint
    from gpt.cli import run_main

    def export() -> str:
        model, tokenizer, _ = load_checkpoint(args.ckpt)
        out = export_hf(model, tokenizer, args.out)
        return f"wrote {out} (load with transformers.GPT2LMHeadModel.from_pretrained({str(out)!r}))"

    return run_main(export)


if __name__ == "__main__":
    sys.exit(main())
