"""The training loop: pretraining and fine-tuning with exact resume, mixed precision and DDP.

    python train.py --config shakespeare_char_cpu --data data/shakespeare_char --out-dir out/shakespeare_char
    python train.py --resume out/shakespeare_char --max-iters 5000          # continue exactly
    torchrun --nproc-per-node 2 train.py --data ... --out-dir ...            # DistributedDataParallel

One step, in nanoGPT's order: the step's LR -> `grad_accum` micro-steps (forward, loss / accum,
backward; DDP syncs gradients only on the last micro-step) -> unscale, check the loss and gradient
norm are finite, clip -> optimizer step. Evaluation and checkpoints happen between steps.

Exact resume: batches are a function of (seed, step, rank), the LR a function of the step, and the
checkpoint carries weights, optimizer, scaler and RNG states, so a resumed run computes the very
same losses as one that never stopped (bit-identical on CPU in float32).
"""

from __future__ import annotations

import collections
import math
import os
import signal
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt import checkpoint
from gpt.config import ConfigError, TrainConfig, build_config
from gpt.errors import UserError
from gpt.model import GPT, GPTConfig
from gpt.progress import format_duration
from gpt.runlog import RunLogger, peak_flops
from gpt.schedule import get_lr


LATEST = ("last.pt",)  # resuming continues the latest state, not the best one


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (non-finite loss, mismatched tokenizer, ...); the message says why."""


@dataclass
class Runtime:
    """Where and how this process computes."""

    device: torch.device
    dtype: torch.dtype
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    ddp: bool = False  # launched by torchrun (a process group, DDP), even with a single process

    @property
    def master(self) -> bool:
        return self.rank == 0

    def peak_memory_gib(self) -> float | None:
        """The most GPU memory tensors have held so far (CUDA only; allocator caches not counted)."""
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None

    def autocast(self) -> ExitStack:
        """The forward pass's context: autocast unless float32 and, on CPU, the math attention kernel.

        PyTorch's CPU flash-attention kernel is the slower one for training: its backward took 44%
        of a step, and the math kernel measured 37 vs 64 ms/step in bf16 (4x4x128, block 64, batch
        24, 2 cores). On CUDA the default choice (flash / memory-efficient) stays.
        """
        stack = ExitStack()
        if self.dtype != torch.float32:
            stack.enter_context(torch.autocast(device_type=self.device.type, dtype=self.dtype))
        if self.device.type == "cpu":
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        return stack


def setup_runtime(cfg: TrainConfig) -> Runtime:
    ddp = "WORLD_SIZE" in os.environ  # set by torchrun
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and ddp:
        name = f"cuda:{local_rank}"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # set_device and peers want an index
    if cfg.deterministic:
        # cuBLAS needs a fixed workspace (read when its handle is made); strict mode, because with
        # warn_only=True the flash-attention backward keeps its faster non-deterministic algorithm
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls: ~free speed in float32 parts
        torch.backends.cudnn.allow_tf32 = True
    if ddp:
        torch.distributed.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if device.type == "cuda" else "float32"
    if dtype == "float16" and device.type != "cuda":
        raise ConfigError("dtype: float16 training needs CUDA (use bfloat16 or float32 on CPU)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return Runtime(device, getattr(torch, dtype), rank, local_rank, world_size, ddp)


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only; the fused kernel where this PyTorch has one."""
    kwargs = dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
    try:
        return torch.optim.AdamW(model.param_groups(cfg.weight_decay), fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(model.param_groups(cfg.weight_decay), foreach=True, **kwargs)


def lr_at(step: int, cfg: TrainConfig) -> float:
    return get_lr(
        step, schedule=cfg.lr_schedule, lr=cfg.learning_rate, min_lr=cfg.min_lr,
        warmup_iters=cfg.warmup_iters, decay_iters=cfg.lr_decay_iters or cfg.max_iters,
        decay_fraction=cfg.decay_fraction, d_model=cfg.n_embd,
    )


def train_step(train_model, optimizer, scaler, get_batch, step: int, accum: int, rt: Runtime, grad_clip: float):
    """Accumulate `accum` micro-batches, then clip; returns (mean loss, gradient norm, target tokens).

    `get_batch(step, micro_step)` gives the positional arguments of `GPT.forward`: (idx, targets)
    for language modelling, (idx, targets, src, src_mask) for seq2seq.

    Each micro-loss is divided by `accum` so the summed gradients equal the gradient of the mean
    loss over the whole global batch, the same as one big batch would give.
    """
    total = torch.zeros((), device=rt.device)
    tokens = torch.zeros((), dtype=torch.long, device=rt.device)
    for micro in range(accum):
        batch = get_batch(step, micro)
        last = micro == accum - 1
        with train_model.no_sync() if rt.ddp and not last else nullcontext():
            with rt.autocast():
                _, loss = train_model(*batch)
                loss = loss / accum
            scaler.scale(loss).backward()
        total += loss.detach()
        tokens += batch[1].ne(-1).sum()  # targets that count (seq2seq batches vary in size)
    scaler.unscale_(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    return total, grad_norm, tokens


@torch.no_grad()
def estimate_loss(model: GPT, task, splits=("train", "val"), rt: Runtime | None = None) -> dict[str, float]:
    """Mean loss per target token on each split, over the task's evaluation batches."""
    was_training = model.training
    model.eval()
    out = {}
    for split in splits:
        total, count = 0.0, 0
        for idx, targets, *rest in task.eval_batches(split):
            with rt.autocast() if rt else nullcontext():
                logits, _ = model(idx, None, *rest)
            total += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1,
                                     reduction="sum").item()
            count += int((targets != -1).sum())
        out[split] = total / max(count, 1)
    model.train(was_training)
    return out


@contextmanager
def explain_oom(cfg: TrainConfig, step: int, out_dir: Path, evaluating: bool = False):
    """CUDA out of memory becomes one line naming the fix. It happens before anything of this step is
    saved, so the last checkpoint stays as it was."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        if evaluating:
            bs = cfg.eval_batch_size or cfg.batch_size
            what, fix = "evaluating", f"evaluate in smaller batches, e.g. --eval-batch-size {max(1, bs // 2)}"
        else:
            what = f"training (micro-batches of {cfg.batch_size} x {cfg.block_size} tokens)"
            fix = (f"use a smaller --batch-size with more --grad-accum for the same global batch, e.g. "
                   f"--batch-size {max(1, cfg.batch_size // 2)} --grad-accum {cfg.grad_accum * 2}")
        saved = f"the last checkpoint in {out_dir} is intact" if (out_dir / "last.pt").exists() else "nothing was saved"
        raise TrainingError(f"CUDA out of memory at step {step} while {what}: {fix}; {saved}") from None


def tokenizers_match(a: dict, b: dict) -> bool:
    keys = {"gpt2": ("kind",), "char": ("kind", "chars"), "bpe": ("kind", "ranks", "pattern")}.get(a.get("kind"), ())
    return bool(keys) and all(a.get(k) == b.get(k) for k in keys)


def build_model(cfg: TrainConfig, task, explicit: set[str], log) -> tuple[GPT, dict]:
    """A fresh model, or one initialised from `init_from`; returns (model, the model config used)."""
    vocab = math.ceil(task.vocab_size / 64) * 64  # padded to a multiple of 64: faster matmuls
    if not cfg.init_from:
        mcfg = GPTConfig(vocab_size=vocab, **cfg.model_kwargs())
        return GPT(mcfg), mcfg.to_dict()
    model, meta = checkpoint.load_model(cfg.init_from)
    if not tokenizers_match(meta["tokenizer"], task.tokenizer_spec):
        raise TrainingError(
            f"tokenizer mismatch: {cfg.init_from} was trained with a {meta['tokenizer'].get('kind')!r} tokenizer "
            f"different from the dataset's {task.tokenizer_spec.get('kind')!r} one; prepare the data with the "
            f"checkpoint's tokenizer (e.g. `python data/prepare.py ... --tokenizer {meta['tokenizer'].get('kind')}`)"
        )
    mdict = dict(meta["model_config"], dropout=cfg.dropout)  # architecture from the checkpoint
    state = model.state_dict()
    model = GPT(GPTConfig.from_dict(mdict))
    model.load_state_dict(state)
    block = cfg.block_size if "block_size" in explicit else mdict["block_size"]
    if block < mdict["block_size"]:
        log(f"init_from: cropping block_size {mdict['block_size']} -> {block}")
        model.crop_block_size(block)
    elif block > mdict["block_size"]:
        raise ConfigError(f"block_size: {block} exceeds the checkpoint's {mdict['block_size']} (it can only shrink)")
    return model, model.config.to_dict()


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    # generator states are CPU byte tensors, wherever the checkpoint was mapped to
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


class StopSignal:
    """SIGINT/SIGTERM set a flag; the loop finishes its step, saves and exits. A second SIGINT aborts."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def config_from_argv(argv: list[str]) -> tuple[TrainConfig, set[str]]:
    """Parse the CLI; `--resume RUN` starts from that run's saved config (CLI values still win)."""
    from gpt.config import parse_cli

    cli, config_name, _ = parse_cli(argv)
    base = {}
    if cli.get("resume"):
        base = checkpoint.read_meta(cli["resume"], names=LATEST)["train_config"]
        base = {k: v for k, v in base.items() if k not in ("resume", "init_from", "force")}
        base["out_dir"] = str(checkpoint.resolve(cli["resume"], names=LATEST).parent)  # where the run is now
    cfg = build_config(argv, base=base)
    explicit = set(cli) | (set(base) if base else set())
    if config_name:
        from gpt.config import find_config, load_toml

        explicit |= set(load_toml(find_config(config_name)))
    return cfg, explicit


def train(cfg: TrainConfig, explicit: set[str] = frozenset()) -> dict:
    """Run training as configured; returns a summary dict (final losses, steps, time)."""
    from gpt.tasks import open_task

    t_start = time.time()
    if not cfg.data:
        raise ConfigError("data: no dataset given; pass --data data/NAME (prepare one with data/prepare.py)")
    rt = setup_runtime(cfg)
    out_dir = Path(cfg.out_dir)
    if rt.master and not cfg.resume and (out_dir / "last.pt").exists() and not cfg.force:
        raise ConfigError(
            f"out_dir: {out_dir} already holds a run; continue it with `--resume {out_dir}`, "
            f"or pass --force to start over there"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    task = open_task(cfg.data)
    if not cfg.init_from:
        task.check_model(cfg)
    log = RunLogger.create(str(out_dir), rt.master, cfg.wandb_project, cfg.wandb_run_name, cfg.wandb_mode, cfg.to_dict())
    torch.manual_seed(cfg.seed + rt.rank)

    model, model_config = build_model(cfg, task, explicit, log.print)
    cfg.block_size = model.config.block_size
    model.to(rt.device)
    optimizer = make_optimizer(model, cfg, rt.device)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)

    start_step, best_val, skipped = 0, float("inf"), 0
    if cfg.resume:
        ckpt = checkpoint.read(cfg.resume, map_location=rt.device, names=LATEST)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        meta = ckpt["meta"]
        start_step, best_val, skipped = meta["step"], meta.get("best_val_loss", float("inf")), meta.get("skipped_steps", 0)
        if rt.world_size == meta.get("world_size", 1):  # the same processes: continue their RNG streams
            _set_rng_state(ckpt["rng"][rt.rank] if isinstance(ckpt["rng"], list) else ckpt["rng"], rt.device)
        log.print(f"resuming {cfg.resume} at step {start_step}")
    if rt.master:
        import json

        (out_dir / "config.json").write_text(json.dumps({"train": cfg.to_dict(), "model": model_config}, indent=2))

    train_model = torch.compile(model) if cfg.compile else model  # `model` stays the one saved
    if rt.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(train_model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    if cfg.grad_accum % rt.world_size:
        raise ConfigError(f"grad_accum: {cfg.grad_accum} must be a multiple of the {rt.world_size} processes")
    accum = cfg.grad_accum // rt.world_size
    task.start(cfg, rt, accum)
    peak = cfg.peak_flops or peak_flops(rt.device)
    flops_per_token = model.flops_per_token(cfg.block_size)

    def save(name: str, step: int, val_loss: float | None) -> None:
        rng = _rng_state(rt.device)
        if rt.ddp:  # every rank's dropout stream, so a same-size resume continues them all
            gathered = [None] * rt.world_size
            torch.distributed.all_gather_object(gathered, rng)
            rng = gathered
        if not rt.master:
            return
        meta = checkpoint.build_meta(
            model_config=model_config, tokenizer=task.tokenizer_spec, step=step, train_config=cfg.to_dict(),
            val_loss=val_loss, best_val_loss=best_val, skipped_steps=skipped, world_size=rt.world_size,
            sampler={"seed": cfg.seed, "mode": cfg.sampling, "next_step": step}, dataset=str(cfg.data),
            **task.checkpoint_meta,
        )
        state = dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                     scaler=scaler.state_dict() if scaler.is_enabled() else None, rng=rng)
        checkpoint.save(out_dir / name, state, meta)

    log.print(
        f"{model.num_params() / 1e6:.2f}M parameters | {rt.device} {str(rt.dtype).removeprefix('torch.')} | "
        f"{rt.world_size} process(es) | global batch {task.describe_batch(cfg)} | "
        f"steps {start_step} -> {cfg.max_iters}"
    )
    model.train()
    step, last_eval = start_step, {}
    t_step, recent = time.time(), collections.deque(maxlen=50)  # recent step times, for the ETA
    interval = {"steps": 0, "seconds": 0.0, "tokens": torch.zeros((), dtype=torch.long, device=rt.device)}
    with StopSignal() as stop:
        while step < cfg.max_iters:
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with explain_oom(cfg, step + 1, out_dir):
                loss, grad_norm, n_tokens = train_step(train_model, optimizer, scaler, task.train_batch, step, accum,
                                                       rt, cfg.grad_clip)
                finite = torch.isfinite(loss) & (torch.isfinite(grad_norm) | scaler.is_enabled())
                if not finite:
                    optimizer.zero_grad(set_to_none=True)
                    if not cfg.skip_nonfinite:
                        raise TrainingError(
                            f"non-finite loss ({loss.item():.4g}) or gradient norm ({grad_norm.item():.4g}) at step "
                            f"{step}; stopped before the optimizer step. The last checkpoint in {out_dir} is intact: "
                            f"lower --learning-rate, or pass --skip-nonfinite to skip such steps"
                        )
                    skipped += 1
                else:
                    scaler.step(optimizer)  # the first step also allocates the optimizer's state
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
            step += 1
            now = time.time()
            recent.append(now - t_step)
            interval["steps"] += 1
            interval["seconds"] += now - t_step
            interval["tokens"] += n_tokens
            t_step = now

            if step % cfg.log_interval == 0 or step == cfg.max_iters:
                if rt.ddp:  # the global batch's mean loss and token count
                    torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.AVG)
                    torch.distributed.all_reduce(interval["tokens"])
                dt = interval["seconds"] / interval["steps"]
                tok_s = interval["tokens"].item() / interval["seconds"]
                mfu = flops_per_token * tok_s / (peak * rt.world_size) if peak else None  # per device
                mem = rt.peak_memory_gib()
                eta = sorted(recent)[len(recent) // 2] * (cfg.max_iters - step)  # median: robust to pauses
                if cfg.max_minutes:
                    eta = min(eta, 60 * cfg.max_minutes - (now - t_start))
                interval.update(steps=0, seconds=0.0, tokens=torch.zeros_like(interval["tokens"]))
                log.print(
                    f"step {step:>6} | loss {loss.item():.4f} | lr {lr:.2e} | {tok_s / 1e3:,.1f}k tok/s | "
                    f"{dt * 1e3:.0f} ms/step" + (f" | mfu {mfu:.1%}" if mfu is not None else "") +
                    (f" | mem {mem:.1f} GiB" if mem is not None else "") + f" | eta {format_duration(eta)}"
                )
                log.record("train", step, loss=loss.item(), lr=lr, grad_norm=grad_norm.item(), tokens_per_s=tok_s,
                           ms_per_step=dt * 1e3, mfu=mfu, peak_mem_gib=mem, skipped_steps=skipped,
                           elapsed=now - t_start)

            # 0 = go on, 1 = out of time (evaluate, save, stop), 2 = signalled (save, stop)
            halt = 2 if stop.signum is not None else int(bool(cfg.max_minutes) and now - t_start >= 60 * cfg.max_minutes)
            if rt.ddp:  # every rank stops at the same step, for the same reason, if any of them must
                flag = torch.tensor([float(halt)], device=rt.device)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
                halt = int(flag.item())
            evaluate = step % cfg.eval_interval == 0 or step == cfg.max_iters or halt == 1
            if evaluate:
                t_eval = time.time()
                with explain_oom(cfg, step, out_dir, evaluating=True):
                    last_eval = estimate_loss(model, task, rt=rt)
                val = last_eval["val"]
                improved = val < best_val
                best_val = min(best_val, val)
                log.print(
                    f"eval {step:>6} | train {last_eval['train']:.4f} | val {val:.4f} | val ppl {math.exp(min(val, 50)):.2f}"
                    f" | {time.time() - t_eval:.1f}s | elapsed {format_duration(time.time() - t_start)}"
                )
                log.record("eval", step, train_loss=last_eval["train"], val_loss=val, val_ppl=math.exp(min(val, 50)),
                           elapsed=time.time() - t_start)
                save("last.pt", step, val)
                if improved and rt.master:
                    checkpoint.link_or_copy(out_dir / "last.pt", out_dir / "best.pt")
                t_step = time.time()  # evaluation time is not step time
                if cfg.target_val_loss and val <= cfg.target_val_loss:
                    log.print(f"reached val loss {val:.4f} <= {cfg.target_val_loss} at step {step}")
                    break
            if halt:
                if not evaluate:
                    save("last.pt", step, None)
                reason = signal.Signals(stop.signum).name if stop.signum else f"--max-minutes {cfg.max_minutes}"
                log.print(f"stopped by {reason} at step {step}; resume with: python train.py --resume {out_dir}")
                break

    elapsed = time.time() - t_start
    summary = dict(step=step, elapsed=elapsed, best_val_loss=best_val, skipped_steps=skipped,
                   peak_mem_gib=rt.peak_memory_gib(), interrupted=stop.signum is not None,
                   **{f"{k}_loss": v for k, v in last_eval.items()})
    log.record("summary", step, **{k: v for k, v in summary.items() if k != "step"})
    log.print(
        f"done: {step} steps in {format_duration(elapsed)} | best val {best_val:.4f}"
        + (f" | {skipped} non-finite steps skipped" if skipped else "") + f" | checkpoints in {out_dir}"
    )
    log.close()
    if rt.ddp:
        torch.distributed.destroy_process_group()
    return summary
