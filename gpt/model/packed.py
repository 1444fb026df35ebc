"""CPU inference: the Linear layers' weights laid out for the matrix-vector products of decoding.

    from gpt.model.packed import pack
    pack(model)        # in place; float32 or bf16 on the CPU; what load_for_inference does there

A decode step multiplies one row per sequence by every weight matrix, so it is bound by how fast the
kernel streams the weights from memory. `nn.Linear` computes x @ W.T on an (out, in) weight, and for
one row the CPU kernels behind it stream that layout far below the memory's bandwidth. Measured on a
Zen 4 EPYC at one thread, GPT-2 124M shape, greedy decode (bench/bench_sampling.py `--runs layout`):
- float32: the weight stored transposed, (in, out) contiguous (still an nn.Linear: F.linear hands MKL's
  gemm a non-transposed operand): ~1.25-1.45x the tokens/s. (oneDNN's packed float32 layout was as fast
  at one thread but stalled at two.) The token embedding reads its rows from the same matrix.
- bf16: the weight reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`, what
  torch.compile's freezing does on CPU) and multiplied by oneDNN: ~2x; the 50k-wide output head alone
  ~10x. Only where oneDNN computes bf16 natively (`torch.ops.mkldnn._is_mkldnn_bf16_supported`).
The results are those of nn.Linear up to float rounding, and independent of how many rows come at once,
so a KV-cached decode still equals a full recompute.

Footguns
- Inference only: the transposed weights do not require gradients, `PackedLinear` has no state_dict
  entries of its own; a packed model is never saved or trained (as with int8).
- bf16: the output head is tied to the token embedding, and packing it makes a second copy of that
  matrix (the embedding lookups keep the original), as int8 does.
- Cross-attention slices its `c_attn` weight (`Attention.project_kv`): those layers stay nn.Linear.
- torch.compile cannot trace the opaque oneDNN tensor: under compilation `PackedLinear` calls the custom
  operator `gpt::packed_linear`, which looks the layer up by a key, so the compiled decode step
  (`GPT.compile_decoding`) has no graph break at each Linear.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn as nn

from gpt.model.transformer import GPT

# PackedLinear layers by key, for the custom op below (weak: a layer leaves with its model)
_LAYERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@torch.library.custom_op("gpt::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """`PackedLinear` number `key` applied to x, as an operator torch.compile traces without a graph break:
    the opaque oneDNN weight stays outside the graph (fake tensors cannot stand for it), the key is a
    constant of the graph."""
    return _LAYERS[key].onednn(x)


@packed_linear.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(nn.Module):
    """An nn.Linear's computation on a bf16 weight in oneDNN's blocked layout (see the module notes)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        # a plain attribute, not a buffer: an opaque oneDNN tensor cannot go into a state dict or move
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), 1)
        self.key = next(_KEYS)
        _LAYERS[self.key] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # (dynamo cannot trace the oneDNN tensor itself: the op hides it)
            return packed_linear(x, self.key, self.out_features)
        return self.onednn(x)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN bf16"


def transposed(weight: torch.Tensor) -> nn.Parameter:
    """The same (out, in) matrix stored column-major: its transpose (in, out) is contiguous."""
    return nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)


def can_pack(model: GPT) -> bool:
    """Whether `pack` changes this model: on the CPU, float32, or bf16 where oneDNN computes it natively."""
    param = model.transformer.wte.weight
    if param.device.type != "cpu":
        return False
    if param.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return param.dtype == torch.float32


def pack(model: GPT) -> GPT:
    """The model with its Linear layers (but cross-attention's) laid out for CPU decoding, in place:
    float32 weights transposed in memory (still nn.Linear; the tied head and embedding share the one
    transposed matrix, so no copy), bf16 layers as `PackedLinear`. Unchanged where `can_pack` says no.
    For inference only (eval mode, no gradients)."""
    if not can_pack(model):
        return model
    model.eval()
    onednn = model.transformer.wte.weight.dtype == torch.bfloat16
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or ".cross_attn" in f".{prefix}":
                continue
            if onednn:
                setattr(parent, name, PackedLinear(child))
            elif child is not model.lm_head:
                child.weight = transposed(child.weight)
    if not onednn and model.lm_head.weight is model.transformer.wte.weight:  # tied: one matrix for both
        model.transformer.wte.weight = model.lm_head.weight = transposed(model.lm_head.weight)
    elif not onednn:
        model.lm_head.weight = transposed(model.lm_head.weight)
    return model
