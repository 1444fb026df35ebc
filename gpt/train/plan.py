"""How a model fits on GPUs before renting them: parameters, FLOPs per token and memory per GPU under DDP,
FSDP and activation checkpointing, and which flags fit.

    gpt plan                                  # GPT-2 124M / 350M / 774M / 1.5B on 1, 8 and 64 GPUs
    gpt plan --config gpt2_1558m --gpus 8     # one config, term by term
    gpt plan --config my.toml --gpu-memory 40 --batch-size 8
    gpt plan --config gpt2_774m --gpus 8 --gpu-memory 24  # + the pp x dp x tp layouts that fit, the first to use

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

Tensor and pipeline parallelism (`layouts`, `layout_memory`; gpt/train/mesh.py lays out the processes):
--tp T divides each block's matrices, the vocabulary (embedding, head, logits) and the activations between
a column-wise and a row-wise product (26C of the 36C above) by T; --pp S gives the fullest stage
ceil(L / S) blocks and the root, and keeps in flight on the first stage every micro-batch (GPipe) or S
of them (1F1B, interleaved); the last stage holds one with the head's log-softmax and logits' gradient.
The bubble, the share of a step a pipeline waits, is (S - 1) / (m + S - 1) with m micro-batches per
replica, (S - 1) / (2m + S - 1) interleaved. Layouts are ordered by what they cost in speed: checkpointing
last, then the fewest model-parallel ways, TP (within a node, at most 8) before PP, FSDP before either.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gpt.errors import UserError
from gpt.model.config import GPTConfig
from gpt.model.transformer import GPT
from gpt.train import pipeline
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


def memory(s: Shape, gpus: int, fsdp: bool, checkpointed: bool) -> Memory:
    """Bytes per GPU for one of the four ways to train with data parallelism alone (see the module notes)."""
    return layout_memory(s, 1, gpus, 1, fsdp, checkpointed, 1)


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


MAX_TP = 8  # tensor parallelism talks at every layer: within one node's GPUs (NVLink), 8 at most


@dataclass
class Layout:
    """One way to lay the model over the GPUs (gpt/train/mesh.py): pipeline stages x data replicas x tensor
    shards, FSDP over the replicas or not, activation checkpointing or not; its memory on the fullest GPU and
    its pipeline bubble (the share of a step the GPUs of a pipeline wait)."""

    pp: int
    dp: int
    tp: int
    fsdp: bool
    checkpointed: bool
    memory: Memory
    bubble: float

    def flags(self) -> str:
        out = [f"--tp {self.tp}"] if self.tp > 1 else []
        out += [f"--pp {self.pp}"] if self.pp > 1 else []
        out += ["--fsdp"] if self.fsdp else []
        out += ["--activation-checkpointing"] if self.checkpointed else []
        return " ".join(out) or "(no flag)"


def layout_memory(
    s: Shape, pp: int, dp: int, tp: int, fsdp: bool, checkpointed: bool, micro_batches: int, schedule: str = "1f1b"
) -> Memory:
    """Bytes on the fullest GPU of a pp x dp x tp layout (the module notes' terms, split as the layout splits
    them). Tensor parallelism divides each block's matrices and the vocabulary (embedding and head) by tp, and
    the activations that live between a column-wise and a row-wise product (q, k, v, the attention output, the
    MLP's hidden layer and GELU: 26C of the block's 36C per token) and the logits; the residual stream and the
    norms' inputs stay whole on every shard. Pipeline parallelism gives a stage n_layer / pp blocks; the first
    stage also holds the embeddings and the last a copy of the tied head, so the fullest holds the blocks and
    the root once. In flight on the first stage: `pipeline.in_flight`'s count (GPipe every micro-batch,
    1F1B pp of them). `pipeline.stage_memory` (`gpt plan --pp`) details each process of one pipeline."""
    blocks = -(-s.n_layer // pp)
    root = s.params - s.n_layer * s.block_params
    P = (blocks * s.block_params + root) / tp  # the stage's parameters on one shard
    if not fsdp:
        weights, gradients, optimizer = 6 * P, 4 * P * (2 if dp > 1 else 1), 8 * P
    else:
        gathered = root / tp + 2 * s.block_params / tp
        weights, gradients, optimizer = 4 * P / dp + 2 * gathered, 4 * P / dp + 4 * gathered, 8 * P / dp
    tokens = s.batch * s.seq
    layer = 10 * s.n_embd + 26 * s.n_embd / tp + 16 + 4 * s.n_head / tp  # one block's saved bytes per token
    kept = tokens * blocks * (4 * s.n_embd if checkpointed else layer)  # a micro-batch through one stage
    head = tokens * (6 * s.n_embd + 4 * s.vocab_size / tp + 16) + 4 * tokens * s.vocab_size / tp  # + logits' grad
    recompute = tokens * layer if checkpointed else 0
    chunks = 2 if schedule == "interleaved" else 1  # interleaved: in flight per chunk of half the stage's layers
    in_flight = 1 if pp == 1 else pipeline.in_flight(pp, 0, micro_batches, schedule) / chunks
    first = kept * in_flight + (head if pp == 1 else 16 * tokens * in_flight)  # the first stage (all, if pp = 1)
    last = kept + head  # the last stage: its micro-batch's backward starts at once
    return Memory(weights, gradients, optimizer, max(first, last) + recompute)


def layouts(
    cfg: TrainConfig, vocab_size: int, gpus: int, gpu_memory_gb: float, reserve: float, schedule: str = "1f1b"
) -> list[Layout]:
    """Every layout of `cfg` on `gpus` GPUs that fits, the one to use first: tensor shards that divide the
    heads (at most MAX_TP), stages no more than the layers, the rest data parallel; ordered by what each costs
    in speed: activation checkpointing (a forward again) last, then the fewest model-parallel ways (TP talks at
    every layer, PP waits in its bubble), FSDP (gathers each step) before those, TP before PP (no bubble)."""
    shape = Shape.of(replace(cfg.model, vocab_size=vocab_size), cfg.batch_size, cfg.model.block_size)
    budget = gpu_memory_gb * 1e9 * (1 - reserve)
    found = []
    for tp in (n for n in range(1, min(gpus, MAX_TP) + 1) if gpus % n == 0 and shape.n_head % n == 0):
        for pp in (n for n in range(1, min(gpus // tp, shape.n_layer) + 1) if gpus // tp % n == 0):
            dp = gpus // (tp * pp)
            micro = max(1, -(-cfg.grad_accum // dp))  # each replica's share of the step's micro-batches
            for fsdp in (False, True):
                for checkpointed in (False, True):
                    m = layout_memory(shape, pp, dp, tp, fsdp, checkpointed, micro, schedule)
                    if m.total <= budget:
                        found.append(Layout(pp, dp, tp, fsdp, checkpointed, m, pipeline.bubble(pp, micro, schedule)))
    return sorted(found, key=lambda x: (x.checkpointed, x.tp * x.pp, x.pp, x.fsdp))


def layout_table(name: str, found: list[Layout], gpus: int, top: int = 5) -> str:
    """The first `top` layouts that fit, as a Markdown table (the first is the one to use)."""
    if not found:
        return f"{name} on {gpus} GPU(s): no layout fits; lower --batch-size, raise --grad-accum, or add GPUs"
    lines = [
        f"{name} on {gpus} GPU(s): layouts that fit, the first to use (GiB on the fullest GPU)",
        "",
        "| pp x dp x tp | FSDP | AC | weights | gradients | optimizer | activations | total | bubble | flags |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in found[:top]:  # (the first is the one to use)
        m = x.memory
        lines.append(
            f"| {x.pp} x {x.dp} x {x.tp} | {'yes' if x.fsdp else 'no'} | {'yes' if x.checkpointed else 'no'} | "
            f"{gib(m.weights)} | {gib(m.gradients)} | {gib(m.optimizer)} | {gib(m.activations)} | {gib(m.total)} | "
            f"{x.bubble:.0%} | {x.flags()} |"
        )
    return "\n".join([*lines, "", f"use: {found[0].flags()}"])


def stage_memory(shape, pp: int, micro_batches: int, schedule: str, checkpointed: bool = False) -> list:
    """Bytes on each process of a pipeline (a `Memory` per process) for a `Shape`
    (its batch the micro-batch): its stages' float32 weights with autocast's bf16 copies, gradients and AdamW
    moments (the plan's DDP terms for its share: no buckets, gradients are averaged in place), and the
    activations of the micro-batches in flight. The first process adds the embeddings and the ids, the last
    the final norm, the head's copy of the embedding, the loss's log-softmax and the logits' gradient."""
    s, n_stages = shape, pp * (2 if schedule == "interleaved" else 1)
    runs = pipeline.split(s.n_layer, n_stages)
    tokens, C, V = s.batch * s.seq, s.n_embd, s.vocab_size
    per_layer = 4 * C if checkpointed else 36 * C + 16 + 4 * s.n_head
    out = []
    for rank in range(pp):
        mine = [st for st in range(n_stages) if st % pp == rank]
        layers = sum(len(runs[st]) for st in mine)
        params = layers * s.block_params
        acts = per_layer * layers / len(mine)  # one chunk's, per token
        if 0 in mine:
            params += V * C + s.seq * C  # wte, wpe (learned positions: the plan's GPT-2 configs)
            acts += 16 / len(mine)
        if n_stages - 1 in mine:
            params += 2 * C + (V * C if 0 not in mine else 0)  # ln_f, the head's copy of wte
        held = pipeline.in_flight(pp, rank, micro_batches, schedule) * tokens * acts
        if n_stages - 1 in mine:  # the head's saved tensors: of every micro-batch under GPipe, else of one
            held += (micro_batches if schedule == "gpipe" else 1) * tokens * (6 * C + 4 * V) + 4 * tokens * V
        if checkpointed:  # one block computing again in the backward
            held += tokens * (36 * C + 16 + 4 * s.n_head)
        out.append(Memory(weights=6 * params, gradients=4 * params, optimizer=8 * params, activations=held))
    return out


def plan_lines(shape, gpus: int, pp: int, grad_accum: int, schedule: str, budget: float) -> list[str]:
    """`gpt plan --pp N`: each pipeline process's memory (GiB, term by term) and the bubble, as Markdown lines."""
    if gpus % pp or pp > shape.n_layer:
        return [f"--pp {pp}: needs a number of GPUs it divides and at most {shape.n_layer} stages"]
    dp = gpus // pp
    micro = max(grad_accum // dp, pp)
    lines = [
        "",
        f"pipeline --pp {pp} --pp-schedule {schedule}: {pp} stages x {dp} data replica(s), {micro} micro-batches "
        f"per replica and step, bubble {pipeline.bubble(pp, micro, schedule):.0%} of each step",
        "",
        "| pipeline process | weights | gradients | optimizer | activations | total GiB | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for rank, m in enumerate(stage_memory(shape, pp, micro, schedule)):
        lines.append(
            f"| {rank} | {gib(m.weights)} | {gib(m.gradients)} | {gib(m.optimizer)} | {gib(m.activations)} | "
            f"{gib(m.total)} | {'yes' if m.total <= budget else 'no'} |"
        )
    return lines


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
        f"data parallel alone: {FLAGS[p['use']]}",
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
