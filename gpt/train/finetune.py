"""What a LoRA run starts from: the base it adapts, and the adapters it adds (gpt/model/lora.py).

    base = run_base(cfg)                                  # --init-from's checkpoint, or the resumed run's base
    lora_meta = adapt_for_training(model, cfg, base, log)  # freeze the base, add adapters
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from gpt.checkpoints import adapters, loader
from gpt.checkpoints.native import LATEST
from gpt.errors import ConfigError
from gpt.model.lora import LoRAConfig, apply


def run_base(cfg) -> Path:
    """The base a LoRA run adapts: `--init-from`'s checkpoint, or, resuming, the one the run names."""
    if not cfg.resume:
        return loader.base_path(cfg.init_from)
    path = loader.resolve(cfg.resume, names=LATEST)
    meta_ = loader.read_meta(path, names=LATEST)
    if "lora" not in meta_:
        raise ConfigError(f"--lora-rank: the run in {cfg.resume} trains all its weights, it cannot go on as LoRA; "
                          f"start a LoRA run from it with --init-from {cfg.resume}")
    return adapters.find_base(meta_["lora"], path)


def adapt_for_training(model: nn.Module, cfg, base: Path, log) -> dict:
    """Freeze the base, add the adapters `cfg` asks for; returns meta["lora"] for the run's checkpoints."""
    config = LoRAConfig.from_train(cfg)
    n = apply(model, config)
    log(f"lora: rank {config.rank}, alpha {config.alpha:g} on {', '.join(config.targets)}: {n:,} trained parameters; "
        f"the base {base} is frozen")
    return adapters.meta(config, model, base, cfg.out_dir)
