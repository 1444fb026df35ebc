"""Checkpoints: written atomically, loaded without executing anything, self-describing.

    ckpt = load_file(path)                            # a .pt file, meta unchecked (gpt/checkpoints/loader.py reads every kind)
    save(path, state, build_meta(model_config=..., tokenizer=..., step=...))

A run directory (`out/NAME`) holds `last.pt` (latest), `best.pt` (lowest val loss), `config.json`
(the resolved configuration, written at start) and `log.jsonl` (every logged step and eval).

A checkpoint file is a dict of tensors and plain data, loadable with `torch.load(weights_only=True)`:

| key         | contents                                                                  |
|-------------|---------------------------------------------------------------------------|
| `model`     | the (uncompiled) model's state dict                                       |
| `optimizer` | optimizer state dict (training checkpoints only)                          |
| `scaler`    | GradScaler state dict, or None                                            |
| `rng`       | torch CPU / CUDA generator states (a list, one per process, under DDP)    |
| `meta`      | the metadata below, as a JSON string                                      |

The metadata has one builder, `build_meta` (the trainer's save, the Hugging Face import), and one
reader, `check_meta` (every load goes through it):

| field           | contents                                                                      |
|-----------------|-------------------------------------------------------------------------------|
| `format`        | FORMAT_VERSION (1); required                                                  |
| `model_config`  | `GPTConfig.to_dict()`, the architecture the weights belong to; required       |
| `tokenizer`     | the spec `gpt.data.tokenizer.get_tokenizer` takes (`{"kind": ...}`); required      |
|                 | (a bpe's `pattern` is one of its KNOWN_PATTERNS: `check_spec`)                    |
| `step`          | optimizer steps taken (0 for an import)                                       |
| `train_config`  | `TrainConfig.to_dict()`: what `train.py --resume` continues                   |
| `val_loss`      | val loss at this step (absent when saved without an evaluation)               |
| `best_val_loss` | lowest val loss so far                                                        |
| `skipped_steps` | non-finite steps skipped (`--skip-nonfinite`)                                 |
| `world_size`    | processes that trained (their RNG streams continue on a same-size resume)     |
| `sampler`       | `{"seed", "mode", "next_step"}`: where the data sampler stands                |
| `dataset`       | the `--data` directory                                                        |
| `seq2seq`       | `{"bos", "eos", "pad"}` ids of an encoder-decoder model's pairs dataset       |
| `hf_dir`        | the Hugging Face directory a model was imported from                          |
| `tokens_seen`   | training tokens (targets) processed so far, over all processes                |
| `lora`          | LoRA: `model` holds only adapters; their settings and base (gpt/model/lora.py)      |
| `chat_template` | a chat model's role markers and end token (gpt/data/chat.py `ChatTemplate.spec`) |
| `qat`           | trained quantisation-aware: `{"scheme": "int4", "group_size": 32}` (gpt/model/qat.py) |

Only the required fields are checked on load; any other one a checkpoint lacks (a file made by hand,
or by another tool) is a one-line CheckpointError naming the file when something asks for it
(`meta["train_config"]` on `--resume`), never a KeyError.

Footguns
- A crash or a full disk while writing must never destroy the previous good checkpoint: every write
  goes to a temporary file `.NAME.tmp-PID-RANDOM` beside the target, is flushed and fsynced, then renamed
  over it. A process killed mid-write leaves that file behind; the next save into the directory
  removes the ones whose process is gone. Pids are this machine's: don't let two machines save into
  one directory.
- torch.save reports a failed write as `RuntimeError: ... unexpected pos ...`; the file is written
  through `_Recorder`, which keeps the OSError behind it, so a full disk is named as such.
- Sampling prefers best.pt (lowest val loss); resuming wants last.pt (the latest state).
- `--fsdp` runs save sharded checkpoints instead, `last.dcp` / `best.dcp` (directories, gpt/checkpoints/dcp.py).
  Everything that reads a checkpoint reads those too (one process reads all the shards); where a run
  directory holds both kinds under one name (a run that switched), the later step wins.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from gpt.data.tokenizer import check_spec
from gpt.errors import UserError, storage_error
from gpt.fsutil import fsync_path, remove_stale_temps, replacing
from gpt.model.transformer import GPT, GPTConfig

FORMAT_VERSION = 1
LATEST = ("last.pt",)  # resuming continues the latest state, never the best one
REQUIRED = ("format", "model_config", "tokenizer")
OPTIONAL = (
    "train_config",
    "val_loss",
    "best_val_loss",
    "skipped_steps",
    "world_size",
    "sampler",
    "dataset",
    "seq2seq",
    "hf_dir",
    "tokens_seen",
    "lora",
    "chat_template",
    "qat",
)
TRAINING_ONLY = ("train_config", "optimizer", "rng", "step", "sampler")  # what --resume needs, train.py writes
BEST_FIRST = ("best.pt", "last.pt")
SHARDED = {"last.pt": "last.dcp", "best.pt": "best.dcp"}  # the DCP checkpoint (gpt/checkpoints/dcp.py) for each name


class CheckpointError(UserError, ValueError):
    """A path that is missing or is not a gpt checkpoint."""


class Fields(dict):
    """A checkpoint, or its meta, read from `source`: a plain dict in which a missing key is a one-line
    CheckpointError naming the file and what to do, instead of a KeyError."""

    def __init__(self, data: dict, source: str | os.PathLike):
        super().__init__(data)
        self.source = source

    def __missing__(self, key):
        hint = ""
        if key in TRAINING_ONLY:
            hint = (
                f": it was not written by `gpt train`, so --resume cannot continue it; fine-tune from it instead "
                f"with `gpt train --init-from {self.source} --data DATA --out-dir OUT`"
            )
        raise CheckpointError(f"{self.source} has no {key}{hint}")


# ---- metadata: one builder, one reader -------------------------------------------------------------


def build_meta(model_config: dict, tokenizer: dict, step: int = 0, **fields) -> dict:
    """A checkpoint's metadata (the fields in the module docs); optional fields given as None are left out."""
    unknown = sorted(set(fields) - set(OPTIONAL))
    if unknown:
        raise TypeError(f"build_meta: no meta field {unknown}; document a new one in gpt/checkpoints/native.py first")
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "model_config": model_config,
        "tokenizer": tokenizer,
        **{k: v for k, v in fields.items() if v is not None},
    }


def check_meta(meta: dict | str, source: str | os.PathLike) -> Fields:
    """The metadata of `source` (a dict, or the JSON string a file holds), checked: the required fields,
    a model config this version can build, a tokenizer spec. Problems are one line naming `source`."""
    if isinstance(meta, (str, bytes)):
        try:
            meta = json.loads(meta)
        except ValueError as e:
            raise CheckpointError(f"{source} is not a gpt checkpoint: its meta is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{source} is not a gpt checkpoint: its meta is a {type(meta).__name__}, not an object")
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise CheckpointError(
            f"{source} is not a gpt checkpoint: missing {', '.join(missing)} (a checkpoint "
            f"written by `gpt train` has them; see gpt/checkpoints/native.py for the fields)"
        )
    if meta["format"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{source}: checkpoint format {_cut(meta['format'])}, this version of gpt reads format {FORMAT_VERSION}"
        )
    model_config(meta["model_config"], source)
    if not isinstance(meta["tokenizer"], dict) or "kind" not in meta["tokenizer"]:
        raise CheckpointError(
            f'{source}: its tokenizer {_cut(meta["tokenizer"])} is not a tokenizer spec (a JSON object with a "kind")'
        )
    check_spec(meta["tokenizer"], source, CheckpointError)  # a bpe's pattern is one gpt knows
    return Fields(meta, source)


def _cut(value) -> str:
    """A value of a checkpoint's meta in a message: its repr, cut short (the meta is the file's to state)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def model_config(config: dict, source: str | os.PathLike) -> GPTConfig:
    """The GPTConfig a checkpoint's model config describes; a bad one is one line naming `source`."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: invalid model config: expected a JSON object, got {type(config).__name__}")
    try:
        return GPTConfig.from_dict(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{source}: invalid model config: {str(e).removeprefix('invalid model config: ')}"
        ) from None


def build_model(meta: dict, state_dict: dict, source: str | os.PathLike) -> GPT:
    """The model `meta["model_config"]` describes, holding `state_dict`; weights of other names or shapes
    are one line naming `source` and the first few differences."""
    model = GPT(model_config(meta["model_config"], source))
    problem = state_dict_mismatch(model.state_dict(), state_dict)
    if problem:
        raise CheckpointError(f"{source}: the weights do not match its model config: {problem}")
    model.load_state_dict(state_dict)
    return model


def state_dict_mismatch(want: dict, got) -> str:
    """What differs between the state dict a model wants and the one given ("" when nothing)."""
    if not isinstance(got, dict):
        return f"the weights are a {type(got).__name__}, not a state dict"

    def shape(v):
        return tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__

    def few(items: list[str]) -> str:
        return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")

    missing = [k for k in want if k not in got]
    unexpected = [k for k in got if k not in want]
    shapes = [
        f"{k} is {shape(got[k])}, the config wants {shape(v)}"
        for k, v in want.items()
        if k in got and shape(got[k]) != shape(v)
    ]
    parts = [
        f"missing {few(missing)}" if missing else "",
        f"unexpected {few(unexpected)}" if unexpected else "",
        few(shapes) if shapes else "",
    ]
    return "; ".join(p for p in parts if p)


# ---- reading ---------------------------------------------------------------------------------------


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether `path` is a DCP checkpoint directory written by gpt/checkpoints/dcp.py."""
    return (Path(path) / "meta.json").is_file() and (Path(path) / ".metadata").is_file()


def unreadable(path: Path, e: Exception) -> str:
    """Why torch.load could not read `path`, in words: an empty or truncated file (an interrupted copy)
    says so; anything else gives torch's first line."""
    size = path.stat().st_size
    if size == 0:
        return "the file is empty (0 bytes; an interrupted copy?)"
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive, whose directory is at its end
        return f"the file is truncated or not a PyTorch file ({size:,} bytes, no complete archive)"
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"


def load_file(path: Path, map_location="cpu", mmap: bool = False) -> dict:
    """A .pt checkpoint: torch.load with weights_only (nothing is executed), as a dict that has a meta."""
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except OSError as e:
        raise storage_error(e, "read", path) from None
    except pickle.UnpicklingError:  # torch.load(weights_only=True) refused
        raise CheckpointError(
            f"{path} is not a gpt checkpoint: it holds objects other than tensors and plain "
            f"data, whose code loading would run; refused"
        ) from None
    except Exception as e:  # not a torch file, a truncated one, ...
        raise CheckpointError(f"{path} is not a gpt checkpoint: {unreadable(path, e)}") from None
    if not isinstance(ckpt, dict) or "meta" not in ckpt:
        holds = ", ".join(map(str, ckpt))[:120] if isinstance(ckpt, dict) else f"a {type(ckpt).__name__}"
        raise CheckpointError(f"{path} is not a gpt checkpoint: it has no meta (it holds {holds})")
    return ckpt


def read_file(path: Path, map_location="cpu") -> Fields:
    """A .pt checkpoint with its `meta` checked and parsed (`check_meta`) and its weights present."""
    return checked(load_file(path, map_location), path)


def checked(ckpt: dict, path: Path) -> Fields:
    """`ckpt` (a .pt file's dict, or a DCP checkpoint read whole) with `meta` checked, its weights present."""
    ckpt = Fields(ckpt, path)
    ckpt["meta"] = check_meta(ckpt["meta"], path)
    if "model" not in ckpt:
        raise CheckpointError(f"{path} is not a gpt checkpoint: it has no model weights")
    return ckpt


# ---- writing ---------------------------------------------------------------------------------------


def save(path: str | os.PathLike, state: dict, meta: dict) -> None:
    """Atomically write `state` (tensors and plain data) plus `meta` (`build_meta`) to `path`.

    A failed write (full disk, read-only place, a file where a directory should be) is one-line
    StorageError; the previous file at `path` is then untouched.
    """
    payload = dict(state, meta=json.dumps({"format": FORMAT_VERSION, **meta}))
    _replace(Path(path), lambda tmp: _torch_save(payload, tmp))


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Atomically make `dst` a copy of `src` (a hard link where the filesystem allows: no extra disk)."""

    def link(tmp: Path) -> None:
        try:
            os.link(src, tmp)
        except OSError:  # no hard links here (or across devices): a copy, on the disk before it is renamed
            shutil.copyfile(src, tmp)
            fsync_path(tmp)

    _replace(Path(dst), link)


def _replace(path: Path, write: Callable[[Path], None]) -> None:
    """`write` a temporary file beside `path`, then rename it over `path`: readers see the old file or the
    new one, never half of one. An OSError on the way is one line saying the old file is intact."""
    existed = path.exists()
    try:
        _make_dir(path.parent)
        remove_stale_temps(path.parent)
        with replacing(path) as tmp:
            write(tmp)
    except OSError as e:
        kept = f"the previous {path.name} is intact" if existed else "nothing was written"
        raise storage_error(e, "write checkpoint", path, kept) from None
    fsync_path(path.parent)  # make the rename itself durable


def _make_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where the directory should be
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(directory)) from None


class _Recorder:
    """The temporary file as torch.save sees it, keeping the first OSError of a write: torch's zip writer
    reports a failed write as RuntimeError("... unexpected pos ...")."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def _torch_save(payload: dict, tmp: Path) -> None:
    with open(tmp, "wb") as f:  # (a new name nobody could plant a link at: fsutil.temp_name)
        out = _Recorder(f)
        try:
            torch.save(payload, out)
        except RuntimeError:
            if out.error is None:
                raise
            raise out.error from None
        f.flush()
        os.fsync(f.fileno())
