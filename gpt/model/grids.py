"""The quantisation grids: what a weight becomes when it is stored in int8, int4 or llama.cpp's Q4_0.

    q, scale = grids.int8(w)                  # int8 in [-64, 64], one scale per row (gpt/model/quantize.py)
    q, scale = grids.int4(w, group_size=32)   # 0..15 around 8, one bf16 scale per group of a row
    q, scale = grids.q4_0(w)                  # llama.cpp's Q4_0: groups of 32, its scale rule, fp16 scales
    w_on_grid = grids.dequantized(w, "int4", 32)  # the float weight the quantised model really multiplies by

One function per grid, used by everything that must agree on it: the quantised layers of
gpt/model/quantize.py, quantisation-aware training (gpt/model/qat.py) and the GGUF check of Q4_0
(tests/test_grids.py holds ours equal to llama.cpp's own quantiser, bit for bit).

- **int8**: per output row, symmetric, the row's largest magnitude maps to 64 (module notes of
  gpt/model/quantize.py: why 64 and not 127). Activations are quantised per row at run time, [-127, 127].
- **int4**: per group of `group_size` input features of each row, Q4_0's rule (the entry of largest
  magnitude, sign kept, maps to -8; q = trunc(w / d + 8.5) clamped to 0..15; w = (q - 8) d) with the
  scale d rounded to bfloat16 first, as PyTorch's int4 CPU kernel (`torch._weight_int4pack_mm_for_cpu`)
  holds it: so the grid's floats are the kernel's weights exactly.
- **q4_0**: llama.cpp's `quantize_row_q4_0_ref`: d = max / -8 in float32, q = min(15, trunc(w x (1/d) + 8.5)),
  and the file keeps d in float16: the weight llama.cpp multiplies by is (q - 8) x fp16(d).

Footguns
- A row whose length the group does not divide has no int4 or Q4_0 grid: callers leave such layers in float
  (gpt/model/quantize.py) or write them in another type (gpt/checkpoints/gguf.py), and QAT does the same.
"""

from __future__ import annotations

import torch

SCHEMES = ("int8", "int4", "q4_0")
GROUP_SIZES = (32, 64, 128)  # int4's --group-size; Q4_0 is always 32
Q4_0_GROUP = 32
INT8_LEVELS = 64  # weights in [-64, 64] (gpt/model/quantize.py's notes)
TINY = 1e-30  # the smallest int8 scale (an all-zero row quantises to zeros, not to NaN)


def int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as int8 in [-64, 64], scale per row): w ~ q x scale[:, None]."""
    scale = w.detach().abs().amax(dim=1).clamp_min(TINY) / INT8_LEVELS
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = w.shape
    if cols % group_size:
        raise ValueError(f"a row of {cols} does not split into groups of {group_size}")
    return w.reshape(rows, cols // group_size, group_size)


def _largest(groups: torch.Tensor) -> torch.Tensor:
    """Each group's entry of largest magnitude, its sign kept (the first of equals, as llama.cpp's loop)."""
    return groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True))


def int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as int32 in 0..15, scale (rows, groups) float32 holding bfloat16 values): w ~ (q - 8) x scale."""
    groups = _groups(w.detach().float(), group_size)
    d = (_largest(groups) / -8).to(torch.bfloat16).float()
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(groups * inverse + 8.5).clamp(0, 15)
    return q.reshape(w.shape).to(torch.int32), d.squeeze(-1)


def q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as int32 in 0..15, scale (rows, groups) float32 holding float16 values): llama.cpp's Q4_0."""
    groups = _groups(w.detach().float(), Q4_0_GROUP)
    d = _largest(groups) / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(groups * inverse + 8.5).clamp(0, 15)
    return q.reshape(w.shape).to(torch.int32), d.to(torch.float16).float().squeeze(-1)


def dequantized(w: torch.Tensor, scheme: str, group_size: int = 32) -> torch.Tensor:
    """`w` (a 2-D weight, rows the outputs) as the quantised model multiplies by it, float32."""
    if scheme == "int8":
        q, scale = int8(w)
        return q.float() * scale[:, None]
    q, scale = int4(w, group_size) if scheme == "int4" else q4_0(w)
    group = group_size if scheme == "int4" else Q4_0_GROUP
    return ((q - 8).float().reshape(*scale.shape, group) * scale[..., None]).reshape(w.shape)


def fits(w_shape: torch.Size | tuple, scheme: str, group_size: int = 32) -> bool:
    """Whether a weight of that shape has a grid under `scheme` (its rows split into whole groups)."""
    group = {"int8": 1, "int4": group_size, "q4_0": Q4_0_GROUP}[scheme]
    return len(w_shape) == 2 and w_shape[1] % group == 0
