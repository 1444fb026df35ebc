"""Sizing a run from one number, as nanochat does from `--depth`: the whole training configuration for a
prepared corpus and a time budget on this machine, with the reasoning behind each choice.

    gpt plan --depth 4 --data data/shakespeare_char --minutes 10
    gpt plan --params 10M --data data/wikitext --minutes 60 --out-dir out/wikitext

The rules (nanochat's scripts/base_train.py and GPT.setup_optimizer, re-anchored on a run measured here):

| choice          | rule                                                                                     |
|-----------------|------------------------------------------------------------------------------------------|
| width, heads    | n_embd = depth x aspect ratio (64), rounded up to a multiple of the head size (64); heads = n_embd / head size |
| `--params P`    | the depth whose model (the corpus's vocabulary, learned positions) is nearest P, in ratio |
| block size      | the width as a power of two in [64, 1024]: attention's 12·L·T·C FLOPs per token stay ~1/6 of the blocks' 72·L·C² |
| token budget D  | the measured training tokens/s x the minutes, less OVERHEAD_SHARE for evaluations and checkpoints |
| batch (tokens)  | B = B_ref x (D / D_ref)^0.383 (Power Lines, Bopt ∝ D^0.383), a power of two, >= one sequence, <= D / MIN_STEPS |
| AdamW LR        | lr_ref x (n_embd / n_embd_ref)^-0.5 x (B / B_ref)^0.5 (embeddings, head, norms)           |
| Muon LR         | muon_lr_ref x (B / B_ref)^0.5: Muon's orthogonalised update needs no width correction       |
| weight decay    | wd_ref x (B / B_ref)^0.5 x (D_ref / D) (keeps B / (lr·wd·D) constant: T_epoch), at most wd_ref |
| schedule        | the reference's: cosine, warmup and final LR as the same shares of the run                |
| evaluations     | EVALS (4), the last at the end, of as many batches (<= 20) as fit in OVERHEAD_SHARE (10%) |

The reference (`_ref`) is the shipped `shakespeare_char_cpu` config, the main job measured on this
project's CPUs (width 128, 24 x 64 = 1,536 tokens a step, 400 steps = 614,400 tokens, AdamW 6e-3,
Muon 0.05, weight decay 0.1), where nanochat's is its d12 at 2^19 tokens a step: our runs are CPU-sized,
so the laws are kept and the anchor moved to a run that is known to train well here.

The throughput is measured, not estimated: a few optimizer steps of the proposed model on random ids,
on the device and precision train.py would pick, the median of three after one warm-up step
(`measure_throughput`), at the largest micro-batch the plan allows and again at the one it chose. On a
machine shared with other work the figure moves with the load: plan on a quiet machine. The command
has no `--max-minutes`: train.py's time limit estimates the final evaluation from the first (warm-up)
step's speed, and stopped a 1-minute plan at step 1; the steps themselves are the budget.
"""

from __future__ import annotations

import math
import re
import shlex
import statistics
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import torch

from gpt import runtime
from gpt.data.format import read_meta
from gpt.errors import UserError
from gpt.model.config import GPTConfig
from gpt.model.transformer import GPT
from gpt.train.config import TrainConfig
from gpt.train.flags import build_config
from gpt.train.preflight import plan_batch
from gpt.train.start import padded_vocab
from gpt.train.step import make_optimizer, train_step

REFERENCE = "shakespeare_char_cpu"
ASPECT_RATIO = 64  # nanochat's n_embd / n_layer
HEAD_DIM = 64  # GPT-2's head size (nanochat's 128 suits its d20+ GPU models; at depth 2-8 it leaves 1-4 heads)
BATCH_EXPONENT = 0.383  # Power Lines (arXiv 2505.13738): the best batch grows as D^0.383
OVERHEAD_SHARE = 0.1  # of the minutes kept for evaluations, checkpoints and start-up
MIN_STEPS = 100  # the batch shrinks before the run drops below this many optimizer steps
MEASURE_TOKENS = 4096  # tokens per timed micro-batch
MEASURE_STEPS = 3  # timed steps after one warm-up step (their median)
MAX_DEPTH = 64
EVALS = 4  # evaluations in a run


class SizingError(UserError, ValueError):
    """Settings a run cannot be sized from."""


def width_for(depth: int, aspect_ratio: int = ASPECT_RATIO, head_dim: int = HEAD_DIM) -> tuple[int, int]:
    """(n_embd, n_head) for `depth` blocks: depth x aspect_ratio rounded up to a whole number of heads."""
    n_embd = -(-depth * aspect_ratio // head_dim) * head_dim
    return n_embd, n_embd // head_dim


def block_for(n_embd: int) -> int:
    """The context for a width: n_embd as a power of two, within [64, 1024] (see the module table)."""
    return min(1024, max(64, 2 ** round(math.log2(n_embd))))


def parse_count(text: str) -> int:
    """`10M`, `1.5B`, `800k` or `250000` as a number of parameters."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMbB]?)\s*", text)
    if not m or float(m[1]) <= 0:
        raise SizingError(f"--params: expected a positive count such as 10M, 1.5B or 800k, got {text!r}")
    return int(float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[m[2].lower()])


def model_for(
    depth: int, vocab_size: int, aspect_ratio: int = ASPECT_RATIO, head_dim: int = HEAD_DIM, block_size: int = 0
) -> GPTConfig:
    """The model of `depth` blocks: the reference's kind of block at the width and context of the rules."""
    n_embd, n_head = width_for(depth, aspect_ratio, head_dim)
    return replace(
        reference().model,
        n_layer=depth,
        n_embd=n_embd,
        n_head=n_head,
        block_size=block_size or block_for(n_embd),
        vocab_size=vocab_size,
    )


def count_params(model_config: GPTConfig) -> int:
    with torch.device("meta"):  # shapes only: no memory, any size
        return GPT(model_config).num_params(non_embedding=False)


def depth_for_params(params: int, vocab_size: int, **shape) -> int:
    """The depth whose model is nearest `params` parameters, in ratio (depths 1 to MAX_DEPTH; the count grows
    with the depth, so the search stops at the first model over twice `params`)."""
    counts = {}
    for d in range(1, MAX_DEPTH + 1):
        counts[d] = count_params(model_for(d, vocab_size, **shape))
        if counts[d] > 2 * params:
            break
    if params < counts[1] / 2:
        raise SizingError(
            f"--params: {params:,} is less than half of the smallest model for this corpus (depth 1: "
            f"{counts[1]:,} parameters, most of them the {vocab_size:,}-token embedding); ask for more"
        )
    return min(counts, key=lambda d: abs(math.log(counts[d] / params)))


def round3(x: float) -> float:
    """Three significant figures: what the printed command says is what the proposal holds."""
    return float(f"{x:.3g}")


def reference() -> TrainConfig:
    return build_config(["--config", REFERENCE])


def measure_throughput(cfg: TrainConfig, micro_batch: int, device: str = "auto", steps: int = MEASURE_STEPS) -> float:
    """Training tokens per second of `cfg`'s model and optimizer at `micro_batch` sequences, measured:
    the median of `steps` optimizer steps on random ids after one warm-up step, on the device train.py would use."""
    rt = runtime.setup(device=device, dtype=cfg.dtype, threads=cfg.threads)
    torch.manual_seed(0)
    model = GPT(cfg.model).to(rt.device)
    optimizer = make_optimizer(model, cfg.optimizer_config(), rt.device)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    T = cfg.model.block_size
    x = torch.randint(0, cfg.model.vocab_size, (micro_batch, T + 1), device=rt.device)
    batch = (x[:, :-1], x[:, 1:])

    def step():
        train_step(model, optimizer, scaler, lambda s, m: batch, 0, 1, rt, cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)

    step()  # warm-up: first-call allocations and kernel choices
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return micro_batch * T / statistics.median(seconds)  # the median: one stall on a shared machine is not the rate


@dataclass
class Proposal:
    """A sized run: the training config, what it was derived from, and why (one reason per line)."""

    config: TrainConfig
    tokens_per_second: float
    reasons: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        """The train.py flags that give `config` from the defaults."""
        c, m = self.config, self.config.model
        pairs = [
            ("data", c.data),
            ("out-dir", c.out_dir),
            ("n-layer", m.n_layer),
            ("n-head", m.n_head),
            ("n-embd", m.n_embd),
            ("block-size", m.block_size),
            ("bias", str(m.bias).lower()),
            ("activation", m.activation),
            ("optimizer", c.optimizer),
            ("learning-rate", c.learning_rate),
            ("min-lr", c.min_lr),
            ("muon-lr", c.muon_lr),
            ("weight-decay", c.weight_decay),
            ("beta2", c.beta2),
            ("batch-size", c.batch_size),
            ("grad-accum", c.grad_accum),
            ("max-iters", c.max_iters),
            ("lr-decay-iters", c.lr_decay_iters),
            ("warmup-iters", c.warmup_iters),
            ("eval-interval", c.eval_interval),
            ("eval-iters", c.eval_iters),
        ]
        if c.device != "auto":
            pairs.append(("device", c.device))
        return [a for k, v in pairs for a in (f"--{k}", str(v))]

    def command(self) -> str:
        return "gpt train " + shlex.join(self.argv())


def propose(
    model_config: GPTConfig,
    data: str,
    train_tokens: int,
    minutes: float,
    tokens_per_second: float,
    out_dir: str = "out/run",
    device: str = "auto",
    params: str = "",
    depth: int = 0,
) -> Proposal:
    """The run for `model_config` on a corpus of `train_tokens` in `minutes` at the measured throughput."""
    ref = reference()
    ref_tokens_per_step = ref.batch_size * ref.grad_accum * ref.model.block_size  # B_ref
    ref_tokens = ref_tokens_per_step * ref.max_iters  # D_ref
    m = model_config
    T = m.block_size
    n_params = count_params(m)
    why = [
        f"width: n_embd {m.n_embd} for depth {m.n_layer} (depth x aspect ratio, rounded up to whole heads), "
        f"{m.n_head} heads of {m.n_embd // m.n_head}; {n_params:,} parameters with the {m.vocab_size:,}-row embedding",
        f"context: block size {T} (the width as a power of two in [64, 1024]: attention ~1/6 of the FLOPs)",
        f"throughput: {tokens_per_second:,.0f} training tokens/s measured on this machine",
    ]
    budget = int(tokens_per_second * minutes * 60 * (1 - OVERHEAD_SHARE))
    if budget < T:
        raise SizingError(
            f"--minutes: {minutes:g} minutes at {tokens_per_second:,.0f} tokens/s train less than one sequence of "
            f"{T} tokens; give more minutes or a smaller --depth"
        )
    why.append(
        f"token budget: {tokens_per_second:,.0f} tokens/s x {minutes:g} min x {1 - OVERHEAD_SHARE:.0%} "
        f"(the rest for evaluation and checkpoints) = D = {budget:,} tokens"
    )
    want = ref_tokens_per_step * (budget / ref_tokens) ** BATCH_EXPONENT
    tokens_per_step = 2 ** round(math.log2(want))
    tokens_per_step = max(T, min(tokens_per_step, 2 ** math.floor(math.log2(max(budget // MIN_STEPS, 1)))))
    micro_cap = max(1, MEASURE_TOKENS // T)
    batch_size, accum = plan_batch(max(1, tokens_per_step // T), micro_cap)
    tokens_per_step = batch_size * accum * T
    steps = max(1, budget // tokens_per_step)
    why.append(
        f"batch: {ref_tokens_per_step:,} x (D / {ref_tokens:,})^{BATCH_EXPONENT} = {want:,.0f} tokens, as a power "
        f"of two within [one sequence, D / {MIN_STEPS}] -> {batch_size} x {accum} micro-batches x {T} = "
        f"{tokens_per_step:,} tokens a step, {steps:,} steps"
    )
    batch_scale = (tokens_per_step / ref_tokens_per_step) ** 0.5
    width_scale = (m.n_embd / ref.model.n_embd) ** -0.5
    lr = round3(ref.learning_rate * width_scale * batch_scale)
    muon_lr = round3(ref.muon_lr * batch_scale)
    trained = steps * tokens_per_step
    # capped at the reference's: the rule lowers the decay of longer runs; for runs shorter than the reference it
    # would raise it past anything measured (a 30k-token run asked for 8x)
    weight_decay = round3(min(ref.weight_decay, ref.weight_decay * batch_scale * ref_tokens / trained))
    why += [
        f"AdamW LR: {ref.learning_rate:g} x ({m.n_embd}/{ref.model.n_embd})^-0.5 x ({tokens_per_step:,}/"
        f"{ref_tokens_per_step:,})^0.5 = {lr:.3g} (embeddings, head, norms)",
        f"Muon LR: {ref.muon_lr:g} x ({tokens_per_step:,}/{ref_tokens_per_step:,})^0.5 = {muon_lr:.3g} "
        f"(the blocks' matrices; no width factor)",
        f"weight decay: {ref.weight_decay:g} x ({tokens_per_step:,}/{ref_tokens_per_step:,})^0.5 x "
        f"({ref_tokens:,}/{trained:,}), at most {ref.weight_decay:g} = {weight_decay:.3g}",
    ]
    epochs = trained / max(train_tokens, 1)
    ratio = trained / n_params
    note = (
        "; the corpus repeats that often: expect overfitting, a smaller --depth sees it less often"
        if epochs > 4
        else ""
    )
    why.append(f"data: {trained:,} tokens = {epochs:.2f} epochs of the {train_tokens:,}-token train split{note}")
    why.append(
        f"tokens per parameter: {ratio:.2g} (nanochat trains ~12 per scaling parameter; "
        + (
            "fewer here: a smaller --depth would learn more in these minutes)"
            if ratio < 6
            else "more here: a larger --depth could use these minutes)"
            if ratio > 40
            else "close enough)"
        )
    )
    warmup = max(1, round(steps * ref.warmup_iters / ref.max_iters))
    # an eval batch costs about a third of a training micro-batch (forward only); EVALS evaluations of both splits
    # fit in the overhead share
    eval_iters = min(TrainConfig.eval_iters, max(1, round(OVERHEAD_SHARE * steps * accum * 3 / (2 * EVALS))))
    cfg = replace(
        ref,
        data=data,
        out_dir=out_dir,
        device=device,
        model=replace(m, vocab_size=GPTConfig().vocab_size),  # vocab_size comes from the dataset
        batch_size=batch_size,
        grad_accum=accum,
        max_iters=steps,
        lr_decay_iters=steps,
        warmup_iters=warmup,
        learning_rate=lr,
        min_lr=round3(lr * ref.min_lr / ref.learning_rate),
        muon_lr=muon_lr,
        weight_decay=weight_decay,
        eval_interval=-(-steps // EVALS),  # the last one at the end
        eval_iters=eval_iters,
        eval_batch_size=0,
        eval_train=True,
        log_interval=TrainConfig.log_interval,
    )
    why.append(
        f"schedule: {ref.lr_schedule}, warmup {warmup} steps, final LR a tenth of the peak (as the reference); "
        f"{EVALS} evaluations of {eval_iters} batches a split (about {OVERHEAD_SHARE:.0%} of the steps' time); "
        f"no --max-minutes: the steps are the budget (`gpt train`'s limit judges the evaluation's cost by the first, "
        f"warm-up step, and stops short runs at step 1)"
    )
    if params:
        why.insert(0, f"depth: {depth}, the depth whose model is nearest {params} parameters")
    return Proposal(cfg, tokens_per_second, why)


def size(
    data: str,
    minutes: float,
    depth: int | None = None,
    params: str = "",
    aspect_ratio: int = ASPECT_RATIO,
    head_dim: int = HEAD_DIM,
    block_size: int = 0,
    tokens_per_second: float = 0.0,
    out_dir: str = "out/run",
    device: str = "auto",
) -> Proposal:
    """`gpt plan --depth N | --params P`: check the settings, read the corpus, build the model,
    measure its throughput (unless `tokens_per_second` is given) and propose the run."""
    problems = []
    if (depth is None) == (not params):
        problems.append("give one of --depth N or --params P")
    if depth is not None and not 1 <= depth <= MAX_DEPTH:
        problems.append(f"--depth: must be in [1, {MAX_DEPTH}], got {depth}")
    for name, value in (("--aspect-ratio", aspect_ratio), ("--head-dim", head_dim)):
        if value < 1:
            problems.append(f"{name}: must be >= 1, got {value}")
    if block_size < 0 or not 0 <= tokens_per_second < math.inf:
        problems.append("--block-size and --tokens-per-second must be >= 0 (0: chosen / measured)")
    if not minutes > 0 or not math.isfinite(minutes):
        problems.append(f"--minutes: must be > 0, got {minutes:g}")
    if not data:
        problems.append("--data: the prepared dataset to size the run for (from gpt prepare)")
    if problems:
        raise SizingError("; ".join(problems))
    meta = read_meta(data, "tokens")
    vocab = padded_vocab(SimpleNamespace(vocab_size=meta["vocab_size"]))  # the embedding rows train.py will make
    shape = dict(aspect_ratio=aspect_ratio, head_dim=head_dim, block_size=block_size)
    chosen = depth if depth is not None else depth_for_params(parse_count(params), vocab, **shape)
    model = model_for(chosen, vocab, **shape)
    train_tokens = meta["splits"]["train"]["tokens"]
    if tokens_per_second:
        return propose(model, data, train_tokens, minutes, tokens_per_second, out_dir, device, params, chosen)
    # measured at the largest micro-batch the plan uses, then again at the one it chose if that is smaller
    # (a small batch trains fewer tokens a second)
    cfg = replace(reference(), model=model, device=device)
    micro = max(1, MEASURE_TOKENS // model.block_size)
    for _ in range(3):  # the batch rarely changes twice: a smaller throughput asks for a smaller batch
        tokens_per_second = measure_throughput(cfg, micro, device)
        proposal = propose(model, data, train_tokens, minutes, tokens_per_second, out_dir, device, params, chosen)
        line = next(i for i, r in enumerate(proposal.reasons) if r.startswith("throughput:"))
        proposal.reasons[line] += f" (micro-batches of {micro})"
        if proposal.config.batch_size == micro:
            break
        micro = proposal.config.batch_size
    return proposal
