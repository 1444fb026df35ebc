"""GRPO (Shao et al. 2024): group sampling from the policy, rewards from a checker, the clipped policy loss.

    gpt train --objective grpo --init-from out/sft --data problems.jsonl --reward exact --group-size 8
    objective = GRPO.load(cfg, task, rt)            # in the trainer, after the policy is built
    loss = objective.loss(train_model, batch)       # in the step (step.train_step), per micro-batch of prompts

For each prompt of a micro-batch (gpt/train/prompts.py), `sample_group` draws G completions (--group-size)
from the current policy, batched on the model's KV caches (the train room cannot use gpt/infer's sampler:
the rooms are siblings), at --grpo-temperature, each ending at the stop token or after --grpo-max-new-tokens.
Each completion's text gets its reward (gpt/train/rewards.py); the advantage of completion i of a group is
(r_i - mean(r)) / (std(r) + 1e-4), the std unbiased, as TRL's GRPOTrainer. Then, as TRL computes it, per
completion token t with pi the policy's probability of the sampled token:

    ratio = pi / pi_old;  per_token = -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) + beta kl
    kl = ref / pi - log(ref / pi) - 1                  (the k3 estimator; only with --beta > 0)

and the loss, by --grpo-loss: `grpo`, each completion's mean over its tokens, then the mean over
completions; `bnpo`, the mean over every completion token of the micro-batch; `dr_grpo`, the sum over
completion tokens divided by (completions x --grpo-max-new-tokens). pi_old is the policy that sampled the
batch: the same weights at its first update (ratio 1, the gradient of plain REINFORCE with the group baseline),
its log-probs kept for the next --grpo-updates - 1 steps, which train on the same completions. The reference
(`--reference`, default the `--init-from` checkpoint) is loaded only when --beta > 0, frozen.

Logged (TRL's names), as the mean over the steps since the last log line: reward, reward_std (the groups'
mean std), completions/mean_length, kl, clip_ratio/region_mean (the share of completion tokens whose ratio is clipped),
frac_reward_zero_std (groups that all scored alike: no gradient). Evaluation is greedy: the mean reward of one
completion per held-out prompt (`val_reward`); its loss is minus that reward, so the best checkpoint is the
highest-reward one.

Footguns
- A group whose completions all score the same has advantage 0: no gradient. A task the policy never (or
  always) solves teaches nothing: start from a model that sometimes gets it right.
- Under torchrun each process samples the completions of its own prompts; the reward of a `module:function`
  runs on every process.
- Resuming between the --grpo-updates steps of one batch samples that batch again (from the resumed weights).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpt.train.prefer import load_reference
from gpt.train.rewards import load_reward

LOSSES = ("grpo", "bnpo", "dr_grpo")


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r - the group's mean) / (the group's std + 1e-4), rewards (N,) in groups of `group_size` in a row."""
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(1, keepdim=True)
    std = grouped.std(1, keepdim=True)  # unbiased (Bessel), as TRL's nanstd
    return ((grouped - mean) / (std + 1e-4)).view(-1)


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token log-probability of `targets` (N, T) under `logits` (N, T, V); 0 where the target is -1."""
    n, t = targets.shape
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1, reduction="none")
    return -nll.view(n, t)


def grpo_loss(logps, old, ref, advantages, mask, epsilon: float, beta: float, kind: str = "grpo", max_new=1):
    """(loss, figures) of completion tokens: logps, old, ref (N, T) log-probs of the sampled tokens under the
    policy, the sampling policy and the reference (ref None with beta 0), advantages (N,), mask (N, T) bool on
    the completion tokens. Figures: kl (mean over tokens) and clip_ratio, detached."""
    m = mask.float()
    ratio = torch.exp(logps - old)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * a)
    figures = {}
    if beta:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token = per_token + beta * kl
        figures["kl"] = (kl * m).sum().detach() / m.sum().clamp(min=1)
    if kind == "grpo":
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    elif kind == "bnpo":
        loss = (per_token * m).sum() / m.sum().clamp(min=1)
    else:
        loss = (per_token * m).sum() / (per_token.size(0) * max_new)
    clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + epsilon) & (a > 0))
    figures["clip_ratio/region_mean"] = (clipped.float() * m).sum().detach() / m.sum().clamp(min=1)
    return loss, figures


@torch.no_grad()
def sample_group(model, prompt: list[int], g: int, max_new: int, temperature: float, stops, generator=None):
    """G completions of one prompt from `model` (a GPT), one batch on its KV caches: (ids (G, n) with each
    row's tokens up to and including its stop token, then -1; lengths (G,)). temperature 0 is greedy."""
    device = model.transformer.wte.weight.device
    caches = model.new_caches(g, len(prompt) + max_new)
    x = torch.tensor(prompt, device=device).expand(g, -1)
    stops = torch.tensor(list(stops), dtype=torch.long, device=device)
    out = torch.full((g, max_new), -1, dtype=torch.long, device=device)
    done = torch.zeros(g, dtype=torch.bool, device=device)
    lengths = torch.full((g,), max_new, dtype=torch.long, device=device)
    for t in range(max_new):
        logits = model.head(model.hidden(x, caches)[:, -1]).float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        out[:, t] = torch.where(done, -1, nxt)
        ended = ~done & torch.isin(nxt, stops)
        lengths[ended] = t + 1
        done |= ended
        if bool(done.all()):
            break
        x = nxt.unsqueeze(1)
    return out[:, : int(lengths.max())], lengths


@dataclass
class Rollout:
    """One micro-batch's sampled completions, scored: what the policy updates are computed on."""

    x: torch.Tensor  # (N, T) prompt + completion ids, right-padded with 0
    y: torch.Tensor  # (N, T) the completion tokens at the positions that predict them, -1 elsewhere
    advantages: torch.Tensor  # (N,)
    ref: torch.Tensor | None  # (N, T) the reference's log-probs of y (beta > 0)
    old: torch.Tensor | None  # (N, T) the sampling policy's log-probs of y (--grpo-updates > 1)
    figures: dict


class GRPO:
    """The GRPO loss of a micro-batch of prompts (`loss`), its figures (`take_metrics`), greedy evaluation."""

    def __init__(self, cfg, task, rt, reference=None):
        self.cfg, self.task, self.rt, self.reference = cfg, task, rt, reference
        self.reward = load_reward(cfg.reward)
        self.metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.evaluated: dict[str, dict[str, float]] = {}
        self.rollouts: dict[int, tuple[int, Rollout]] = {}  # micro step -> (the batch's first step, its rollout)

    @classmethod
    def load(cls, cfg, task, rt) -> GRPO:
        """The objective; the reference loaded from `cfg.reference` (frozen) when --beta > 0."""
        reference = load_reference(cfg.reference, task, rt) if cfg.beta > 0 else None
        return cls(cfg, task, rt, reference)

    def describe(self) -> str:
        cfg = self.cfg
        ref = f"beta {cfg.beta:g} to a frozen reference" if self.reference is not None else "no reference (beta 0)"
        return (
            f"objective grpo ({cfg.grpo_loss}): reward {cfg.reward}, {cfg.group_size} completions per prompt of "
            f"<= {cfg.grpo_max_new_tokens} tokens at temperature {cfg.grpo_temperature:g}, clip {cfg.epsilon:g}, "
            f"{cfg.grpo_updates} update(s) per batch, {ref}"
        )

    def _generator(self, step: int, micro: int) -> torch.Generator:
        gen = torch.Generator(device=self.rt.device)
        gen.manual_seed(hash((self.cfg.seed, step, micro)) & 0x7FFF_FFFF_FFFF)  # micro: the place in the global batch
        return gen

    @torch.no_grad()
    def rollout(self, model, batch, generator, temperature: float, group: int, scored_only=False) -> Rollout:
        """Sample `group` completions of each prompt of `batch`, score them, and lay them out for the loss
        (`scored_only`: the rewards alone, in the figures)."""
        cfg, task = self.cfg, self.task
        policy = getattr(model, "module", model)  # (DDP's wrapped module: sampling needs no gradient sync)
        policy = getattr(policy, "_orig_mod", policy)  # (--compile)
        was = policy.training
        policy.eval()
        seqs, starts, rewards, lengths = [], [], [], []
        for ids, row in zip(batch.ids, batch.rows):
            out, n = sample_group(policy, ids, group, cfg.grpo_max_new_tokens, temperature, task.stops, generator)
            for completion, k in zip(out.tolist(), n.tolist()):
                tokens = completion[:k]
                text_ids = tokens[:-1] if tokens and tokens[-1] in task.stops else tokens
                rewards.append(self.reward(task.tokenizer.decode(text_ids), row))
                seqs.append(ids + tokens)
                starts.append(len(ids))
                lengths.append(k)
        policy.train(was)
        dev = self.rt.device
        width = max(map(len, seqs)) - 1
        x = torch.zeros((len(seqs), width), dtype=torch.long)
        y = torch.full((len(seqs), width), -1, dtype=torch.long)
        for i, (s, p) in enumerate(zip(seqs, starts)):
            x[i, : len(s) - 1] = torch.tensor(s[:-1])
            y[i, p - 1 : len(s) - 1] = torch.tensor(s[p:])
        x, y = x.to(dev), y.to(dev)
        r = torch.tensor(rewards, dtype=torch.float32, device=dev)
        grouped = r.view(-1, group)
        std = grouped.std(1) if group > 1 else torch.zeros(grouped.size(0), device=dev)
        figures = {
            "reward": r.mean(),
            "reward_std": std.mean(),
            "completions/mean_length": torch.tensor(lengths, dtype=torch.float32).mean(),
            "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean(),
        }
        ref = old = None
        if scored_only:
            return Rollout(x, y, r, ref, old, figures)
        if self.reference is not None:
            with self.rt.autocast():
                ref = token_logps(self.reference(x, None)[0], y)
        if cfg.grpo_updates > 1:
            with self.rt.autocast():
                policy.eval()
                old = token_logps(policy(x, None)[0], y)
                policy.train(was)
        advantages = group_advantages(r, group) if group > 1 else torch.zeros_like(r)
        return Rollout(x, y, advantages, ref, old, figures)

    def loss(self, model, batch) -> torch.Tensor:
        """The micro-batch's GRPO loss: its completions sampled at the first of each --grpo-updates steps
        (`batch` is that step's prompts), reused by the others."""
        cfg, micro = self.cfg, batch.micro
        first = batch.step - batch.step % cfg.grpo_updates
        kept = self.rollouts.get(micro)
        if kept is None or kept[0] != first:
            gen = self._generator(first, micro)
            kept = (first, self.rollout(model, batch, gen, cfg.grpo_temperature, cfg.group_size))
            self.rollouts[micro] = kept
        ro = kept[1]
        logits, _ = model(ro.x, None)
        logps = token_logps(logits, ro.y)
        mask = ro.y != -1
        old = ro.old if ro.old is not None else logps.detach()
        loss, figures = grpo_loss(
            logps, old, ro.ref, ro.advantages, mask, cfg.epsilon, cfg.beta, cfg.grpo_loss, cfg.grpo_max_new_tokens
        )
        batch.tokens = ro.x.numel()
        for k, v in {**ro.figures, **figures}.items():
            self.metrics[k].append(v.float())
        return loss

    @torch.no_grad()
    def evaluate(self, model, batches) -> tuple[float, dict[str, float]]:
        """(minus the mean greedy reward, {"reward": it}) over the prompts of `batches` (every process's)."""
        total = torch.zeros(2, device=self.rt.device)
        for batch in batches:
            n = len(batch.ids)
            reward = self.rollout(model, batch, None, 0.0, 1, scored_only=True).figures["reward"]
            total += torch.stack([reward * n, torch.tensor(float(n), device=reward.device)])
        if self.rt.ddp:
            torch.distributed.all_reduce(total)
        reward = float(total[0] / total[1].clamp(min=1))
        return -reward, {"reward": reward}

    def take_metrics(self) -> dict[str, float]:
        """The mean of each figure since the last call (over all processes under DDP: every rank calls it)."""
        if not self.metrics:
            return {}
        names = sorted(self.metrics)
        values = torch.stack([torch.stack(self.metrics[k]).float().mean().to(self.rt.device) for k in names])
        if self.rt.ddp:
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.AVG)
        self.metrics = defaultdict(list)
        return dict(zip(names, values.tolist()))
