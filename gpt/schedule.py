"""Learning-rate schedules: pure functions of the step, so resuming at step s gives the same rate.

    from gpt.schedule import noam_lr
    lr = noam_lr(step, d_model=512, warmup=4000)   # the "Attention Is All You Need" schedule
"""

from __future__ import annotations


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
