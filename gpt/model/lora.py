"""LoRA: a frozen pretrained GPT plus small trained low-rank adapters (Hu et al., 2021).

    python train.py --config finetune --init-from out/wikitext --data data/shakespeare --out-dir out/lora --lora-rank 8
    python sample.py --ckpt out/lora --prompt "ROMEO:"                    # base + adapters (merged on load)
    python -m gpt.lora merge --ckpt out/lora --out out/lora-merged.pt     # a plain checkpoint: sample, export, init-from
    python -m gpt.hf export --ckpt out/lora --out hf/lora                 # loads base + adapters, exports merged

Each targeted `nn.Linear` y = x W^T + b becomes a `LoRALinear`:

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T        A: (r, in), B: (out, r)

W and b keep their names and are frozen (requires_grad False, bitwise unchanged by training); A starts
Kaiming-uniform and B at zero (the paper's reference code), so step 0 computes exactly the base model.
Everything outside the adapters is frozen too (embeddings, LayerNorms). `merge` folds the update into W
(W + alpha/r * B A) and gives back plain `nn.Linear`s: same logits, no extra cost when sampling.

The target `wte` adapts the token embedding, which is tied to the output head: one update B A
(B: vocab x r, A: r x n_embd) that both see, rows E[i] + (alpha/r) B[i] A going in and logits
h (E + (alpha/r) B A)^T coming out (the head is a LoRALinear over the shared matrix, the embedding a
`TiedLoRAEmbedding` reading its adapters). Merging updates the shared matrix once, so the tie holds.
It is what lets adapters move token frequencies, which dominate a change of domain (see the README's
fine-tuning benchmark).

A LoRA checkpoint holds only the adapters (`...attn.c_attn.lora_A`, `...lora_B`) and names its base in
`meta["lora"]` (gpt/checkpoint.py): `base` (absolute path), `base_relative` (from the checkpoint's
directory, so a base moved together with the run still loads), `base_sha256` (a fingerprint of the
base weights as adapted: a base that changed since, e.g. a best.pt that moved on, is refused in one
line instead of silently giving other text), and `rank`, `alpha`, `dropout`, `targets`.
`gpt.checkpoint.load_model` / `load_checkpoint` (sample.py, `python -m gpt.hf export`, `--init-from`,
and any server built on them) load base + adapters merged; `load_adapted(path, merge=False)` keeps the
adapters separate (e.g. a server swapping adapters over one base).

Why not Hugging Face PEFT: it would wrap our GPT in a PeftModel that renames every parameter
(`base_model.model....base_layer.weight`), which breaks the key-for-key GPT-2 names the checkpoint,
HF import/export and `--resume` rely on, saves adapters in its own format beside (not inside) our
atomic checkpoint with its meta, and pulls in accelerate, huggingface_hub, psutil and PyYAML. The math
is the twenty lines of `LoRALinear` below.

Footgun: seq2seq models slice `c_attn.weight` directly for cross-attention (gpt/model.py), which would
bypass an adapter; LoRA is refused for them (`--lora-rank` with `--n-encoder-layer`).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt.config import LORA_DEFAULT_TARGETS, ConfigError
from gpt.errors import UserError

ADAPTER_KEYS = ("lora_A", "lora_B")


class LoRAError(UserError, ValueError):
    """A LoRA checkpoint whose base is missing or changed, or adapters that do not fit the model."""


@dataclass
class LoRAConfig:
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))

    @classmethod
    def from_train(cls, cfg) -> "LoRAConfig":
        return cls(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_list())

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}


class LoRALinear(nn.Linear):
    """A frozen nn.Linear plus a trained low-rank update; `weight` and `bias` keep their names."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight.requires_grad_(False)
        self.bias = base.bias.requires_grad_(False) if base.bias is not None else None
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **kw))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # scaled at rank r, the narrowest point: (B, T, r), not (B, T, out_features)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A) * self.scale, self.lora_B)
        return F.linear(x, self.weight, self.bias) + update

    def merged(self) -> nn.Linear:
        """A plain nn.Linear computing the same function: W becomes W + scale * B A in place (a matrix tied
        elsewhere, the token embedding, changes with it) and is shared, as is the bias."""
        out = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        with torch.no_grad():
            delta = (self.lora_B.float() @ self.lora_A.float()) * self.scale
            self.weight.copy_((self.weight.float() + delta).to(self.weight.dtype))
        out.weight, out.bias = self.weight, self.bias
        return out


class TiedLoRAEmbedding(nn.Embedding):
    """The token embedding tied to a LoRALinear output head: rows of (E + scale * B A), the head's update."""

    def __init__(self, base: nn.Embedding, head: LoRALinear):
        nn.Module.__init__(self)
        assert base.weight is head.weight, "the embedding must be tied to the head"
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, None, 2.0, False, False
        self.weight, self.lora_A, self.lora_B, self.scale = head.weight, head.lora_A, head.lora_B, head.scale

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight) + (F.embedding(idx, self.lora_B) * self.scale) @ self.lora_A

    def merged(self) -> nn.Embedding:
        """A plain nn.Embedding over the shared matrix (which the head's merge has already updated)."""
        out = nn.Embedding(self.num_embeddings, self.embedding_dim, device="meta")
        out.weight = self.weight
        return out


def _targets(model: nn.Module, targets: list[str]):
    """(parent module, attribute name, Linear) for every targeted Linear of the decoder blocks."""
    for name, module in list(model.named_modules()):
        for target in targets:
            if name.startswith("transformer.h.") and name.endswith("." + target) and isinstance(module, nn.Linear):
                parent, _, attr = name.rpartition(".")
                yield model.get_submodule(parent), attr, module


def apply(model: nn.Module, config: LoRAConfig) -> int:
    """Freeze `model` and put adapters on its targeted layers, in place; returns the trainable parameters."""
    if getattr(model.config, "n_encoder_layer", 0):
        raise ConfigError("--lora-rank: LoRA adapts decoder-only models here, not seq2seq (--n-encoder-layer)")
    layers = list(_targets(model, config.targets))
    if "wte" in config.targets:  # the tied embedding: adapt the head, let the embedding read its adapters
        layers.append((model, "lm_head", model.lm_head))
    smallest = min(min(m.in_features, m.out_features) for _, _, m in layers)
    if config.rank > smallest:
        raise ConfigError(f"--lora-rank: {config.rank} exceeds the smallest adapted layer's {smallest} features; "
                          f"use at most {smallest} (ranks of 4-64 are usual)")
    model.requires_grad_(False)
    for parent, attr, linear in layers:
        setattr(parent, attr, LoRALinear(linear, config.rank, config.alpha, config.dropout))
    if "wte" in config.targets:
        model.transformer.wte = TiedLoRAEmbedding(model.transformer.wte, model.lm_head)
    return trainable_params(model)


def trainable_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def is_adapted(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer, in place; the model computes the same logits with plain modules
    (the heads first: a tied embedding's merge only unwraps the matrix its head's merge updated)."""
    for kind in (LoRALinear, TiedLoRAEmbedding):
        for name, module in list(model.named_modules()):
            if type(module) is kind:
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, module.merged())
    return model


# ---- what a checkpoint holds ------------------------------------------------------------------------


def saved_weights(model: nn.Module) -> dict:
    """The state a checkpoint stores: only the adapters of an adapted model, everything otherwise."""
    state = model.state_dict()
    if not is_adapted(model):
        return state
    return {k: v for k, v in state.items() if k.rpartition(".")[2] in ADAPTER_KEYS}


def load_weights(model: nn.Module, state: dict, source) -> None:
    """Load what `saved_weights` stored; adapters that do not fit are one line naming `source`."""
    if not is_adapted(model):
        model.load_state_dict(state)
        return
    want = saved_weights(model)
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    shapes = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k].shape)]
    if missing or unexpected or shapes:
        what = (f"missing {missing[:2]}" if missing else f"unexpected {unexpected[:2]}" if unexpected
                else f"{shapes[0]} is {tuple(state[shapes[0]].shape)}, the adapters want {tuple(want[shapes[0]].shape)}")
        raise LoRAError(f"{source}: the LoRA adapters do not fit this model ({what}); a resumed LoRA run keeps "
                        f"its --lora-rank and --lora-targets")
    model.load_state_dict(state, strict=False)


def fingerprint(model: nn.Module) -> str:
    """sha256 of the frozen base weights (names, dtypes, shapes, bytes), adapters excluded."""
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        if key.rpartition(".")[2] in ADAPTER_KEYS:
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def base_path(init_from) -> Path:
    """The file (or Hugging Face directory) `--init-from` names, as a LoRA checkpoint records it."""
    from gpt import checkpoint, hf

    return Path(init_from).resolve() if hf.is_hf_dir(init_from) else checkpoint.resolve(init_from).resolve()


def meta(config: LoRAConfig, model: nn.Module, base: Path, out_dir) -> dict:
    """meta["lora"] of a checkpoint saved into `out_dir`: the settings and where the base is."""
    return {**config.to_dict(), "base": str(base), "base_relative": os.path.relpath(base, Path(out_dir).resolve()),
            "base_sha256": fingerprint(model), "trainable": trainable_params(model)}


def find_base(lora_meta: dict, source) -> Path:
    """The base a LoRA checkpoint names: its absolute path, else the same path relative to the checkpoint."""
    here = Path(source).resolve().parent
    for candidate in (Path(lora_meta["base"]), here / lora_meta.get("base_relative", "")):
        if candidate.exists() and candidate != here:
            return candidate
    raise LoRAError(f"{source} is a LoRA checkpoint whose base model {lora_meta['base']} is gone: put the base "
                    f"back, or merge with another copy of it: `python -m gpt.lora merge --ckpt {source} --base "
                    f"PATH --out merged.pt`")


def build_base(lora_meta: dict, model_config: dict, source, base=None, device="cpu") -> nn.Module:
    """The base model a LoRA checkpoint adapts, cropped as it was, adapters applied (B still zero), its
    fingerprint checked."""
    from gpt import checkpoint

    base = Path(base) if base else find_base(lora_meta, source)
    model, _ = checkpoint.load_model(base, device=device)
    if model_config["block_size"] < model.config.block_size:
        model.crop_block_size(model_config["block_size"])
    if fingerprint(model) != lora_meta["base_sha256"]:
        raise LoRAError(f"{source}: its base {base} has changed since the adapters were trained on it (the weights "
                        f"differ): give the base they were trained on")
    apply(model, LoRAConfig(lora_meta["rank"], lora_meta["alpha"], lora_meta["dropout"], lora_meta["targets"]))
    return model


def load_adapted(path, device="cpu", merge_adapters: bool = False, base=None):
    """(model, meta) of a LoRA checkpoint: the base plus its adapters, separate or merged, in eval mode;
    `base` overrides the base path the checkpoint names."""
    from gpt import checkpoint

    ckpt = checkpoint.read(path, map_location=device)
    if "lora" not in ckpt["meta"]:
        raise LoRAError(f"{ckpt.source} is not a LoRA checkpoint (it holds all the weights already)")
    return from_checkpoint(ckpt, device, merge_adapters, base)


def from_checkpoint(ckpt: dict, device="cpu", merge_adapters: bool = True, base=None):
    """(model, meta) from a LoRA checkpoint already read (`gpt.checkpoint.read`)."""
    meta_ = ckpt["meta"]
    model = build_base(meta_["lora"], meta_["model_config"], ckpt.source, base, device)
    load_weights(model, ckpt["model"], ckpt.source)
    model.eval()
    return (merge(model) if merge_adapters else model), meta_


# ---- training: the trainer's calls -------------------------------------------------------------------


def run_base(cfg) -> Path:
    """The base a LoRA run adapts: `--init-from`'s checkpoint, or, resuming, the one the run names."""
    from gpt import checkpoint

    if not cfg.resume:
        return base_path(cfg.init_from)
    path = checkpoint.resolve(cfg.resume, names=checkpoint.LATEST)
    meta_ = checkpoint.read_meta(path, names=checkpoint.LATEST)
    if "lora" not in meta_:
        raise ConfigError(f"--lora-rank: the run in {cfg.resume} trains all its weights, it cannot go on as LoRA; "
                          f"start a LoRA run from it with --init-from {cfg.resume}")
    return find_base(meta_["lora"], path)


def adapt_for_training(model: nn.Module, cfg, base: Path, log) -> dict:
    """Freeze the base, add the adapters `cfg` asks for; returns meta["lora"] for the run's checkpoints."""
    config = LoRAConfig.from_train(cfg)
    n = apply(model, config)
    log(f"lora: rank {config.rank}, alpha {config.alpha:g} on {', '.join(config.targets)}: {n:,} trained parameters; "
        f"the base {base} is frozen")
    return meta(config, model, base, cfg.out_dir)


def check_resume(saved: dict, lora_meta: dict | None, source) -> None:
    """A resumed run stays what it was: LoRA or not, the same rank, alpha and targets, the same base."""
    was = saved.get("lora")
    if was is None and lora_meta is None:
        return
    if was is None:
        raise ConfigError(f"--lora-rank: the run in {source} trains all its weights, it cannot go on as LoRA")
    if lora_meta is None:
        raise ConfigError(f"--lora-rank 0: {source} is a LoRA run (rank {was['rank']}); resume it as one, or merge "
                          f"it (`python -m gpt.lora merge`) and fine-tune the merged checkpoint with --init-from")
    changed = [f"--lora-{k} {lora_meta[k]} (the run has {was[k]})" for k in ("rank", "alpha", "targets")
               if lora_meta[k] != was[k]]
    if changed:
        raise ConfigError(f"--resume {source}: a LoRA run keeps its adapters' shape: {', '.join(changed)}")
    if lora_meta["base_sha256"] != was["base_sha256"]:
        raise LoRAError(f"--resume {source}: its base {lora_meta['base']} has changed since the run started (the "
                        f"weights differ): give the base the adapters were trained on")


# ---- python -m gpt.lora merge ------------------------------------------------------------------------


def merge_checkpoint(path, out, base=None) -> Path:
    """Write base + adapters of the LoRA checkpoint `path` as one plain checkpoint (`out`: a .pt file, or a
    directory that gets best.pt): sample.py, `--init-from` and the HF export read it like any other."""
    from gpt import checkpoint

    model, meta_ = load_adapted(path, merge_adapters=True, base=base)
    keep = {k: meta_[k] for k in ("step", "val_loss", "dataset") if k in meta_}
    new_meta = checkpoint.build_meta(model_config=model.config.to_dict(), tokenizer=meta_["tokenizer"], **keep)
    out = Path(out)
    target = out if out.suffix == ".pt" else out / "best.pt"
    checkpoint.save(target, {"model": model.state_dict()}, new_meta)
    return target


def main(argv=None) -> int:
    from gpt.cli import ArgumentParser, run_main

    p = ArgumentParser(prog="python -m gpt.lora", description="LoRA checkpoints: `merge` writes base + adapters as "
                       "one plain checkpoint (for sample.py, --init-from, python -m gpt.hf export).")
    p.add_argument("command", choices=["merge"])
    p.add_argument("--ckpt", required=True, help="a LoRA run directory (best.pt, else last.pt) or checkpoint file")
    p.add_argument("--out", required=True, help="a .pt file, or a directory (it gets best.pt)")
    p.add_argument("--base", default=None, help="the base model, if not where the checkpoint says (default: there)")
    args = p.parse_args(argv)

    def run() -> str:
        target = merge_checkpoint(args.ckpt, args.out, args.base)
        return f"wrote {target} (base + adapters merged; sample with `python sample.py --ckpt {target}`)"

    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
