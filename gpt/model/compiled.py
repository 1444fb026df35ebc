"""The one-token decode step compiled ahead of time on the CPU (`GPT.compile_decoding`, `gpt sample --compile`).

    model.compile_decoding()                         # on the CPU: an `AheadOfTimeStep`, compiled at its first call
    logits = model.decode_step(ids, caches, length)  # what gpt.infer.sampling.Decoder calls at each token

A decode step of a small model is overhead bound: the char model's eager step dispatches 74 aten ops
(tests/test_decode_ops.py keeps the count), each with a fixed cost, where its arithmetic takes a few
microseconds. torch.compile fuses the small ops but keeps a Python wrapper, dynamo's guards and an MKL call
per Linear. This step is exported once (`torch.export`, the cache length symbolic, and the rows when there are
several) and compiled by AOTInductor into one C++ function; each token is then one call of it from Python, no
guards. bench/bench_llamacpp.py times it as `gpt sample` runs it, eager and compiled, at each precision
(bench/README.md, "Against llama.cpp"). Three choices make most of that (`inductor_options`):
- freezing: the weights are constants of the compiled code, laid out for their kernels when compiling;
- matrix products by Inductor's own C++ GEMM template (`max_autotune_gemm_backends="CPP"`): no dispatcher
  and no MKL or oneDNN call per Linear (a small library product's cost is mostly fixed). Its kernel streams
  frozen weights for one row faster than MKL's float32 and oneDNN's bf16 kernels do: float32 always; bf16
  for one row (GPT-2 bf16 decoded faster with it than with the row products below: bench/README.md,
  "Against llama.cpp") and for the rows of a small model; a big bf16 model's program for many rows keeps
  oneDNN's packed kernels, not measured against the template. The cut at 10M parameters (`SMALL_PARAMS`)
  lies between the char model and GPT-2, not at a measured crossover;
- one query's attention spelled out (`one_query_attention`, under compilation) so the compiler fuses it
  into its own loops; the fused SDPA kernel has a fixed cost per call whatever the length;
- a big int8 model's one-row products as the row times each of the matrix's rows, summed (`row_products`):
  a decode step reads each weight once for one row, so it is bound by how fast the weights stream in, and
  `torch._int_mm` streams them slower for a single row than this loop does (each int8 weight converted to
  float32 as it is read, no packing; the template makes no int8 product). The inputs of these loops are
  computed once, not again for each output (`realize_opcount_threshold`: Inductor would otherwise recompute
  a LayerNorm or GELU feeding a product for every one of its rows). Programs for many rows keep
  `torch._int_mm`, which reads a weight once for all the rows, and so do small models (the char model's
  step is bound by its many small kernels, not by its weights: one loop per product made its int8 step
  slower).

Footguns
- The weights are compiled into the step as constants (the GEMM template reorders them when compiling):
  the step is a second copy of them in memory, and a change to the model's weights after the first
  call is not seen by it. Compile after loading, decode, and compile again for other weights.
- The model must hold plain `nn.Linear` layers, or `Int8Linear` / `Int4Linear` (`gpt.model.quantize`, plain
  PyTorch too: their `torch._int_mm` and int4 products stay calls of those ops, which the GEMM template does
  not make; the one-row loops leave int4's kernel as it is): compile
  before `gpt.model.packed.pack` (the loader does not pack a model loaded for compiling).
- The first call waits for the compile, or for loading the step an earlier run compiled from the same
  weights (`gpt.model.stepcache`, GPT_COMPILE_CACHE); both times are in bench/README.md, "Against llama.cpp".
"""

from __future__ import annotations

import tempfile
import time
import warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from gpt.errors import UserError, storage_error
from gpt.model import stepcache
from gpt.model.cache import KVCache
from gpt.model.quantize import QUANTIZED, Int8Linear

NO_COMPILE = "or decode without --compile"
TEMPLATE = {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}  # Inductor's C++ GEMM template
SMALL_PARAMS = 10_000_000  # below: small models' kernels (bf16: the template for many rows; int8: torch._int_mm)


class CompileError(UserError, ValueError):
    """A model the ahead-of-time step cannot be built from."""


class StepModule(nn.Module):
    """What is exported: ids (B, 1), the shared position (0-dim) and each layer's cached keys and values
    (B, nh, L, hs) -> the logits (B, V) after ids; the keys and values of ids are written in place."""

    def __init__(self, model: nn.Module, rolling: bool, rings: tuple = ()):
        super().__init__()
        self.model, self.rolling = model, rolling
        self.rings = rings or (None,) * len(model.transformer.h)  # per layer: a ring's (n_global, window), or None

    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor, written: torch.Tensor, kv: list[torch.Tensor]
    ) -> torch.Tensor:
        slots = torch.arange(written.size(0), device=ids.device)
        caches = [
            _Written(k, v, pos, slots, self.rolling) if ring is None else _ring(k, v, pos, *ring)
            for k, v, ring in zip(kv[::2], kv[1::2], self.rings, strict=True)
        ]
        return self.model._logits_after(ids, caches)


def _ring(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, n_global: int, window: int) -> KVCache:
    """A windowed layer's ring cache (gpt/model/cache.py) over the step's inputs: attended whole, every step."""
    ring = KVCache.__new__(KVCache)
    ring.k, ring.v, ring.pos, ring.rolling, ring.lengths = k, v, pos, True, None
    ring.ring, ring.n_global, ring.period = True, n_global, window
    return ring


class _Written(KVCache):
    """A static cache seen through its first `len(slots)` slots, the written ones: what `KVCache.view`
    makes, but gathered (`index_select`, which the compiler reads in place) rather than sliced, since
    export cannot keep the length of a slice symbolic (it asks whether the slice is contiguous)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, rolling: bool):
        self.k, self.v, self.pos, self.slots, self.rolling = k, v, pos, slots, rolling
        self.ring, self.n_global, self.period, self.lengths = False, 0, k.size(2), None  # (key_positions)

    @property
    def max_len(self) -> int:
        return self.slots.size(0)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position pos % length in the view is pos % buffer length here: pos < length until the view is whole
        slot = (self.pos % self.k.size(2)).view(1)
        self.k.index_copy_(2, slot, k)
        self.v.index_copy_(2, slot, v)
        return self.k.index_select(2, self.slots), self.v.index_select(2, self.slots)


class AheadOfTimeStep:
    """`decode_step(ids, caches, length)` of `GPT.compile_decoding` on the CPU. Compiled at the first call: one
    compile serves every cache length, one row (the common case) its own and every larger row count another."""

    def __init__(self, model: nn.Module, compiled: bool = True):
        unsupported = sorted({_opaque(m) for m in model.modules()} - {None})
        if unsupported:
            raise CompileError(
                f"the compiled decode step needs plain nn.Linear (or Int8Linear, Int4Linear) layers, not "
                f"{', '.join(unsupported)}: "
                "compile before packing"
            )
        self.model, self.compiled = model, compiled  # compiled=False: the exported module run eagerly (tests)
        self._runs = {}  # by the caches' shape but rows (the compiled code assumes it)
        self.compile_seconds = 0.0  # spent compiling (or loading) so far (sample.py reports the speed without it)
        self.cache_hits = 0  # steps loaded from the disk cache instead of compiled (gpt.model.stepcache)
        self._lengths: dict[int, torch.Tensor] = {}

    def __call__(self, ids: torch.Tensor, caches: list[KVCache], length: int) -> torch.Tensor:
        """The logits after ids (B, 1) over `caches` (static: a tensor position) of which the first `length`
        slots are written (the position's included); windowed layers' rings are attended whole."""
        written = self._lengths.get(length)
        if written is None:  # a tensor of that length, the one symbolic size: one per length, made once
            written = self._lengths[length] = torch.empty(length, dtype=torch.bool)
        tensors = [ids.contiguous(), caches[0].pos, written]  # (the compiled code assumes the layouts)
        for cache in caches:
            tensors += (cache.k, cache.v)
        # one row (the common case) is a compile of its own, unless a program for many rows exists: samples
        # that finish leave the batch, and the last one must not wait for a second compile
        key = (ids.size(0) == 1, (caches[0].k.shape[1:], *(cache.max_len for cache in caches)))  # (rings: sizes)
        run = self._runs.get(key) or self._runs.get((False, key[1]))
        if run is None:
            start = time.perf_counter()
            rings = tuple((c.n_global, c.period) if c.ring else None for c in caches)
            run = self._runs[key] = self._compile(tensors, one_row=key[0], rings=rings)
            self.compile_seconds += time.perf_counter() - start
        return run(tensors)[0]

    def _compile(self, tensors: list[torch.Tensor], one_row: bool, rings: tuple = ()):
        rolling = self.model.positions.slides
        if not self.compiled:
            step = StepModule(self.model, rolling, rings)
            return lambda t: [step(t[0], t[1], t[2], t[3:])]
        ids, pos, _, *kv = tensors
        options = inductor_options(self.model, one_row)
        layout = (
            f"rows {'one' if one_row else 'any'}, rolling {rolling}, ids {ids.dtype}, pos {pos.dtype}, "
            + ", ".join(f"{t.dtype}{tuple(t.shape[1:])}" for t in kv)
            + (f", rings {rings}" if any(rings) else "")
        )
        cache = stepcache.usable()  # None: off, or not trusted (a warning says why)
        name = stepcache.key(self.model, layout, options) if cache else None
        cached = stepcache.load(cache, name) if name else None
        if cached is not None:  # this step compiled by an earlier run (gpt.model.stepcache)
            self.cache_hits += 1
            return cached.loader.run
        # example inputs of 2 written slots (export takes a size of 1 for a constant) and 1 row or 2 (the rows
        # symbolic, the template's matrix products run generic loops: GPT-2 float32 decoded 69.9 tokens/s
        # that way, 76.0 with one row's code, in two runs on one machine)
        rows = 1 if one_row else 2
        ids = ids.new_zeros((rows, 1))
        kv = [t.new_zeros((rows, *t.shape[1:])) for t in kv]
        rows = None if one_row else {0: torch.export.Dim("rows", min=1, max=1 << 16)}
        plain = [t.size(2) for t, ring in zip(kv[::2], rings or (None,) * len(kv), strict=False) if ring is None]
        length = torch.export.Dim("length", min=1, max=max(plain, default=kv[0].size(2)))
        shapes = (rows, None, {0: length}, [rows for _ in kv])
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own, from inside export
            example = (ids, pos.new_zeros(()), torch.empty(2, dtype=torch.bool), kv)
            with row_products(self.model, one_row and "realize_opcount_threshold" in options):
                program = torch.export.export(StepModule(self.model, rolling, rings), example, dynamic_shapes=shapes)
            try:
                with tempfile.TemporaryDirectory(prefix="gpt-step-") as tmp:
                    path = torch._inductor.aoti_compile_and_package(
                        program, package_path=str(Path(tmp) / "step.pt2"), inductor_configs=options
                    )
                    loaded = torch._inductor.aoti_load_package(path)
                    if name:  # (an entry refused or damaged above is replaced)
                        stepcache.keep(cache, path, name)
            except OSError as e:  # the compiler's files (the temporary directory, torch's cache) did not fit
                raise storage_error(e, "compile the decode step in", tempfile.gettempdir(), NO_COMPILE) from None
            except Exception as e:  # a C++ compiler missing or failing: one line, not Inductor's pages
                first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
                raise CompileError(
                    f"could not compile the decode step ({first.strip()[:200]}); it needs a C++ compiler (g++), {NO_COMPILE}"
                ) from None
        return loaded.loader.run


class DynamoStep:
    """`decode_step(ids, caches, length)` of `GPT.compile_decoding` off the CPU: torch.compile's graph of the
    step over the caches cut to `length` (views), that length symbolic: one graph for every length but the
    full cache (contiguous, a second graph)."""

    def __init__(self, model: nn.Module):
        self.step = torch.compile(model._logits_after)
        self._marked = False

    def __call__(self, ids: torch.Tensor, caches: list[KVCache], length: int) -> torch.Tensor:
        views = [cache.view(slice(None), length, cache.pos) for cache in caches]  # (rings: whole)
        if length < max((c.max_len for c in caches if not c.ring), default=0) and not self._marked:
            # marked once (marking at every step cost ~35 us a token on the char model): the symbolic-length
            # graph, once compiled, serves the unmarked views after
            self._marked = True
            for view in (view for view in views if not view.ring):
                torch._dynamo.mark_dynamic(view.k, 2)
                torch._dynamo.mark_dynamic(view.v, 2)
        return self.step(ids, views)


def inductor_options(model: nn.Module, one_row: bool = False) -> dict:
    """Freezing (the weights are constants, laid out for their kernels when compiling) and Inductor's own GEMM
    template for float32, for one row, and for small models. Quantised models keep their kernels
    (`torch._int_mm`, int4's), a big bf16 model oneDNN's for many rows; a big int8 model's one row takes the
    row products (`row_products`) with their inputs computed once (module notes)."""
    weight = model.transformer.wte.weight
    small = sum(t.numel() for t in (*model.parameters(), *model.buffers())) < SMALL_PARAMS  # (int8: buffers)
    quantized = any(isinstance(m, QUANTIZED) for m in model.modules())
    if (weight.dtype == torch.float32 or small or one_row) and not quantized:
        return {"freezing": True} | TEMPLATE
    return {"freezing": True} | ({"realize_opcount_threshold": 0} if one_row and not small else {})


def _row_product(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` for one row, as the row times each row of the weight, summed (see `row_products`)."""
    y = (x.unsqueeze(-2) * linear.weight).sum(-1)
    return y if linear.bias is None else y + linear.bias


@contextmanager
def row_products(model: nn.Module, on: bool = True):
    """While exporting a one-row step, the model's Linear layers (`nn.Linear`, `Int8Linear.row_forward`) compute
    their products as the row times each row of the weight, summed: Inductor makes each one loop that streams
    the weight once, converting it to float32 as it reads. Only this model's layers, restored after."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, Int8Linear))] if on else []
    for m in layers:
        m.forward = m.row_forward if isinstance(m, Int8Linear) else partial(_row_product, m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward


def _opaque(module: nn.Module) -> str | None:
    """The name of a layer export cannot see through (packed: oneDNN, column blocks, our C kernels), else None."""
    kind = type(module).__name__
    return kind if kind in ("PackedLinear", "ChunkedLinear", "RowLinear") else None
