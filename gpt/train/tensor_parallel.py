"""Tensor parallelism (`--tp N`): each block's matrices split over the N processes of the mesh's "tp" dimension.

    torchrun --nproc-per-node 2 -m gpt train --config ... --data ... --tp 2          # 2 shards
    torchrun --nproc-per-node 4 -m gpt train ... --tp 2 --fsdp                      # 2 replicas x 2 shards, FSDP2
    torchrun --nproc-per-node 2 -m gpt train ... --tp 2 --sequence-parallel         # + norms on sequence shards

    tensor_parallel.check(model_config, cfg.tp)      # one line per refusal, before any work
    tensor_parallel.parallelize(model, mesh["tp"], sequence_parallel=False)   # in place, before FSDP, optimizer
    with tensor_parallel.loss_context(model): ...    # forward and backward of a step (vocabulary-parallel loss)

Megatron's split, written as `parallelize_module` plans (torch.distributed.tensor.parallel):

| module                       | split                 | each process holds              | communication             |
|------------------------------|-----------------------|---------------------------------|---------------------------|
| `attn.c_attn` (q, k, v fused) | column-wise           | q, k and v of its n_head/N heads | input: gradient all-reduce |
| `attn.c_proj`                | row-wise              | its heads' input columns         | output all-reduce         |
| `mlp.c_fc` / `mlp.c_proj`    | column- / row-wise    | 4C/N hidden units                | as attention              |
| `transformer.wte`            | along the vocabulary  | vocab/N rows (uneven is fine)    | output all-reduce         |
| `lm_head` (tied to wte)      | along the vocabulary  | the same rows (one parameter)    | none: loss_parallel       |
| `encoder.h.*` (seq2seq)      | as the decoder's blocks | as the decoder's blocks        | as the decoder's blocks   |
| `cross_attn.c_attn` / `c_proj` | column- / row-wise  | q, k and v of its heads          | as attention              |

- **q, k, v**: `c_attn` holds the three projections one after another, so a plain column-wise split
  would give the first process every query and half the keys. Before the split its rows are put in
  the order [q, k, v of process 0's heads, then process 1's, ...] (`fused_order`), so each process's
  contiguous shard is its own heads' q, k and v, and each attention module computes `n_head / N`
  heads. Checkpoints keep the one-process order: `SavedLayout` (used by gpt/checkpoints/dcp.py's
  save and load) turns the weight, its bias and their AdamW moments back into it and out of it, so
  parameter names and saved tensors are those of a one-process run and a checkpoint resumes in any
  layout.
- **Loss without full logits**: the head's logits stay split along the vocabulary (a DTensor) and the
  cross-entropy runs under `loss_parallel()`, which reduces max, sum-exp and the target's logit over
  the processes instead of gathering (vocab x tokens) floats. With label smoothing, which
  loss_parallel does not take, the head gathers the logits instead. Evaluation gathers them
  (no gradients kept).
- **Seq2seq**: the encoder's blocks take the decoder's plan; cross-attention's fused matrix is
  reordered and split as self-attention's (`split_seq2seq`), and `Attention` reads q and k, v as
  slices of this process's shard ([q | k | v] of its heads, n_embd / N rows each) through a DTensor
  product, so the replicated input's gradient is summed over the processes as `ColwiseParallel` does.
  `SavedLayout` finds every fused matrix by its name's ending (`attn.c_attn`, `cross_attn.c_attn`).
  Encoder and decoder read the one split embedding.
- Norms, position embeddings, dropout and x0_skip's scalars are not split: every process of a group
  computes them on the same (replicated) activations, unless --sequence-parallel.
- **Sequence parallelism** (`--sequence-parallel`, `sequence_plan` and `sequence_split`, as Megatron-SP and
  torchtitan): between the attention and MLP layers the residual stream is a DTensor split along the
  sequence (dim 1), so the norms (`SequenceParallel`, their weights replicated DTensors), the residual
  dropouts and the adds run on T/N positions and keep T/N positions' activations for the backward. Each
  attention / MLP gathers its input whole (`PrepareModuleInput`, an all-gather) and its row-wise output
  projection reduce-scatters instead of all-reducing (`RowwiseParallel(output_layouts=Shard(1))`): the
  same traffic. Positions (learned wpe, sinusoidal) are added to the whole embedding before it is
  split at the embedding dropout (`transformer.drop`), rope inside attention on the gathered sequence,
  so every encoding is right as it is; the head gathers ln_f's shards (`ColwiseParallel(input_layouts=
  Shard(1))`); the encoder's output is gathered once for every cross-attention; x0_skip's scalars become
  replicated DTensors. Uneven lengths (seq2seq batches) are fine: DTensor pads the collectives. The
  split matrices' inputs (gathered) and attention itself are saved whole as before, so the saving is
  the norms', dropouts' and residual adds' share of the saved activations (modest on small models).

Refused in one line (`check`): heads not divisible by N, value embeddings (per-head gates over a width the split divides).
Every positional encoding (learned, sinusoidal, rope), qk_norm, relu2, post-norm, logit_softcap,
untied_head, x0_skip, zero_init_proj, label smoothing, dropout and the seq2seq model work.

Footguns
- With --sequence-parallel and dropout, the processes of a group draw the same mask pattern on their
  different sequence shards (the RNG follows the data-parallel rank), as attention dropout already does
  on their different heads: the masks are correlated across shards, not wrong per position.
- Every process of a tp group must see the same batch and the same dropout masks on the replicated
  activations: batches are picked by the data-parallel rank and the RNG is seeded by it
  (gpt/train/trainer.py), never by the global rank.
- A save gathers each `c_attn` weight, bias and moment whole on every process of its tp group (and
  of its dp group under --fsdp) to put it in the one-process order (the rest is written shard by shard).
- With data parallelism but without --fsdp the replicas are kept in step by `replicate` from
  `torch.distributed._composable` (FSDP2's, private in PyTorch 2.13): DDP takes neither a mesh nor
  DTensor parameters.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from gpt.errors import ConfigError
from gpt.model.config import GPTConfig

FUSED = ("attn.c_attn.weight", "attn.c_attn.bias")  # names ending so hold q, k, v one after another


def check(config: GPTConfig, tp: int) -> None:
    """Whether `config`'s model splits over `tp` processes; one line naming what does not."""
    if tp <= 1:
        return
    if config.n_head % tp:
        raise ConfigError(f"--tp {tp}: must divide the model's {config.n_head} attention heads (--n-head)")
    if config.n_embd % tp:
        raise ConfigError(f"--tp {tp}: must divide the model's width {config.n_embd} (--n-embd)")
    if config.value_embeds:
        raise ConfigError(f"--tp {tp}: value_embeds is not split in this version; train without it or without --tp")


def fused_order(rows: int, tp: int) -> torch.Tensor:
    """The rows of a fused q|k|v tensor (3C rows) in the order its tp-split copy holds them: each
    process's contiguous share is [its q rows, its k rows, its v rows]."""
    return torch.arange(rows).view(3, tp, rows // (3 * tp)).transpose(0, 1).reshape(-1)


def _grouped(t: torch.Tensor, tp: int) -> torch.Tensor:
    return t[fused_order(t.size(0), tp).to(t.device)]


def _ungrouped(t: torch.Tensor, tp: int) -> torch.Tensor:
    return t[torch.argsort(fused_order(t.size(0), tp)).to(t.device)]


def parallelize(model: nn.Module, mesh, sequence_parallel: bool = False, gather_logits: bool = False) -> None:
    """Split `model` (a GPT, decoder-only or seq2seq, checked by `check`, or a pipeline stage of a decoder: its
    blocks, and the embedding and head where it holds them) over the 1-D "tp" `mesh`, in place. Every process
    of the group must hold the same weights (the caller broadcasts rank 0's). `gather_logits`: the head's
    output whole (a pipeline stage hands plain tensors on); otherwise split along the vocabulary for
    `loss_context`."""
    from torch.distributed.tensor import Replicate, Shard  # lazy: distributed
    from torch.distributed.tensor.parallel import (  # lazy: distributed
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = mesh.size()
    decoder = list(model.transformer.h.children())  # (a GPT's list, a pipeline stage's dict)
    for block in decoder:
        _regroup(block.attn.c_attn, tp)
    plan = {
        "attn.c_attn": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }
    if sequence_parallel:
        plan.update(sequence_plan("attn", "mlp"))
    for block in decoder:
        parallelize_module(block, mesh, plan)
        block.attn.n_head = model.config.n_head // tp
    wte, head = model.transformer["wte"] if "wte" in model.transformer else None, model.lm_head
    tied = head is not None and wte is not None and head.weight is wte.weight
    model.split_logits = model.config.label_smoothing == 0 and not gather_logits  # loss_parallel: no smoothing
    ends = {}
    if wte is not None:
        ends["transformer.wte"] = RowwiseParallel(input_layouts=Replicate())
    if head is not None:
        split = model.split_logits
        ends["lm_head"] = ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if split else Replicate(),
            use_local_output=not split,
        )
    parallelize_module(model, mesh, ends)
    if sequence_parallel:
        sequence_split(model, mesh)
    if tied:  # the plans made two parameters of the one matrix: the head reads the embedding's again
        model.lm_head.weight = model.transformer.wte.weight
    split_seq2seq(model, mesh, plan, sequence_parallel)


def split_seq2seq(model: nn.Module, mesh, plan: dict, sequence_parallel: bool = False) -> None:
    """The seq2seq parts of `parallelize`: the encoder's blocks split by `plan` as the decoder's, and each
    decoder block's cross-attention by heads (its fused q|k|v reordered as self-attention's; Attention reads
    q and k, v as slices of this process's shard). Nothing for a decoder-only model. The embedding, split by
    `parallelize`, is the one table both stacks read."""
    from torch.distributed.tensor.parallel import (  # lazy: distributed
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = mesh.size()
    encoder = getattr(model, "encoder", None)
    crossing = [b for b in model.transformer.h.children() if hasattr(b, "cross_attn")]
    cross_plan = {"cross_attn.c_attn": ColwiseParallel(), "cross_attn.c_proj": RowwiseParallel()}
    if sequence_parallel:
        cross_plan.update(sequence_plan("cross_attn", norms=("ln_cross",)))
    for block in encoder.h.children() if encoder is not None else ():
        _regroup(block.attn.c_attn, tp)
        parallelize_module(block, mesh, plan)
        block.attn.n_head = model.config.n_head // tp
    for block in crossing:
        _regroup(block.cross_attn.c_attn, tp)
        parallelize_module(block, mesh, cross_plan)
        block.cross_attn.n_head = model.config.n_head // tp


def sequence_plan(*layers: str, norms: tuple[str, ...] = ("ln_1", "ln_2")) -> dict:
    """Sequence parallelism's entries of a block's plan: the block's input and output and its norms on
    sequence shards (dim 1), each of `layers` (an attention or MLP) gathering its input whole and its
    row-wise output projection reduce-scattering back to shards (dropout after it runs on the shards)."""
    from torch.distributed.tensor import Replicate, Shard  # lazy: distributed
    from torch.distributed.tensor.parallel import (  # lazy: distributed
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {norm: SequenceParallel() for norm in norms}
    for layer in layers:
        plan[layer] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        plan[f"{layer}.c_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


def sequence_split(model: nn.Module, mesh) -> None:
    """Sequence parallelism's model-level entries: the embedding's output (with its positions, whole) split
    into sequence shards at the embedding dropout, the final norms on shards, the encoder's output gathered
    once for every cross-attention."""
    from torch.distributed.tensor import Replicate, Shard  # lazy: distributed
    from torch.distributed.tensor.parallel import (  # lazy: distributed
        PrepareModuleInput,
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "transformer.drop": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
        ),
        "transformer.ln_f": SequenceParallel(),
    }
    if getattr(model, "encoder", None) is not None:
        plan["encoder.ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    from torch.distributed.tensor import DTensor  # lazy: distributed

    for name in ("resid_lambdas", "x0_lambdas"):  # x0_skip's scalars scale the sharded stream: replicated DTensors
        if hasattr(model, name):
            p = getattr(model, name)
            setattr(model, name, nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False)))
    if getattr(model, "encoder", None) is not None:
        gather = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)
        parallelize_module(model.encoder.ln_f, mesh, gather)


def _regroup(c_attn: nn.Linear, tp: int) -> None:
    """A fused q|k|v projection's rows (weight and bias) in `fused_order`, in place, before its split."""
    with torch.no_grad():
        c_attn.weight.copy_(_grouped(c_attn.weight, tp))
        if c_attn.bias is not None:
            c_attn.bias.copy_(_grouped(c_attn.bias, tp))


def held(model: nn.Module) -> int:
    """The parameter elements this process holds (a split parameter's local shard; a tied one once)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())


def loss_context(model: nn.Module):
    """The context of a training step's forward and backward: `loss_parallel` when the logits are split."""
    if not getattr(model, "split_logits", False):
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel  # lazy: distributed

    return loss_parallel()


def _is_fused(name: str) -> bool:
    return name.endswith(FUSED)


class SavedLayout:
    """Between a tp-split model's state (DCP's `get_state_dict`: model and optimizer state keyed by name)
    and the one-process layout checkpoints hold: the fused q|k|v tensors reordered (see the module notes)."""

    def __init__(self, tp: int):
        self.tp = tp

    def _each(self, model_state: dict, optim_state: dict, fn) -> tuple[dict, dict]:
        model_state = {k: fn(v) if _is_fused(k) else v for k, v in model_state.items()}
        optim_state = {
            k: {m: fn(v) if _is_fused(k) and v.dim() > 0 else v for m, v in s.items()} if isinstance(s, dict) else s
            for k, s in optim_state.items()
        }
        return model_state, optim_state

    def saved(self, model_state: dict, optim_state: dict) -> tuple[dict, dict]:
        """The state with the fused tensors in the one-process order (split the same way on the tp dim)."""
        return self._each(model_state, optim_state, self._to_saved)

    def placeholders(self, model_state: dict, optim_state: dict) -> tuple[dict, dict]:
        """Tensors for DCP's load to fill with a checkpoint's (one-process order) values."""
        return self._each(model_state, optim_state, self._placeholder)

    def restored(self, loaded: dict, like: dict) -> dict:
        """Loaded one-process-order fused tensors back in this model's layout (`like`: get_state_dict's)."""
        out = {}
        for k, v in loaded.items():
            if isinstance(v, dict):
                out[k] = {
                    m: self._from_saved(t, like[k][m]) if _is_fused(k) and t.dim() > 0 else t for m, t in v.items()
                }
            else:
                out[k] = self._from_saved(v, like[k]) if _is_fused(k) else v
        return out

    def from_whole(self, model_state: dict, optim_state: dict) -> tuple[dict, dict]:
        """A whole (one-file) checkpoint's state in the order the split model wants before distributing."""
        return self._each(model_state, optim_state, lambda t: _grouped(t, self.tp))

    @staticmethod
    def _split(whole: torch.Tensor, like):
        """`whole` as a DTensor on `like`'s mesh: rows split over "tp", replicated over the other dimensions."""
        from torch.distributed.tensor import DTensor, Replicate, Shard  # lazy: distributed

        mesh = like.device_mesh
        names = mesh.mesh_dim_names
        placements = [Shard(0) if name == "tp" else Replicate() for name in names]
        local = whole.chunk(mesh["tp"].size())[mesh.get_local_rank("tp")].contiguous()
        return DTensor.from_local(local, mesh, placements, shape=whole.shape, stride=whole.stride())

    def _to_saved(self, t):
        return self._split(_ungrouped(t.full_tensor(), self.tp), t)

    def _placeholder(self, t):
        return self._split(torch.zeros(t.shape, dtype=t.dtype, device=t.to_local().device), t)

    def _from_saved(self, saved, like):
        from torch.distributed.tensor import distribute_tensor  # lazy: distributed

        whole = _grouped(saved.full_tensor(), self.tp)
        return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)
