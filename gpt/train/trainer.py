"""The training loop: pretraining and fine-tuning with exact resume, mixed precision and DDP.

    gpt train --config shakespeare_char_cpu --data data/shakespeare_char --out-dir out/shakespeare_char
    gpt train --resume out/shakespeare_char --max-iters 5000          # continue exactly
    torchrun --nproc-per-node 2 -m gpt train --data ... --out-dir ...        # DistributedDataParallel
    torchrun --nproc-per-node 8 -m gpt train ... --fsdp --activation-checkpointing  # sharded (gpt/train/parallel.py, gpt/checkpoints/dcp.py)
    torchrun --nproc-per-node 2 -m gpt train ... --pp 2 --grad-accum 8          # in stages (gpt/train/pipeline.py)

`train(plan)` (a `RunPlan`: the command line resolved once, gpt/train/start.py) reads as its steps: claim the run directory, open the data, build (or resume) the model,
then loop. One step, in nanoGPT's order: the step's LR -> `grad_accum` micro-steps (forward, loss /
accum, backward; DDP syncs gradients only on the last micro-step) -> unscale, check the loss and
gradient norm are finite, clip -> optimizer step. Evaluation and checkpoints happen between steps.

Exact resume: batches are a function of (seed, step, rank), the LR a function of the step, and the
checkpoint carries weights, optimizer, scaler and RNG states, so a resumed run computes the very
same losses as one that never stopped (bit-identical on CPU in float32; on CUDA with --deterministic).

Nothing saved is lost: a checkpoint is written atomically and only from finite weights with a finite
val loss; a resume must use the same tokenizer and architecture; the run directory is locked.
"""

from __future__ import annotations

import collections
import enum
import math
import signal
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from gpt.checkpoints import adapters, dcp, loader, native
from gpt.errors import ConfigError
from gpt.model import lora, qat
from gpt.progress import format_duration
from gpt.runtime import FreeMemoryCap, Runtime, setup
from gpt.train import distill, grpo, parallel, pipeline, plot, prefer, preflight, prompts, start, tensor_parallel
from gpt.train.config import TrainConfig
from gpt.train.health import HealthMonitor
from gpt.train.mesh import Layout
from gpt.train.rundir import RunDir
from gpt.train.runlog import RunLogger, peak_flops
from gpt.train.schedule import windows_at
from gpt.train.start import TrainingError
from gpt.train.step import estimate_loss, make_optimizer, set_hyperparameters, train_step
from gpt.train.stopping import StopSignal, TimeLimit
from gpt.train.tasks import open_task


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
            what = f"training (micro-batches of {cfg.batch_size} x {cfg.model.block_size} tokens)"
            fix = (
                f"use a smaller --batch-size with more --grad-accum for the same global batch, e.g. "
                f"--batch-size {max(1, cfg.batch_size // 2)} --grad-accum {cfg.grad_accum * 2}"
            )
        kept = any((out_dir / name).exists() for name in ("last.pt", native.SHARDED["last.pt"]))
        saved = f"the last checkpoint in {out_dir} is intact" if kept else "nothing was saved"
        raise TrainingError(f"CUDA out of memory at step {step} while {what}: {fix}; {saved}") from None


class Halt(enum.IntEnum):
    """Why the loop stops after a step; ordered, so processes agree on the most urgent (all_reduce MAX)."""

    GO_ON = 0
    OUT_OF_TIME = 1  # --max-minutes: evaluate, save, stop
    SIGNALLED = 2  # SIGINT / SIGTERM: save, stop


# ---- the run's random state ---------------------------------------------------------------------------


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


# ---- the run -------------------------------------------------------------------------------------------


def train(plan: start.RunPlan) -> dict:
    """Run training as planned; returns a summary dict (final losses, steps, time)."""
    t_start = time.time()
    cfg = plan.cfg
    if not cfg.data:
        raise ConfigError("--data: no dataset given; pass --data data/NAME (prepare one with gpt prepare)")
    rt = setup(cfg.device, cfg.dtype, cfg.threads, cfg.deterministic)
    rt.compiled = cfg.compile
    run_dir = RunDir(cfg.out_dir, rt.master)
    try:
        parallel.check(cfg, rt)
        pipeline.check(cfg, rt)
        task = prompts.PromptTask(cfg.data, plan) if cfg.objective == "grpo" else open_task(cfg.data)
        if task.kind == "preferences" and cfg.objective == "lm":
            raise ConfigError(
                f"--data {cfg.data} holds preference pairs: train on them with --objective dpo or --objective orpo"
            )
        if not cfg.init_from:
            task.check_model(cfg)
        with run_dir.claim(resume=bool(cfg.resume), force=cfg.force):
            log = RunLogger.create(
                cfg.out_dir,
                rt.master,
                cfg.wandb_project,
                cfg.wandb_run_name,
                cfg.wandb_mode,
                cfg.to_dict(),
                tensorboard=cfg.tensorboard,
            )
            try:
                return Run(plan, rt, task, run_dir, log, t_start).loop()
            finally:
                log.close()
    finally:
        if rt.ddp:
            torch.distributed.destroy_process_group()


class Run:
    """One training run's state and its named steps: start (fresh, fine-tune or resume), step, log,
    evaluate, save."""

    def __init__(self, plan: start.RunPlan, rt: Runtime, task, run_dir: RunDir, log: RunLogger, t_start: float):
        cfg, self.resume = plan.cfg, plan.resume  # the checkpoint a resume continues, located once
        self.after_eval, self.last_bpb = plan.after_eval, None
        self.cfg, self.rt, self.task, self.run_dir, self.log, self.t_start = cfg, rt, task, run_dir, log, t_start
        self.out_dir = Path(cfg.out_dir)
        # the processes of one tensor-parallel group are one data-parallel rank: the same batches, the same
        # dropout masks (gpt/train/mesh.py)
        self.layout = Layout.of(rt.world_size, cfg.tp, cfg.pp) if rt.ddp else Layout()
        self.data_rt = replace(rt, rank=self.layout.coordinates(rt.rank)[1], world_size=self.layout.dp)
        self.sharded = cfg.fsdp or cfg.tp > 1 or cfg.pp > 1  # checkpoints through DCP, every process its part
        self.saved_layout = tensor_parallel.SavedLayout(cfg.tp) if cfg.tp > 1 else None
        torch.manual_seed(cfg.seed + self.data_rt.rank)
        log.print(f"building the model on {rt.describe()}")
        model, self.model_config = start.new_model(plan, task, log.print)
        self.lora_meta = start.add_adapters(model, plan, log.print) if plan.lora else None
        self.qat_meta = None
        if cfg.qat:  # the forward on the grid inference will use (gpt/model/qat.py)
            line, self.qat_meta = qat.start(model, cfg.qat, cfg.qat_group_size)
            log.print(line)
        # the model built: a checkpoint's, cropped, the dataset's vocab
        self.cfg = cfg = replace(cfg, model=model.config)
        tensor_parallel.check(model.config, cfg.tp)  # a resumed or --init-from model's shape: known only now
        self.model = model.to(rt.device)
        self.teacher = distill.Teacher.load(cfg, task, rt, model.config.vocab_size) if cfg.distill_from else None
        if self.teacher:
            log.print(self.teacher.describe())
        if cfg.objective in ("dpo", "grpo") and not cfg.reference and cfg.init_from:  # recorded for a resume
            self.cfg = cfg = replace(cfg, reference=str(cfg.init_from))
        objectives = {"dpo": prefer.Preference, "orpo": prefer.Preference, "grpo": grpo.GRPO}
        self.objective = objectives[cfg.objective].load(cfg, task, rt) if cfg.objective != "lm" else None
        if self.objective:
            log.print(self.objective.describe())
        total = model.num_params(non_embedding=False)  # the whole model's, before a pipeline keeps its stages
        self.pipe = pipeline.Pipeline(model, cfg, rt) if cfg.pp > 1 else None  # this process's stages
        if self.pipe:
            self.model = model = self.pipe.part
            log.print(self.pipe.description)
        self.train_model = parallel.wrap(model, cfg, rt)  # before the optimizer: FSDP swaps in sharded parameters
        if cfg.tp > 1 or cfg.pp > 1:
            sp = ", sequence parallel" if cfg.sequence_parallel else ""
            log.print(
                f"layout {self.layout}: process 0 holds {tensor_parallel.held(model):,} of {total:,} parameters{sp}"
            )
        self.optimizer = make_optimizer(model, cfg.optimizer_config(), rt.device, split=cfg.tp > 1)
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
        self.step, self.best_val, self.skipped, self.saved_step, self.tokens_seen = 0, float("inf"), 0, None, 0
        self.pending_tokens = torch.zeros((), dtype=torch.long, device=rt.device)
        self.health = HealthMonitor(min_history=max(10, cfg.warmup_iters))  # not judged during warmup
        self.figure = plot.FigureWriter(self.out_dir, log.print, enabled=rt.master and cfg.plot)
        if cfg.batch_size == 0:  # --batch-size auto (CUDA): the batch size and accumulation that fit
            batch_size, grad_accum = preflight.auto_batch_size(self.model, cfg, rt, log.print)
            self.cfg = cfg = replace(cfg, batch_size=batch_size, grad_accum=grad_accum)
        if cfg.resume:
            self._resume()
        run_dir.write_config({"train": cfg.to_dict(), "model": self.model_config})
        dp = self.data_rt.world_size
        if cfg.grad_accum % dp:
            replicas = f"{dp} data-parallel replicas" if dp != rt.world_size else f"{dp} processes"
            raise ConfigError(f"--grad-accum: {cfg.grad_accum} must be a multiple of the {replicas}")
        self.accum = cfg.grad_accum // dp
        task.start(cfg, self.data_rt, self.accum)  # the processes of one pipeline / tp group read the same batches
        self.peak = cfg.peak_flops or peak_flops(rt.device)
        self.flops_per_token = model.flops_per_token(cfg.model.block_size)
        self.limit = TimeLimit(cfg.max_minutes, t_start, task.eval_tokens())

    def _resume(self) -> None:
        cfg, rt = self.cfg, self.rt
        source, meta = self.resume.path, self.resume.meta  # last.pt, or last.dcp (sharded): located once
        start.check_resumable(meta, self.model_config, self.task, cfg)
        adapters.check_resume(meta, self.lora_meta, cfg.resume)
        kernels = [{k: g.get(k) for k in ("foreach", "fused")} for g in self.optimizer.param_groups]
        if self.sharded:  # each process reads the shards it holds (a .pt: its part of the whole)
            ckpt = dcp.load(source, self.model, self.optimizer, self.saved_layout, self.pipe and self.pipe.whole)
        else:
            ckpt = loader.read(self.resume, map_location=rt.device)
            lora.load_weights(self.model, ckpt["model"], ckpt.source)  # all weights, or a LoRA run's adapters
            self.optimizer.load_state_dict(ckpt["optimizer"])
        for group, kernel in zip(self.optimizer.param_groups, kernels):  # this layout's kernels, not the saved run's
            group.update(kernel)
        meta = ckpt["meta"]
        if ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.step = self.saved_step = meta["step"]
        self.best_val, self.skipped = meta.get("best_val_loss", float("inf")), meta.get("skipped_steps", 0)
        self.tokens_seen = meta.get("tokens_seen", 0)
        if rt.world_size == meta.get("world_size", 1):  # the same processes: continue their RNG streams
            _set_rng_state(ckpt["rng"][rt.rank] if isinstance(ckpt["rng"], list) else ckpt["rng"], rt.device)
        self.log.print(f"resuming {cfg.resume} at step {self.step}")
        note = start.schedule_change(meta["train_config"], cfg, self.step)
        if note:
            self.log.print(note)

    def save(self, name: str, val_loss: float | None, stop: StopSignal) -> None:
        """Write `name` atomically: weights, optimizer, scaler, RNG, and the meta that resumes them. Never
        from non-finite weights: the last good checkpoint stays."""
        rt = self.rt
        if not parallel.all_finite(self.model, rt):
            raise TrainingError(
                f"the weights are no longer finite at step {self.step}: not saved; {self._kept()}; lower "
                f"--learning-rate (or --grad-clip){self._way_back()}"
            )
        self._count_tokens()  # (those of steps since the last log step, which a resume would lose)
        rng = _rng_state(rt.device)
        if rt.ddp:  # every rank's dropout stream, so a same-size resume continues them all
            gathered = [None] * rt.world_size
            torch.distributed.all_gather_object(gathered, rng)
            rng = gathered
        cfg = self.cfg
        if not (rt.master or self.sharded):
            return
        meta = native.build_meta(
            model_config=self.model_config,
            tokenizer=self.task.tokenizer_spec,
            step=self.step,
            train_config=cfg.to_dict(),
            val_loss=val_loss,
            best_val_loss=self.best_val,
            skipped_steps=self.skipped,
            world_size=rt.world_size,
            sampler={"seed": cfg.seed, "mode": cfg.sampling, "next_step": self.step},
            dataset=str(cfg.data),
            tokens_seen=self.tokens_seen,
            lora=self.lora_meta,
            qat=self.qat_meta,
            **self.task.checkpoint_meta,
        )
        scaler = self.scaler.state_dict() if self.scaler.is_enabled() else None
        with stop.deferred():  # a second Ctrl-C waits for the write to finish
            if self.sharded:  # every process writes its shards (gpt/checkpoints/dcp.py)
                dcp.save(
                    self.out_dir / native.SHARDED[name],
                    self.model,
                    self.optimizer,
                    meta,
                    scaler,
                    rng,
                    self.saved_layout,
                    self.pipe and self.pipe.whole,
                )
            else:
                state = dict(
                    model=lora.saved_weights(self.model), optimizer=self.optimizer.state_dict(), scaler=scaler, rng=rng
                )
                native.save(self.out_dir / name, state, meta)
        self.saved_step = self.step

    def _kept(self) -> str:
        if self.saved_step is None:
            return "nothing was saved"
        last = native.SHARDED["last.pt"] if self.sharded else "last.pt"
        return f"{self.out_dir / last} still holds step {self.saved_step}"

    def _way_back(self) -> str:
        """When best.pt holds an earlier, better state than last.pt (a run that diverged, saved, and then
        stopped on non-finite values), how to continue from it exactly: "" otherwise."""
        try:
            last = loader.read_meta(self.out_dir, names=native.LATEST)
            found = loader.trained(self.out_dir, names=("best.pt",))
            best_path, best = found.path, found.meta
        except native.CheckpointError:
            return ""
        last_val, best_val = last.get("val_loss"), best.get("val_loss")
        if (
            best.get("step", 0) >= last.get("step", 0)
            or best_val is None
            or (last_val is not None and best_val >= last_val)
        ):
            return ""
        than = f"; last.pt: step {last['step']}, val {last_val:.4f}" if last_val is not None else ""
        return (
            f"; or go back to {best_path.name}, an earlier and better state (step {best['step']}, val "
            f"{best_val:.4f}{than}), and continue from it exactly with: gpt train --resume {best_path} "
            f"--max-iters {self.cfg.max_iters}"
        )

    def evaluate(self, stop: StopSignal) -> dict[str, float]:
        """Losses on both splits; saves last.pt (and best.pt when val improved)."""
        t_eval = time.time()
        with explain_oom(self.cfg, self.step, self.out_dir, evaluating=True):
            splits = ("train", "val") if self.cfg.eval_train else ("val",)
            if self.pipe:
                losses = self.pipe.estimate_loss(self.model, self.task, splits, rt=self.rt)
            else:
                losses = estimate_loss(self.model, self.task, splits, rt=self.rt, objective=self.objective)
        val = losses["val"]
        train = f"train {losses['train']:.4f} | " if "train" in losses else ""
        self.limit.eval_seconds = time.time() - t_eval
        bpb = self.task.val_bits_per_byte(val) if math.isfinite(val) else None  # None: not a token stream
        self.last_bpb = bpb
        self.log.print(
            f"eval {self.step:>6} | {train}val {val:.4f}"
            + (f" | val ppl {math.exp(min(val, 50)):.2f}" if not self.objective else "")
            + "".join(
                f" | val {k.split('/')[-1]} {v:.2f}"
                for k, v in (self.objective.evaluated.get("val", {}) if self.objective else {}).items()
                if k in ("rewards/accuracies", "rewards/margins", "reward")
            )
            + (f" | val bpb {bpb:.4f}" if bpb is not None else "")
            + f" | {self.limit.eval_seconds:.1f}s | elapsed {format_duration(time.time() - self.t_start)}"
        )
        self.log.record(
            "eval",
            self.step,
            train_loss=losses.get("train"),
            val_loss=val,
            val_ppl=math.exp(min(val, 50)),
            val_bpb=bpb,
            elapsed=time.time() - self.t_start,
            **{
                f"{split}_{k}": v
                for split, figures in (self.objective.evaluated.items() if self.objective else ())
                for k, v in figures.items()
            },
        )
        if not math.isfinite(val):
            raise TrainingError(
                f"non-finite val loss ({val}) at step {self.step}: not saved; {self._kept()}; "
                f"lower --learning-rate, then --resume{self._way_back()}"
            )
        improved = val < self.best_val
        self.best_val = min(self.best_val, val)
        self.save("last.pt", val, stop)
        if improved and self.rt.master:
            if self.sharded:
                dcp.mark_best(self.out_dir)
            else:
                native.link_or_copy(self.out_dir / "last.pt", self.out_dir / "best.pt")
        self.figure.update()  # OUT_DIR/run.png, drawn in the background
        return losses

    def train_one_step(self) -> tuple[torch.Tensor, torch.Tensor, float, float, float]:
        """One optimizer step: (loss, gradient norm) as tensors for logging, and as floats (one host sync),
        and the LR."""
        cfg, optimizer, scaler = self.cfg, self.optimizer, self.scaler
        lr = set_hyperparameters(optimizer, self.step, cfg)
        if cfg.window_schedule:  # (the model's windows of this step: gpt/train/schedule.py)
            self.model.windows = windows_at(self.step, cfg)
        with explain_oom(cfg, self.step + 1, self.out_dir):
            step_fn = (
                self.pipe.train_step
                if self.pipe
                else partial(train_step, teacher=self.teacher, objective=self.objective)
            )
            loss, grad_norm, n_tokens = step_fn(
                self.train_model,
                optimizer,
                scaler,
                self.task.train_batch,
                self.step,
                self.accum,
                self.rt,
                cfg.grad_clip,
                self.task.tokens,
                lambda: tensor_parallel.loss_context(self.model),
            )
            self.pending_tokens += n_tokens  # (a device tensor: counted at log steps and saves)
            loss_f, norm_f = torch.stack([loss.detach().float(), grad_norm.float()]).tolist()  # the step's one sync
            if not (math.isfinite(loss_f) and (math.isfinite(norm_f) or scaler.is_enabled())):
                optimizer.zero_grad(set_to_none=True)
                if not cfg.skip_nonfinite:
                    raise TrainingError(
                        f"non-finite loss ({loss_f:.4g}) or gradient norm ({norm_f:.4g}) at step "
                        f"{self.step}; stopped before the optimizer step; {self._kept()}: lower --learning-rate, "
                        f"or pass --skip-nonfinite to skip such steps{self._way_back()}"
                    )
                self.skipped += 1
            else:
                with self.health.measure_update(optimizer, enabled=self._is_log_step(self.step + 1)):
                    scaler.step(optimizer)  # the first step also allocates the optimizer's state
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss, grad_norm, loss_f, norm_f, lr

    def loop(self) -> dict:
        cfg, rt, log = self.cfg, self.rt, self.log
        log.print(
            f"{self.model.num_params() / 1e6:.2f}M parameters | {rt.describe()} | {rt.world_size} process(es) | "
            f"global batch {self.task.describe_batch(cfg)} | steps {self.step} -> {cfg.max_iters}"
        )
        for line in preflight.report(self.model, cfg, self.data_rt, self.accum):
            log.print(line)
        # CPU: resident memory held under the estimate + the allocator's slack (gpt/runtime.py, FreeMemoryCap)
        limit, slack = preflight.resident_limit(preflight.run_estimate(self.model, cfg, self.data_rt))
        free_cap = FreeMemoryCap(limit, slack // 2) if rt.device.type == "cpu" else None
        if cfg.compile:  # the first step traces and compiles: say so before the wait
            log.print(
                "compiling the model for the first step (torch.compile: tens of seconds on a CPU, less "
                "with inductor's cache from an earlier run)"
            )
        self.model.train()
        last_eval = {}
        t_step, recent = time.time(), collections.deque(maxlen=50)  # recent step times, for the ETA
        interval = {"steps": 0, "seconds": 0.0, "tokens": 0}
        first = self.first_step = self.step + 1  # its log line comes at once: the first sign of life and speed
        self.step_tokens = 0.0  # tokens per step at the last log step (the first step is one)
        with StopSignal() as stop:
            while self.step < cfg.max_iters:
                loss, grad_norm, loss_f, norm_f, lr = self.train_one_step()
                if free_cap is not None:
                    free_cap.after_step()
                for warning in self.health.check(self.step, loss_f, norm_f):
                    log.print(f"warning: {warning}")
                    log.record("health", self.step, warning=warning)
                now = time.time()
                if self.step > first:  # the first step pays for warm-up (allocation, compiling): not a step's time
                    recent.append(now - t_step)
                interval["steps"] += 1
                interval["seconds"] += now - t_step
                step_seconds = sorted(recent)[len(recent) // 2] if recent else now - t_step  # median: robust to pauses
                t_step = now
                if self.step == first + preflight.PREFLIGHT_STEPS and self.step < cfg.max_iters:
                    log.print(
                        preflight.eta_line(
                            step_seconds, preflight.PREFLIGHT_STEPS, cfg.max_iters - self.step, self.limit, now
                        )
                    )

                if self._is_log_step(self.step):
                    self._log_step(loss, grad_norm, lr, interval, step_seconds, now)

                due = self.step % cfg.eval_interval == 0 or self.step == cfg.max_iters
                if log.console_closed and stop.signum is None:  # stdout's reader went away: as a signal would
                    stop.signum = signal.SIGPIPE
                if stop.signum is not None:
                    halt = Halt.SIGNALLED
                elif self.limit.out_of_time(
                    now, step_seconds, self.step_tokens / step_seconds, due, self.step == first
                ):
                    halt = Halt.OUT_OF_TIME
                else:
                    halt = Halt.GO_ON
                if rt.ddp:  # every rank stops at the same step, for the same reason, if any of them must
                    flag_ = torch.tensor([float(halt)], device=rt.device)
                    torch.distributed.all_reduce(flag_, op=torch.distributed.ReduceOp.MAX)
                    halt = Halt(int(flag_.item()))
                evaluate = due or halt is Halt.OUT_OF_TIME
                if evaluate:
                    last_eval = self.evaluate(stop)
                    t_step = time.time()  # evaluation time is not step time
                    if cfg.target_val_loss and last_eval["val"] <= cfg.target_val_loss:
                        log.print(
                            f"reached val loss {last_eval['val']:.4f} <= {cfg.target_val_loss} at step {self.step}"
                        )
                        break
                    if self.after_eval is not None and self.after_eval(self.step, last_eval["val"], self.last_bpb):
                        log.print(f"stopped by the sweep's pruner at step {self.step} (its last.pt is saved)")
                        break
                if halt is not Halt.GO_ON:
                    if not evaluate:
                        self.save("last.pt", None, stop)
                    reason = signal.Signals(stop.signum).name if stop.signum else f"--max-minutes {cfg.max_minutes}"
                    log.print(
                        f"stopped by {reason} at step {self.step}; resume with: gpt train --resume {self.out_dir}"
                    )
                    break
        if free_cap is not None and free_cap.trims:
            log.print(
                f"allocator: {free_cap.trims} trims (resident set over {preflight.gib(free_cap.limit)}) gave "
                f"{preflight.gib(free_cap.returned)} back"
            )
        return self._finish(last_eval, stop.signum)

    def _is_log_step(self, step: int) -> bool:
        return step % self.cfg.log_interval == 0 or step in (self.cfg.max_iters, self.first_step)

    def _count_tokens(self) -> int:
        """Add the tokens trained on (`task.tokens`) since the last count (over all processes: a collective under
        DDP, so every rank calls it at the same step) to `tokens_seen`; returns them."""
        tokens = self.pending_tokens
        if self.rt.ddp:
            torch.distributed.all_reduce(tokens)
        n = int(tokens.item()) // self.layout.tp  # each tensor-parallel group trained on one batch
        self.tokens_seen += n
        self.pending_tokens = torch.zeros_like(tokens)
        return n

    def _log_step(self, loss, grad_norm, lr, interval, step_seconds, now) -> None:
        cfg, rt = self.cfg, self.rt
        if rt.ddp:  # the global batch's mean loss
            torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.AVG)
        interval["tokens"] += self._count_tokens()
        dt = interval["seconds"] / interval["steps"]
        tok_s = interval["tokens"] / interval["seconds"]
        self.step_tokens = interval["tokens"] / interval["steps"]  # what the time limit's throughput is counted in
        mfu = self.flops_per_token * tok_s / (self.peak * rt.world_size) if self.peak else None  # per device
        mem = rt.peak_memory_gib()
        eta = f"eta {format_duration(step_seconds * (cfg.max_iters - self.step))}"
        ahead = self.limit.ahead(now, step_seconds, cfg.max_iters - self.step)
        if ahead:  # the time limit ends the run first: its end, not the step count's
            eta = f"eta {format_duration(ahead[0])} at the {cfg.max_minutes:g}-minute limit (~{ahead[1]:,} steps)"
        interval.update(steps=0, seconds=0.0, tokens=0)
        loss, grad_norm = loss.item(), grad_norm.item()
        figures = self.objective.take_metrics() if self.objective else {}
        self.log.print(
            f"step {self.step:>6} | loss {loss:.4f} | lr {lr:.2e} | {tok_s / 1e3:,.1f}k tok/s | "
            f"{dt * 1e3:.0f} ms/step"
            + (f" | mfu {mfu:.1%}" if mfu is not None else "")
            + (f" | mem {mem:.1f} GiB" if mem is not None else "")
            + f" | {eta}"
            + (f" | upd/w {self.health.update_ratio:.1e}" if self.health.update_ratio else "")
            + (f" | acc {figures['rewards/accuracies']:.2f}" if "rewards/accuracies" in figures else "")
            + (f" | window {max(self.model.windows.pattern)}" if cfg.window_schedule else "")
            + (
                f" | reward {figures['reward']:.3f} | len {figures['completions/mean_length']:.1f}"
                if "reward" in figures
                else ""
            )
        )
        self.log.record(
            "train",
            self.step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens_per_s=tok_s,
            ms_per_step=dt * 1e3,
            mfu=mfu,
            peak_mem_gib=mem,
            skipped_steps=self.skipped,
            elapsed=now - self.t_start,
            tokens=self.tokens_seen,
            update_ratio=self.health.update_ratio,
            **figures,
            **({"window": max(self.model.windows.pattern)} if cfg.window_schedule else {}),
        )
        self.health.update_ratio = None

    def _finish(self, last_eval: dict, signum: int | None) -> dict:
        self.figure.close()  # the final figure, with every evaluation
        elapsed = time.time() - self.t_start
        summary = dict(
            step=self.step,
            elapsed=elapsed,
            best_val_loss=self.best_val,
            skipped_steps=self.skipped,
            peak_mem_gib=self.rt.peak_memory_gib(),
            interrupted=signum is not None,
            stopped_by=signal.Signals(signum).name if signum is not None else None,  # the exit status: 128 + it
            **{f"{k}_loss": v for k, v in last_eval.items()},
        )
        self.log.record("summary", self.step, **{k: v for k, v in summary.items() if k != "step"})
        self.log.print(
            f"done: {self.step} steps in {format_duration(elapsed)} | "
            + (f"best val {self.best_val:.4f}" if self.best_val < float("inf") else "not evaluated yet")
            + (f" | {self.skipped} non-finite steps skipped" if self.skipped else "")
            + f" | checkpoints in {self.out_dir}"
        )
        return summary
