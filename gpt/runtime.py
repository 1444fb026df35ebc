"""Where and how a process computes: device, precision, threads, processes. One answer for training,
sampling and evaluation.

    rt = runtime.setup(device="auto", dtype="auto", threads=0)        # training (also under torchrun)
    rt = runtime.setup(device="auto", dtype="auto", distributed=False) # sampling / evaluation
    with rt.autocast():
        logits, loss = model(x, y)

Precision policy (`dtype="auto"`)
- CUDA: bf16 autocast where the GPU supports it, else fp16 with a GradScaler (the trainer's).
- CPU: bf16 autocast only where the CPU computes bf16 natively (AVX-512 BF16 or AMX: the cpuinfo
  flags `avx512_bf16` / `amx_bf16`); float32 elsewhere. Without those instructions a bf16 matrix
  product is emulated and many times slower than float32 (an AVX2-only EPYC's step: bench/README.md,
  "Training"), so an explicit `--dtype bfloat16` there warns. Inference (bf16 weights, no
  autocast) only from INFERENCE_BF16_MIN_PARAMS parameters: smaller models decode faster in float32.
  Decoding one sequence through our C kernels' whole step (gpt.model.rowkernels: `bf16_steps`) picks bf16
  at any size on a CPU with native bf16, and from that size on one without: there the kernels widen bf16
  weights to float32 in registers (AVX2), which pays once the step is bound by the weights' bytes, and a
  prompt's products over rowkernels.MANY_ROWS rows run in float32 (bench/README.md, "bf16 against float32").
  $GPT_CPU_BF16=0|1 overrides the CPU check (tests and developers run the other CPU class's path).
- Other devices (mps): float32.
`Runtime.reason` says why, for the run header.

The allocator (`tune_allocator`, which `setup` calls first, so every command gets it)
- glibc's malloc hands blocks over 128 KiB to mmap (a threshold that rises with each such block freed,
  to at most 32 MiB) and gives the heap's free top back to the system once 128 KiB lie there. A training
  or decode step frees and reallocates tens of MiB of activations and gradients, so every step the kernel
  unmaps them and faults zeroed pages back in: a large share of a CPU run's time was system time (2-core
  EPYC, the main job, a BPE job and Multi30k). The fast path asks glibc (mallopt) for what
  `MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_TOP_PAD_=536870912` would
  set: blocks under 32 MiB come from the heap from the start, freed memory stays with the process
  (trimmed only past 2 GiB free) and the heap grows in 512 MiB steps (address space: pages count in the
  RSS once touched). System time, wall time and peak RSS with and without it: bench/README.md, "The
  allocator" (the same loss). The cost: memory freed after a peak is kept until the process exits.
- Training (`FreeMemoryCap`, the trainer's, on CPU): large blocks come from the heap too (a Multi30k
  step's ~100 MiB logits were mapped and faulted in afresh every step), and once the resident set passes
  the preflight estimate plus half a step's activations, free memory is given back (malloc_trim):
  batches of varying shape leave holes that later shapes do not fit (a 20-minute Multi30k run grew to
  4.87 GB RSS for an estimate of 1.3 GiB). `malloc_stats` says what malloc holds (mallinfo2).
- oneDNN's primitive cache is bounded at 128 shapes (`bound_onednn_cache`; ONEDNN_PRIMITIVE_CACHE_CAPACITY
  as the user set it wins): batches of varying shape otherwise add a primitive and its buffers per shape.
- Weights our decoding kernels stream once a token, and CPU KV caches, live on transparent huge pages where
  the kernel gives them (`on_huge_pages`: a private mapping advised MADV_HUGEPAGE; THP's default "madvise"
  mode gives 2 MiB pages to such mappings only): fewer TLB misses, and the prefetchers do not stop at every
  4 KiB page (bench/README.md, "Against llama.cpp").
- `GPT_MALLOC=default` keeps glibc's own settings; a MALLOC_*_ variable or a GLIBC_TUNABLES
  glibc.malloc.* entry the user set for one of the three is left as the user set it. Other C libraries
  (musl, macOS, Windows) are left alone.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import platform
import sys
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Inference on a CPU with native bf16 through PyTorch's kernels (serving, evaluation; sampling where our C
# step does not run): below this many parameters bf16 weights decode no faster than float32, and the smallest
# models slower (bf16 / float32 tokens/s by model size: bench/README.md, "bf16 against float32"). A decode step
# of a small model is dispatch overhead, which bf16's conversions add to; wide matmuls are where bf16 pays.
# Our C step pays it with native bf16 at any size; without, from this size (`resolve_dtype`'s bf16_steps).
INFERENCE_BF16_MIN_PARAMS = 7_000_000


class DeviceError(UserError, ValueError):
    """A device or precision this machine cannot provide (the message says what it can)."""


class AllocatorError(UserError, ValueError):
    """A $GPT_MALLOC value that is not one of fast, default."""


class SlowPrecisionWarning(UserWarning):
    """bf16 asked for on a CPU that emulates it."""


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


BF16_OVERRIDE = "GPT_CPU_BF16"  # 0: behave as a CPU without native bf16, 1: as one with it; unset: detect


def cpu_bf16_override() -> bool | None:
    """What $GPT_CPU_BF16 says (None when unset), so either CPU class can run the other's precision path."""
    value = os.environ.get(BF16_OVERRIDE, "").strip()
    if value not in ("", "0", "1"):
        raise DeviceError(
            f"{BF16_OVERRIDE}={value!r}: use 0 (as a CPU without native bf16), 1 (as one with it) "
            f"or leave it unset (detect)"
        )
    return None if value == "" else value == "1"


def cpu_has_native_bf16() -> bool:
    """True where the CPU has bf16 arithmetic instructions (x86 AVX-512 BF16 or AMX-BF16), or where
    $GPT_CPU_BF16=1 says to behave as if it had (0: as if it had not)."""
    override = cpu_bf16_override()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) if override is None else override


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_description() -> str:
    """e.g. 'AMD EPYC (AVX2, no native bf16)' for headers and benchmark records (with ', GPT_CPU_BF16=1'
    where the override decides)."""
    capability = torch.backends.cpu.get_cpu_capability()
    override = f", {BF16_OVERRIDE}={int(cpu_bf16_override())}" if cpu_bf16_override() is not None else ""
    return f"{cpu_name()} ({capability}, {'native' if cpu_has_native_bf16() else 'no native'} bf16{override})"


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' is cuda where available, else cpu; anything else must exist on this machine."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DeviceError(f"--device {name!r} is not a device: use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        count = torch.cuda.device_count()
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # set_device and peers want an index
        elif device.index >= count:
            raise DeviceError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 .. cuda:{count - 1}")
    elif device.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise DeviceError(f"--device {name}: MPS is not available on this machine; use --device cpu")
    elif device.type != "cpu":
        raise DeviceError(f"--device {name}: not supported here; use auto, cpu, cuda, cuda:N or mps")
    return device


def resolve_dtype(
    name: str, device: torch.device, inference_params: int | None = None, bf16_steps: bool = False
) -> tuple[torch.dtype, str]:
    """The compute precision for `name` on `device`, and the reason (see the module notes).
    `inference_params`: the model's parameter count when it only runs forward (sampling, serving,
    evaluation), where `auto` on a CPU with native bf16 depends on the model's size.
    `bf16_steps`: the caller decodes one sequence through our C kernels' whole step (gpt.model.rowkernels):
    with native bf16, `auto` picks bf16 at any size; without it (the kernels widen bf16 weights in
    registers), from INFERENCE_BF16_MIN_PARAMS."""
    if name != "auto" and name not in DTYPES:
        raise DeviceError(f"--dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    if name == "float16" and device.type != "cuda":
        raise DeviceError(f"--dtype float16 needs a CUDA device (got {device}); use bfloat16 or float32")
    native_bf16 = device.type == "cpu" and cpu_has_native_bf16()
    if name == "bfloat16" and device.type == "cpu" and not native_bf16:
        warnings.warn(
            "--dtype bfloat16 on a CPU without native bf16 (no AVX-512 BF16 / AMX) is emulated and can "
            "be many times slower than float32; --dtype auto picks float32 here",
            SlowPrecisionWarning,
            stacklevel=2,
        )
    if name != "auto":
        return DTYPES[name], "asked for"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "this GPU supports bf16"
        return torch.float16, "this GPU has no bf16: fp16 with loss scaling"
    if device.type == "cpu":
        has = "has" if native_bf16 else "has no"
        why = (
            f"this CPU {has} native bf16"
            if cpu_bf16_override() is None
            else f"{BF16_OVERRIDE}={int(native_bf16)}: as a CPU that {has} native bf16"
        )
        below = f"{INFERENCE_BF16_MIN_PARAMS / 1e6:g}M parameters"
        small = inference_params is not None and inference_params < INFERENCE_BF16_MIN_PARAMS
        if native_bf16 and small and not bf16_steps:
            return torch.float32, f"{why}, but decodes faster in float32 below {below}"
        if not native_bf16 and bf16_steps and inference_params is not None and not small:
            return torch.bfloat16, f"{why}, but our C decoding kernels read bf16 weights faster from {below}"
        return (torch.bfloat16 if native_bf16 else torch.float32), why
    return torch.float32, f"{device.type} default"


def decode_threads(n_params: int) -> int:
    """CPU threads for sampling when none were asked for. A decode step is a few hundred tiny matrix
    products: for a small model one thread is fastest, and threads that wait for each other collapse
    when other processes share the cores (the 4x4x128 char model on 2 busy cores: bench/README.md,
    "Sampling on a CPU"). Larger models use torch's default unless the machine is already busy."""
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0] >= cores - 0.5
    except OSError:  # pragma: no cover (no load average on this platform)
        busy = False
    return 1 if n_params < 20_000_000 or busy else torch.get_num_threads()


MALLOC_SWITCH = "GPT_MALLOC"  # fast (unset: the default) | default: glibc's own settings
# glibc's mallopt parameters (malloc.h), each with the environment variable and tunable that set it at
# start-up, and the fast path's value (mallopt takes an int: 2 GiB - 1 is its largest trim threshold)
FAST_MALLOC = {
    "mmap_threshold": (-3, 32 << 20),  # M_MMAP_THRESHOLD (setting it also ends glibc's dynamic threshold)
    "trim_threshold": (-1, 2**31 - 1),  # M_TRIM_THRESHOLD
    "top_pad": (-2, 512 << 20),  # M_TOP_PAD
}
M_MMAP_MAX = -4  # FreeMemoryCap sets it to 0: no block is mmap'd, however large


def glibc() -> ctypes.CDLL | None:
    """This process's C library where it is glibc (mallopt is glibc's), else None (musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):  # unknown to musl: ValueError
            return None
        return ctypes.CDLL(None)
    except (ValueError, OSError, AttributeError):
        return None


def user_malloc_settings(environ=os.environ) -> set[str]:
    """Which of FAST_MALLOC's parameters the user set (MALLOC_MMAP_THRESHOLD_=..., GLIBC_TUNABLES=
    glibc.malloc.mmap_threshold=...): those stay as the user set them."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    return {name for name in FAST_MALLOC if f"MALLOC_{name.upper()}_" in environ or f"glibc.malloc.{name}=" in tunables}


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (malloc.h, glibc 2.33+): byte counts over all arenas."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def malloc_stats(libc: ctypes.CDLL | None = None) -> dict[str, int] | None:
    """What glibc's malloc holds, in bytes: `heap` (from the system, heap arenas), `mmapped` (blocks
    mapped one by one), `in_use` and `free` (held, free, the pages still resident unless trimmed). None
    where the C library is not glibc 2.33+."""
    libc = libc or glibc()
    info = getattr(libc, "mallinfo2", None) if libc is not None else None
    if info is None:
        return None
    info.restype = _MallInfo2
    m = info()
    return {"heap": m.arena, "mmapped": m.hblkhd, "in_use": m.uordblks + m.hblkhd, "free": m.fordblks}


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class FreeMemoryCap:
    """Keeps a training process's resident memory under `limit` by giving glibc's free memory back.

        cap = FreeMemoryCap(limit=budget, least=worth_it)
        cap.after_step()          # between steps: malloc_trim(0) when resident > limit and >= least is free

    With the fast settings freed memory stays with the process for the next step, but batches of
    varying shape (pairs grouped by length) free and allocate blocks of ever new sizes: free holes
    that the next sizes do not fit pile up in the heap and every page of them stays resident (a
    Multi30k run's RSS grew to several times what it used). Past `limit`, glibc's malloc_trim gives back
    every whole free page, inside free blocks as well as at the heap's top; `least` (resident free
    memory: the resident set less what malloc has handed out, mallinfo2, less what was resident outside
    malloc when the cap was made) keeps it from trimming when there is little to give. Each trim costs
    the next steps the page faults of what it gave back, so the limit is a ceiling, not a target.
    It also stops glibc from mmap'ing large blocks (M_MMAP_MAX 0; MALLOC_MMAP_MAX_ as the user set it
    wins): past glibc's largest mmap threshold, 32 MiB, a block (a translation step's logits and their
    gradients: ~100 MiB each) was mapped and faulted in afresh every step. `trims` counts the trims,
    `returned` the resident bytes they gave back.

    Footguns: a no-op where the C library is not glibc 2.33+ (no mallinfo2), off Linux (no /proc) or under
    GPT_MALLOC=default (glibc trims by itself there); a `limit` below what a step uses trims after every
    step and faults its activations back in (system time), which is what the fast settings are for.
    """

    def __init__(self, limit: int, least: int = 64 << 20, environ=os.environ, libc: ctypes.CDLL | None = None):
        self.limit, self.least, self.trims, self.returned = limit, least, 0, 0
        self.libc = None if environ.get(MALLOC_SWITCH, "").strip() == "default" else (libc or glibc())
        if self.libc is not None and getattr(self.libc, "mallinfo2", None) is None:
            self.libc = None
        self.outside = self._outside() if self.libc is not None else None
        if self.outside is None:
            self.libc = None
        mine = "MALLOC_MMAP_MAX_" in environ or "glibc.malloc.mmap_max=" in environ.get("GLIBC_TUNABLES", "")
        if self.libc is not None and not mine:  # large blocks from the heap too: reused, not faulted in again
            self.libc.mallopt(M_MMAP_MAX, 0)

    def _outside(self) -> int | None:
        resident, stats = resident_bytes(), malloc_stats(self.libc)
        return None if resident is None or stats is None else resident - stats["in_use"]

    def resident_free(self) -> int:
        """Bytes of free malloc memory that are resident now (an estimate, see the class notes)."""
        return max(self._outside() - self.outside, 0) if self.libc is not None else 0

    def after_step(self) -> int:
        """Trim when the resident set is over `limit` with at least `least` bytes of it free; returns the
        resident bytes the trim gave back (0: nothing done)."""
        if self.libc is None:
            return 0
        before = resident_bytes()
        if before <= self.limit or self.resident_free() < self.least:
            return 0
        self.libc.malloc_trim(0)
        self.trims += 1
        returned = max(before - resident_bytes(), 0)
        self.returned += returned
        return returned


def tune_allocator(environ=os.environ, libc: ctypes.CDLL | None = None) -> str:
    """Apply the fast allocator settings (see the module notes) unless $GPT_MALLOC=default; a no-op where
    the C library is not glibc. Returns what it did, e.g. `glibc malloc tuned (mmap_threshold, ...)`."""
    switch = environ.get(MALLOC_SWITCH, "").strip() or "fast"
    if switch not in ("fast", "default"):
        raise AllocatorError(
            f"{MALLOC_SWITCH}={switch!r}: use fast (keep freed memory for the next step; the default) or "
            f"default (glibc's own allocator settings)"
        )
    if switch == "default":
        return f"allocator unchanged ({MALLOC_SWITCH}=default)"
    libc = libc or glibc()
    if libc is None:
        return "allocator unchanged (not glibc)"
    mine = user_malloc_settings(environ)
    tuned = [name for name, (param, value) in FAST_MALLOC.items() if name not in mine and libc.mallopt(param, value)]
    return f"glibc malloc tuned ({', '.join(tuned) or 'nothing'})" + (
        f"; {', '.join(sorted(mine))} as set" if mine else ""
    )


@dataclass
class Runtime:
    """Where and how this process computes."""

    device: torch.device
    dtype: torch.dtype
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    ddp: bool = False  # launched by torchrun (a process group, DDP), even with a single process
    reason: str = ""
    compiled: bool = False  # the training step runs a torch.compile'd model (picks the attention kernel)

    @property
    def master(self) -> bool:
        return self.rank == 0

    def precision(self) -> str:
        """The precision and why: `float32 (this CPU has no native bf16)`."""
        return str(self.dtype).removeprefix("torch.") + (f" ({self.reason})" if self.reason else "")

    def describe(self) -> str:
        """The run header's words: `cpu float32 (this CPU has no native bf16), 2 threads`."""
        what = f"{self.device} {self.precision()}"
        if self.device.type == "cpu":
            what += f", {torch.get_num_threads()} threads"
        return what

    def peak_memory_gib(self) -> float | None:
        """The most GPU memory tensors have held so far (CUDA only; allocator caches not counted)."""
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None

    def autocast(self) -> ExitStack:
        """The forward pass's context: autocast unless float32 and, on CPU, the attention kernel that
        trains fastest there.

        PyTorch's CPU flash-attention kernel is the slower one in bf16 (its backward took most of a
        step; 4x4x128, block 64, batch 24, 2 cores) and under torch.compile, where inductor fuses the math
        kernel's softmax. In eager float32 flash is the faster one (AVX2 EPYC, 2 cores; the main job and
        4x4x128 at batch 12: bench/README.md, "Training"). On CUDA the default choice stays. The math
        kernel computes in float32 whatever its inputs (PyTorch upcasts bf16 there): under bf16 autocast
        on the CPU the Linear layers run in bf16 and attention in float32 (tests/test_precision.py).
        """
        stack = ExitStack()
        if self.dtype != torch.float32:
            stack.enter_context(torch.autocast(device_type=self.device.type, dtype=self.dtype))
        if self.device.type == "cpu" and (self.dtype != torch.float32 or self.compiled):
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        return stack


ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_ENTRIES = "128"  # a step's distinct products fit; oneDNN's default of 1024 grows with every batch shape


def bound_onednn_cache(environ=os.environ) -> None:
    """oneDNN (bf16 matrix products on the CPU) keeps a primitive, with its buffers, for every input shape it
    meets, up to 1,024 of them: batches of pairs grouped by length have a new shape at almost every step, so
    a Multi30k run's resident memory grew for its whole length. 128 entries hold every product of a step of
    one shape (what a fixed-shape run needs) and stop that growth; a value the user set is kept. It must be
    set before oneDNN makes its first primitive, which `setup` (first in every command) is."""
    environ.setdefault(ONEDNN_CACHE, ONEDNN_CACHE_ENTRIES)


def setup(
    device: str = "auto",
    dtype: str = "auto",
    threads: int = 0,
    deterministic: bool = False,
    distributed: bool | None = None,
) -> Runtime:
    """Resolve and apply the allocator, device, precision and threads; join the torchrun process group if
    launched by it (`distributed=None`: whenever torchrun's WORLD_SIZE is set)."""
    tune_allocator()
    bound_onednn_cache()
    if threads < 0:
        raise DeviceError(f"--threads must be >= 0 (0: the default), got {threads}")
    ddp = "WORLD_SIZE" in os.environ if distributed is None else distributed
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if ddp else 1
    rank = int(os.environ.get("RANK", "0")) if ddp else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if ddp else 0
    if ddp and device in ("auto", "cuda") and torch.cuda.is_available():
        device = f"cuda:{local_rank}"
    dev = resolve_device(device)
    precision, reason = resolve_dtype(dtype, dev)
    if deterministic:
        # cuBLAS needs a fixed workspace (read when its handle is made); strict mode, because with
        # warn_only=True the flash-attention backward keeps its faster non-deterministic algorithm
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls: ~free speed in float32 parts
        torch.backends.cudnn.allow_tf32 = True
    if threads:
        torch.set_num_threads(threads)
    if ddp:
        torch.distributed.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Runtime(dev, precision, rank, local_rank, world_size, ddp, reason)


HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of CPU tensor `t` in a private mapping the kernel is asked to back with 2 MiB pages (`madvise`;
    module notes), or `t` itself: under 2 MiB, not on the CPU, no madvise (not Linux), or no mapping to be had.
    Where the kernel gives no huge pages (THP off) the copy is ordinary memory."""
    out = _huge_mapping(t.shape, t.dtype) if t.device.type == "cpu" else None
    return t if out is None else out.copy_(t)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros(shape) in such a mapping on the CPU (anonymous memory is zero already: nothing is written, and
    pages come as they are first touched), else torch.zeros."""
    out = _huge_mapping(shape, dtype) if torch.device(device).type == "cpu" else None
    return torch.zeros(shape, dtype=dtype, device=device) if out is None else out


def _huge_mapping(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised (zero) CPU tensor in a private mapping advised MADV_HUGEPAGE, from its first 2 MiB boundary,
    or None: under 2 MiB, no madvise, or no mapping to be had."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # no memory for the mapping, or a kernel without THP
        return None
    start = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE_PAGE  # the first 2 MiB boundary
    out = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start)  # (it keeps `buf` mapped)
    return out.view(dtype).view(shape)
