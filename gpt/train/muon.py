"""Muon for the blocks' weight matrices and AdamW for the rest, as one torch optimizer (`--optimizer muon`).

    groups = model.param_groups(weight_decay=0.1, muon=True)   # the "muon" group: the blocks' Linear weights
    optimizer = Muon(groups, lr=6e-3, betas=(0.9, 0.95), ns_dtype=torch.float32)
    for group in optimizer.param_groups:                        # the trainer sets each group's LR every step
        group["lr"] = muon_lr if group["muon"] else lr

Muon (K. Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural networks") is SGD with
Nesterov momentum whose update for a 2-D weight is replaced by the nearest semi-orthogonal matrix
(U V^T of the update's SVD), approximated by five Newton-Schulz iterations. Every direction of the
update then moves by the same amount, so rare directions are not drowned by common ones. It is meant
for the hidden matrices only: embeddings, the tied output head, LayerNorms and biases keep AdamW
(decoupled weight decay), in the same optimizer so the trainer, GradScaler and checkpoints see one.

| group                   | update                                                                   |
|-------------------------|--------------------------------------------------------------------------|
| `muon: True`            | m = mu*m + (1-mu)*g; u = NS5((1-mu)*g + mu*m); w -= lr*(wd*w + sqrt(max(1, rows/cols))*u) |
| with `cautious_wd`      | the same, the decay masked: w -= lr*(wd*w*[u*w >= 0] + ...) elementwise    |
| the others              | AdamW (torch's own `adam(..., decoupled_weight_decay=True)`)              |

Cautious weight decay (`--muon-cautious-wd`; Chen et al. 2025, "Cautious Weight Decay", nanochat's Muon)
decays a weight only where the update moves it towards zero anyway (update and weight of one sign), so
the decay never pulls against what the gradient asks for.

The Newton-Schulz coefficients (3.4445, -4.7750, 2.0315), mu = 0.95 and the sqrt(rows/cols) scale are
Jordan's. torch.optim.Muon (PyTorch >= 2.9) computes the same update, but always in bf16: on a CPU
without native bf16 that made the main job's step several times slower (bench/README.md, "Training"). Here
`ns_dtype` is the precision the device computes fast: bf16 on GPUs and on CPUs with native bf16,
float32 otherwise (`ns_dtype_for`). tests/test_muon.py checks the update against torch.optim.Muon.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from gpt.runtime import resolve_dtype

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MOMENTUM = 0.95


def ns_dtype_for(device: torch.device) -> torch.dtype:
    """bf16 where the device computes it natively (CUDA with bf16, CPUs with AVX-512 BF16 / AMX), else float32."""
    dtype, _ = resolve_dtype("auto", device)
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def orthogonalize(g: torch.Tensor, dtype: torch.dtype = torch.float32, steps: int = NS_STEPS) -> torch.Tensor:
    """About U V^T for g = U S V^T (its singular values land between about 0.7 and 1.2), in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide side: X X^T is the smaller square
        x = x.T
    x = x / x.norm().clamp(min=1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked `muon`, AdamW on the others (see the module notes)."""

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        ns_dtype: torch.dtype = torch.float32,
        cautious_wd: bool = False,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, muon=False)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        self.cautious_wd = cautious_wd

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon(group, params)
            elif params:
                self._adamw(group, params)
        return loss

    def _muon(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, decay = group["lr"], group["weight_decay"]
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - MOMENTUM)
            update = orthogonalize(p.grad.lerp(buf, MOMENTUM), self.ns_dtype)  # Nesterov
            if self.cautious_wd:  # w -= lr * wd * w where the update (subtracted) and w agree in sign
                p.sub_(p * (update * p >= 0), alpha=lr * decay)
            else:
                p.mul_(1 - lr * decay)
            p.add_(update.to(p.dtype), alpha=-lr * max(1.0, p.size(0) / p.size(1)) ** 0.5)

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        for p in params:
            if not self.state[p]:
                self.state[p].update(
                    step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                )
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            foreach=True,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
