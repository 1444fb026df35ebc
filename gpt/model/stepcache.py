"""Compiled decode steps kept on disk (`gpt.model.compiled`): a later run of `gpt sample --compile` on the same
weights loads its step instead of compiling it again (loading against compiling: bench/README.md, "Against
llama.cpp").

    GPT_COMPILE_CACHE=DIR      # where (default: $XDG_CACHE_HOME/gpt/compiled-steps, else ~/.cache/gpt/...)
    GPT_COMPILE_CACHE=off      # never read or write one: every run compiles, as before the cache

An entry is the AOTInductor package AOTInductor wrote (`<key>.pt2`: the C++ step with the weights inside), named
by a hash of everything the compile read: the weights and buffers, the model's config, the cache layout and row
kind, the compiler options, torch's version, the source of gpt/model (the traced code), and this CPU (its
model, flags and the ISA caps in the environment: the code is built for them, so a home directory shared by
different machines keeps one entry per kind of CPU). Entries are written whole (a temporary name, then a rename);
the least recently used are removed past `BUDGET_BYTES`.

Footguns
- An entry is native code that is loaded and run. The directory is created private (0700); never point
  GPT_COMPILE_CACHE at one that others can write.
- A cache that cannot be written (a full disk, read-only, no home) or an entry that does not load is not an
  error: the step compiles as without a cache, and a bad entry is replaced.
- Only whole runs of the same weights hit: a checkpoint trained further is another entry (about the size of
  the weights: the step holds them).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

BUDGET_BYTES = 4 << 30  # about six GPT-2 124M float32 steps
SUFFIX = ".pt2"


def directory() -> Path | None:
    """The cache directory GPT_COMPILE_CACHE names (or the default), or None when it is off."""
    named = os.environ.get("GPT_COMPILE_CACHE", "")
    if named.lower() in ("off", "0", "none", "false"):
        return None
    if named:
        return Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpt" / "compiled-steps"


def key(model: nn.Module, layout: str, options: dict) -> str:
    """The name of the entry for `model`'s step: a hash of what the compile depends on (module notes)."""
    h = hashlib.sha256()
    for part in (
        torch.__version__,
        _source_digest(),
        _cpu(),
        json.dumps(model.config.to_dict(), sort_keys=True, default=str),
        layout,
        json.dumps(options, sort_keys=True, default=str),
    ):
        h.update(part.encode() + b"\0")
    seen = set()  # a tied matrix once
    for name, tensor in model.state_dict().items():
        h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\0".encode())
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:40]


def lookup(name: str) -> Path | None:
    """The entry of that name if the cache holds one (its use recorded for the eviction order), else None."""
    root = directory()
    path = root / f"{name}{SUFFIX}" if root else None
    if path is None or not path.is_file():
        return None
    try:
        os.utime(path)
    except OSError:
        pass
    return path


def keep(package: str | os.PathLike, name: str) -> None:
    """Copy the compiled package into the cache under `name`, whole or not at all, then evict past the budget.
    Failures (a full disk, a read-only cache) leave the cache as it was."""
    root = directory()
    if root is None:
        return
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(package, "rb") as src, tempfile.NamedTemporaryFile("wb", dir=root, suffix=".part", delete=False) as f:
            tmp = Path(f.name)
            while chunk := src.read(1 << 24):
                f.write(chunk)
        os.replace(tmp, root / f"{name}{SUFFIX}")
        tmp = None
        evict(root, BUDGET_BYTES, keep_name=name)
    except OSError:
        pass
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def forget(path: Path) -> None:
    """Remove an entry that did not load."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def evict(root: Path, budget: int, keep_name: str = "") -> None:
    """Remove the least recently used entries until the cache holds at most `budget` bytes (never `keep_name`)."""
    entries = sorted((p.stat().st_mtime, p) for p in root.glob(f"*{SUFFIX}"))
    total = sum(p.stat().st_size for _, p in entries)
    for _, path in entries:
        if total <= budget:
            break
        if path.stem != keep_name:
            total -= path.stat().st_size
            path.unlink(missing_ok=True)


def _source_digest() -> str:
    """The model code the step was traced from (this directory's sources)."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _cpu() -> str:
    """This CPU, as far as the compiled code depends on it."""
    caps = [os.environ.get(v, "") for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")]
    described = platform.processor()
    try:
        fields = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = line.partition(":")
            fields.setdefault(field.strip(), value.strip())
        described = f"{fields.get('model name', '')} {fields.get('flags', fields.get('Features', ''))}"
    except OSError:
        pass
    return " ".join([platform.machine(), described, torch.backends.cpu.get_cpu_capability(), *caps])
