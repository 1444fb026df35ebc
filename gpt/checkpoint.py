"""Checkpoints: written atomically, loaded without executing anything, self-describing.

A run directory (`out/NAME`) holds `last.pt` (latest), `best.pt` (lowest val loss), `config.json`
(the resolved configuration, written at start) and `log.jsonl` (every logged step and eval).

A checkpoint file is a dict of tensors and plain data, loadable with `torch.load(weights_only=True)`:

| key         | contents                                                                  |
|-------------|---------------------------------------------------------------------------|
| `model`     | the (uncompiled) model's state dict                                       |
| `optimizer` | optimizer state dict (training checkpoints only)                          |
| `scaler`    | GradScaler state dict, or None                                            |
| `rng`       | torch CPU / CUDA generator states                                         |
| `meta`      | a JSON string: format, step, model_config, train_config, tokenizer spec,  |
|             | val loss, data sampler position ... (see `read_meta`)                     |

Footgun: a crash while writing must never destroy the previous good checkpoint, so `save` writes a
temporary file in the same directory, flushes and fsyncs it, then renames it over the old one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from gpt.errors import UserError

FORMAT_VERSION = 1
LATEST = ("last.pt",)  # resuming continues the latest state, never the best one


class CheckpointError(UserError, ValueError):
    """A path that is missing or is not a gpt checkpoint."""


def save(path: str | os.PathLike, state: dict, meta: dict) -> None:
    """Atomically write `state` (tensors and plain data) plus `meta` (JSON-serialisable) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(state, meta=json.dumps({"format": FORMAT_VERSION, **meta}))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Atomically make `dst` a copy of `src` (a hard link where the filesystem allows: no extra disk)."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def resolve(path: str | os.PathLike, names: tuple[str, ...] = ("best.pt", "last.pt")) -> Path:
    """A checkpoint file from a file path or a run directory (the first of `names` there).

    Sampling prefers best.pt (lowest val loss); resuming wants last.pt (the latest state).
    """
    path = Path(path)
    if path.is_dir():
        for name in names:
            if (path / name).is_file():
                return path / name
        raise CheckpointError(f"no {' or '.join(names)} in {path}: train one with `python train.py --out-dir {path}`")
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    return path


def read(path: str | os.PathLike, map_location="cpu", names: tuple[str, ...] = ("best.pt", "last.pt")) -> dict:
    """The raw checkpoint dict with `meta` parsed; never unpickles arbitrary objects."""
    path = resolve(path, names)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
        ckpt["meta"] = json.loads(ckpt["meta"])
    except Exception as e:
        raise CheckpointError(f"{path} is not a gpt checkpoint ({type(e).__name__}: {str(e)[:120]})") from None
    if ckpt["meta"].get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {ckpt['meta'].get('format')!r}")
    return ckpt


def read_meta(path: str | os.PathLike, names: tuple[str, ...] = ("best.pt", "last.pt")) -> dict:
    """Only the metadata (the tensors are memory-mapped, not read)."""
    path = resolve(path, names)
    try:
        return json.loads(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["meta"])
    except Exception as e:
        raise CheckpointError(f"{path} is not a gpt checkpoint ({type(e).__name__}: {str(e)[:120]})") from None


def load_model(path: str | os.PathLike, device="cpu"):
    """(model, meta) from a run directory, checkpoint file or Hugging Face GPT-2 directory (gpt/hf.py)."""
    from gpt import hf
    from gpt.model import GPT, GPTConfig

    if hf.is_hf_dir(path):
        return hf.load_hf_dir(path, device)
    ckpt = read(path, map_location=device)
    model = GPT(GPTConfig.from_dict(ckpt["meta"]["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), ckpt["meta"]


def load_checkpoint(path: str | os.PathLike, device="cpu"):
    """(model, tokenizer, meta), model in eval mode: everything sampling needs."""
    from gpt.tokenizer import get_tokenizer

    model, meta = load_model(path, device)
    return model, get_tokenizer(meta["tokenizer"]), meta
