"""Checkpoints: written atomically, loaded without executing anything, self-describing.

    model, tok, meta = load_checkpoint("out/NAME")    # a run dir (best.pt, else last.pt), a .pt file or a HF GPT-2 dir
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
| `tokenizer`     | the spec `gpt.tokenizer.get_tokenizer` takes (`{"kind": ...}`); required      |
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
| `lora`          | LoRA: `model` holds only adapters; their settings and base (gpt/lora.py)      |

Only the required fields are checked on load; any other one a checkpoint lacks (a file made by hand,
or by another tool) is a one-line CheckpointError naming the file when something asks for it
(`meta["train_config"]` on `--resume`), never a KeyError.

Footguns
- A crash or a full disk while writing must never destroy the previous good checkpoint: every write
  goes to a temporary file `.NAME.tmp-PID` beside the target, is flushed and fsynced, then renamed
  over it. A process killed mid-write leaves that file behind; the next save into the directory
  removes the ones whose process is gone. Pids are this machine's: don't let two machines save into
  one directory.
- torch.save reports a failed write as `RuntimeError: ... unexpected pos ...`; the file is written
  through `_Recorder`, which keeps the OSError behind it, so a full disk is named as such.
- Sampling prefers best.pt (lowest val loss); resuming wants last.pt (the latest state).
- `--fsdp` runs save sharded checkpoints instead, `last.dcp` / `best.dcp` (directories, gpt/dcp.py).
  Everything that reads a checkpoint reads those too (one process reads all the shards); where a run
  directory holds both kinds under one name (a run that switched), the later step wins.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from gpt import hf
from gpt.dataformat import is_dataset
from gpt.fsutil import fsync_path, process_alive, replacing
from gpt.errors import UserError, storage_error
from gpt.model import GPT, GPTConfig
from gpt.quantize import dtype_flag, quantize as quantize_model
from gpt.runtime import Runtime, decode_threads, resolve_dtype, setup

FORMAT_VERSION = 1
LATEST = ("last.pt",)  # resuming continues the latest state, never the best one
REQUIRED = ("format", "model_config", "tokenizer")
OPTIONAL = ("train_config", "val_loss", "best_val_loss", "skipped_steps", "world_size", "sampler", "dataset",
            "seq2seq", "hf_dir", "tokens_seen", "lora")
TRAINING_ONLY = ("train_config", "optimizer", "rng", "step", "sampler")  # what --resume needs, train.py writes
BEST_FIRST = ("best.pt", "last.pt")
SHARDED = {"last.pt": "last.dcp", "best.pt": "best.dcp"}  # the DCP checkpoint (gpt/dcp.py) for each name
TEMP_FILE = re.compile(r"\..+\.tmp-(\d+)")


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
            hint = (f": it was not written by train.py, so --resume cannot continue it; fine-tune from it instead "
                    f"with `python train.py --init-from {self.source} --data DATA --out-dir OUT`")
        raise CheckpointError(f"{self.source} has no {key}{hint}")


# ---- metadata: one builder, one reader -------------------------------------------------------------


def build_meta(model_config: dict, tokenizer: dict, step: int = 0, **fields) -> dict:
    """A checkpoint's metadata (the fields in the module docs); optional fields given as None are left out."""
    unknown = sorted(set(fields) - set(OPTIONAL))
    if unknown:
        raise TypeError(f"build_meta: no meta field {unknown}; document a new one in gpt/checkpoint.py first")
    return {"format": FORMAT_VERSION, "step": step, "model_config": model_config, "tokenizer": tokenizer,
            **{k: v for k, v in fields.items() if v is not None}}


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
        raise CheckpointError(f"{source} is not a gpt checkpoint: missing {', '.join(missing)} (a checkpoint "
                              f"written by train.py has them; see gpt/checkpoint.py for the fields)")
    if meta["format"] != FORMAT_VERSION:
        raise CheckpointError(f"{source}: checkpoint format {meta['format']!r}, this version of gpt reads format "
                              f"{FORMAT_VERSION}")
    model_config(meta["model_config"], source)
    if not isinstance(meta["tokenizer"], dict) or "kind" not in meta["tokenizer"]:
        raise CheckpointError(f"{source}: its tokenizer {meta['tokenizer']!r} is not a tokenizer spec "
                              f"(a JSON object with a \"kind\")")
    return Fields(meta, source)


def model_config(config: dict, source: str | os.PathLike) -> GPTConfig:
    """The GPTConfig a checkpoint's model config describes; a bad one is one line naming `source`."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: invalid model config: expected a JSON object, got {type(config).__name__}")
    try:
        return GPTConfig.from_dict(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: invalid model config: {str(e).removeprefix('invalid model config: ')}") from None


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
    shapes = [f"{k} is {shape(got[k])}, the config wants {shape(v)}" for k, v in want.items()
              if k in got and shape(got[k]) != shape(v)]
    parts = [f"missing {few(missing)}" if missing else "", f"unexpected {few(unexpected)}" if unexpected else "",
             few(shapes) if shapes else ""]
    return "; ".join(p for p in parts if p)


# ---- reading ---------------------------------------------------------------------------------------


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether `path` is a DCP checkpoint directory written by gpt/dcp.py."""
    return (Path(path) / "meta.json").is_file() and (Path(path) / ".metadata").is_file()


def resolve(path: str | os.PathLike, names: tuple[str, ...] = BEST_FIRST) -> Path:
    """A checkpoint (a file, or a DCP directory) from its path or a run directory (the first of `names`
    there, or its DCP twin: the later step of the two)."""
    path = Path(path)
    if path.is_dir() and not is_sharded(path):
        for name in names:
            found = [p for p in (path / name, path / SHARDED.get(name, name)) if p.is_file() or is_sharded(p)]
            if found:
                return max(found, key=lambda p: read_meta(p).get("step", 0))
        raise CheckpointError(_not_a_run(path, names))
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    return path


def _not_a_run(path: Path, names: tuple[str, ...]) -> str:
    """Why a directory without checkpoints is not a run, and what to pass instead."""
    if is_dataset(path):
        return (f"{path} is a prepared dataset, not a training run: give a run directory produced by train.py, "
                f"e.g. out/{path.name} after `python train.py --data {path} --out-dir out/{path.name}`")
    if hf.is_hf_dir(path):
        return (f"{path} is a Hugging Face model directory: it holds weights but no training state; fine-tune "
                f"from it with `python train.py --init-from {path} --data DATA --out-dir OUT`")
    return f"no {' or '.join(names)} in {path}: train one with `python train.py --out-dir {path}`"


def _load(path: Path, map_location="cpu", mmap: bool = False) -> dict:
    """torch.load with weights_only (nothing is executed), as a dict that has a meta."""
    if is_sharded(path):
        from gpt import dcp

        return dcp.read(path, map_location)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except OSError as e:
        raise storage_error(e, "read", path) from None
    except pickle.UnpicklingError:  # torch.load(weights_only=True) refused
        raise CheckpointError(f"{path} is not a gpt checkpoint: it holds objects other than tensors and plain "
                              f"data, whose code loading would run; refused") from None
    except Exception as e:  # not a torch file, a truncated one, ...
        reason = (str(e).splitlines() or [""])[0][:120]
        raise CheckpointError(f"{path} is not a gpt checkpoint ({type(e).__name__}: {reason})") from None
    if not isinstance(ckpt, dict) or "meta" not in ckpt:
        holds = ", ".join(map(str, ckpt))[:120] if isinstance(ckpt, dict) else f"a {type(ckpt).__name__}"
        raise CheckpointError(f"{path} is not a gpt checkpoint: it has no meta (it holds {holds})")
    return ckpt


def read(path: str | os.PathLike, map_location="cpu", names: tuple[str, ...] = BEST_FIRST) -> Fields:
    """The checkpoint dict with `meta` checked and parsed (`check_meta`); never unpickles arbitrary objects."""
    path = resolve(path, names)
    ckpt = Fields(_load(path, map_location), path)
    ckpt["meta"] = check_meta(ckpt["meta"], path)
    if "model" not in ckpt:
        raise CheckpointError(f"{path} is not a gpt checkpoint: it has no model weights")
    return ckpt


def read_meta(path: str | os.PathLike, names: tuple[str, ...] = BEST_FIRST) -> Fields:
    """Only the checked metadata (the tensors are memory-mapped, not read)."""
    path = resolve(path, names)
    if is_sharded(path):
        from gpt import dcp

        return dcp.read_meta(path)
    return check_meta(_load(path, mmap=True)["meta"], path)


def _read_hf(path: str | os.PathLike) -> tuple[Fields, dict, Path]:
    """(meta, state dict, source) of a Hugging Face GPT-2 directory: the config first, weights last."""
    source = Path(path) / "config.json"
    config = model_config(hf.read_config(path), source)
    meta = build_meta(model_config=config.to_dict(), tokenizer=hf.tokenizer_spec(path, config.vocab_size),
                      hf_dir=str(path))
    return check_meta(meta, source), hf.read_weights(path), source


def load_model(path: str | os.PathLike, device="cpu"):
    """(model, meta), model in eval mode, from a run directory, checkpoint file or Hugging Face GPT-2
    directory (gpt/hf.py); a LoRA checkpoint gives its base with the adapters merged in."""
    if hf.is_hf_dir(path):
        meta, state, source = _read_hf(path)
    else:
        ckpt = read(path, map_location=device)
        if "lora" in ckpt["meta"]:  # adapters only: loaded onto the base they name, merged (gpt/lora.py)
            from gpt import lora

            return lora.from_checkpoint(ckpt, device)
        meta, state, source = ckpt["meta"], ckpt["model"], ckpt.source
    return build_model(meta, state, source).to(device).eval(), meta


def load_checkpoint(path: str | os.PathLike, device="cpu"):
    """(model, tokenizer, meta), model in eval mode: everything sampling needs."""
    from gpt.tokenizer import get_tokenizer

    model, meta = load_model(path, device)
    return model, get_tokenizer(meta["tokenizer"]), meta


class Inference(NamedTuple):
    rt: Runtime
    model: GPT
    tokenizer: object
    meta: dict
    n_params: int  # counted before quantizing (int8 Linear layers hold no nn.Parameters)


def load_for_inference(path: str | os.PathLike, device: str = "auto", dtype: str = "auto", threads: int = 0,
                       quantize: str = "none", single_stream: bool = False) -> Inference:
    """What sample.py, translation, evaluation and the server share: the runtime for --device / --dtype /
    --threads, the checkpoint in that precision, its Linear layers in int8 with --quantize int8.
    `single_stream` (one sequence decoded at a time, sample.py): on CPU without --threads, the thread
    count `decode_threads` picks for the model's size."""
    dtype = dtype_flag(dtype, quantize)
    rt = setup(device, dtype, threads, distributed=False)
    model, tokenizer, meta = load_checkpoint(path, device=rt.device)
    n_params = model.num_params()
    if dtype == "auto":  # inference's rule, which depends on the model's size
        rt.dtype, rt.reason = resolve_dtype(dtype, rt.device, inference_params=n_params)
    if single_stream and rt.device.type == "cpu" and not threads:
        torch.set_num_threads(decode_threads(n_params))
    return Inference(rt, quantize_model(model.to(rt.dtype), quantize), tokenizer, meta, n_params)


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
        except OSError:
            shutil.copyfile(src, tmp)

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
    with open(tmp, "wb") as f:
        out = _Recorder(f)
        try:
            torch.save(payload, out)
        except RuntimeError:
            if out.error is None:
                raise
            raise out.error from None
        f.flush()
        os.fsync(f.fileno())


def remove_stale_temps(directory: Path) -> list[Path]:
    """Remove the temporary files and directories (`.NAME.tmp-PID`) that saves of processes no longer running left in
    `directory`; those of live processes are never touched. Returns what was removed."""
    removed = []
    for f in directory.iterdir():
        match = TEMP_FILE.fullmatch(f.name)
        if not match or int(match[1]) == os.getpid() or process_alive(int(match[1])):
            continue
        if f.is_symlink() or f.is_file():  # a checkpoint, or a link gpt/dcp.py was switching
            f.unlink(missing_ok=True)  # missing: another process cleaned it first
        elif f.is_dir():  # a sharded checkpoint being written (gpt/dcp.py)
            shutil.rmtree(f, ignore_errors=True)
        removed.append(f)
    return removed
