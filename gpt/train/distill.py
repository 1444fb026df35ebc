"""Knowledge distillation: the student learns the teacher's distribution as well as the data's next tokens.

    gpt train --data data/shakespeare_char --out-dir out/small --distill-from out/big \\
        --distill-alpha 0.5 --distill-temperature 2
    teacher = Teacher.load(cfg, task, rt, student_vocab=128)   # --distill-from: frozen, eval, inference precision
    loss = teacher.mix(logits, loss, batch)                     # in the step (step.train_step), per micro-batch

Each micro-batch's loss is `alpha * T^2 * KL(teacher || student)` at temperature T (both softmaxes of the
logits / T) plus `(1 - alpha) *` the usual loss. The KL is the mean over the positions whose target is not
-1 (a chat dataset's prompts and padding, as the usual loss), summed over the real vocabulary: the dataset's
`vocab_size` ids, not the rows either model pads its embedding with (50257 of 50304). T^2 keeps the KL's
gradients the size of the usual loss's at any T (Hinton et al. 2015). The teacher's logits are computed
here for each micro-batch, under no_grad: no files of them, and under DDP / FSDP each process computes its
own micro-batches' (the teacher is whole on every process).

The teacher is any checkpoint `gpt/checkpoints/loader.py` reads (a run directory, `.pt`, DCP directory,
Hugging Face directory, LoRA adapters merged onto their base); its tokenizer must be the dataset's.

Footguns: the teacher draws no random numbers (eval mode: no dropout), so a resumed distillation run
continues exactly; but the teacher is read again at resume from the path the run recorded, so replacing
it in between changes the run. The logged train loss is the mixed loss; evaluation stays the plain
cross-entropy (val loss and bits per byte compare with runs trained alone). Decoder-only models only: not
seq2seq, and not with --pp or --tp in this version.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpt.checkpoints import loader
from gpt.checkpoints.native import CheckpointError
from gpt.errors import ConfigError
from gpt.train.start import tokenizers_match


def kl_term(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, vocab: int, temperature: float):
    """T^2 * KL(teacher || student) at temperature T, summed over the first `vocab` ids and averaged over
    the positions whose target is not -1 (0 where there are none). Logits (B, T, V), targets (B, T)."""
    keep = targets.reshape(-1) != -1
    s = student[..., :vocab].reshape(-1, vocab)[keep].float() / temperature
    t = teacher[..., :vocab].reshape(-1, vocab)[keep].float() / temperature
    log_s, log_t = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    return kl.sum() / keep.sum().clamp(min=1) * temperature**2


class Teacher:
    """A frozen model whose logits a student learns from (`mix`)."""

    def __init__(self, model: torch.nn.Module, vocab: int, rt, alpha: float, temperature: float):
        self.model, self.vocab, self.rt, self.alpha, self.temperature = model, vocab, rt, alpha, temperature

    @classmethod
    def load(cls, cfg, task, rt, student_vocab: int) -> Teacher:
        """The teacher `cfg.distill_from` names, on the run's device, in eval mode without gradients, its
        weights in the run's compute dtype; refused in one line unless its tokenizer is the dataset's and it
        is decoder-only."""
        path, data = cfg.distill_from, cfg.data
        try:
            model, meta = loader.load_model(path, device=rt.device)
        except CheckpointError as e:  # (no checkpoint there: the message names the flag)
            raise ConfigError(f"--distill-from: {e}") from None
        spec = meta["tokenizer"]
        if not tokenizers_match(spec, task.tokenizer_spec):
            raise ConfigError(
                f"--distill-from {path}: the teacher was trained with a {spec.get('kind')!r} tokenizer different "
                f"from the student's, of {data} ({task.tokenizer_spec.get('kind')!r}): the teacher and the student "
                f"must share one tokenizer (the same token ids)"
            )
        if model.config.n_encoder_layer or getattr(task, "kind", "") == "pairs":
            raise ConfigError(f"--distill-from {path}: decoder-only models only, not seq2seq, in this version")
        vocab = task.vocab_size
        if min(model.config.vocab_size, student_vocab) < vocab:  # (cannot happen with matching tokenizers)
            raise ConfigError(
                f"--distill-from {path}: the teacher's vocabulary ({model.config.vocab_size}) or the student's "
                f"({student_vocab}) is smaller than the dataset's {vocab} ids"
            )
        model.requires_grad_(False)
        if rt.dtype != torch.float32:  # the inference precision: weights in the compute dtype, no master copy
            model.to(rt.dtype)
        return cls(model.eval(), vocab, rt, cfg.distill_alpha, cfg.distill_temperature)

    def describe(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        return f"distilling from a {n / 1e6:.2f}M-parameter teacher: alpha {self.alpha:g}, temperature {self.temperature:g}"

    @torch.no_grad()
    def logits(self, batch) -> torch.Tensor:
        """The teacher's logits for a micro-batch, `GPT.forward`'s positional args (idx, targets, ...)."""
        with self.rt.autocast():
            logits, _ = self.model(batch[0], None, *batch[2:])
        return logits

    def mix(self, logits: torch.Tensor, loss: torch.Tensor, batch) -> torch.Tensor:
        """alpha * T^2 * KL(teacher || student) + (1 - alpha) * loss, on this micro-batch."""
        if self.alpha == 0:  # exactly the usual loss (no teacher forward)
            return loss
        kl = kl_term(logits, self.logits(batch), batch[1], self.vocab, self.temperature)
        return self.alpha * kl + (1 - self.alpha) * loss
