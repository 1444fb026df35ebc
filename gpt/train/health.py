"""Run health: warnings before a run goes bad, and the update-to-weight ratio.

    health = HealthMonitor()
    for warning in health.check(step, loss, grad_norm): print("warning:", warning)
    with health.measure_update(optimizer, enabled=log_step):
        optimizer.step()
    health.update_ratio        # ||W_after - W_before|| / ||W_before|| over the trained weights

Rules (each compares a step with the median of the `window` steps before it, so one slow drift is
never flagged, and nothing is flagged before `min_history` steps exist; the trainer sets it to the
warmup's length, whose first steps swing widely in a healthy run):
- loss spike: loss > median + max(`spike_mads` * 1.4826 * MAD, `spike_floor`) nats. The MAD (median
  absolute deviation) scales with how noisy this run's loss is; the floor keeps an almost constant
  loss from flagging tiny bumps.
- gradient-norm explosion: grad norm (before clipping) > `grad_factor` x the recent median. Clipping
  hides it from the update, not from the warning: a norm growing step after step usually comes before
  the NaN that stops a run.
One warning per episode: a rule that fired stays quiet until a step is normal again.

The update-to-weight ratio is the size of one optimizer step relative to the weights it moves; around
1e-3 is healthy for Adam-style training (Karpathy's rule of thumb): much larger means the LR is too
high, much smaller that the weights barely move. It needs a copy of the trained weights from before
the step, so it is measured at log steps only (for LoRA the copy is only the adapters).
"""

from __future__ import annotations

import collections
import math
import statistics
from contextlib import contextmanager

import torch

from gpt.train.parallel import by_mesh, full


class HealthMonitor:
    def __init__(
        self,
        window: int = 50,
        min_history: int = 10,
        spike_mads: float = 6.0,
        spike_floor: float = 0.25,
        grad_factor: float = 10.0,
    ):
        self.losses = collections.deque(maxlen=window)
        self.grad_norms = collections.deque(maxlen=window)
        self.min_history, self.spike_mads, self.spike_floor, self.grad_factor = (
            min_history,
            spike_mads,
            spike_floor,
            grad_factor,
        )
        self.firing = {"loss": False, "grad": False}
        self.update_ratio: float | None = None

    def check(self, step: int, loss: float, grad_norm: float) -> list[str]:
        """Warnings for this step's loss and gradient norm (non-finite values are the trainer's to stop)."""
        warnings = []
        if math.isfinite(loss):
            if len(self.losses) >= self.min_history:
                median = statistics.median(self.losses)
                mad = statistics.median(abs(x - median) for x in self.losses)
                limit = median + max(self.spike_mads * 1.4826 * mad, self.spike_floor)
                spiking = loss > limit
                if spiking and not self.firing["loss"]:
                    warnings.append(
                        f"loss spike at step {step}: {loss:.4f}, recent median {median:.4f} (limit "
                        f"{limit:.4f}); if it keeps happening lower --learning-rate or raise --warmup-iters"
                    )
                self.firing["loss"] = spiking
            self.losses.append(loss)
        if math.isfinite(grad_norm):
            if len(self.grad_norms) >= self.min_history:
                median = statistics.median(self.grad_norms)
                exploding = grad_norm > self.grad_factor * median
                if exploding and not self.firing["grad"]:
                    warnings.append(
                        f"gradient norm exploding at step {step}: {grad_norm:.4g}, {grad_norm / median:.0f}x "
                        f"the recent median {median:.4g}; lower --learning-rate or --grad-clip before it "
                        f"becomes NaN"
                    )
                self.firing["grad"] = exploding
            self.grad_norms.append(grad_norm)
        return warnings

    @contextmanager
    def measure_update(self, optimizer: torch.optim.Optimizer, enabled: bool = True):
        """Around an optimizer step: sets `update_ratio` (None when not enabled)."""
        if not enabled:
            yield
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in params]
        yield

        def norm(tensors) -> torch.Tensor:  # of all of them together; FSDP shards' norms are gathered
            return torch.stack([full(t.float().norm()) for t in tensors]).norm()

        with torch.no_grad():  # one host sync (a collective per tensor under FSDP)
            size = norm(before)
            for group in by_mesh(params):  # the update, in place of the copies (a foreach op takes one kind)
                torch._foreach_sub_([before[i] for i in group], [params[i] for i in group])
            change, size = torch.stack([norm(before), size]).tolist()
        self.update_ratio = change / size if size > 0 else None
