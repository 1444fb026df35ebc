"""LoRA checkpoints: adapters only, naming the base they adapt (the layers are gpt/model/lora.py).

    meta["lora"] = adapters.meta(config, model, base, out_dir)          # the trainer's save
    model = adapters.attach(base_model, meta["lora"], meta["model_config"], source, base)

`meta["lora"]` holds `base` (absolute path), `base_relative` (from the checkpoint's directory, so a
base moved together with the run still loads), `base_sha256` (a fingerprint of the base weights as
adapted: a base that changed since, e.g. a best.pt that moved on, is refused in one line instead of
silently giving other text), and `rank`, `alpha`, `dropout`, `targets`; `grown` when the run grew the
base's vocabulary for a chat template's tokens (the base is grown the same way when loaded). A run that
fine-tuned a rope base at a longer block with rope scaling records them in its model_config; the base is
rebuilt with them when loaded (`attach`). Loading the base itself is the
loader's (gpt/checkpoints/loader.py: `load_model`, `load_adapted`); this module never imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.nn as nn

from gpt.errors import ConfigError
from gpt.model.config import GPTConfig
from gpt.model.lora import LoRAConfig, LoRAError, apply, fingerprint, trainable_params
from gpt.model.transformer import GPT

EXTENSION = ("rope_scaling", "rope_factor", "rope_original_block")  # a LoRA run's own, beside its block size


def meta(config: LoRAConfig, model: nn.Module, base: Path, out_dir, grown: dict | None = None) -> dict:
    """meta["lora"] of a checkpoint saved into `out_dir`: the settings and where the base is; `grown`, if
    the base's vocabulary was grown for a chat template's tokens (GPT.grow_vocab, deterministic)."""
    return {
        **config.to_dict(),
        **({"grown": grown} if grown else {}),
        "base": str(base),
        "base_relative": os.path.relpath(base, Path(out_dir).resolve()),
        "base_sha256": fingerprint(model),
        "trainable": trainable_params(model),
    }


def find_base(lora_meta: dict, source) -> Path:
    """The base a LoRA checkpoint names: its absolute path, else the same path relative to the checkpoint."""
    here = Path(source).resolve().parent
    for candidate in (Path(lora_meta["base"]), here / lora_meta.get("base_relative", "")):
        if candidate.exists() and candidate != here:
            return candidate
    raise LoRAError(
        f"{source} is a LoRA checkpoint whose base model {lora_meta['base']} is gone: put the base "
        f"back, or merge with another copy of it: `gpt lora merge --ckpt {source} --base "
        f"PATH --out merged.pt`"
    )


def attach(model: nn.Module, lora_meta: dict, model_config: dict, source, base) -> nn.Module:
    """The base model a LoRA checkpoint adapts, cropped as it was, adapters applied (B still zero), its
    fingerprint checked."""
    model = _extended(model, model_config)
    if model_config["block_size"] < model.config.block_size:
        model.crop_block_size(model_config["block_size"])
    if "grown" in lora_meta:  # the chat template's tokens, added to the base as the run added them
        model.grow_vocab(lora_meta["grown"]["vocab_size"], range(*lora_meta["grown"]["fresh"]))
    if fingerprint(model) != lora_meta["base_sha256"]:
        raise LoRAError(
            f"{source}: its base {base} has changed since the adapters were trained on it (the weights "
            f"differ): give the base they were trained on"
        )
    apply(model, LoRAConfig(lora_meta["rank"], lora_meta["alpha"], lora_meta["dropout"], lora_meta["targets"]))
    return model


def _extended(model: nn.Module, model_config: dict) -> nn.Module:
    """The base rebuilt at the run's longer block and rope scaling, as the run built it (a rope model:
    gpt/train/start.py `context_extension`), else the base itself."""
    changed = {
        k: model_config[k] for k in EXTENSION if k in model_config and getattr(model.config, k) != model_config[k]
    }
    if model_config["block_size"] <= model.config.block_size and not changed:
        return model
    config = GPTConfig.from_dict({**model.config.to_dict(), **changed, "block_size": model_config["block_size"]})
    weight = next(model.parameters())
    rebuilt = GPT(config).to(device=weight.device, dtype=weight.dtype)
    rebuilt.load_state_dict(model.state_dict())  # (a rope model: the same weights at any block)
    return rebuilt.train(model.training)


def check_resume(saved: dict, lora_meta: dict | None, source) -> None:
    """A resumed run stays what it was: LoRA or not, the same rank, alpha and targets, the same base."""
    was = saved.get("lora")
    if was is None and lora_meta is None:
        return
    if was is None:
        raise ConfigError(f"--lora-rank: the run in {source} trains all its weights, it cannot go on as LoRA")
    if lora_meta is None:
        raise ConfigError(
            f"--lora-rank 0: {source} is a LoRA run (rank {was['rank']}); resume it as one, or merge "
            f"it (`gpt lora merge`) and fine-tune the merged checkpoint with --init-from"
        )
    changed = [
        f"--lora-{k} {lora_meta[k]} (the run has {was[k]})"
        for k in ("rank", "alpha", "targets")
        if lora_meta[k] != was[k]
    ]
    if changed:
        raise ConfigError(f"--resume {source}: a LoRA run keeps its adapters' shape: {', '.join(changed)}")
    if lora_meta["base_sha256"] != was["base_sha256"]:
        raise LoRAError(
            f"--resume {source}: its base {lora_meta['base']} has changed since the run started (the "
            f"weights differ): give the base the adapters were trained on"
        )
