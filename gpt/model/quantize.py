"""int8 and int4 CPU inference: the Linear layers in int8 (weights and activations) or int4 (weights).

    gpt sample --ckpt out/shakespeare-char --quantize int8 [--compile]
    gpt sample --ckpt out/gpt2-run --quantize int4 [--group-size 32] [--compile]
    gpt serve --ckpt out/shakespeare-char --quantize int8

    from gpt.model.quantize import quantize
    model = quantize(model, "int8")          # in place; float32 on the CPU only
    model = quantize(model, "int4", 64)      # int4 weights in groups of 64 input features

**int4** (`Int4Linear`): each weight row in groups of `--group-size` (32, 64 or 128) input features, four
bits a weight and one bfloat16 scale a group (gpt/model/grids.py's `int4`: Q4_0's rule), multiplied by
PyTorch's int4 CPU kernel (`torch._weight_int4pack_mm_for_cpu`), which takes the activations in bfloat16
(its float32 path was ten times slower here) and returns bfloat16, turned back to float32. A layer whose
input width the group does not divide stays float32 (the run's summary says how many). Measured speed and
val loss: bench/README.md.

`quantize` swaps every `nn.Linear` for an `Int8Linear`: its weight stored as int8 with one scale per
output channel (symmetric, the channel's largest magnitude maps to 64); at each call every input row is
quantised with a scale of its own (its largest magnitude maps to 127), the int8 x int8 product accumulates
exactly in int32 (`torch._int_mm`) and the result is scaled back to float32 and the bias added.
Embeddings, LayerNorms and attention itself stay float32. The weights of the Linear layers take a quarter
of the memory, which is what makes decoding faster: a decode step reads every weight once for a handful
of rows, so it is bound by memory traffic (GPT-2 124M's output head in int8 against float32: bench/README.md,
"Against llama.cpp"). The layer is plain PyTorch, so the compiled decode step
(`gpt.model.compiled`, `--compile`) takes it as it is, with the same numbers as eager decoding.

One scale per row (not per batch) makes a row's result independent of the rows decoded beside it: a
sample decodes the same alone or in the server's batch (a test holds it). bench/bench_sampling.py
measures tokens/s and val loss against float32.

Footguns
- The output head is tied to the token embedding: quantising `lm_head` makes an int8 copy of the
  matrix, and `wte` stays float32 for the embedding lookups.
- Cross-attention (encoder-decoder models) slices its `c_attn` weight into query and key/value parts
  (`Attention.project_kv`), which an Int8Linear cannot do: those stay float32.
- A quantised model is for inference only: no training, no checkpoint saving, no CUDA.
- Weights take 129 levels, not 255: oneDNN's int8 product on CPUs without VNNI (AVX2, AVX-512 before
  Cascade Lake) adds pairs of u8 x s8 products in int16 and saturates, which weights up to 64 in magnitude
  never reach (with 127 a product was off by millions: tests/test_quantize.py runs it with oneDNN capped
  at AVX2). One bit of weight precision for the same numbers on every x86 CPU; val loss against float32:
  bench/README.md, "int8 against float32".
- Eager, each Int8Linear is about ten small ops (quantise the row, multiply, scale back): GPT-2 124M decoded
  slower eager than with the fused fbgemm kernel of `torch.ao` this layer replaced, and a model as small as
  the char one runs int8 slower than float32 eager (bench/README.md, "int8 against float32"). So
  load_for_inference hands them to our C kernels where they build (gpt.model.packed, gpt.model.rowkernels:
  one call a layer, the same numbers), and `--compile` fuses them (bench/README.md, "Against llama.cpp").
- A row with one huge activation (an outlier channel) quantises its other entries coarsely: llama.cpp's
  q8_0 scales every 32 entries instead, which this layer's single int8 product cannot.
- Why not PyTorch's own tooling: `torch.ao.quantization` (deprecated) shares one activation scale across
  the batch (rows change each other's results) and cannot be exported for the compiled step; torchao's int8
  configs ran slower than float32 in eager mode on our CPU (they need torch.compile).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gpt.errors import UserError
from gpt.model import grids

MODES = ("none", "int8", "int4")
TINY = grids.TINY  # the smallest scale (an all-zero row or channel quantises to zeros, not to NaN)
KERNEL_ROWS = 16  # torch's int4 packing takes a multiple of 16 output rows: the rest are padded with zeros


class QuantizeError(UserError, ValueError):
    """A quantisation that cannot be done (unknown mode, a GPU model, a low-precision dtype)."""


class Int8Linear(nn.Module):
    """`nn.Linear`'s y = x W^T + b with W in int8 (one scale per output channel) and x quantised to int8 per
    row at each call (module notes). Buffers only: no Parameters, nothing to train."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight_int8, scale = grids.int8(linear.weight.detach().float())
        self.register_buffer("weight_int8", weight_int8)  # (out, in)
        self.register_buffer("weight_scale", scale / 127)  # times a row's largest magnitude: the product's scale
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_product(x, self.weight_int8, self.weight_scale, self.bias)

    def row_forward(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` for the compiled one-row step (`gpt.model.compiled.row_products`): the same quantised row
        times each int8 weight row, summed in float32 instead of `torch._int_mm`'s int32. The same numbers:
        the products are integers of at most 127 x 64 in magnitude and float32 sums integers exactly below
        2**24, which a row of typical activations stays far under (only 2,065 products all at the extremes
        and of one sign could pass it)."""
        times_weight = lambda q: (q.unsqueeze(-2) * self.weight_int8).sum(-1)  # noqa: E731 (int8 read as it is)
        return int8_product(x, self.weight_int8, self.weight_scale, self.bias, times_weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int8_product(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias, times_weight=None):
    """`Int8Linear`'s y = x W^T + b: each row of `x` quantised with its own scale (integers in [-127, 127], still
    float), multiplied by the (out, in) int8 `weight` (`torch._int_mm`'s exact int32, or `times_weight`), and scaled
    back (row scale x channel scale) with the bias added. As few ops as can be: each costs ~2 us in eager
    decoding, 49 layers a token for GPT-2."""
    rows = x.reshape(-1, weight.size(1))
    amax = rows.abs().amax(dim=1, keepdim=True).clamp_min(TINY)
    q = torch.round(rows * (127 / amax))  # within [-127, 127]: no clamp needed
    product = times_weight(q) if times_weight else torch._int_mm(q.to(torch.int8), weight.t())
    scale = amax * weight_scale  # (rows, out)
    y = product * scale if bias is None else torch.addcmul(bias, product, scale)
    return y.view(*x.shape[:-1], weight.size(0))


class Int4Linear(nn.Module):
    """`nn.Linear` with its weight in int4, in groups of `group_size` input features with a bfloat16 scale each
    (gpt/model/grids.py's `int4`), multiplied by PyTorch's int4 CPU kernel (module notes). Buffers only."""

    def __init__(self, linear: nn.Linear, group_size: int = 32):
        super().__init__()
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        q, scale = grids.int4(linear.weight.detach().float(), group_size)  # (out, in), (out, in / group)
        pad = -self.out_features % KERNEL_ROWS
        q = torch.cat([q, torch.full((pad, q.size(1)), 8, dtype=q.dtype)])  # padding rows: (8 - 8) x 0
        scale = torch.cat([scale, scale.new_zeros(pad, scale.size(1))])
        self.register_buffer("weight_int4", torch._convert_weight_to_int4pack_for_cpu(q, 8))
        # the kernel's (groups, out, [scale, zero]) with w = (q - 8) x scale + zero: zero 0, symmetric
        self.register_buffer(
            "scale_zero", torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1).to(torch.bfloat16).contiguous()
        )
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int4pack_mm_for_cpu(rows, self.weight_int4, self.group_size, self.scale_zero)
        y = y[:, : self.out_features].float()
        y = y if self.bias is None else y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"bias={self.bias is not None}"
        )


QUANTIZED = (Int8Linear, Int4Linear)


def dtype_flag(dtype: str, mode: str) -> str:
    """The --dtype to run at: int8 and int4 start from float32 weights, so `auto` means float32 with --quantize
    (also on a CPU with native bf16, where auto would otherwise pick bf16); any other is refused before
    anything is loaded."""
    if mode == "none":
        return dtype
    if dtype not in ("auto", "float32"):
        raise QuantizeError(f"--quantize {mode} starts from float32 weights, not {dtype}: use --dtype float32")
    return "float32"


def linear_names(model: nn.Module, mode: str = "int8", group_size: int = 32) -> set[str]:
    """The Linear layers `quantize` converts: all of them except cross-attention's (see the footguns) and, in
    int4, those whose input width the group does not divide."""
    return {
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and ".cross_attn." not in name
        and (mode != "int4" or m.in_features % group_size == 0)
    }


def quantize(model: nn.Module, mode: str = "int8", group_size: int = 32) -> nn.Module:
    """The model (a GPT) with its Linear layers in int8 or int4 (`group_size` input features a scale), or as
    it is ("none"). In place."""
    if mode not in MODES:
        raise QuantizeError(f"--quantize {mode!r} is not one of {', '.join(MODES)}")
    if mode == "int4" and group_size not in grids.GROUP_SIZES:
        raise QuantizeError(f"--group-size {group_size}: use one of {', '.join(map(str, grids.GROUP_SIZES))}")
    if mode == "none":
        return model
    param = model.transformer.wte.weight
    if param.device.type != "cpu":
        raise QuantizeError(f"--quantize {mode} runs on the CPU only, not {param.device}: use --device cpu")
    if param.dtype != torch.float32:
        raise QuantizeError(
            f"--quantize {mode} starts from float32 weights, not {str(param.dtype).replace('torch.', '')}: "
            "use --dtype float32"
        )
    model.eval()
    for name in linear_names(model, mode, group_size):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        linear = getattr(owner, child)
        setattr(owner, child, Int8Linear(linear) if mode == "int8" else Int4Linear(linear, group_size))
    return model


def summary(model: nn.Module, mode: str, group_size: int = 32) -> str:
    """What `quantize` made of the model, for the run's header: "int4 Linear layers (groups of 32; 2 left in
    float32)"."""
    kept = sum(isinstance(m, nn.Linear) for m in model.modules())
    detail = [f"groups of {group_size}"] if mode == "int4" else []
    detail += [f"{kept} left in float32"] if kept else []
    return f"{mode} Linear layers" + (f" ({'; '.join(detail)})" if detail else "")
