"""How the model being trained is laid over the processes: DDP, FSDP2 (`--fsdp`), activation checkpointing.

    torchrun --nproc-per-node 8 -m gpt train --config gpt2_124m --data ... --fsdp --activation-checkpointing

    train_model = parallel.wrap(model, cfg, rt)   # before the optimizer is made: FSDP replaces the parameters
    with parallel.micro_step(train_model, last):  # DDP syncs gradients on the last micro-step only

- **DDP** (torchrun without `--fsdp`): every process holds the whole model, optimizer and gradients;
  gradients are all-reduced.
- **FSDP** (`--fsdp`, under torchrun): `fully_shard` on every transformer block (encoder and decoder),
  then on the root (embeddings, final norm, tied head), as PyTorch's FSDP2 documents. Each process
  keeps 1/N of every parameter, its gradient and its AdamW state (float32); a block's parameters are
  all-gathered just before its forward and again before its backward, and freed after each.
  Mixed precision matches `--dtype`: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`
  gathers bf16 copies and reduces gradients in float32 (float32 runs need no policy); autocast stays
  on as in every other run, so norms, softmax and the loss compute in float32 either way. Gradients
  are reduce-scattered at every micro-step: holding whole gradients until the last one would cost
  the memory FSDP is there to save.
- **Activation checkpointing** (`--activation-checkpointing`, with or without either): each block's
  forward runs under `torch.utils.checkpoint` (non-reentrant), so only its input is kept and the
  rest is recomputed in the backward pass: about one more forward per step for activation memory of
  one block instead of all. Dropout recomputes the same masks (the RNG state is replayed). Installed
  as each block's `wrapper` (gpt/model/block.py's `Block`), so parameter names, state dicts and
  checkpoints do not change.

Footguns
- `--fsdp` needs torchrun (one process is `--nproc-per-node 1`), and refuses float16: GradScaler's
  overflow check would have to agree across shards. Use bf16 (`--dtype auto` picks it on any GPU that
  has it).
- Under FSDP the parameters and state dict entries are DTensor shards: the trainer saves through
  gpt/checkpoints/dcp.py (`torch.distributed.checkpoint`), never `model.state_dict()` into one file.
- With `--compile`, FSDP compiles each block in place (`block.compile()`) before sharding it, as
  torchtitan does; DDP compiles the whole model as before.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from gpt.errors import ConfigError
from gpt.model.transformer import GPT
from gpt.runtime import Runtime
from gpt.train import mesh, tensor_parallel
from gpt.train.config import TrainConfig
from gpt.train.mesh import Layout


def check(cfg: TrainConfig, rt: Runtime) -> None:
    """What --fsdp, --tp and --pp need from this launch, one line each; the trainer asks before touching the run
    directory (and gpt/train/pipeline.py's `check` what a pipeline needs of the run)."""
    if cfg.tp > 1 or cfg.pp > 1:
        if not rt.ddp:
            raise ConfigError(
                "--tp / --pp split the model over the processes torchrun starts: launch with `torchrun "
                "--nproc-per-node N -m gpt train ...` (N a multiple of tp x pp)"
            )
        Layout.of(rt.world_size, cfg.tp, cfg.pp)
        if cfg.tp > 1:
            check_tp(cfg, rt)
    if not cfg.fsdp:
        return
    if not rt.ddp:
        raise ConfigError(
            "--fsdp shards the model over the processes torchrun starts: launch with `torchrun "
            "--nproc-per-node N -m gpt train ... --fsdp` (N = 1 for a single process), or pass --no-fsdp"
        )
    if rt.device.type not in ("cuda", "cpu"):
        raise ConfigError(f"--fsdp runs on CUDA (nccl) or CPU (gloo), not {rt.device.type}")
    if rt.dtype == torch.float16:
        raise ConfigError(
            "--fsdp with float16: loss scaling is not supported with sharded gradients; use "
            "--dtype bfloat16 (or train without --fsdp)"
        )


def check_tp(cfg: TrainConfig, rt: Runtime) -> None:
    """What --tp cannot be combined with in this version, one line each (the model's shape: tensor_parallel.check)."""
    tensor_parallel.check(cfg.model, cfg.tp)
    refused = [
        (
            rt.dtype == torch.float16,
            "float16 (loss scaling's overflow check would differ between shards): use --dtype bfloat16",
        ),
        (cfg.compile, "--compile: not tried with split layers yet; pass --no-compile"),
        (cfg.optimizer == "muon", "--optimizer muon: its orthogonalisation needs whole matrices; use adamw"),
        (cfg.lora_rank > 0, "--lora-rank: adapters are not split; fine-tune without --tp"),
    ]
    for refused_, why in refused:
        if refused_:
            raise ConfigError(f"--tp {cfg.tp} with {why}")


def mixed_precision(dtype: torch.dtype):
    """FSDP's policy for the compute dtype: gathered parameters in it, gradients reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # lazy: distributed

    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def checkpoint_activations(model: GPT) -> None:
    """Recompute every block's activations in the backward pass instead of keeping them."""
    for block in model.blocks():
        block.wrapper = _recomputed


def _recomputed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing to keep anyway
        return forward(*args, **kwargs)
    if torch.compiler.is_compiling():  # the compiled graph fixes its kernels (and dynamo takes no context_fn)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    # Eager, the recomputation runs in the backward pass, outside the forward's contexts: checkpoint
    # replays autocast itself, the attention kernels the runtime chose (gpt/runtime.py) are replayed here.
    kernels = _attention_kernels()
    return checkpoint(
        forward, *args, use_reentrant=False, context_fn=lambda: (nullcontext(), sdpa_kernel(kernels)), **kwargs
    )


def _attention_kernels() -> list:
    """The scaled-dot-product-attention backends enabled now."""
    flags = {
        SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled(),
        SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled(),
        SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled(),
        SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled(),
    }
    return [backend for backend, enabled in flags.items() if enabled]


def shard(model: GPT, dtype: torch.dtype, compile: bool = False, mesh=None) -> None:
    """FSDP2, in place: each block, then the root. The model's class and parameters change (DTensors).
    Every process starts from rank 0's weights, as DDP does (each one seeded its own initialisation).
    `mesh`: the data-parallel sub-mesh of a tensor-parallel run (its model split and broadcast already)."""
    from torch.distributed.fsdp import fully_shard  # lazy: distributed

    if mesh is None:
        with torch.no_grad():
            for t in model.state_dict().values():
                torch.distributed.broadcast(t, src=0)
    policy = mixed_precision(dtype)
    options = compile_options(next(model.parameters()).device)
    for block in model.blocks():
        if compile:
            block.compile(options=options)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def compile_options(device: torch.device) -> dict:
    """Inductor settings for `torch.compile`. On CPU its generated code computes tanh (GPT-2's GELU)
    with a slow vectorised tanh; as 2 / (1 + exp(-2x)) - 1 the GELU kernels and the compiled step are
    faster (AVX2 EPYC, 2 cores: bench/README.md, "Training").
    PyTorch leaves it off by default for one atan2 case (its issue 148241); absolute error ~1e-7."""
    return {"cpp.use_decompose_tanh": True} if device.type == "cpu" else {}


def wrap(model: GPT, cfg: TrainConfig, rt: Runtime) -> nn.Module:
    """The module the training step calls. `model` stays the one evaluated and saved (sharded in place
    under FSDP; the uncompiled, unwrapped module otherwise)."""
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    if cfg.tp > 1 and cfg.pp == 1:  # (a pipeline splits its stages itself: gpt/train/pipeline.py)
        return split(model, cfg, rt)
    if cfg.fsdp:
        if cfg.pp == 1:  # (a pipeline shards each stage over its replicas itself: gpt/train/pipeline.py)
            shard(model, rt.dtype, compile=cfg.compile)
        return model
    train_model = torch.compile(model, options=compile_options(rt.device)) if cfg.compile else model
    if rt.ddp and cfg.pp == 1:  # (a pipeline averages its replicas' gradients itself: gpt/train/pipeline.py)
        from torch.nn.parallel import DistributedDataParallel as DDP  # lazy: distributed

        train_model = DDP(train_model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    return train_model


def split(model: GPT, cfg: TrainConfig, rt: Runtime) -> nn.Module:
    """--tp: the model split over the mesh's "tp" processes (gpt/train/tensor_parallel.py), then over "dp"
    FSDP2-sharded (--fsdp) or replicated, gradients all-reduced (PyTorch's FSDP2-based `replicate`, which takes
    a mesh and split parameters where DDP takes neither)."""
    device_mesh = mesh.build(Layout.of(rt.world_size, cfg.tp, cfg.pp), rt.device.type)
    broadcast(model)
    tensor_parallel.parallelize(model, device_mesh["tp"], sequence_parallel=cfg.sequence_parallel)
    if cfg.fsdp:
        shard(model, rt.dtype, mesh=device_mesh["dp"])
    elif device_mesh["dp"].size() > 1:
        from torch.distributed._composable.replicate_with_fsdp import replicate  # lazy: distributed

        replicate(model, mesh=device_mesh["dp"], mp_policy=mixed_precision(rt.dtype))
    return model


def broadcast(model: nn.Module) -> None:
    """Global rank 0's weights and buffers on every process (each one seeded its own initialisation)."""
    with torch.no_grad():
        for t in model.state_dict().values():
            torch.distributed.broadcast(t, src=0)


def by_mesh(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The positions of `tensors` grouped by the mesh each is split over (plain tensors in a group of their
    own): multi-tensor ops take one kind at a time (a tensor-parallel model's norms stay whole, and under
    --fsdp its split matrices live on a 2-D mesh, the rest on the data-parallel one)."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(getattr(t, "device_mesh", None), []).append(i)
    return list(groups.values())


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, counted=None, group=None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters split over different meshes or not at all (see
    `by_mesh`): each kind's norm apart, then one total norm and one clipping factor for all. For a pipeline's
    stages (gpt/train/pipeline.py): `counted`, the parameters whose gradients the norm counts (a tied copy that
    two stages hold counted once), and `group`, the processes holding the rest of the model, whose norms it adds."""
    params = [p for p in params if p.grad is not None]
    kinds = [[params[i] for i in group] for group in by_mesh([p.grad for p in params])]
    if len(kinds) < 2 and counted is None and group is None:
        return full(torch.nn.utils.clip_grad_norm_(params, max_norm))
    grads = [p.grad for p in (params if counted is None else counted) if p.grad is not None]
    total = torch.stack([full(torch.nn.utils.get_total_norm([grads[i] for i in k])) for k in by_mesh(grads)]).norm()
    if group is not None:
        squares = total.float().square()
        torch.distributed.all_reduce(squares, group=group)
        total = squares.sqrt()
    for k in kinds:
        torch.nn.utils.clip_grads_with_norm_(k, max_norm, total)
    return total


def micro_step(train_model: nn.Module, last: bool):
    """The context of one micro-step's forward and backward: DDP skips the gradient all-reduce on all
    but the last; FSDP reduce-scatters every time (see the module notes)."""
    from torch.nn.parallel import DistributedDataParallel as DDP  # lazy: distributed

    return train_model.no_sync() if isinstance(train_model, DDP) and not last else nullcontext()


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the whole value of `t` (a DTensor's is gathered, a collective)."""
    from torch.distributed.tensor import DTensor  # lazy: distributed

    return t.full_tensor() if isinstance(t, DTensor) else t


def all_finite(model: nn.Module, rt: Runtime) -> bool:
    """Whether every parameter is finite, on every process (each checks its own shards under FSDP)."""
    from torch.distributed.tensor import DTensor  # lazy: distributed

    local = all(bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()) for p in model.parameters())
    if not rt.ddp:
        return local
    flag = torch.tensor([float(local)], device=rt.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())
