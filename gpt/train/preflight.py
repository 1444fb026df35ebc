"""Preflight: what a run will cost, said before step 1, and `--batch-size auto` on CUDA.

    for line in report(model, cfg, rt, accum, world_size): print(line)   # parameters, tokens/step, memory
    eta_line(step_seconds, steps_done, steps_left, limit, now)            # after the first few steps
    find_batch_size(fits, upper)                                          # the largest micro-batch that fits

The memory estimate is per process, in bytes:

| part        | estimate                                                                               |
|-------------|----------------------------------------------------------------------------------------|
| weights     | every parameter and buffer at its dtype                                                |
| gradients   | the trained parameters at their dtype (LoRA: the adapters only)                        |
| optimizer   | AdamW's two moments, 2 x the trained parameters in float32 (Muon's matrices: one)      |
| activations | per token and layer ~18 x n_embd values kept for backward (LayerNorm inputs / outputs,  |
|             | q, k, v, attention output, the 4 x n_embd MLP hidden twice), 2 bytes under autocast,   |
|             | 4 in float32, plus 1 byte per dropout mask; the logits (B, T, vocab): LOGIT_BYTES each  |
|             | (them, their float32 copy, the log-softmax, the gradients). Flash / memory-efficient   |
|             | attention keeps no T x T scores. Seq2seq: --max-tokens per side, the most a batch holds |
| runtime     | CPU only: what the process held before the model (torch's libraries, the data), so the  |
|             | sum is comparable with the RSS                                                         |
| allocator   | CPU only: half the activations, the free memory glibc keeps between steps (freed blocks |
|             | that steps of other shapes do not fit; measured, below)                                |

On a CPU the run holds its resident set under the estimate plus `resident_limit`'s slack (another half of
the activations) by trimming glibc's free memory past it (gpt.runtime.FreeMemoryCap); the preflight line
says that limit. What is in use stays under the estimate: a multi30k_cpu step (bf16, 3,072 tokens of pairs)
used ~0.5 GiB of malloc'd memory above the process's start for an activation estimate of 0.87 GiB; the rest
of the resident set is the allocator's free memory, which batches of varying shapes fragment, hence the
`allocator` term (bench/results/m30k_memory.json: 13-minute runs on a busy machine, before and after the
limit and --pad-to; bench/results/m30k-memory.json: a quiet run against this estimate). Each trim's memory
is faulted back in by the steps after it, so the limit is a ceiling, not a target. A step's peak can pass
the limit before the trim after it; on CUDA the log lines show the measured peak (`mem`) next to the estimate.

`--batch-size auto` (CUDA only) tries micro-batches on the real model, a forward and backward pass
each with the optimizer's memory held aside, under a 90% cap of the GPU's memory (headroom for
fragmentation and evaluation): doubling until one does not fit, then bisecting. `plan_batch` then picks
the micro-batch and `--grad-accum` that keep `--global-batch`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gpt.errors import ConfigError
from gpt.progress import format_duration
from gpt.runtime import resident_bytes

PREFLIGHT_STEPS = 5  # steps measured before the first ETA is said (the first one pays for warm-up)
MEMORY_CAP = 0.9  # share of the GPU's memory a probed micro-batch may use
# bytes per logit in a training step: the logits, their float32 copy, the log-softmax and the gradients;
# measured on a CPU as the peak's growth with the vocabulary (8192 -> 16384, 3,072 tokens): 30 / 38
LOGIT_BYTES = {True: 30, False: 38}  # autocast (bf16 / fp16), float32


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _unique_tensors(model: torch.nn.Module):
    seen = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def memory_estimate(
    model: torch.nn.Module, micro_batch: int, seq_len: int, autocast: bool, optimizer: str = "adamw"
) -> dict[str, int]:
    """Bytes per process by part (see the module table), for micro-batches of `micro_batch` x `seq_len`."""
    tensors = list(_unique_tensors(model))
    trained = [t for t in tensors if isinstance(t, torch.nn.Parameter) and t.requires_grad]
    groups = model.param_groups(0.0, muon=optimizer == "muon")
    one_buffer = sum(p.numel() for g in groups if g.get("muon") for p in g["params"])  # Muon's momentum only
    cfg = model.config
    tokens = micro_batch * seq_len
    act = 2 if autocast else 4
    masks = 2 if cfg.dropout > 0 else 0  # attention and MLP residual dropout masks, a byte each
    layers = cfg.n_layer + cfg.n_encoder_layer
    return {
        "weights": sum(t.numel() * t.element_size() for t in tensors),
        "gradients": sum(t.numel() * t.element_size() for t in trained),
        "optimizer": sum(2 * t.numel() * 4 for t in trained) - 4 * one_buffer,
        "activations": layers * tokens * (18 * cfg.n_embd * act + masks * cfg.n_embd)
        + tokens * cfg.vocab_size * LOGIT_BYTES[autocast],
    }


def _pairs_tokens(model: torch.nn.Module, cfg) -> int | None:
    """A seq2seq run's most tokens per side of a micro-batch (None: not seq2seq)."""
    return cfg.max_tokens or cfg.batch_size * cfg.model.block_size if model.config.n_encoder_layer else None


def run_estimate(model: torch.nn.Module, cfg, rt) -> dict[str, int]:
    """`memory_estimate` for this run's micro-batches, with the CPU's `runtime` part (see the module table)."""
    micro = _pairs_tokens(model, cfg)
    batch, seq = (1, micro) if micro else (cfg.batch_size, cfg.model.block_size)  # pairs: --max-tokens a side
    mem = memory_estimate(model, batch, seq, autocast=rt.dtype != torch.float32, optimizer=cfg.optimizer)
    resident = resident_bytes() if rt.device.type == "cpu" else None
    if resident is not None:  # the weights are already in it
        mem["runtime"] = max(resident - mem["weights"], 0)
        mem["allocator"] = mem["activations"] // 2  # the free memory glibc holds between steps (module notes)
    return mem


MIN_SLACK = 256 << 20  # the allocator's free memory a CPU run may hold at least (small models' steps vary more)


def resident_limit(mem: dict[str, int]) -> tuple[int, int]:
    """(limit, slack): the resident set a CPU run is held under (gpt.runtime.FreeMemoryCap), the estimate
    plus `slack` for the allocator's free memory: half a step's activations, at least MIN_SLACK."""
    slack = max(mem["activations"] // 2, MIN_SLACK)
    return sum(mem.values()) + slack, slack


def report(model: torch.nn.Module, cfg, rt, accum: int) -> list[str]:
    """The preflight lines: parameters (trained and frozen), tokens per step, estimated memory. `rt`: the
    data-parallel view of the run (its world the data replicas: the processes of one pipeline or tensor
    group share a batch)."""
    total = sum(t.numel() for t in _unique_tensors(model) if isinstance(t, torch.nn.Parameter))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    micro = _pairs_tokens(model, cfg)
    replicas = rt.world_size
    by = "data replicas" if cfg.tp * cfg.pp > 1 else "processes"
    tokens = (micro or cfg.batch_size * cfg.model.block_size) * accum * replicas
    shape = f"<= {micro:,} tokens of pairs" if micro else f"{cfg.batch_size} x {cfg.model.block_size}"
    mem = run_estimate(model, cfg, rt)
    frozen = f", {total - trained:,} frozen" if trained < total else ""
    return [
        f"preflight: {total:,} parameters, {trained:,} trained ({trained / max(total, 1):.2%}){frozen}",
        f"preflight: {'up to ' if micro else ''}{tokens:,} tokens per step ({shape} x {accum} micro-batches"
        f"{f' x {replicas} {by}' if replicas > 1 else ''}); {cfg.max_iters:,} steps = "
        f"{tokens * cfg.max_iters:,} tokens",
        "preflight: estimated memory per process "
        + " + ".join(f"{k} {gib(v)}" for k, v in mem.items())
        + f" = {gib(sum(mem.values()))}"
        + (
            f"; held under {gib(resident_limit(mem)[0])} resident (free memory past it is trimmed)"
            if "runtime" in mem
            else ""
        ),
    ]


def eta_line(step_seconds: float, steps_done: int, steps_left: int, limit=None, now: float = 0.0) -> str:
    """The run's time to go, from the measured step time: to the last step, or to the --max-minutes
    `limit` (a gpt.stopping.TimeLimit) when that comes first."""
    measured = f"preflight: measured {step_seconds * 1e3:.0f} ms/step over {steps_done} steps: "
    ahead = limit.ahead(now, step_seconds, steps_left) if limit is not None else None
    if ahead is None:
        return measured + f"the remaining {steps_left:,} steps take about {format_duration(step_seconds * steps_left)}"
    seconds, steps = ahead
    return (
        measured + f"the run stops at the {limit.minutes:g}-minute limit (--max-minutes) in about "
        f"{format_duration(seconds)}, after about {steps:,} of the {steps_left:,} steps left to --max-iters"
    )


# ---- --batch-size auto -----------------------------------------------------------------------------


def find_batch_size(fits: Callable[[int], bool], upper: int) -> int:
    """The largest micro-batch in [1, upper] for which `fits(b)` holds, assuming that fitting is monotone:
    doubling from 1, then bisecting between the last that fitted and the first that did not."""
    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None and good < upper:
        trial = min(2 * good, upper)
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def plan_batch(global_batch: int, largest: int, world_size: int = 1) -> tuple[int, int]:
    """(micro-batch, --grad-accum over all processes) for `global_batch` sequences per step, micro-batches
    of at most `largest`: the largest micro-batch that divides each process's share exactly, unless that
    costs more than half of `largest`; then `largest` itself and a global batch rounded up."""
    share = math.ceil(global_batch / world_size)
    largest = max(1, min(largest, share))
    divisor = max(b for b in range(1, largest + 1) if share % b == 0)
    micro = divisor if 2 * divisor >= largest else largest
    return micro, math.ceil(share / micro) * world_size


def auto_batch_size(model: torch.nn.Module, cfg, rt, log) -> tuple[int, int]:
    """--batch-size auto: probe the largest micro-batch that fits on this GPU; returns the (batch_size,
    grad_accum) that keep cfg.global_batch (every process agrees on the smallest)."""
    if rt.device.type != "cuda":
        raise ConfigError(
            f"--batch-size auto: measures GPU memory, CUDA only (this run is on {rt.device}); give a "
            f"number, e.g. --batch-size 12"
        )
    if model.config.n_encoder_layer:
        raise ConfigError("--batch-size auto: not for seq2seq (pairs batches are sized by --max-tokens)")
    optimizer_bytes = memory_estimate(model, 1, cfg.model.block_size, False, cfg.optimizer)["optimizer"]
    torch.cuda.set_per_process_memory_fraction(MEMORY_CAP, rt.device)
    try:
        largest = find_batch_size(
            lambda b: _fits(model, b, cfg.model.block_size, optimizer_bytes, rt),
            math.ceil(cfg.global_batch / rt.world_size),
        )
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, rt.device)
    if rt.ddp:
        agreed = torch.tensor([largest], device=rt.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        largest = int(agreed.item())
    if largest == 0:
        raise ConfigError(
            f"--batch-size auto: not even one sequence of {cfg.model.block_size} tokens fits on {rt.device}; "
            f"use a smaller --block-size or model"
        )
    batch_size, grad_accum = plan_batch(cfg.global_batch, largest, rt.world_size)
    kept = batch_size * grad_accum
    log(
        f"batch size auto: micro-batches of up to {largest} fit in {MEMORY_CAP:.0%} of {rt.device}'s memory; "
        f"--batch-size {batch_size} --grad-accum {grad_accum} = {kept} sequences per step"
        + ("" if kept == cfg.global_batch else f" (asked for {cfg.global_batch})")
    )
    return batch_size, grad_accum


def _fits(model: torch.nn.Module, batch: int, seq_len: int, optimizer_bytes: int, rt) -> bool:
    """One forward and backward pass of `batch` x `seq_len` random tokens, the optimizer's memory held."""
    held = x = loss = None
    try:
        held = torch.empty(optimizer_bytes, dtype=torch.uint8, device=rt.device)
        x = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=rt.device)
        with rt.autocast():
            _, loss = model(x, x)
        loss.backward()
        torch.cuda.synchronize(rt.device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        del held, x, loss
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
