"""Where a run starts: a fresh model, one fine-tuned from a checkpoint (all weights, or LoRA adapters on a
frozen base), or a run resumed exactly where it stopped.

    cfg, explicit = config_from_argv(sys.argv[1:])    # with --resume RUN, the run's own config is the base
    model, model_config = new_model(cfg, task, explicit, log)
    check_resumable(meta, model_config, task, cfg)    # a resume continues the same model on the same data

The loop itself is gpt/train/trainer.py; the checkpoints it reads are gpt/checkpoints/.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch.nn as nn

from gpt.checkpoints import adapters, loader
from gpt.checkpoints.native import LATEST
from gpt.errors import ConfigError, UserError
from gpt.model.config import GPTConfig
from gpt.model.lora import LoRAConfig, apply
from gpt.model.transformer import GPT
from gpt.train.config import (
    TrainConfig,
    build_config,
    find_config,
    flag,
    load_toml,
    parse_cli,
)
from gpt.train.schedule import lr_at

ARCHITECTURE = (
    "vocab_size",
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
    "bias",
    "n_encoder_layer",
    "pos_encoding",
    "norm",
    "activation",
    "qk_norm",
    "logit_softcap",
    "untied_head",
)  # what a resumed run cannot change (dropout and label smoothing it can)


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (non-finite loss, mismatched tokenizer, ...); the message says why."""


# ---- the configuration: a command line, and with --resume the run's own config under it ---------------


def config_from_argv(argv: list[str]) -> tuple[TrainConfig, set[str]]:
    """The training config of a command line, and the names given explicitly (by the command line, the
    config file or, with `--resume RUN`, the run's saved config, which the command line may change)."""
    cli, config_name, _ = parse_cli(argv)
    base = {}
    if cli.get("resume"):
        saved = loader.read_meta(cli["resume"], names=LATEST)
        base = dict(saved["train_config"])
        # the architecture the run has (an --init-from run's came from its checkpoint, not from these flags)
        base.update({k: v for k, v in saved["model_config"].items() if k in base})
        for key in ("resume", "init_from", "force"):
            base.pop(key, None)
        base["out_dir"] = str(loader.resolve(cli["resume"], names=LATEST).parent)  # where it is now
    cfg = build_config(argv, base=base)
    explicit = set(cli) | set(base)
    if config_name:
        explicit |= set(load_toml(find_config(config_name)))
    return cfg, explicit


# ---- the model: fresh, fine-tuned from a checkpoint, or resumed ---------------------------------------


def tokenizers_match(a: dict, b: dict) -> bool:
    if a.get("kind") == "specials":
        return b.get("kind") == "specials" and a["specials"] == b["specials"] and tokenizers_match(a["base"], b["base"])
    keys = {"gpt2": ("kind",), "char": ("kind", "chars"), "bpe": ("kind", "ranks", "pattern")}.get(a.get("kind"), ())
    return bool(keys) and all(a.get(k) == b.get(k) for k in keys)


def chat_growth(spec: dict, task) -> range | None:
    """The ids a checkpoint with tokenizer `spec` lacks of a chat dataset's tokenizer (its base plus the
    template's special tokens), or None if the checkpoint has them all already."""
    data = task.tokenizer_spec
    if data.get("kind") == "specials" and spec.get("kind") != "specials" and tokenizers_match(spec, data["base"]):
        return range(task.vocab_size - len(data["specials"]), task.vocab_size)
    return None


def check_tokenizer(source: str, spec: dict, task, data: str) -> None:
    """A checkpoint's tokenizer must be the dataset's (the same ids must mean the same text), or for a chat
    dataset the base it adds the template's special tokens to."""
    if not tokenizers_match(spec, task.tokenizer_spec) and chat_growth(spec, task) is None:
        kind = spec.get("kind")
        raise TrainingError(
            f"tokenizer mismatch: {source} was trained with a {kind!r} tokenizer different from the one of "
            f"{data} ({task.tokenizer_spec.get('kind')!r}); use the dataset it was trained on, or prepare "
            f"the text with the checkpoint's tokenizer (`python data/prepare.py ... --tokenizer-from {source}`)"
        )


def padded_vocab(task) -> int:
    return math.ceil(task.vocab_size / 64) * 64  # a multiple of 64: faster matmuls


def new_model(cfg: TrainConfig, task, explicit: set[str], log, init_from: str = "") -> tuple[GPT, dict]:
    """A fresh model, or one initialised from `init_from` (default: cfg.init_from); returns (model, the
    model config used)."""
    init_from = init_from or cfg.init_from
    if not init_from:
        mcfg = dataclasses.replace(cfg.model, vocab_size=padded_vocab(task))
        return GPT(mcfg), mcfg.to_dict()
    model, meta = loader.load_model(init_from)
    check_tokenizer(init_from, meta["tokenizer"], task, cfg.data)
    mdict = dict(meta["model_config"], dropout=cfg.model.dropout)  # architecture from the checkpoint
    ignored = [
        f"{flag(k)} {getattr(cfg.model, k)}"
        for k in ARCHITECTURE
        if k in explicit and k != "block_size" and k in mdict and getattr(cfg.model, k) != mdict[k]
    ]
    if ignored:
        log(f"init_from: the architecture comes from {init_from}; ignoring {', '.join(ignored)}")
    state = model.state_dict()
    model = GPT(GPTConfig.from_dict(mdict))
    model.load_state_dict(state)
    fresh = chat_growth(meta["tokenizer"], task)
    if fresh is not None:
        model.grow_vocab(padded_vocab(task), fresh)
        model.grown = {"vocab_size": model.config.vocab_size, "fresh": [fresh.start, fresh.stop]}
        log(
            f"init_from: the chat template's {len(fresh)} special tokens (ids {fresh.start}..{fresh.stop - 1}) are new to "
            f"{init_from}: its embedding and tied head grow to {model.config.vocab_size:,} rows, the new ones "
            f"starting at the mean of the old"
        )
    block = cfg.model.block_size if "block_size" in explicit else mdict["block_size"]
    if block < mdict["block_size"]:
        log(f"init_from: cropping block_size {mdict['block_size']} -> {block}")
        model.crop_block_size(block)
    elif block > mdict["block_size"]:
        raise ConfigError(f"--block-size: {block} exceeds the checkpoint's {mdict['block_size']} (it can only shrink)")
    return model, model.config.to_dict()


def check_resumable(meta: dict, model_config: dict, task, cfg: TrainConfig) -> None:
    """A resumed run continues the same model on the same kind of data: refuse anything else in one line."""
    check_tokenizer(cfg.resume, meta["tokenizer"], task, cfg.data)
    saved = meta["model_config"]
    changed = [
        f"{flag(k)} {model_config[k]} (the run has {saved[k]})"
        for k in ARCHITECTURE
        if k != "vocab_size" and k in saved and model_config.get(k) != saved[k]
    ]
    if changed:
        raise ConfigError(
            f"--resume {cfg.resume}: the architecture of a run cannot change: {', '.join(changed)}; "
            f"start a new run, or fine-tune it with --init-from {cfg.resume}"
        )
    optimizer = meta["train_config"].get("optimizer", "adamw")
    if cfg.optimizer != optimizer:
        raise ConfigError(
            f"--resume {cfg.resume}: the run was trained with --optimizer {optimizer}, not "
            f"{cfg.optimizer}; resume it with --optimizer {optimizer}, or fine-tune it with --init-from"
        )


def schedule_change(saved: dict, cfg: TrainConfig, step: int) -> str | None:
    """What training longer than the run planned does to the LR, in one line (None if nothing changes)."""
    old_end, new_end = saved.get("max_iters", cfg.max_iters), cfg.max_iters
    if new_end <= old_end or cfg.lr_schedule in ("constant", "noam"):
        return None
    if not cfg.lr_decay_iters:  # the decay follows --max-iters: it stretches to the new end
        old_lr = lr_at(step, dataclasses.replace(cfg, max_iters=old_end))
        return (
            f"--max-iters {new_end} (was {old_end}): the LR decay follows --max-iters, so it now ends at step "
            f"{new_end}; the LR at step {step} goes from {old_lr:.2e} to {lr_at(step, cfg):.2e}"
        )
    if cfg.lr_decay_iters < new_end:
        return (
            f"--max-iters {new_end}: the LR decay ends at --lr-decay-iters {cfg.lr_decay_iters}, so steps "
            f"{max(step, cfg.lr_decay_iters)}..{new_end} run at --min-lr {cfg.min_lr:.2e}; pass "
            f"--lr-decay-iters {new_end} to stretch the decay instead"
        )
    return None


# ---- LoRA: the base a run adapts, and its adapters ------------------------------------------------------


def lora_base(cfg) -> Path:
    """The base a LoRA run adapts: `--init-from`'s checkpoint, or, resuming, the one the run names."""
    if not cfg.resume:
        return loader.base_path(cfg.init_from)
    path = loader.resolve(cfg.resume, names=LATEST)
    meta_ = loader.read_meta(path, names=LATEST)
    if "lora" not in meta_:
        raise ConfigError(
            f"--lora-rank: the run in {cfg.resume} trains all its weights, it cannot go on as LoRA; "
            f"start a LoRA run from it with --init-from {cfg.resume}"
        )
    return adapters.find_base(meta_["lora"], path)


def add_adapters(model: nn.Module, cfg, base: Path, log) -> dict:
    """Freeze the base, add the adapters `cfg` asks for; returns meta["lora"] for the run's checkpoints."""
    config = LoRAConfig.from_train(cfg)
    grown = getattr(model, "grown", None)
    if grown and "wte" not in config.targets:  # the new tokens' rows must be able to learn
        config = dataclasses.replace(config, targets=[*config.targets, "wte"])
        log("lora: the chat template's tokens are new to the base: adapting wte too (their embedding rows)")
    n = apply(model, config)
    log(
        f"lora: rank {config.rank}, alpha {config.alpha:g} on {', '.join(config.targets)}: {n:,} trained parameters; "
        f"the base {base} is frozen"
    )
    return adapters.meta(config, model, base, cfg.out_dir, grown)
