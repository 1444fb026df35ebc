"""How a model fits on GPUs before renting them: parameters, FLOPs per token and memory per GPU under DDP,
FSDP and activation checkpointing, and which flags fit.

    gpt plan                                  # GPT-2 124M / 350M / 774M / 1.5B on 1, 8 and 64 GPUs
    gpt plan --config gpt2_1558m --gpus 8     # one config, term by term
    gpt plan --config my.toml --gpu-memory 40 --batch-size 8

The model (vocab_size 50304 unless `--vocab-size`), micro-batch and context come from the training
config; the training runs bf16 autocast with AdamW, as on any GPU with bf16. Bytes per GPU, with P the
parameters, N the GPUs, b x T the micro-batch, L the layers, C the width, V the vocabulary:

| term        | DDP (torchrun, or one process)                     | FSDP (`--fsdp`)                                     |
|-------------|----------------------------------------------------|-----------------------------------------------------|
| weights     | 4P float32 + 2P bf16 copies autocast keeps for the backward | 4P/N shards + bf16 copies of the root (embeddings, head) and two blocks (one computing, one prefetched) |
| gradients   | 4P, plus 4P of DDP's all-reduce buckets when N > 1 | 4P/N + float32 gradients of the root and one block while they are reduce-scattered |
| optimizer   | 8P (AdamW's two moments, float32)                  | 8P/N                                                |
| activations | what autograd saves, bT(L(36C + 16 + 4H) + 6C + 4V + 16) with H heads, plus the logits' float32 gradient (4bTV) in the backward | the same |

With `--activation-checkpointing` a block keeps only its float32 input (4C per token and layer, so
bT(4LC + 6C + 4V + 16) in all) and one block's activations exist again while it is recomputed. Per
token and layer our block saves, under bf16 autocast with flash attention: float32 residual stream
and LayerNorm inputs (8C), bf16 matmul inputs (2C + 2C + 2C + 8C), q, k, v and the attention output
(8C), the GELU input (8C), LayerNorm statistics (16) and the attention's log-sum-exp (4H); the rest
is the final norm and head (6C), the log-softmax for the loss (4V) and the batch's ids and targets
(16). tests/test_plan.py checks these counts against the tensors autograd saves. What is not
counted: the CUDA context and allocator slack (hence `--reserve`, default 10% of the GPU kept free),
and torch.compile's savings (it fuses the loss and some saved tensors: GPT-2 124M compiled peaks below
this plan's eager figure; docs/distributed.md has the measurement).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gpt.errors import UserError
from gpt.model.config import GPTConfig
from gpt.model.transformer import GPT
from gpt.train.config import TrainConfig

SIZES = ("gpt2_124m", "gpt2_350m", "gpt2_774m", "gpt2_1558m")
GPUS = (1, 8, 64)
MODES = (("DDP", False, False), ("DDP + AC", False, True), ("FSDP", True, False), ("FSDP + AC", True, True))
PREFERENCE = ("DDP", "FSDP", "DDP + AC", "FSDP + AC")  # fastest first: sharding costs traffic, AC an extra forward
GiB = 2**30


class PlanError(UserError, ValueError):
    """Settings a plan cannot be made for."""


@dataclass
class Memory:
    """Bytes per GPU, by what holds them."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


@dataclass
class Shape:
    """What the estimate needs of a model and a micro-batch."""

    params: int  # unique parameters (the tied head counted once)
    block_params: int  # one decoder block's
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    batch: int  # micro-batch, sequences per GPU
    seq: int  # tokens per sequence
    flops_per_token: float

    @classmethod
    def of(cls, model_config: GPTConfig, batch: int, seq: int) -> Shape:
        with torch.device("meta"):  # shapes only: no memory, any size
            model = GPT(model_config)
        layers = model.blocks()
        return cls(
            model.num_params(non_embedding=False),
            sum(p.numel() for p in layers[-1].parameters()),
            len(layers),
            model_config.n_head,
            model_config.n_embd,
            model_config.vocab_size,
            batch,
            seq,
            model.flops_per_token(seq),
        )


def saved_activations(s: Shape, checkpointed: bool) -> float:
    """Bytes autograd keeps from the forward for the backward (the module notes' formula)."""
    per_layer = 4 * s.n_embd if checkpointed else 36 * s.n_embd + 16 + 4 * s.n_head
    return s.batch * s.seq * (s.n_layer * per_layer + 6 * s.n_embd + 4 * s.vocab_size + 16)


def activations(s: Shape, checkpointed: bool) -> float:
    """Saved activations plus the backward's largest transients: the logits' float32 gradient and, with
    checkpointing, the block being recomputed."""
    tokens = s.batch * s.seq
    extra = 4 * tokens * s.vocab_size + (tokens * (36 * s.n_embd + 16 + 4 * s.n_head) if checkpointed else 0)
    return saved_activations(s, checkpointed) + extra


def memory(s: Shape, gpus: int, fsdp: bool, checkpointed: bool) -> Memory:
    """Bytes per GPU for one of the four ways to train (see the module notes)."""
    P = s.params
    acts = activations(s, checkpointed)
    if not fsdp:
        return Memory(weights=6 * P, gradients=4 * P * (2 if gpus > 1 else 1), optimizer=8 * P, activations=acts)
    root = P - s.n_layer * s.block_params  # embeddings, final norm, tied head: gathered around the whole pass
    return Memory(
        weights=4 * P / gpus + 2 * (root + 2 * s.block_params),
        gradients=4 * P / gpus + 4 * (root + s.block_params),
        optimizer=8 * P / gpus,
        activations=acts,
    )


def plan(cfg: TrainConfig, vocab_size: int, gpus: int, gpu_memory_gb: float, reserve: float) -> dict:
    """Every way to train `cfg` on `gpus` GPUs of `gpu_memory_gb` GB: memory, whether it fits, what to use."""
    shape = Shape.of(replace(cfg.model, vocab_size=vocab_size), cfg.batch_size, cfg.model.block_size)
    budget = gpu_memory_gb * 1e9 * (1 - reserve)
    rows = {name: memory(shape, gpus, fsdp, ac) for name, fsdp, ac in MODES}
    fits = [name for name in PREFERENCE if rows[name].total <= budget]
    accum = cfg.grad_accum if cfg.grad_accum % gpus == 0 else gpus * -(-cfg.grad_accum // gpus)
    return {
        "shape": shape,
        "gpus": gpus,
        "budget": budget,
        "rows": rows,
        "use": fits[0] if fits else None,
        "grad_accum": accum,
        "tokens_per_step": accum * cfg.batch_size * cfg.model.block_size,
    }


FLAGS = {
    "DDP": "(no flag)",
    "FSDP": "--fsdp",
    "DDP + AC": "--activation-checkpointing",
    "FSDP + AC": "--fsdp --activation-checkpointing",
    None: "none: lower --batch-size, raise --grad-accum",
}


def gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def detail(name: str, p: dict) -> str:
    """One config on one GPU count: each way's memory, term by term (a Markdown table)."""
    s = p["shape"]
    lines = [
        f"{name}: {s.params / 1e6:,.0f}M parameters, {s.flops_per_token / 1e9:.2f} GFLOPs per token (training), "
        f"micro-batch {s.batch} x {s.seq} tokens, {p['gpus']} GPU(s), {gib(p['budget'])} GiB usable each",
        "",
        "| mode | weights | gradients | optimizer | activations | total GiB | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, m in p["rows"].items():
        lines.append(
            f"| {mode} | {gib(m.weights)} | {gib(m.gradients)} | {gib(m.optimizer)} | {gib(m.activations)} | "
            f"{gib(m.total)} | {'yes' if m.total <= p['budget'] else 'no'} |"
        )
    lines += [
        "",
        f"global batch: --grad-accum {p['grad_accum']} ({p['tokens_per_step']:,} tokens per step; it must be a "
        f"multiple of the GPUs)",
        f"use: {FLAGS[p['use']]}",
    ]
    return "\n".join(lines)


def summary(plans: list[tuple[str, dict]]) -> str:
    """Many configs and GPU counts, one row each: the four totals and the flags to use (a Markdown table)."""
    lines = [
        "| config | params | GFLOPs/token | micro-batch | GPUs | tokens/step | DDP | DDP + AC | FSDP | FSDP + AC "
        "| use |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in plans:
        s = p["shape"]
        totals = " | ".join(f"{gib(m.total)}" + ("" if m.total <= p["budget"] else " ✗") for m in p["rows"].values())
        lines.append(
            f"| {name} | {s.params / 1e6:,.0f}M | {s.flops_per_token / 1e9:.2f} | {s.batch} x {s.seq} | "
            f"{p['gpus']} | {p['tokens_per_step'] / 2**20:.1f}M | {totals} | {FLAGS[p['use']]} |"
        )
    return "\n".join(lines)
