"""The pieces of one training step: the optimizer (`make_optimizer`), each step's hyperparameters, the step
itself (`train_step`: micro-batches, backward, clip) and the evaluation loss (`estimate_loss`); the loop around
them is gpt/train/trainer.py's.

    optimizer = make_optimizer(model, cfg.optimizer_config, fused=False)
    lr = set_hyperparameters(optimizer, step, cfg)
    loss, grad_norm, tokens = train_step(model, optimizer, scaler, get_batch, step, accum, rt, cfg.grad_clip)
    losses = estimate_loss(model, task, ("train", "val"), rt)

Footguns
- `train_step` leaves the gradients unscaled and clipped but takes no optimizer step: the loop checks the loss
  and the norm are finite first (gpt/train/health.py), then steps.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from gpt.model.transformer import GPT
from gpt.progress import Progress
from gpt.runtime import Runtime
from gpt.train import distill, parallel, prefer
from gpt.train.config import OptimizerConfig, TrainConfig
from gpt.train.muon import Muon, ns_dtype_for
from gpt.train.schedule import lr_at, wd_at
from gpt.train.tasks import count_targets


def make_optimizer(
    model: GPT, opt: OptimizerConfig, device: torch.device, split: bool = False
) -> torch.optim.Optimizer:
    """AdamW (the fused kernel where this PyTorch has one), or Muon + AdamW (gpt/train/muon.py); weight decay on
    matrices only. `split`: a tensor-parallel model, whose groups mix split parameters (DTensors) and whole
    ones, which the fused and multi-tensor kernels refuse: AdamW updates one parameter at a time."""
    kwargs = dict(lr=opt.lr, betas=opt.betas)
    if split:
        optimizer = torch.optim.AdamW(model.param_groups(opt.weight_decay), foreach=False, fused=False, **kwargs)
    elif opt.name == "muon":
        groups = model.param_groups(opt.weight_decay, muon=True)
        optimizer = Muon(groups, ns_dtype=ns_dtype_for(device), cautious_wd=opt.cautious_wd, **kwargs)
    else:
        try:
            optimizer = torch.optim.AdamW(model.param_groups(opt.weight_decay), fused=True, **kwargs)
        except (RuntimeError, TypeError):
            optimizer = torch.optim.AdamW(model.param_groups(opt.weight_decay), foreach=True, **kwargs)
    for group in optimizer.param_groups:  # from the start, so a saved optimizer and a fresh one have the same keys
        group["decays"] = bool(group["weight_decay"])  # (a decay scheduled down to 0 stays a group that decays)
    return optimizer


def set_hyperparameters(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Each param group's LR and weight decay for `step`; returns the step's LR (--learning-rate's schedule).
    Muon's matrices and x0_skip's scalars follow the same schedule, scaled to their own peaks (--muon-lr,
    --scalar-lr, --resid-lr); the groups that decay follow --wd-schedule (the scalars and norms never decay)."""
    lr, wd = lr_at(step, cfg), wd_at(step, cfg)
    peaks = {"resid": cfg.resid_lr, "x0": cfg.scalar_lr}
    for group in optimizer.param_groups:
        peak = cfg.muon_lr if group.get("muon") else peaks.get(group.get("scalar"), cfg.learning_rate)
        group["lr"] = lr * peak / cfg.learning_rate
        if group.setdefault("decays", bool(group["weight_decay"])):  # (an optimizer saved before the key)
            group["weight_decay"] = wd
    return lr


def train_step(
    train_model,
    optimizer,
    scaler,
    get_batch,
    step: int,
    accum: int,
    rt: Runtime,
    grad_clip: float,
    count=count_targets,
    loss_context=nullcontext,
    teacher: distill.Teacher | None = None,
    objective: prefer.Preference | None = None,
):
    """Accumulate `accum` micro-batches, then clip; returns (mean loss, gradient norm, tokens trained on:
    `count(batch)` summed).

    `get_batch(step, micro_step)` gives the positional arguments of `GPT.forward`: (idx, targets)
    for language modelling, (idx, targets, src, src_mask) for seq2seq.

    Each micro-loss is divided by `accum` so the summed gradients equal the gradient of the mean
    loss over the whole global batch, the same as one big batch would give. `loss_context` is entered
    around each forward and backward (--tp: the vocabulary-parallel loss, gpt/train/tensor_parallel.py).
    `teacher` (--distill-from): each micro-loss mixed with the KL to the teacher's logits (gpt/train/distill.py).
    `objective` (--objective dpo | orpo | grpo): each micro-loss is its loss (gpt/train/prefer.py, grpo.py).
    """
    total = torch.zeros((), device=rt.device)
    tokens = torch.zeros((), dtype=torch.long, device=rt.device)
    for micro in range(accum):
        batch = get_batch(step, micro)
        last = micro == accum - 1
        with parallel.micro_step(train_model, last), loss_context():
            with rt.autocast():
                if objective is not None:
                    loss = objective.loss(train_model, batch) / accum
                else:
                    logits, loss = train_model(*batch)
                    loss = (teacher.mix(logits, loss, batch) if teacher else loss) / accum
            scaler.scale(loss).backward()
        total += parallel.full(loss.detach())
        tokens += count(batch)
    scaler.unscale_(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = parallel.clip_grad_norm(params, grad_clip if grad_clip > 0 else float("inf"))
    return total, grad_norm, tokens


@torch.no_grad()
def estimate_loss(
    model: GPT, task, splits=("train", "val"), rt: Runtime | None = None, objective: prefer.Preference | None = None
) -> dict[str, float]:
    """Mean loss per target token on each split, over the task's evaluation batches; with an `objective`, its
    mean loss per pair (its figures in `objective.evaluated[split]`)."""
    was_training = model.training
    model.eval()
    out = {}
    for split in splits:
        if objective is not None:
            out[split], objective.evaluated[split] = objective.evaluate(model, task.eval_batches(split))
            continue
        total, count = 0.0, 0
        batches = task.eval_batches(split)
        bar = Progress(f"eval {split}", len(batches), unit="batches", scale=1)  # drawn on a terminal only
        for idx, targets, *rest in batches:
            with rt.autocast() if rt else nullcontext():
                logits, _ = model(idx, None, *rest)
            logits = parallel.full(logits)  # --tp: split along the vocabulary
            total += F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1, reduction="sum"
            ).item()
            count += int((targets != -1).sum())
            bar.update()
        bar.close(keep=False)
        out[split] = total / max(count, 1)
    model.train(was_training)
    return out
