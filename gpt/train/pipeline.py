"""Pipeline parallelism (`--pp N`): the decoder's layers split into stages that micro-batches flow through.

    torchrun --nproc-per-node 2 -m gpt train --data ... --pp 2 --grad-accum 8                 # 1F1B, 2 stages
    torchrun --nproc-per-node 2 -m gpt train --data ... --pp 2 --pp-schedule interleaved      # 4 stages, 2 each
    torchrun --nproc-per-node 4 -m gpt train --data ... --pp 2 --grad-accum 8  # 2 stages x 2 data replicas
    torchrun --nproc-per-node 4 -m gpt train --data ... --pp 2 --grad-accum 8 --fsdp  # each stage sharded over 2
    torchrun --nproc-per-node 4 -m gpt train --data ... --pp 2 --tp 2 --grad-accum 8  # each stage split over 2

    pipe = pipeline.Pipeline(model, cfg, rt)     # this process's stages; `pipe.part` is what it trains and saves
    loss, grad_norm, tokens = pipe.train_step(pipe.part, optimizer, scaler, task.train_batch, step, accum, rt, clip)
    losses = pipe.estimate_loss(pipe.part, task, ("val",), rt)
    plan.stage_memory(shape, pp=4, micro_batches=8, schedule="1f1b")       # gpt/train/plan.py, `gpt plan --pp 4`

Built on `torch.distributed.pipelining`: each stage a `PipelineStage`, driven by a schedule: `gpipe`
(every micro-batch's forward, then every backward: simplest, activations of all micro-batches kept),
`1f1b` (one forward, one backward once the pipeline is full: activations of at most N micro-batches
kept; the default) or `interleaved` (`ScheduleInterleaved1F1B` over 2N stages, two per process,
looped: stage s on process s mod N). The idle share of a step, the bubble, is (N - 1) / (M + N - 1)
for M micro-batches through N stages with GPipe and 1F1B, and about half that interleaved.

- **Stages.** The decoder's layers are cut into equal runs (the first stages take one more where
  they do not divide). The first stage also holds the token and position embeddings; the last the
  final norm, the head and the loss. A stage is a `Stage`, a `GPT` holding only its parts under the
  whole model's names (`transformer.h.5.attn.c_attn.weight` is called that on whichever process
  holds it), so DCP checkpoints written in any layout read in any other, and `gpt dcp convert`
  gives the one-file checkpoint `gpt sample` reads. `part` is all of this process's stages in one
  such module: what the optimizer steps, the trainer saves and checks for finite weights.
- **Micro-batches** are the run's gradient accumulation: the `grad_accum / dp` micro-batches of a
  step are concatenated and the schedule cuts them apart again, so every stage sees the micro-batch
  a one-process run would. The schedule divides each micro-batch's gradient by their number, as the
  one-process step divides each micro-loss.
- **The tied head.** The head's matrix is the token embedding's (`wte`), on the first stage; the
  last stage holds a copy of its own (`transformer.wte` there, `lm_head.weight` its alias, as in the
  whole model). After each step's backward the two gradients are summed between the first and the
  last stage (Megatron's way), so both copies take the same optimizer step and stay equal; the
  gradient norm counts the matrix once. Checkpoints hold it once (DCP keeps one of equal keys).
- **Data parallel.** With more processes than stages (dp = world / pp), each stage's gradients are
  averaged over its data replicas after the schedule (an all-reduce per parameter: DDP's result, not
  its overlap); with --fsdp each stage is sharded over its replicas instead (FSDP2 on the mesh's "dp"
  dimension, which reduces the gradients itself). All stages of one pipeline read the same batches: the
  data-parallel rank picks them.
- **Tensor parallel.** With `--tp`, each stage's blocks, embedding and head are split over the mesh's "tp"
  processes as gpt/train/tensor_parallel.py splits a whole model, after the stages are cut (every process
  of a tp group holds the same stages; each tp rank has its own pipeline, `mesh["pp"]`). The last stage
  gathers its logits (a stage hands plain tensors on); the embedding's gradient, whole on the first
  stage, is split like the head's before the two are summed.
- **The loss** is known on the last stage only: it is summed over the pipeline's processes (the
  others add zero), so every process logs and checks the same value. Evaluation runs the stages in
  order by point-to-point sends (no schedule, no gradients) and shares the last stage's sum.
- The processes are the "pp" dimension of the run's DeviceMesh (gpt/train/mesh.py): the pipeline's
  group is `mesh["pp"]`, the replicas `mesh["dp"]`, the tensor shards `mesh["tp"]`.

Footguns
- Every process builds the whole model once (rank 0's initial weights are broadcast, as DDP does),
  then keeps its stages' parts: a model must fit one process's memory at start-up.
- Not with: --lora-rank, seq2seq models, packed chat data, x0_skip, value_embeds, --compile,
  --sequence-parallel, float16 (the checks in `problems` name each). Dropout draws from each process's
  own generator, so a run with dropout is not the one-process run's bit for bit (its distribution is
  the same).
- A step needs at least N micro-batches per replica (--grad-accum >= N x dp): fewer leaves stages idle
  and 1F1B refuses them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gpt.data.format import dataset_kind
from gpt.errors import ConfigError
from gpt.model.transformer import GPT
from gpt.runtime import Runtime
from gpt.train import tensor_parallel
from gpt.train.config import TrainConfig
from gpt.train.mesh import Layout, build
from gpt.train.parallel import broadcast, clip_grad_norm, mixed_precision

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def problems(cfg: TrainConfig, rt: Runtime) -> list[str]:
    """What stops `cfg` running as a pipeline over the processes of `rt`, one line each."""
    out, m, pp, world_size = [], cfg.model, cfg.pp, rt.world_size
    stages = pp * (2 if cfg.pp_schedule == "interleaved" else 1)
    if m.n_layer < stages:
        what = f"{stages} stages ({pp} processes x 2, interleaved)" if stages != pp else f"{pp} stages"
        out.append(f"--pp {pp}: {what} need at least as many layers, the model has {m.n_layer}")
    kind = dataset_kind(cfg.data) if cfg.data else "tokens"
    refused = {
        "--lora-rank": cfg.lora_rank > 0,
        "--compile": cfg.compile,
        "a seq2seq model (n_encoder_layer)": m.n_encoder_layer > 0,
        "--x0-skip": m.x0_skip,
        "--value-embeds": m.value_embeds,
        "float16 (loss scaling over stages): use --dtype bfloat16": rt.dtype == torch.float16,
        "--batch-size auto": cfg.batch_size == 0,
        "--sequence-parallel (stages hand whole sequences on)": cfg.sequence_parallel,
        f"a {kind} dataset (token streams only)": kind != "tokens",
    }
    out += [f"--pp: not with {name} in this version" for name, on in refused.items() if on]
    if world_size % pp == 0 and cfg.batch_size:
        dp = world_size // (pp * cfg.tp)
        if dp and cfg.grad_accum % dp == 0 and cfg.grad_accum // dp < pp:
            out.append(
                f"--grad-accum {cfg.grad_accum}: a pipeline of {pp} stages needs at least {pp} micro-batches per "
                f"data replica: pass --grad-accum {pp * dp} or more"
            )
    return out


def check(cfg: TrainConfig, rt: Runtime) -> None:
    """The first of `problems` as a ConfigError, when --pp asks for stages (after gpt/train/parallel.py's `check`)."""
    found = problems(cfg, rt) if cfg.pp > 1 else []
    if found:
        raise ConfigError(found[0])


def split(n_layer: int, n_stages: int) -> list[range]:
    """The layers of each stage: equal runs, the first ones one longer where they do not divide."""
    size, extra = divmod(n_layer, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + size + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def in_flight(pp: int, rank: int, micro_batches: int, schedule: str) -> int:
    """Micro-batches whose activations process `rank` holds at once (per stage it runs, interleaved: per chunk):
    GPipe all of them; 1F1B those sent in before the first comes back, pp - rank; interleaved (two chunks a
    process) Megatron's warm-up count, 2 (pp - rank - 1) + pp, plus the one computing."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "interleaved":
        return min(2 * micro_batches, 2 * (pp - rank - 1) + pp + 1)
    return min(micro_batches, pp - rank)


def bubble(pp: int, micro_batches: int, schedule: str) -> float:
    """The share of a step a process idles while the pipeline fills and drains: (pp - 1) / (M + pp - 1) for M
    micro-batches, with M counted twice interleaved (each process runs two chunks of half the layers)."""
    m = micro_batches * (2 if schedule == "interleaved" else 1)
    return (pp - 1) / (m + pp - 1)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of `t`: a DTensor's local shard (sharing its storage), else `t`."""
    from torch.distributed.tensor import DTensor  # lazy: distributed

    return t.to_local() if isinstance(t, DTensor) else t


class Stage(GPT):
    """The parts of `model` that `layers` (and the embedding when `first`, the final norm and head when `last`)
    make, under the whole model's parameter names. A `GPT` for what reads it (parameter groups, counts,
    blocks); `forward` runs this stage only."""

    def __init__(self, model: GPT, layers, first: bool, last: bool):
        nn.Module.__init__(self)
        self.config, self.positions, self.first, self.last = model.config, model.positions, first, last
        self.windows = model.windows  # each layer's attention window, by its index in the whole model
        t, tied = model.transformer, not model.config.untied_head
        parts = {}
        if first or (last and tied):  # the last stage's copy of the tied matrix (see the module notes)
            parts["wte"] = t.wte
        if first:
            if "wpe" in t:
                parts["wpe"] = t.wpe
            parts["drop"] = t.drop
        parts["h"] = nn.ModuleDict({str(i): t.h[i] for i in layers})  # keyed as the ModuleList indexes them
        if last:
            parts["ln_f"] = t.ln_f
        self.transformer = nn.ModuleDict(parts)
        if first and model.positions.adds == "pe":  # the fixed table, a buffer
            self.register_buffer("pe", model.pe, persistent=False)
        self.lm_head = model.lm_head if last else None  # (None: what `param_groups` leaves out of Muon's matrices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or the previous stage's hidden states in; hidden states, or the last
        stage's logits, out."""
        h = self.embed(x) if self.first else x
        rope = self.rope(0, h.size(1), h.device)
        bands = self.bands(None, None, h.size(1), causal=True)  # windowed layers (gpt/model/sparse.py), or None
        for i, block in self.transformer.h.items():
            h = block(h, mask=bands[int(i)] if bands else None, causal=True, rope=rope)
        return self.head(self.transformer.ln_f(h)) if self.last else h

    def blocks(self) -> list:
        return list(self.transformer.h.values())


class Pipeline:
    """This process's stages of `model`, the groups they talk in, and the step and evaluation through them."""

    def __init__(self, model: GPT, cfg: TrainConfig, rt: Runtime):
        self.cfg, self.rt = cfg, rt
        self.layout = Layout.of(rt.world_size, cfg.tp, cfg.pp)
        self.mesh = build(self.layout, rt.device.type)
        self.group = self.mesh["pp"].get_group()
        self.dp_group = self.mesh["dp"].get_group() if self.layout.dp > 1 else None
        self.pp_rank = self.mesh["pp"].get_local_rank()
        broadcast(model)  # every process starts from rank 0's weights, as under DDP
        # the whole model's names, in its order, and its tied names: what a checkpoint of all the parts holds
        self.whole = {
            "names": [n for n, _ in model.named_parameters()],
            "aliases": {"lm_head.weight": "transformer.wte.weight"} if not model.config.untied_head else {},
        }
        pp, n_stages = cfg.pp, cfg.pp * (2 if cfg.pp_schedule == "interleaved" else 1)
        self.n_stages = n_stages
        runs = split(model.config.n_layer, n_stages)
        self.local = [s for s in range(n_stages) if s % pp == self.pp_rank]  # looped: s on process s mod pp
        self.modules = {s: Stage(model, runs[s], s == 0, s == n_stages - 1) for s in self.local}
        mine = [i for s in self.local for i in runs[s]]
        self.part = Stage(model, mine, 0 in self.local, n_stages - 1 in self.local)
        self.has_first, self.has_last = 0 in self.local, n_stages - 1 in self.local
        self.tie_group = self._tie_group() if not model.config.untied_head else None
        if cfg.tp > 1:  # each stage's matrices split over its tensor-parallel group, the logits gathered
            tensor_parallel.parallelize(self.part, self.mesh["tp"], gather_logits=True)
        if cfg.fsdp:  # each stage sharded over its data replicas
            self._shard(rt.dtype)
        self.schedule, self.accum = None, None
        self.description = (
            f"pipeline: {n_stages} stages ({cfg.pp_schedule}) over {pp} processes x {self.layout.dp} data "
            f"replica(s); this process: layers {', '.join(f'{r.start}-{r.stop - 1}' for r in map(runs.__getitem__, self.local))}"
        )

    def _shard(self, dtype: torch.dtype) -> None:
        """FSDP2 on the "dp" sub-mesh, as gpt/train/parallel.py shards a whole model: each block, then each
        stage as the root of its embeddings, final norm and head. The part shares the stages' modules."""
        from torch.distributed.fsdp import fully_shard  # lazy: distributed

        policy, dp = mixed_precision(dtype), self.mesh["dp"]
        for stage in self.modules.values():
            for block in stage.blocks():
                fully_shard(block, mesh=dp, mp_policy=policy)
            fully_shard(stage, mesh=dp, mp_policy=policy)

    def _tie_group(self):
        """The group of the first and the last stage of this process's pipeline (every process makes every
        such group: new_group is collective)."""
        ranks, mine = self.mesh.mesh, None  # (pp, dp, tp) global ranks
        for d in range(self.layout.dp):
            for t in range(self.layout.tp):
                pair = [int(ranks[0, d, t]), int(ranks[-1, d, t])]
                group = dist.new_group(pair)
                if self.rt.rank in pair:
                    mine = group
        return mine

    def _schedule(self, accum: int):
        """The schedule for `accum` micro-batches a step (made at the first step: the trainer knows `accum` then)."""
        from torch.distributed.pipelining import (  # lazy: distributed
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        if self.schedule is not None and self.accum == accum:
            return self.schedule
        stages = [
            PipelineStage(self.modules[s], s, self.n_stages, self.rt.device, group=self.group) for s in self.local
        ]
        loss = self.part.loss  # a micro-batch's mean loss; the schedule scales gradients by 1 / accum
        if self.cfg.pp_schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(stages, accum, loss_fn=loss)
        else:
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.cfg.pp_schedule]
            self.schedule = kind(stages[0], accum, loss_fn=loss)
        self.accum = accum
        return self.schedule

    def train_step(
        self, train_model, optimizer, scaler, get_batch, step, accum, rt, grad_clip, count=None, loss_context=None
    ):
        """`step.train_step` through the pipeline: (mean loss, gradient norm, tokens), the loss and norm the
        same on every process, the tokens counted on the first stage only (the trainer sums them over all)."""
        schedule = self._schedule(accum)
        batches = [get_batch(step, micro) for micro in range(accum)]
        idx, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        losses = []
        with rt.autocast():
            if self.has_first:
                schedule.step(idx, target=targets, losses=losses)
            else:
                schedule.step(target=targets, losses=losses)
        total = torch.zeros((), device=rt.device)
        for loss in losses:  # (the last stage's; in the order the one-process step adds them)
            total += loss.detach() / accum
        dist.all_reduce(total, group=self.group)
        params = [p for p in self.part.parameters() if p.grad is not None]
        self._sync_gradients(params)
        norm = self._clip(params, grad_clip)
        tokens = sum(count(b) for b in batches) if count and self.has_first else 0
        return total, norm, torch.as_tensor(tokens, device=rt.device)

    def _sync_gradients(self, params: list[torch.Tensor]) -> None:
        if self.dp_group is not None and not self.cfg.fsdp:  # the replicas' mean, as DDP's (FSDP has reduced them)
            for p in params:
                dist.all_reduce(_local(p.grad), group=self.dp_group)
                p.grad.div_(self.layout.dp)
        if self.tie_group is not None:  # the embedding's and the head's gradients, on both copies (same shards)
            wte = self.part.transformer.wte.weight
            if getattr(wte.grad, "placements", None) != getattr(wte, "placements", None):  # --tp: the embedding's
                wte.grad = wte.grad.redistribute(wte.device_mesh, wte.placements)  # whole, the head's split: split
            dist.all_reduce(_local(wte.grad), group=self.tie_group)

    def _clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The whole model's gradient norm (the tied matrix once), and the gradients clipped to `max_norm`."""
        copy = self.part.transformer.wte.weight if self.tie_group is not None and not self.has_first else None
        counted = [p for p in params if p is not copy]
        return clip_grad_norm(params, max_norm if max_norm > 0 else float("inf"), counted, self.group)

    @torch.no_grad()
    def estimate_loss(self, model, task, splits=("train", "val"), rt: Runtime | None = None) -> dict[str, float]:
        """`step.estimate_loss` through the stages in order; every process returns the last stage's figures."""
        was_training = self.part.training
        self.part.eval()
        out = {}
        owner = [dist.get_global_rank(self.group, s % self.cfg.pp) for s in range(self.n_stages)]
        for split in splits:
            total, count = torch.zeros((), dtype=torch.float64, device=self.rt.device), 0
            for idx, targets, *_ in task.eval_batches(split):
                x = idx
                for s in self.local:
                    if s > 0:
                        x = torch.empty(*idx.shape, self.cfg.model.n_embd, device=self.rt.device)
                        dist.recv(x, src=owner[s - 1])
                    with self.rt.autocast():
                        x = self.modules[s](x)
                    if s < self.n_stages - 1:
                        dist.send(x.float().contiguous(), dst=owner[s + 1])
                if self.has_last:
                    total += F.cross_entropy(
                        x.flatten(0, 1).float(), targets.flatten(), ignore_index=-1, reduction="sum"
                    ).double()
                count += int((targets != -1).sum())
            dist.all_reduce(total, group=self.group)
            out[split] = total.item() / max(count, 1)
        self.part.train(was_training)
        return out
