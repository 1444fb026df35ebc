"""Learning-rate schedules as pure functions of the step (so resuming needs only the step).

| schedule   | shape                                                                          |
|------------|--------------------------------------------------------------------------------|
| `cosine`   | linear warmup to `lr`, cosine decay to `min_lr` at `decay_iters`, then `min_lr` |
| `constant` | linear warmup to `lr`, then constant                                           |
| `wsd`      | warmup, stable at `lr`, linear decay to `min_lr` over the last `decay_fraction` |
| `noam`     | "Attention Is All You Need": lr * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5)  |

For `noam`, `lr` is the multiplier of the paper's formula (1.0 in the paper); the trainer's step 0 is
the paper's step 1.

The weight decay has a schedule too (`wd_at`, `--wd-schedule`): `constant`, or from `weight_decay` at step 0
down to 0 at `decay_iters`, `linear` or `cosine` (nanochat decays Muon's this way); it multiplies the LR in
the decoupled update (w -= lr * wd * w), so it falls on top of the LR's own decay.
"""

from __future__ import annotations

import math

from gpt.model.windows import Windows


def noam_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """The paper's schedule: `scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`.

    Linear warm-up for `warmup` steps to the peak `scale * (d_model * warmup)^-0.5`, then decay
    proportional to 1/sqrt(step). `step` counts optimizer updates from 1 as in the paper; step 0
    (a trainer counting from 0) is given step 1's rate rather than a wasted zero. With Adam the
    paper uses betas (0.9, 0.98), eps 1e-9 and the rate as given (scale 1).
    """
    if d_model <= 0 or warmup <= 0:
        raise ValueError(f"noam_lr needs d_model > 0 and warmup > 0, got d_model={d_model}, warmup={warmup}")
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def get_lr(
    step: int,
    *,
    schedule: str,
    lr: float,
    min_lr: float = 0.0,
    warmup_iters: int = 0,
    decay_iters: int = 1,
    decay_fraction: float = 0.2,
    d_model: int = 512,
) -> float:
    if schedule == "noam":
        return noam_lr(step + 1, d_model, max(warmup_iters, 1), lr)
    if step < warmup_iters:
        return lr * (step + 1) / (warmup_iters + 1)
    if schedule == "constant":
        return lr
    if step >= decay_iters:
        return min_lr
    if schedule == "cosine":
        progress = (step - warmup_iters) / max(1, decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
    if schedule == "wsd":
        decay_start = decay_iters - int(decay_fraction * decay_iters)
        if step < decay_start:
            return lr
        return lr - (lr - min_lr) * (step - decay_start) / max(1, decay_iters - decay_start)
    raise ValueError(f"unknown lr schedule {schedule!r}")


def lr_at(step: int, cfg) -> float:
    """The LR of `step` under a TrainConfig's schedule settings."""
    return get_lr(
        step,
        schedule=cfg.lr_schedule,
        lr=cfg.learning_rate,
        min_lr=cfg.min_lr,
        warmup_iters=cfg.warmup_iters,
        decay_iters=cfg.lr_decay_iters or cfg.max_iters,
        decay_fraction=cfg.decay_fraction,
        d_model=cfg.model.n_embd,
    )


def get_wd(step: int, *, schedule: str, wd: float, decay_iters: int = 1) -> float:
    """The weight decay of `step`: `wd` throughout (constant), or from `wd` at step 0 to 0 at `decay_iters`."""
    if schedule == "constant":
        return wd
    progress = min(step / max(1, decay_iters), 1.0)
    if schedule == "linear":
        return wd * (1.0 - progress)
    if schedule == "cosine":
        return wd * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown weight decay schedule {schedule!r}")


def wd_at(step: int, cfg) -> float:
    """The weight decay of `step` under a TrainConfig's settings."""
    return get_wd(step, schedule=cfg.wd_schedule, wd=cfg.weight_decay, decay_iters=cfg.lr_decay_iters or cfg.max_iters)


WINDOW_SIZES = 4  # --window-schedule: at most this many sizes (compiled: 2 graphs each, train and eval; torch keeps 8)
WINDOW_ROUND = 64  # ... each a multiple of this many tokens (or the configured window itself)


def windows_at(step: int, cfg) -> Windows:
    """The model's windows at `step` under --window-schedule: the largest window grows linearly from
    `window_schedule` tokens at step 0 to the configured one at the last step (max_iters - 1), in steps of
    a multiple of WINDOW_ROUND tokens (rounded up), at most WINDOW_SIZES distinct sizes over the run; every
    other window scaled in proportion, full layers full."""
    configured = Windows.of(cfg.model)
    top, start = max(configured.pattern), cfg.window_schedule
    quantum = WINDOW_ROUND * max(1, math.ceil((top - start) / (WINDOW_ROUND * (WINDOW_SIZES - 1))))
    progress = min(step / max(1, cfg.max_iters - 1), 1.0)
    size = min(top, start + math.ceil((top - start) * progress / quantum) * quantum)
    pattern = tuple(max(1, round(w * size / top)) if w else 0 for w in configured.pattern)
    return Windows(pattern, configured.global_tokens)
