"""Preference tuning: DPO against a frozen reference, or ORPO without one, on a preference dataset.

    gpt prepare --preferences pairs.jsonl --out data/prefs --tokenizer-from out/chat
    gpt train --objective dpo --init-from out/chat --data data/prefs --out-dir out/dpo --beta 0.1
    gpt train --objective orpo --init-from out/chat --data data/prefs --out-dir out/orpo --orpo-lambda 0.1
    objective = Preference.load(cfg, task, rt)       # in the trainer, after the policy is built
    loss = objective.loss(train_model, batch)        # in the step (step.train_step), per micro-batch

A batch (gpt/data/preference_batches.py) holds B chosen sequences then their B rejected ones; `y` targets
the answers' tokens, `z` every next token but the padding. From the policy's logits, the log-probability of
each answer given its prompt, summed over its tokens (log pi(y|x)); then, as TRL computes them:

- DPO (Rafailov et al. 2023): with the reference's log-probs of the same answers, the log-ratios
  c = log pi(chosen) - log ref(chosen), r = log pi(rejected) - log ref(rejected), and per pair
  `sigmoid`: -log sigmoid(beta (c - r)); `hinge`: relu(1 - beta (c - r)); `ipo`: (c / |chosen| - r / |rejected|
  - 1 / (2 beta))^2, the log-ratios per answer token (TRL's IPO). Rewards are beta c and beta r.
- ORPO (Hong et al. 2024): the answers' mean log-probs per token p_c, p_r; the log odds ratio
  (p_c - p_r) - (log(1 - e^p_c) - log(1 - e^p_r)); the loss is the cross-entropy of the chosen sequences
  (prompt and answer, all their tokens, as TRL's ORPOTrainer) minus lambda times the mean log sigmoid of it.
  Rewards are lambda p_c and lambda p_r.

The loss is the mean over the micro-batch's pairs (so the step's, over equal micro-batches, is the global
batch's mean). Logged as TRL names them, the mean over the steps since the last log line: rewards/chosen,
rewards/rejected, rewards/accuracies (the share of pairs whose chosen reward is higher), rewards/margins,
logps/chosen, logps/rejected, and for ORPO nll_loss, log_odds_ratio and log_odds_chosen. Evaluation gives
the same loss on val (and train) pairs, its figures under `val_` / `train_`.

The reference is `--reference`, or the checkpoint the run starts from (`--init-from`; recorded in the run's
config, so a resume reloads it); frozen, in eval mode, whole on every process (DDP / FSDP), its log-probs
computed for each micro-batch under no_grad; or, with --reference-cache, once for every pair before the first
step (gpt/train/reference_cache.py), the reference then freed. Its tokenizer must be the policy's: the same ids (a chat
dataset's tokens after a base's vocabulary grow it as they grow the policy).

Footguns: the reference is read again at resume from the recorded path, so replacing it in between changes
the run. Decoder-only models only, not with --pp or --tp in this version.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from gpt.checkpoints import loader
from gpt.checkpoints.native import CheckpointError
from gpt.errors import ConfigError
from gpt.train import reference_cache
from gpt.train.start import chat_growth, padded_vocab, tokenizers_match

OBJECTIVES = ("lm", "dpo", "orpo")
DPO_LOSSES = ("sigmoid", "ipo", "hinge")


def answer_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's targets, their count): logits (N, T, V), targets (N, T), -1 off."""
    n, t = targets.shape
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1, reduction="none")
    return -nll.view(n, t).sum(-1), (targets != -1).sum(-1)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def dpo_terms(policy, reference, counts, beta: float, kind: str = "sigmoid"):
    """(per-pair loss, chosen rewards, rejected rewards) from (chosen, rejected) summed log-probs of the policy
    and the reference and the answers' token counts (chosen, rejected)."""
    chosen, rejected = policy[0] - reference[0], policy[1] - reference[1]
    delta = chosen - rejected
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif kind == "hinge":
        losses = torch.relu(1 - beta * delta)
    else:
        ipo = chosen / counts[0].clamp(min=1) - rejected / counts[1].clamp(min=1)
        losses = (ipo - 1 / (2 * beta)) ** 2
    return losses, beta * chosen.detach(), beta * rejected.detach()


def orpo_terms(mean_chosen, mean_rejected, lam: float):
    """(per-pair -lambda log sigmoid(log odds ratio), chosen rewards, rejected rewards, log odds ratio) from
    the answers' mean log-probs per token."""
    log_odds = (mean_chosen - mean_rejected) - (log1mexp(mean_chosen) - log1mexp(mean_rejected))
    ratio = F.logsigmoid(log_odds)
    return -lam * ratio, lam * mean_chosen.detach(), lam * mean_rejected.detach(), log_odds.detach(), ratio.detach()


class Preference:
    """The DPO or ORPO loss of a micro-batch (`loss`), and its figures (`take_metrics`)."""

    def __init__(self, kind: str, rt, beta: float, dpo_loss: str, orpo_lambda: float, reference=None, cache=None):
        self.kind, self.rt, self.beta, self.dpo_loss, self.orpo_lambda = kind, rt, beta, dpo_loss, orpo_lambda
        self.reference, self.cache = reference, cache  # cache: (pairs, 2) the reference's log-probs, or None
        self.metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.evaluated: dict[str, dict[str, float]] = {}  # split -> its figures at the last evaluation

    @classmethod
    def load(cls, cfg, task, rt) -> Preference:
        """The objective `cfg.objective` names; DPO's reference loaded from `cfg.reference`, frozen."""
        if getattr(task, "kind", "") != "preferences":
            raise ConfigError(
                f"--objective {cfg.objective}: {cfg.data} is not a preference dataset; prepare one with "
                f"`gpt prepare --preferences FILE.jsonl --out DIR --tokenizer-from RUN`"
            )
        if cfg.objective == "orpo":
            return cls("orpo", rt, cfg.beta, cfg.dpo_loss, cfg.orpo_lambda)
        reference = load_reference(cfg.reference, task, rt)
        objective = cls("dpo", rt, cfg.beta, cfg.dpo_loss, cfg.orpo_lambda, reference)
        if cfg.reference_cache:
            objective.cache = reference_cache.load_or_compute(objective, task, cfg, rt)
        return objective

    def describe(self) -> str:
        if self.kind == "orpo":
            return f"objective orpo: lambda {self.orpo_lambda:g}, no reference model"
        if self.cache is not None:
            return f"objective dpo ({self.dpo_loss}): beta {self.beta:g}, the reference's log-probs of {len(self.cache):,} pairs cached"
        n = sum(p.numel() for p in self.reference.parameters())
        return f"objective dpo ({self.dpo_loss}): beta {self.beta:g}, a frozen {n / 1e6:.2f}M-parameter reference"

    @torch.no_grad()
    def reference_logps(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.rt.autocast():
            logits, _ = self.reference(x, None)
        return answer_logps(logits, y)[0]

    def loss(self, model, batch) -> torch.Tensor:
        """The micro-batch's mean loss over its pairs; its figures kept for `take_metrics` (under the split of
        `self.split`: "train", or the split being evaluated)."""
        x, y, z, ids = batch
        logits, _ = model(x, None)
        logps, counts = answer_logps(logits, y)
        b = x.shape[0] // 2
        keep = self.metrics
        if self.kind == "dpo":
            if self.cache is not None:
                ref = self.cache[ids.to(self.cache.device)].T.reshape(-1).to(logps.device)  # chosen, then rejected
            else:
                ref = self.reference_logps(x, y)
            losses, chosen, rejected = dpo_terms(
                logps.split(b), ref.split(b), counts.split(b), self.beta, self.dpo_loss
            )
            loss = losses.mean()
            keep["logps/chosen"].append(logps[:b].detach().mean())
            keep["logps/rejected"].append(logps[b:].detach().mean())
        else:
            means = logps / counts.clamp(min=1)
            nll = F.cross_entropy(logits[:b].flatten(0, 1).float(), z[:b].flatten(), ignore_index=-1)
            losses, chosen, rejected, log_odds, ratio = orpo_terms(means[:b], means[b:], self.orpo_lambda)
            loss = nll + losses.mean()
            keep["logps/chosen"].append(means[:b].detach().mean())
            keep["logps/rejected"].append(means[b:].detach().mean())
            keep["nll_loss"].append(nll.detach())
            keep["log_odds_ratio"].append(ratio.mean())
            keep["log_odds_chosen"].append(log_odds.mean())
        keep["rewards/chosen"].append(chosen.mean())
        keep["rewards/rejected"].append(rejected.mean())
        keep["rewards/accuracies"].append((chosen > rejected).float().mean())
        keep["rewards/margins"].append((chosen - rejected).mean())
        return loss

    @torch.no_grad()
    def evaluate(self, model, batches) -> tuple[float, dict[str, float]]:
        """(mean loss per pair, the figures) over evaluation batches; the training figures pending are kept."""
        pending, self.metrics = self.metrics, defaultdict(list)
        total, count = 0.0, 0
        try:
            for batch in batches:
                with self.rt.autocast():
                    loss = self.loss(model, batch)
                n = batch[0].shape[0] // 2
                total, count = total + float(loss) * n, count + n
            return total / max(count, 1), self.take_metrics()
        finally:
            self.metrics = pending

    def take_metrics(self) -> dict[str, float]:
        """The mean of each figure since the last call (over all processes under DDP: every rank calls it)."""
        if not self.metrics:
            return {}
        names = sorted(self.metrics)
        values = torch.stack([torch.stack(self.metrics[k]).float().mean() for k in names])
        if self.rt.ddp:
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.AVG)
        self.metrics = defaultdict(list)
        return dict(zip(names, values.tolist()))


def load_reference(path: str, task, rt):
    """The frozen reference model at `path` on the run's device, in eval mode without gradients, its weights
    in the run's compute dtype; refused in one line unless its tokenizer is the dataset's (or the base a chat
    template's tokens were added to, which grow it as they grow the policy)."""
    try:
        model, meta = loader.load_model(path, device=rt.device)
    except CheckpointError as e:
        raise ConfigError(f"--reference: {e}") from None
    spec = meta["tokenizer"]
    fresh = chat_growth(spec, task)
    if not tokenizers_match(spec, task.tokenizer_spec) and fresh is None:
        raise ConfigError(
            f"--reference {path}: its {spec.get('kind')!r} tokenizer is not the one of the data and the policy "
            f"({task.tokenizer_spec.get('kind')!r}): the reference must share the policy's tokenizer (the same ids)"
        )
    if model.config.n_encoder_layer:
        raise ConfigError(f"--reference {path}: decoder-only models only, not seq2seq")
    if fresh is not None:
        model.grow_vocab(padded_vocab(task), fresh)
    model.requires_grad_(False)
    if rt.dtype != torch.float32:
        model.to(rt.dtype)
    return model.eval()
