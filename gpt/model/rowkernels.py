"""Our own CPU decoding in C (gpt/model/rowkernels.c): a few rows times a weight in float32, bf16 or int8, and
the whole one-token step of the common block and model.

    from gpt.model.rowkernels import RowLinear, library
    if library():                      # built on first use with the machine's C compiler, else None
        layer = RowLinear(linear)      # an nn.Linear's float32 or bf16 product, weights in 64-output blocks
        layer = RowLinear(int8_linear) # an Int8Linear's (gpt.model.quantize): the same numbers
    block.step = BlockStep(block)      # a block of RowLinear layers: its one-token step in one call
    model.step = StackStep(model)      # every block stepped so: embeddings, blocks, final LayerNorm in one call
    whole_step(model)                  # whether gpt.model.packed.pack would give a model its StackStep

    GPT_ROW_KERNELS=off        # never build: decoding keeps PyTorch's kernels (gpt.model.packed)
    GPT_ROW_KERNELS=x86-64-v3  # build for that -march instead of the machine's own (tests run the AVX2 code so)

A decode step multiplies one row per sequence by every weight, so it is bound by how fast the weights stream
from memory. PyTorch's CPU kernels (MKL, oneDNN, `torch._int_mm`) stream one row far below the memory's rate:
bench/results/kernels.json times them inside the eager step. The C file lays each weight out in blocks of 64
output features, so a block streams in one run and every input value multiplies 64 outputs in a few vectors,
and uses the CPU's pair and quad dot products where it has them (AVX512_BF16, AVX512_VNNI, AVX2's int8
pairs); elsewhere the same loops in plain vectors. A build with neither AVX2 nor AVX-512 is not used
(PyTorch's kernels do as well there). Around the products, a decode step of GPT-2's shape dispatched about 20
small aten ops a layer and the Python between them: `BlockStep` and `StackStep` compute the step in C too (a
pre-norm block with LayerNorms and a GELU or relu2 MLP over a float32 KV cache; the others keep their modules).
The blocked weights and CPU KV caches live on transparent huge pages where the kernel gives them
(gpt.runtime.on_huge_pages). What it gains: bench/README.md, "Against llama.cpp".

The library is compiled with `-O3 -march=native -fopenmp` into a private temporary directory, loaded, and the
file removed: nothing is cached on disk, so nothing another user could write is ever loaded. Its OpenMP is
torch's own libgomp (linked from torch/lib), and each call passes torch.get_num_threads(). A machine
without a C compiler, or where the build or the load fails (a noexec temporary directory), gets None and
decodes with PyTorch's kernels, after one warning line that says why (a `KernelWarning`).

Footguns
- Inference only: no gradients, and the blocked weights are no state_dict entries of the layer's own (like
  gpt.model.packed's); a model with these layers is never saved or trained.
- A tied output head gets its own blocked copy; the token embedding keeps the original (GPT-2: 154 MB float32).
- float32 and bf16 sums run in another order than MKL's or oneDNN's: the results equal nn.Linear's up to
  float rounding, and a row's result is the same whatever rows come beside it, up to MANY_ROWS rows at once
  (a decode step of up to that many sequences); more rows (a prompt's prefill, an evaluation) go through
  PyTorch's product on the weight unblocked for the call, which is faster there (our loops keep a block's
  sums of a few rows in registers, not a GEMM's cache blocking, nor AMX) and rounds as nn.Linear does. int8's
  are exact integers scaled as Int8Linear scales them: the same numbers, to the last bit but for a bias added
  after (torch.addcmul's rounding, which PyTorch's own kernel varies with the shape).
- ctypes releases the GIL for each call: the server's other threads run meanwhile.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt.model import grids
from gpt.model.block import ReLU2
from gpt.model.quantize import Int8Linear, int8_product
from gpt.runtime import cpu_has_native_bf16, on_huge_pages

SOURCE = Path(__file__).with_name("rowkernels.c")
BLOCK = 64  # output features a block (the C file's)
MANY_ROWS = 32  # more rows at once (a prompt, an evaluation): PyTorch's product, on the weight unblocked
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # the C file's F32, BF16, INT8
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


def library(march: str | None = None) -> ctypes.CDLL | None:
    """The kernels built for this machine (or for `march`, default $GPT_ROW_KERNELS, else native) and loaded,
    once a process, or None: GPT_ROW_KERNELS=off, not Linux, no C compiler, or the build failed (`why_not`)."""
    return _build(chosen(march))[0]


def why_not(march: str | None = None) -> str:
    """Why `library(march)` is None ("" when it is not)."""
    return _build(chosen(march))[1]


def chosen(march: str | None = None) -> str:
    """The build asked for: `march`, else $GPT_ROW_KERNELS, else "native"."""
    return march or os.environ.get("GPT_ROW_KERNELS") or "native"


class _BlockArgs(ctypes.Structure):
    """The C file's block_t: one block's weights for `block_step`."""

    _fields_ = [
        ("kind", _I), ("act", _I), ("n_embd", _L), ("n_head", _L), ("hidden", _L), ("eps", _F),
        ("ln_w", _P * 2), ("ln_b", _P * 2), ("w", _P * 4), ("b", _P * 4), ("wsum", _P * 4), ("wscale", _P * 4),
    ]  # fmt: skip


class _StackArgs(ctypes.Structure):
    """The C file's stack_t: a model's embeddings, blocks and final LayerNorm for `stack_step`."""

    _fields_ = [
        ("n_layer", _L), ("vocab", _L), ("blocks", ctypes.POINTER(_BlockArgs)), ("wte", _P), ("wpe", _P),
        ("ln_w", _P), ("ln_b", _P), ("eps", _F),
    ]  # fmt: skip


class KernelWarning(UserWarning):
    """Our kernels could not be built or loaded here: decoding runs on PyTorch's (the message says why)."""


@functools.cache
def _build(march: str) -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why); a warning, once a process, when a build or a load failed."""
    if march == "off":
        return None, "GPT_ROW_KERNELS=off"
    if platform.system() != "Linux":
        return None, f"built on Linux only, not {platform.system()}"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    lib, why = _compiled(cc, march) if cc else (None, "no C compiler (gcc, or $CC)")
    if lib is not None and not lib.fast():  # plain vectors: PyTorch's kernels do as well, no warning
        return None, f"-march={march} has neither AVX2 nor AVX-512"
    if lib is None:
        warnings.warn(
            f"our CPU decoding kernels are not used: {why}; PyTorch's decode slower (GPT_ROW_KERNELS=off hides "
            "this line)",
            KernelWarning,
            stacklevel=3,
        )
    return lib, why


def _compiled(cc: str, march: str) -> tuple[ctypes.CDLL | None, str]:
    """The C file compiled by `cc` for `march` in a private temporary directory and loaded (the file is removed
    with the directory, the library stays mapped), or (None, why)."""
    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = [cc, "-O3", f"-march={march}", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", str(SOURCE)]
    try:
        with tempfile.TemporaryDirectory(prefix="gpt-rowkernels-") as tmp:
            so = Path(tmp) / "rowkernels.so"
            cmd += ["-o", str(so), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lgomp"]
            built = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if built.returncode:
                return None, f"{cc} failed: {(built.stderr.strip().splitlines() or ['?'])[-1]}"
            lib = ctypes.CDLL(str(so))
    except subprocess.TimeoutExpired:
        return None, f"{cc} took more than 120 s"
    except OSError as e:  # no temporary directory, a compiler that does not run, a noexec /tmp
        return None, f"{cc} or loading its library failed: {e}"
    lib.layout.argtypes, lib.layout.restype = [_I], _I
    lib.fast.argtypes, lib.fast.restype = [], _I
    lib.f32_rows.argtypes = [_P, _L, _L, _P, _P, _P, _L, _I]
    lib.bf16_rows.argtypes = [_P, _L, _L, _P, _P, _P, _L, _I]
    lib.int8_rows.argtypes = [_P, _L, _L, _P, _P, _P, _P, _P, _L, _F, _I]
    lib.int8_rows.restype = _I
    lib.block_step.argtypes = [ctypes.POINTER(_BlockArgs), _P, _L, _P, _P, _P, _L, _L, _F, _I]
    lib.block_step.restype = _I
    lib.stack_step.argtypes = [ctypes.POINTER(_StackArgs), _P, _L, _P, _P, _P, _L, _L, _F, _I]
    lib.stack_step.restype = _I
    return lib, ""


def blocks(weight: torch.Tensor, k: int) -> torch.Tensor:
    """An (out, in) weight as the C file's (blocks, in / k, 64, k): 64 output features a block, the last padded
    with zero rows, each output's k consecutive input features together."""
    out, n_in = weight.shape
    padded = weight.new_zeros(-(-out // BLOCK) * BLOCK, n_in)
    padded[:out] = weight
    return padded.view(-1, BLOCK, n_in // k, k).permute(0, 2, 1, 3).contiguous()


def fits(module: nn.Module, march: str | None = None) -> bool:
    """Whether `RowLinear` takes this layer: an nn.Linear in float32 or bf16 on the CPU, or an Int8Linear, with an
    input width the layout's pairs or quads divide."""
    if isinstance(module, Int8Linear):
        weight = module.weight_int8
    elif type(module) is nn.Linear:
        weight = module.weight
    else:
        return False
    lib = library(march)
    return (
        lib is not None
        and weight.device.type == "cpu"
        and weight.dtype in KINDS
        and weight.size(1) % lib.layout(KINDS[weight.dtype]) == 0
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class RowLinear(nn.Module):
    """An nn.Linear's (float32, bf16) or an Int8Linear's product through the C kernels (module notes). Buffers
    only, on the CPU; check `fits` first."""

    def __init__(self, linear: nn.Module, march: str | None = None):
        super().__init__()
        self.march = chosen(march)  # the build each call runs
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight_int8 if isinstance(linear, Int8Linear) else linear.weight.detach()
        self.kind = KINDS[weight.dtype]
        layout = blocks(weight, library(march).layout(self.kind))
        self.register_buffer("weight_blocks", on_huge_pages(layout), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.register_buffer("bias", bias, persistent=False)
        if isinstance(linear, Int8Linear):  # float32 in and out, the row quantised inside
            self.register_buffer("weight_sum", weight.sum(1, dtype=torch.int32), persistent=False)
            self.register_buffer("weight_scale", linear.weight_scale.contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.bfloat16 if self.kind == KINDS[torch.bfloat16] else torch.float32
        rows = x.reshape(-1, self.in_features).to(dtype).contiguous()
        if rows.size(0) > MANY_ROWS:
            return self._library(rows).view(*x.shape[:-1], self.out_features)
        y = rows.new_empty(rows.size(0), self.out_features)
        if not rows.size(0):
            return y.view(*x.shape[:-1], self.out_features)
        lib = _build(self.march)[0]
        m, n_in, w, b, threads = rows.size(0), self.in_features, self.weight_blocks, self.bias, torch.get_num_threads()
        if self.kind == KINDS[torch.int8]:
            failed = lib.int8_rows(
                rows.data_ptr(), m, n_in, w.data_ptr(), self.weight_sum.data_ptr(), self.weight_scale.data_ptr(),
                _ptr(b), y.data_ptr(), self.out_features, grids.TINY, threads,
            )  # fmt: skip
            if failed:
                raise MemoryError(f"no memory for {m} quantised rows of {n_in}")
        else:
            run = lib.f32_rows if self.kind == KINDS[torch.float32] else lib.bf16_rows
            run(rows.data_ptr(), m, n_in, w.data_ptr(), _ptr(b), y.data_ptr(), self.out_features, threads)
        return y.view(*x.shape[:-1], self.out_features)

    def _library(self, rows: torch.Tensor) -> torch.Tensor:
        """Many rows (a prompt, an evaluation): PyTorch's product on the weight unblocked for the call (a copy,
        cheap beside the product), which uses the CPU's matrix units and cache blocking; bf16 on a CPU without
        native bf16 in float32 (then rounded to bf16 as oneDNN's product rounds its float32 sums)."""
        w = self.weight_blocks.permute(0, 2, 1, 3).reshape(-1, self.in_features)[: self.out_features]
        if self.kind == KINDS[torch.int8]:
            return int8_product(rows, w, self.weight_scale, self.bias)
        if self.kind == KINDS[torch.bfloat16] and not cpu_has_native_bf16():  # PyTorch's bf16 GEMM is emulated
            bias = None if self.bias is None else self.bias.float()
            return F.linear(rows.float(), w.float(), bias).to(torch.bfloat16)
        return F.linear(rows, w, self.bias)

    def extra_repr(self) -> str:
        kind = {v: str(k).replace("torch.", "") for k, v in KINDS.items()}[self.kind]
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind} in 64-output blocks"


ACTIVATIONS = {"none": 0, "tanh": 1}  # nn.GELU's `approximate`: the C file's GELU, GELU_TANH
RELU2 = 2  # the C file's RELU2


class BlockStep:
    """A pre-norm block's one-token decode step as one call of the C file's `block_step`: LayerNorm, the fused
    projection, the new key and value written to the cache, one query's attention over it, the output
    projection, the residual, LayerNorm, the MLP and its residual, with the block's RowLinear weights (`fits`
    says which blocks). `Block` calls it with every cached call (`Block.step`, set by gpt.model.packed.pack);
    it returns the block's output, or None for a call it does not take (then the block runs as always): more
    than one token, a static or ring cache, a mask, attention maps being recorded.

    A decode step of GPT-2's shape dispatches about 20 small aten ops a layer besides its products, and the
    Python between them; here they are one call (what it gains: bench/README.md, "Against llama.cpp"). The
    numbers are the eager step's up to float rounding (the same roundings to bf16 in a bf16 model).
    """

    def __init__(self, block: nn.Module):
        attn, mlp, layers = block.attn, block.mlp, _four(block)
        self.march, self.kind, self.attn = layers[0].march, layers[0].kind, attn
        self.dtype = torch.bfloat16 if self.kind == KINDS[torch.bfloat16] else torch.float32
        norms = [block.ln_1, block.ln_2]
        self._keep = [n.weight.detach().float() for n in norms] + [
            None if n.bias is None else n.bias.detach().float() for n in norms
        ]  # the tensors the pointers below point into, alive as long as this step
        self._keep += [t for m in layers for t in (m.weight_blocks, m.bias, *_int8_parts(m))]
        self.args = _BlockArgs(
            self.kind, RELU2 if isinstance(mlp.gelu, ReLU2) else ACTIVATIONS[mlp.gelu.approximate],
            attn.n_embd, attn.n_head, mlp.c_fc.out_features, block.ln_1.eps,
            (_P * 2)(*map(_ptr, self._keep[:2])), (_P * 2)(*map(_ptr, self._keep[2:4])),
            (_P * 4)(*(_ptr(m.weight_blocks) for m in layers)), (_P * 4)(*(_ptr(m.bias) for m in layers)),
            (_P * 4)(*(_ptr(getattr(m, "weight_sum", None)) for m in layers)),
            (_P * 4)(*(_ptr(getattr(m, "weight_scale", None)) for m in layers)),
        )  # fmt: skip

    @staticmethod
    def fits(block: nn.Module) -> bool:
        """Whether a block's decode step can run in C: `_block_shape`, and its four layers RowLinear of one kind
        and build."""
        layers = _four(block)
        return (
            _block_shape(block)
            and all(type(m) is RowLinear for m in layers)
            and len({(m.kind, m.march) for m in layers}) == 1
        )

    def __call__(self, x: torch.Tensor, cache) -> torch.Tensor | None:
        """The block's output for x (B, 1, C) continuing `cache` (written, its position advanced), or None."""
        if (
            cache is None
            or x.size(1) != 1
            or x.dtype != self.dtype
            or x.device.type != "cpu"
            or not _takes(cache, cache.pos, x.size(0), self.attn)
        ):
            return None
        x = x.contiguous()
        out = torch.empty_like(x)
        failed = _build(self.march)[0].block_step(
            ctypes.byref(self.args), x.data_ptr(), x.size(0), out.data_ptr(), cache.k.data_ptr(),
            cache.v.data_ptr(), cache.max_len, cache.pos, grids.TINY, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"no memory for a decode step of {x.size(0)} rows")
        cache.pos += 1
        return out


def _takes(cache, pos, rows: int, attn: nn.Module) -> bool:
    """Whether a step in C can continue `cache` at `pos`: a float32 cache of every position for `rows` rows and
    all of `attn`'s heads, contiguous, at that int position with a slot left, and no attention maps recorded."""
    return (
        type(cache.pos) is int
        and cache.pos == pos
        and not cache.ring
        and pos < cache.max_len
        and cache.k.dtype == torch.float32
        and cache.k.shape == (rows, attn.n_head, cache.max_len, attn.head_dim)
        and cache.k.is_contiguous()
        and cache.v.is_contiguous()
        and attn.weights is None
    )


def _int8_parts(m: RowLinear) -> tuple[torch.Tensor, ...]:
    return (m.weight_sum, m.weight_scale) if m.kind == KINDS[torch.int8] else ()


def _four(block: nn.Module) -> list[nn.Module]:
    """A block's four product layers, in the C file's order."""
    return [block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj]


def _block_shape(block: nn.Module) -> bool:
    """A block `block_step` computes, whatever its layers: pre-norm, LayerNorms of one eps, no cross-attention,
    value embeddings or qk_norm, all the model's heads (no tensor-parallel share), a GELU (either) or relu2."""
    attn, gelu = block.attn, block.mlp.gelu
    return (
        not block.post_norm
        and not hasattr(block, "cross_attn")
        and not hasattr(attn, "ve_gate")
        and not attn.qk_norm
        and attn.n_head * attn.head_dim == attn.n_embd
        and all(type(n) is nn.LayerNorm and n.weight is not None for n in (block.ln_1, block.ln_2))
        and block.ln_1.eps == block.ln_2.eps
        and (type(gelu) is nn.GELU and gelu.approximate in ACTIVATIONS or type(gelu) is ReLU2)
    )


def _stack_shape(model: nn.Module, dtype: torch.dtype) -> bool:
    """A decoder-only model whose step around its blocks `stack_step` computes, the blocks' rows in `dtype`: learned
    positions added to the token embeddings (unscaled), no windows, x0 skips or value embeddings, a final
    LayerNorm, the embeddings contiguous in `dtype` on the CPU."""
    cfg, ln_f = model.config, model.transformer.ln_f
    return (
        not cfg.n_encoder_layer
        and model.positions.adds == "wpe"
        and not model.positions.scaled
        and not model.windows.any  # (windowed layers attend through masks, even over caches of every position)
        and not cfg.x0_skip
        and not cfg.value_embeds
        and type(ln_f) is nn.LayerNorm
        and ln_f.weight is not None
        and all(
            t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
            for t in (model.transformer.wte.weight, model.transformer.wpe.weight)
        )
    )


def whole_step(model: nn.Module) -> bool:
    """Whether gpt.model.packed.pack would give `model` a `StackStep`, asked before packing: the kernels build, and
    every block's four layers `fits`, all of one dtype, in a model of the shapes `BlockStep` and `StackStep` take."""
    blocks = list(model.transformer.h)
    layers = [m for b in blocks for m in _four(b)]
    if not blocks or not all(_block_shape(b) for b in blocks) or not all(fits(m) for m in layers):
        return False
    kinds = {(m.weight_int8 if isinstance(m, Int8Linear) else m.weight).dtype for m in layers}
    return len(kinds) == 1 and _stack_shape(model, torch.bfloat16 if kinds == {torch.bfloat16} else torch.float32)


class StackStep:
    """A decoder-only model's whole one-token decode step as one call of the C file's `stack_step`: the token and
    position embeddings, every block's `BlockStep`, and the final LayerNorm; what `GPT.hidden` returns. Set by
    gpt.model.packed.pack as `GPT.step` where `fits` says; `hidden` calls it with every cached call, and it
    returns None for a call it does not take (then each block is called as always): more than one token, caches
    that are static, rings or not all at one position, a position past the learned table, attention maps being
    recorded. Python's part of a decode step is then this call and the output head's."""

    def __init__(self, model: nn.Module):
        steps = [b.step for b in model.transformer.h]
        self.dtype, self.march, self.block_size = steps[0].dtype, steps[0].march, model.config.block_size
        self.attns = [s.attn for s in steps]
        ln_f = model.transformer.ln_f
        wte, wpe = model.transformer.wte.weight.detach(), model.transformer.wpe.weight.detach()
        self._keep = [steps, wte, wpe, ln_f.weight.detach().float()]  # what the pointers point into
        self._keep.append(None if ln_f.bias is None else ln_f.bias.detach().float())
        self.blocks = (_BlockArgs * len(steps))(*(s.args for s in steps))
        self.args = _StackArgs(
            len(steps), wte.size(0), self.blocks, _ptr(wte), _ptr(wpe), _ptr(self._keep[3]), _ptr(self._keep[4]),
            ln_f.eps,
        )  # fmt: skip

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether every block of a decoder-only model has a `BlockStep`, of one kind and build, and the rest is
        what `stack_step` computes (`_stack_shape`)."""
        steps = [b.step for b in model.transformer.h]
        return (
            bool(steps)
            and all(isinstance(s, BlockStep) for s in steps)
            and len({(s.kind, s.march) for s in steps}) == 1
            and _stack_shape(model, steps[0].dtype)
        )

    def __call__(self, idx: torch.Tensor, caches: list) -> torch.Tensor | None:
        """The final hidden state (B, 1, C) after ids `idx` (B, 1) continuing `caches` (written, their positions
        advanced), or None."""
        pos, rows = caches[0].pos, idx.size(0)
        if idx.size(1) != 1 or type(pos) is not int or pos >= self.block_size or idx.device.type != "cpu":
            return None
        if not all(_takes(cache, pos, rows, attn) for cache, attn in zip(caches, self.attns, strict=True)):
            return None
        ids = idx.to(torch.int64).contiguous()
        out = torch.empty(idx.size(0), 1, self.blocks[0].n_embd, dtype=self.dtype)
        keys = (_P * len(caches))(*(c.k.data_ptr() for c in caches))
        values = (_P * len(caches))(*(c.v.data_ptr() for c in caches))
        failed = _build(self.march)[0].stack_step(
            ctypes.byref(self.args), ids.data_ptr(), ids.size(0), out.data_ptr(), keys, values, caches[0].max_len, pos,
            grids.TINY, torch.get_num_threads(),
        )  # fmt: skip
        if failed == 2:
            raise IndexError("index out of range in self")  # (what nn.Embedding says)
        if failed:
            raise MemoryError(f"no memory for a decode step of {ids.size(0)} rows")
        for cache in caches:
            cache.pos += 1
        return out
