"""int8 CPU inference: the Linear layers quantised to int8, dynamically (PyTorch's own tooling).

    python sample.py --ckpt out/shakespeare-char --quantize int8
    gpt serve --ckpt out/shakespeare-char --quantize int8

    from gpt.model.quantize import quantize
    model = quantize(model, "int8")          # in place; float32 on the CPU only

`torch.ao.quantization.quantize_dynamic` swaps every `nn.Linear` for a dynamically quantised one:
weights stored as int8 with one scale per output channel, activations quantised per call from their
observed range, int8 x int8 matmuls with int32 accumulation (fbgemm / oneDNN on x86, QNNPACK on
ARM), outputs back in float32. Embeddings, LayerNorms and attention itself stay float32. The weights
of the Linear layers take a quarter of the memory, which is what makes decoding faster: a decode
step reads every weight once for a handful of rows, so it is bound by memory traffic
(bench/bench_sampling.py measures tokens/s and val loss against float32).

Footguns
- The output head is tied to the token embedding: quantising `lm_head` makes an int8 copy of the
  matrix, and `wte` stays float32 for the embedding lookups.
- Cross-attention (encoder-decoder models) slices its `c_attn` weight into query and key/value parts
  (`Attention.project_kv`), which a quantised Linear cannot do: those stay float32.
- A quantised model is for inference only: no training, no checkpoint saving, no CUDA.
- `torch.ao.quantization` is deprecated in favour of torchao; torchao's int8 configs ran 3-4x slower
  than float32 in eager mode on our CPU (they need torch.compile), so we use the ao path and silence
  its deprecation warnings here, locally.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from gpt.errors import UserError
from gpt.model.transformer import GPT

MODES = ("none", "int8")


class QuantizeError(UserError, ValueError):
    """A quantisation that cannot be done (unknown mode, a GPU model, a low-precision dtype)."""


def dtype_flag(dtype: str, mode: str) -> str:
    """The --dtype to run at: int8 starts from float32 weights, so `auto` means float32 with --quantize int8
    (also on a CPU with native bf16, where auto would otherwise pick bf16); any other is refused before
    anything is loaded."""
    if mode == "int8" and dtype not in ("auto", "float32"):
        raise QuantizeError(f"--quantize int8 starts from float32 weights, not {dtype}: use --dtype float32")
    return "float32" if mode == "int8" else dtype


def linear_names(model: GPT) -> set[str]:
    """The Linear layers `quantize` converts: all of them except cross-attention's (see the footguns)."""
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".cross_attn." not in name}


def quantize(model: GPT, mode: str = "int8") -> GPT:
    """The model with its Linear layers in int8 (mode "int8"), or as it is ("none"). In place."""
    if mode not in MODES:
        raise QuantizeError(f"--quantize {mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return model
    param = model.transformer.wte.weight
    if param.device.type != "cpu":
        raise QuantizeError(f"--quantize int8 runs on the CPU only, not {param.device}: use --device cpu")
    if param.dtype != torch.float32:
        raise QuantizeError(
            f"--quantize int8 starts from float32 weights, not {str(param.dtype).replace('torch.', '')}: "
            "use --dtype float32"
        )
    spec = dict.fromkeys(linear_names(model), torch.ao.quantization.per_channel_dynamic_qconfig)
    with warnings.catch_warnings():  # the deprecation notices of torch.ao (see the footguns), nothing else
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r".*(deprecated|torchao)", category=UserWarning)
        torch.ao.quantization.quantize_dynamic(model.eval(), spec, dtype=torch.qint8, inplace=True)
    return model
