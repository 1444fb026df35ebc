"""CPU inference: the Linear layers' weights laid out for the matrix-vector products of decoding.

    from gpt.model.packed import pack
    pack(model)        # in place; float32, bf16 or int8 on the CPU; what load_for_inference does there
    pack(model, kernels=False)   # PyTorch's kernels only, as on a machine without a C compiler
    pack(model, kernels=False, chunks=4)   # float32's big matrices in 4 column blocks (default: the threads)

Where the machine builds them (gpt/model/rowkernels.py: a C compiler, Linux), every Linear layer becomes a
`RowLinear`: our own kernels, with the weights in 64-output blocks (float32, bf16, int8). Otherwise, or with
`kernels=False`, PyTorch's kernels with the layouts below (int8 keeps Int8Linear).

A decode step multiplies one row per sequence by every weight matrix, so it is bound by how fast the
kernel streams the weights from memory. `nn.Linear` computes x @ W.T on an (out, in) weight, and for
one row the CPU kernels behind it stream that layout far below the memory's bandwidth. What each layout
gains in tokens/s (GPT-2 124M's shape and the char model, greedy decode, bench/bench_sampling.py `--runs
layout`) is in bench/README.md, "CPU weight layout":
- float32: the weight stored transposed, (in, out) contiguous (still an nn.Linear: F.linear hands MKL's
  gemm a non-transposed operand). (oneDNN's packed float32 layout was as fast at one thread but stalled
  at two.) The token embedding reads its rows from the same matrix.
- float32 at several threads: MKL runs a one-row product on ONE thread whatever the thread count (a
  1x768 @ 768x3072 product streamed as fast at one thread as at two). `ChunkedLinear` splits the output
  features into one column block per thread, (chunks, in, out / chunks) contiguous, and multiplies them
  with one `torch.bmm`, which gives each thread a block: GPT-2's blocks and its 50304-wide head stream
  faster at two threads (the lead's measurement, quiet Zen 4). Only matrices of at least CHUNK_BYTES
  (smaller ones sit in cache, where the extra ops per layer cost more than they save).
- bf16: the weight reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`, what
  torch.compile's freezing does on CPU) and multiplied by oneDNN; the 50k-wide output head gains most.
  Only where oneDNN computes bf16 natively (`torch.ops.mkldnn._is_mkldnn_bf16_supported`).
The results are those of nn.Linear up to float rounding, and independent of how many rows come at once,
so a KV-cached decode still equals a full recompute.

Footguns
- Inference only: the transposed weights do not require gradients, `PackedLinear` has no state_dict
  entries of its own; a packed model is never saved or trained (as with int8).
- float32 chunked: the tied head becomes a block matrix the embedding cannot read rows from, so the
  embedding keeps the original matrix: a second copy of it (GPT-2: 154 MB), as bf16 and int8 make.
  The chunk count is fixed when packing (torch.get_num_threads() then).
- bf16: the output head is tied to the token embedding, and packing it makes a second copy of that
  matrix (the embedding lookups keep the original), as int8 does.
- Cross-attention slices its `c_attn` weight (`Attention.project_kv`): those layers stay nn.Linear.
- Compilers cannot trace the opaque oneDNN tensor: the compiled decode step (`GPT.compile_decoding`,
  gpt/model/compiled.py) refuses a packed model and lays out the weights of an unpacked one itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gpt.model import rowkernels
from gpt.model.quantize import QUANTIZED
from gpt.model.transformer import GPT


class PackedLinear(nn.Module):
    """An nn.Linear's computation on a bf16 weight in oneDNN's blocked layout (see the module notes)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        # a plain attribute, not a buffer: an opaque oneDNN tensor cannot go into a state dict or move
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN bf16"


CHUNK_BYTES = 1 << 21  # float32 matrices at least this big are split into column blocks (smaller: in cache)
BMM_ROWS = 4  # more rows at once than this: a block at a time (MKL threads a many-row product itself)


class ChunkedLinear(nn.Module):
    """An nn.Linear's computation on its weight cut into `chunks` column blocks of out / chunks output
    features each (the last zero-padded), (chunks, in, n) contiguous, multiplied by one torch.bmm so that
    each thread streams one block (see the module notes). Exact: each output is the same dot product."""

    def __init__(self, linear: nn.Linear, chunks: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        n = -(-self.out_features // chunks)  # features per block
        padded = torch.zeros(chunks * n, self.in_features, dtype=linear.weight.dtype)
        padded[: self.out_features] = linear.weight.detach()
        self.weight = nn.Parameter(padded.view(chunks, n, -1).transpose(1, 2).contiguous(), requires_grad=False)
        self.bias = None
        if linear.bias is not None:  # (chunks, 1, n), added by baddbmm
            bias = torch.zeros(chunks * n, dtype=linear.bias.dtype)
            bias[: self.out_features] = linear.bias.detach()
            self.bias = nn.Parameter(bias.view(chunks, 1, n), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, in)
        if rows.size(0) > BMM_ROWS:  # a prefill or an evaluation: each block's product is threaded already
            return self._blockwise(rows).view(*x.shape[:-1], self.out_features)
        many = rows.expand(self.weight.size(0), -1, -1)  # (chunks, M, in), no copy: one block per thread
        if self.bias is None:
            y = torch.bmm(many, self.weight)
        else:
            y = torch.baddbmm(self.bias, many, self.weight)  # (chunks, M, n)
        y = y.transpose(0, 1).reshape(rows.size(0), -1)[:, : self.out_features]  # (M, out)
        return y.view(*x.shape[:-1], self.out_features)

    def _blockwise(self, rows: torch.Tensor) -> torch.Tensor:
        """The product of many rows, block by block into the columns of one output (no (chunks, M, n)
        intermediate the size of the output: an evaluation's logits would take twice the memory)."""
        chunks, _, n = self.weight.shape
        out = rows.new_empty(rows.size(0), chunks * n)
        for i in range(chunks):
            if self.bias is None:
                torch.mm(rows, self.weight[i], out=out[:, i * n : (i + 1) * n])
            else:
                torch.addmm(self.bias[i], rows, self.weight[i], out=out[:, i * n : (i + 1) * n])
        return out[:, : self.out_features] if chunks * n > self.out_features else out

    def extra_repr(self) -> str:
        chunks = self.weight.size(0)
        return f"in_features={self.in_features}, out_features={self.out_features}, float32 in {chunks} column blocks"


def transposed(weight: torch.Tensor) -> nn.Parameter:
    """The same (out, in) matrix stored column-major: its transpose (in, out) is contiguous."""
    return nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)


def can_pack(model: GPT) -> bool:
    """Whether `pack` changes this model: on the CPU, float32, or bf16 where oneDNN computes it natively."""
    param = model.transformer.wte.weight
    if param.device.type != "cpu" or any(isinstance(m, QUANTIZED) for m in model.modules()):
        return False
    if param.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return param.dtype == torch.float32


def pack(model: GPT, chunks: int | None = None, chunk_bytes: int = CHUNK_BYTES, kernels: bool = True) -> GPT:
    """The model with its Linear layers (but cross-attention's) laid out for CPU decoding, in place: with
    `kernels`, where `rowkernels.library()` builds, every layer `rowkernels.fits` as a `RowLinear`; otherwise
    float32 weights of at least `chunk_bytes` as `ChunkedLinear` in `chunks` column blocks (default
    torch.get_num_threads(); 1 keeps them nn.Linear), the others transposed in memory (still nn.Linear;
    a tied head and embedding share the one transposed matrix, so no copy), bf16 layers as
    `PackedLinear`. Unchanged where `can_pack` says no. For inference only (eval mode, no gradients)."""
    model.eval()
    if kernels and rowkernels.library() is not None:  # our own kernels, where the machine can build them
        for parent, name, child in _layers(model):
            if rowkernels.fits(child):
                setattr(parent, name, rowkernels.RowLinear(child))
        for block in model.transformer.h:  # and where a block allows, its whole decode step in one call
            block.step = rowkernels.BlockStep(block) if rowkernels.BlockStep.fits(block) else None
        model.step = rowkernels.StackStep(model) if rowkernels.StackStep.fits(model) else None  # every block's
        return model
    if not can_pack(model):
        return model
    onednn = model.transformer.wte.weight.dtype == torch.bfloat16
    chunks = chunks or torch.get_num_threads()
    tied = model.lm_head.weight is model.transformer.wte.weight
    for parent, name, child in _layers(model):
        if type(child) is not nn.Linear:
            continue
        if onednn:
            setattr(parent, name, PackedLinear(child))
        elif chunks > 1 and child.weight.numel() * child.weight.element_size() >= chunk_bytes:
            setattr(parent, name, ChunkedLinear(child, chunks))  # a tied embedding keeps the original
        elif child is not model.lm_head or not tied:
            child.weight = transposed(child.weight)
        else:  # tied: one transposed matrix for both
            model.transformer.wte.weight = model.lm_head.weight = transposed(model.lm_head.weight)
    return model


def _layers(model: GPT) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, layer) for every layer `pack` may replace: all but cross-attention's (it slices its weight,
    `Attention.project_kv`)."""
    return [
        (parent, name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if ".cross_attn" not in f".{prefix}"
    ]
