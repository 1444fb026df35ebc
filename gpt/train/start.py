"""Where a run starts: a fresh model, one fine-tuned from a checkpoint (all weights, or LoRA adapters on a
frozen base), or a run resumed exactly where it stopped. The command line is resolved here once, into a
`RunPlan` the trainer takes: each checkpoint it names is located and its meta read once.

    plan = resolve_run(sys.argv[1:])                  # with --resume RUN, the run's own config is the base
    model, model_config = new_model(plan, task, log)
    check_resumable(plan.resume.meta, model_config, task, plan.cfg)  # the same model on the same data

The loop itself is gpt/train/trainer.py; the checkpoints it reads are gpt/checkpoints/.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch.nn as nn

from gpt.checkpoints import adapters, loader
from gpt.checkpoints.loader import Located
from gpt.checkpoints.native import LATEST
from gpt.errors import ConfigError, UserError
from gpt.model.config import GPTConfig, rope_problems
from gpt.model.lora import LoRAConfig, apply
from gpt.model.positions import Positions, RopeScaling
from gpt.model.transformer import GPT
from gpt.train.config import TrainConfig, flag
from gpt.train.flags import build_config, find_config, load_toml, parse_cli
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
    "x0_skip",
    "value_embeds",
    *("rope_scaling", "rope_factor", "rope_original_block"),
)  # what a resumed run cannot change (dropout and label smoothing it can)
EXTENSION = ("block_size", "rope_scaling", "rope_factor", "rope_original_block")  # --init-from takes these from
# the command line (a longer context: `context_extension`), the rest of the architecture from the checkpoint


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (non-finite loss, mismatched tokenizer, ...); the message says why."""


# ---- the run, resolved once: a command line, and with --resume the run's own config under it -------------


@dataclass(frozen=True)
class RunPlan:
    """A training run as its command line resolves (`resolve_run`): the config, and each checkpoint it names,
    located with its meta read (gpt/checkpoints/loader.py `locate`). The trainer reads nothing of them again."""

    cfg: TrainConfig
    asked: frozenset[str] = frozenset()  # the architecture fields set explicitly (a flag, the config file, or
    # a resumed run's config): fine-tuning, the checkpoint's own win and these are reported as ignored
    resume: Located | None = None  # --resume RUN: the checkpoint it continues (last.pt, or last.dcp)
    init: Located | None = None  # the weights it starts from: --init-from's, or a resumed LoRA run's base
    lora: LoRAConfig | None = None  # --lora-rank: the adapters trained on the frozen `init`
    base: Path | None = None  # with `lora`: the base as its checkpoints record it
    # a caller's check after each evaluation, (step, val loss, val bits per byte or None) -> stop?: `gpt sweep`'s
    # pruner. True ends the run there (the evaluation has saved last.pt). One process only.
    after_eval: Callable[[int, float, float | None], bool] | None = None


def resolve_run(argv: list[str]) -> RunPlan:
    """The run a command line asks for. Names given explicitly are those of the command line, the config
    file or, with `--resume RUN`, the run's saved config (which the command line may change)."""
    cli, config_name, _ = parse_cli(argv)
    base, resume = {}, None
    if cli.get("resume"):
        resume = loader.trained(cli["resume"], names=LATEST)
        base = dict(resume.meta["train_config"])
        # the architecture the run has (an --init-from run's came from its checkpoint, not from these flags)
        base.update({k: v for k, v in resume.meta["model_config"].items() if k in base})
        for key in ("resume", "init_from", "force"):
            base.pop(key, None)
        base["out_dir"] = str(resume.path.parent)  # where it is now
        if "tp" in cli and "sequence_parallel" not in cli and int(cli["tp"]) <= 1:
            base.pop("sequence_parallel", None)  # a --tp run's layout option, resumed unsplit
    cfg = build_config(argv, base=base)
    explicit = set(cli) | set(base)
    if config_name:
        explicit |= set(load_toml(find_config(config_name)))
    return plan_run(cfg, explicit, resume)


def plan_run(cfg: TrainConfig, explicit: set[str], resume: Located | None = None) -> RunPlan:
    """`cfg`'s plan: where its weights come from, located once (`resume`: already located)."""
    asked = frozenset(k for k in ARCHITECTURE if k in explicit)
    lora = cfg.lora_config()
    if lora and resume:  # the run's own base, as its adapters record it
        if "lora" not in resume.meta:
            raise ConfigError(
                f"--lora-rank: the run in {cfg.resume} trains all its weights, it cannot go on as LoRA; "
                f"start a LoRA run from it with --init-from {cfg.resume}"
            )
        base = adapters.find_base(resume.meta["lora"], resume.path)
        # a resumed run's config restates its base's architecture: only its block size (and rope scaling) is its own
        return RunPlan(cfg, frozenset(EXTENSION), resume, loader.locate(base), lora, base)
    init = loader.locate(cfg.init_from) if cfg.init_from else None
    return RunPlan(cfg, asked, resume, init, lora, loader.base_path(init) if lora else None)


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
            f"the text with the checkpoint's tokenizer (`gpt prepare ... --tokenizer-from {source}`)"
        )


def padded_vocab(task) -> int:
    return math.ceil(task.vocab_size / 64) * 64  # a multiple of 64: faster matmuls


def new_model(plan: RunPlan, task, log) -> tuple[GPT, dict]:
    """A fresh model, or one initialised from `plan.init`; returns (model, the model config used)."""
    cfg, init = plan.cfg, plan.init
    if init is None:  # a resumed run keeps its own vocabulary (an --init-from checkpoint's need not be padded)
        vocab = plan.resume.meta["model_config"]["vocab_size"] if plan.resume else padded_vocab(task)
        mcfg = dataclasses.replace(cfg.model, vocab_size=vocab)
        return GPT(mcfg), mcfg.to_dict()
    source = str(plan.base or cfg.init_from)  # (as the user named it, or the LoRA base its run records)
    model, meta = loader.load_model(init)
    check_tokenizer(source, meta["tokenizer"], task, cfg.data)
    mdict = dict(meta["model_config"], dropout=cfg.model.dropout)  # architecture from the checkpoint
    ignored = [
        f"{flag(k)} {getattr(cfg.model, k)}"
        for k in ARCHITECTURE
        if k in plan.asked and k not in EXTENSION and k in mdict and getattr(cfg.model, k) != mdict[k]
    ]
    if ignored:
        log(f"init_from: the architecture comes from {source}; ignoring {', '.join(ignored)}")
    block = cfg.model.block_size if "block_size" in plan.asked else mdict["block_size"]
    grows = context_extension(plan, mdict, block, source, log)
    state = model.state_dict()
    model = GPT(GPTConfig.from_dict(mdict))
    model.load_state_dict(state)
    fresh = chat_growth(meta["tokenizer"], task)
    if fresh is not None:
        model.grow_vocab(padded_vocab(task), fresh)
        model.grown = {"vocab_size": model.config.vocab_size, "fresh": [fresh.start, fresh.stop]}
        log(
            f"init_from: the chat template's {len(fresh)} special tokens (ids {fresh.start}..{fresh.stop - 1}) are new to "
            f"{source}: its embedding and tied head grow to {model.config.vocab_size:,} rows, the new ones "
            f"starting at the mean of the old"
        )
    if block < mdict["block_size"] and not grows:
        log(f"init_from: cropping block_size {mdict['block_size']} -> {block}")
        model.crop_block_size(block)
    return model, model.config.to_dict()


def context_extension(plan: RunPlan, mdict: dict, block: int, source: str, log) -> bool:
    """Fine-tuning from a checkpoint at another block: a model with a position table only shrinks it; a rope
    model (no table) takes the block as asked, and the rope scaling the command line asks for (its
    rope_original_block the checkpoint's block, or the block its own scaling started from). Updates `mdict`
    (the checkpoint's config); True when the model is built at `block` (no crop needed)."""
    asked, model = plan.asked, plan.cfg.model
    rope = mdict.get("pos_encoding") == "rope"
    if "rope_scaling" in asked and model.rope_scaling and not rope:
        raise ConfigError(
            f"--rope-scaling {model.rope_scaling}: {source} has pos_encoding {mdict.get('pos_encoding')!r}: "
            "only a rope model's rotary frequencies stretch to a longer context"
        )
    if block > mdict["block_size"] and not rope:
        raise ConfigError(
            f"--block-size: {block} exceeds the checkpoint's {mdict['block_size']} (its position table can only shrink)"
        )
    if not rope:
        return False
    before = mdict["block_size"]
    if "rope_scaling" in asked:
        scaled = _scaling(mdict)
        original = scaled.original if scaled else before  # the block the checkpoint was first trained at
        if "rope_original_block" in asked and model.rope_original_block:
            original = model.rope_original_block
        if model.rope_scaling:
            mdict.update(rope_scaling=model.rope_scaling, rope_factor=model.rope_factor)
            mdict["rope_original_block"] = round(original)
        else:
            mdict.update(rope_scaling="", rope_factor=1.0, rope_original_block=0)
    kept = _scaling(mdict)  # rope_original_block 0 means block_size / factor: pinned before the block moves
    if kept and not mdict.get("rope_original_block") and float(kept.original).is_integer():
        mdict["rope_original_block"] = int(kept.original)
    found = rope_problems(SimpleNamespace(**{**GPTConfig().to_dict(), **mdict, "block_size": block}))
    if found:
        raise ConfigError(f"--init-from {source}: " + "; ".join(f"{flag(name)}: {why}" for name, why in found))
    mdict["block_size"] = block
    if block != before:
        scaling = Positions.of(GPTConfig.from_dict(mdict)).scaling
        how = (
            f"{scaling.kind} rope scaling x{scaling.factor:g} from {scaling.original:g}"
            if scaling
            else "no rope scaling: positions past it are new to the model (--rope-scaling yarn stretches them)"
        )
        log(f"init_from: block_size {before} -> {block} ({how})")
    return True


def _scaling(mdict: dict) -> RopeScaling | None:
    """The rope scaling of a checkpoint's model config (one from before these fields: none)."""
    return RopeScaling.of(SimpleNamespace(**{**GPTConfig().to_dict(), **mdict}))


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


# ---- LoRA: the adapters on the frozen base ----------------------------------------------------------------


def add_adapters(model: nn.Module, plan: RunPlan, log) -> dict:
    """Freeze the base, add the adapters the plan asks for; returns meta["lora"] for the run's checkpoints."""
    config = plan.lora
    grown = getattr(model, "grown", None)
    if grown and "wte" not in config.targets:  # the new tokens' rows must be able to learn
        config = dataclasses.replace(config, targets=[*config.targets, "wte"])
        log("lora: the chat template's tokens are new to the base: adapting wte too (their embedding rows)")
    n = apply(model, config)
    log(
        f"lora: rank {config.rank}, alpha {config.alpha:g} on {', '.join(config.targets)}: {n:,} trained parameters; "
        f"the base {plan.base} is frozen"
    )
    return adapters.meta(config, model, plan.base, plan.cfg.out_dir, grown)
